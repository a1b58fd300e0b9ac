//! One running turn: raw runtime events in, wire events and log rows out.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::Turns;
use super::steps::{Effect, End, TurnSteps};
use super::trace::TurnTrace;
use crate::hub::TurnBuffer;
use crate::metrics::Outcome;
use crate::runtime::{Inbox, RawEvent, Runtime, RuntimeError, TurnRequest};
use crate::store::{NewChunk, SealTurn, Store, StoreError, now_ms};
use crate::wire::*;

/// How many raw events a runtime may run ahead of the turn.
const RAW_QUEUE: usize = 256;

/// Most bytes of raw events waiting for the turn (see `runtime::event_queue`).
const RAW_QUEUE_BYTES: usize = 4 * 1024 * 1024;
/// Retries of a runtime that was provably not reached, and the first backoff (doubling).
const MAX_RETRIES: u32 = 3;
const RETRY_BASE: std::time::Duration = std::time::Duration::from_millis(200);

pub(super) struct TurnRun {
    turns: Arc<Turns>,
    store: Store,
    buffer: Arc<TurnBuffer>,
    cancel: CancellationToken,
    conversation_id: String,
    turn_id: String,
    /// What the turn's events so far made of it (the pure part: `steps.rs`).
    steps: TurnSteps,
    /// Steering messages; what the runtime has not taken when the turn ends starts a new turn.
    inbox: Arc<Inbox>,
    /// Chunks whose write failed: written with the next write that succeeds.
    unwritten: Vec<NewChunk>,
    /// The effects of the event at hand (kept for its allocation).
    effects: Vec<Effect>,
    /// The model it runs, as the gateway names it (`<credential>/<model>`), for the metrics.
    model: String,
    /// Who started the turn: a queued message left over starts the next turn as them.
    caller: crate::identity::Identity,
    /// The caller's day of tokens counts this turn's (a user, with quotas).
    counts_tokens: bool,
    /// Fired when the turn's lease is found gone (`Reservations::lost_leases`).
    lease_lost: CancellationToken,
    /// The turn's spans (exported over OTLP when configured).
    trace: TurnTrace,
}

/// How a turn whose lease is gone ends: this gateway's own watchers saw events that will never
/// be in the history, and the error says so before the turn's end (`chunks`: how many of its
/// chunks were not written, when known).
fn lease_lost(chunks: Option<usize>) -> End {
    let what = match chunks {
        Some(n) => format!("what it streamed since its last write ({n} chunks)"),
        None => "what it streamed since its last write".to_owned(),
    };
    End::Failed {
        message: format!(
            "the turn's lease on its conversation ended (another gateway marked it interrupted): {what} is not in the history"
        ),
        code: Some(ErrorCode::Lease),
    }
}

/// A turn whose seal the database refused: retried with backoff until it commits (or the
/// gateway stops; then the next start marks the turn interrupted).
struct PendingSeal {
    turns: Arc<Turns>,
    store: Store,
    conversation_id: String,
    turn_id: String,
    reason: String,
    metrics: TurnMetrics,
    rest: Vec<NewChunk>,
    tokens_per_estimate: Option<f64>,
    charge: Option<(Arc<str>, u64)>,
}

impl PendingSeal {
    async fn retry(self) {
        let mut wait = std::time::Duration::from_millis(100);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.turns.closing.cancelled() => return,
            }
            let seal = SealTurn {
                conversation_id: &self.conversation_id,
                turn_id: &self.turn_id,
                reason: &self.reason,
                metrics: &self.metrics,
                now: now_ms(),
                tokens_per_estimate: self.tokens_per_estimate,
                charge: self.charge.as_ref().map(|(subject, tokens)| crate::store::Charge { subject, tokens: *tokens }),
            };
            match self.store.seal_turn(seal, &self.rest).await {
                Ok(status) => {
                    tracing::info!(conversation = %self.conversation_id, turn = %self.turn_id, "sealed the turn after the database recovered");
                    self.turns.busy.release(&self.conversation_id);
                    self.turns.announce(&self.conversation_id, status);
                    return;
                }
                Err(StoreError::LeaseLost) => {
                    // Another gateway marked the turn interrupted meanwhile: it is history.
                    tracing::warn!(conversation = %self.conversation_id, turn = %self.turn_id, "the turn's lease ended before its seal could be written");
                    self.turns.busy.release(&self.conversation_id);
                    self.turns.announce(&self.conversation_id, ConversationStatus::Idle);
                    return;
                }
                Err(_) => wait = (wait * 2).min(std::time::Duration::from_secs(2)),
            }
        }
    }
}

impl TurnRun {
    pub(super) fn new(
        turns: Arc<Turns>,
        store: Store,
        buffer: Arc<TurnBuffer>,
        cancel: CancellationToken,
        inbox: Arc<Inbox>,
        model: &str,
    ) -> TurnRun {
        let max_tool_output = turns.limits.max_tool_output;
        let trace = TurnTrace::new(&buffer.conversation_id, &buffer.turn_id, model);
        TurnRun {
            trace,
            turns,
            model: model.to_owned(),
            store,
            conversation_id: buffer.conversation_id.to_string(),
            turn_id: buffer.turn_id.to_string(),
            steps: TurnSteps::new(&buffer.conversation_id, &buffer.turn_id, Instant::now(), max_tool_output),
            buffer,
            cancel,
            inbox,
            unwritten: Vec::new(),
            effects: Vec::new(),
            caller: crate::identity::Identity::anonymous(),
            counts_tokens: false,
            lease_lost: CancellationToken::new(),
        }
    }

    /// The turn ends with `error{lease}` when `lost` fires.
    pub(super) fn with_lease(mut self, lost: CancellationToken) -> TurnRun {
        self.lease_lost = lost;
        self
    }

    /// The turn as `caller`'s, its tokens counted against their day with `counts_tokens`.
    pub(super) fn for_caller(mut self, caller: crate::identity::Identity, counts_tokens: bool) -> TurnRun {
        self.caller = caller;
        self.counts_tokens = counts_tokens;
        self
    }

    /// Runs the turn to its seal. Boxed because a turn may start the next one (queued
    /// messages), which makes the future's type recursive.
    pub(super) fn drive(
        self,
        runtime: Arc<dyn Runtime>,
        request: TurnRequest,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(self.run(runtime, request))
    }

    /// The turn's span: its log lines and its exported spans run in it.
    pub(super) fn span(&self) -> tracing::Span {
        self.trace.span()
    }

    /// Ends the turn before its runtime is asked: what the runtime needed could not be read.
    /// Boxed like [`TurnRun::drive`].
    pub(super) fn refuse(self, message: String) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(async move { self.finish(End::Failed { message, code: Some(ErrorCode::Storage) }).await })
    }

    async fn run(mut self, runtime: Arc<dyn Runtime>, request: TurnRequest) {
        self.steps.prompt(&request.prompt);
        let runtime_cancel = self.cancel.child_token();
        let mut attempt = 0;
        // A runtime that hangs (an agent program that prints nothing, say) would otherwise hold
        // the conversation, and a place under --max-turns, for good.
        let longest = self.turns.limits.max_duration;
        let deadline = tokio::time::sleep(longest);
        tokio::pin!(deadline);
        let timed_out = || End::Failed {
            message: format!("the turn ran longer than {} s (max-turn-secs)", longest.as_secs()),
            code: Some(ErrorCode::Timeout),
        };
        let end = 'attempts: loop {
            self.trace.attempt((&self.conversation_id, &self.turn_id), attempt);
            let (sink, mut raw) = crate::runtime::event_queue(RAW_QUEUE, RAW_QUEUE_BYTES);
            let mut task = tokio::spawn(runtime.run_turn(request.clone(), sink, runtime_cancel.clone()));
            let failure = loop {
                tokio::select! {
                    biased;
                    _ = self.cancel.cancelled() => break 'attempts End::Aborted,
                    _ = self.lease_lost.cancelled() => break 'attempts lease_lost(None),
                    _ = &mut deadline => break 'attempts timed_out(),
                    event = raw.recv() => match event {
                        Some(event) => {
                            if let Some(end) = self.handle(event).await {
                                break 'attempts end;
                            }
                        }
                        None => break match (&mut task).await {
                            Ok(Err(e)) => e,
                            Err(e) if e.is_panic() => RuntimeError::turn("the runtime crashed", ErrorCode::Runtime),
                            _ => RuntimeError::turn("the runtime ended the turn without finishing it", ErrorCode::Runtime),
                        },
                    },
                }
            };
            // Only a failure that provably never reached the runtime is retried, and only while
            // nothing of the turn has reached a client.
            let retryable = match &failure {
                RuntimeError::Failed(reason) => Some((reason, RETRY_BASE * 2u32.pow(attempt))),
                // The upstream said when: no sooner than that.
                RuntimeError::Throttled { message, retry_after } => {
                    Some((message, (RETRY_BASE * 2u32.pow(attempt)).max(*retry_after)))
                }
                _ => None,
            };
            if let Some((reason, backoff)) = retryable
                && !self.steps.published_content
                && attempt < MAX_RETRIES
            {
                attempt += 1;
                self.turns.metrics.runtime_error("retried");
                tracing::warn!(attempt, reason = %reason, backoff_ms = backoff.as_millis() as u64, "runtime unavailable; retrying");
                // A step the failed attempt opened produced nothing: forget it.
                self.steps.forget_step();
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => continue 'attempts,
                    _ = self.cancel.cancelled() => break 'attempts End::Aborted,
                    _ = self.lease_lost.cancelled() => break 'attempts lease_lost(None),
                    _ = &mut deadline => break 'attempts timed_out(),
                }
            }
            break End::Failed { message: failure.to_string(), code: Some(failure.code()) };
        };
        // Exactly one terminal: whatever the runtime sends after it is not read.
        runtime_cancel.cancel();
        self.finish(end).await;
    }

    /// Handles one raw event; the end when it is a terminal, or when the turn's chunks could
    /// not be written (the turn ends failed once the event's other effects are carried out).
    async fn handle(&mut self, event: RawEvent) -> Option<End> {
        let mut effects = std::mem::take(&mut self.effects);
        self.trace.raw((&self.conversation_id, &self.turn_id), &event);
        let end = self.steps.handle(event, Instant::now(), &mut effects);
        let failed = self.apply(&mut effects).await;
        self.effects = effects;
        failed.or(end)
    }

    /// Carries the effects out in order; the end a failed write calls for, if one failed.
    async fn apply(&mut self, effects: &mut Vec<Effect>) -> Option<End> {
        let mut failed = None;
        for effect in effects.drain(..) {
            match effect {
                Effect::Publish(event) => {
                    self.trace.published(&event);
                    self.buffer.publish(&event);
                }
                Effect::Persist if failed.is_none() => failed = self.flush().await.err(),
                // After a failed write the chunks go with the seal.
                Effect::Persist => {}
                Effect::SessionId(id) => {
                    tracing::debug!(session = %id, "runtime session");
                    if let Err(e) = self.store.set_session_id(&self.conversation_id, &id).await {
                        tracing::error!(error = %e, "could not store the runtime session");
                    }
                }
            }
        }
        failed
    }

    fn ids(&self) -> (String, String) {
        (self.conversation_id.clone(), self.turn_id.clone())
    }

    async fn flush(&mut self) -> Result<(), End> {
        if !self.steps.assembler.has_pending() {
            return Ok(());
        }
        // Chunks a failed write left behind go first, so the log keeps the turn's order.
        let mut chunks = std::mem::take(&mut self.unwritten);
        chunks.extend(self.steps.assembler.take());
        match self.store.append_chunks(&self.conversation_id, &self.turn_id, &chunks).await {
            Ok(_) => Ok(()),
            Err(StoreError::LeaseLost) => {
                tracing::error!("the turn lost its lease on the conversation; it stops writing");
                // The gateway that marked it interrupted tells the others how it ended. This
                // gateway's own watchers saw events that will never be in the history: the error
                // says so, before the turn's end (a paused gateway streams the rest of a step
                // when it resumes, then finds its write refused).
                self.buffer.leave_bus();
                Err(lease_lost(Some(chunks.len())))
            }
            Err(e) => {
                self.unwritten = chunks;
                tracing::error!(error = %e, "could not write the turn's chunks");
                Err(End::Failed {
                    message: "the turn could not be written to the log".into(),
                    code: Some(ErrorCode::Storage),
                })
            }
        }
    }

    /// Counts the turn's end in `/metrics`, and by its model.
    /// What the turn costs its subject's day, written with the seal (none: not counted).
    fn charge(&self) -> Option<(Arc<str>, u64)> {
        if !self.counts_tokens {
            return None;
        }
        let charge = self.steps.tally.charge();
        if charge.estimated_steps > 0 {
            let metrics = &self.turns.metrics;
            metrics.quota_estimated_turns.fetch_add(1, Relaxed);
            metrics.quota_estimated_tokens.fetch_add(charge.tokens, Relaxed);
            tracing::info!(
                tokens = charge.tokens,
                steps = charge.estimated_steps,
                "charged the turn an estimate for steps without usage"
            );
        }
        Some((self.caller.subject.clone(), charge.tokens))
    }

    fn count_end(&self, end: &End, turn_metrics: &crate::wire::TurnMetrics) {
        let metrics = &self.turns.metrics;
        let outcome = match end {
            End::Finished(_) => Outcome::Finished,
            End::Aborted => Outcome::Aborted,
            End::Failed { code, .. } => Outcome::Failed(code.as_ref()),
        };
        metrics.models.turn_ended(&self.model, outcome, turn_metrics);
        metrics.turns_sealed.fetch_add(1, Relaxed);
        match end {
            End::Failed { code, .. } => {
                metrics.turns_failed.fetch_add(1, Relaxed);
                metrics.runtime_error(crate::metrics::code_label(code.as_ref()));
            }
            End::Aborted => {
                metrics.turns_aborted.fetch_add(1, Relaxed);
            }
            End::Finished(_) => {}
        }
        // Every event of the turn, turn-sealed included.
        metrics.events_emitted.fetch_add(u64::from(self.buffer.published()) + 1, Relaxed);
    }

    /// The turn of the messages queued too late for this one, unless it was stopped (a stop
    /// means stop) or its conversation closed.
    fn queued_turn(&self, end: &End, sealed_status: ConversationStatus) -> Option<super::StartTurn> {
        let leftover = self.inbox.drain();
        let stopped = matches!(end, End::Aborted) || sealed_status == ConversationStatus::Closed;
        if stopped && !leftover.is_empty() {
            tracing::info!(conversation = %self.conversation_id, dropped = leftover.len(), "dropped queued messages of a stopped turn");
        }
        (!stopped && !leftover.is_empty()).then(|| super::StartTurn {
            conversation_id: self.conversation_id.clone(),
            message: leftover.into_iter().map(|m| m.text).collect::<Vec<_>>().join("\n\n"),
            model: None,
            cwd: None,
            reasoning_effort: None,
            caller: self.caller.clone(),
        })
    }

    /// Closes whatever is open, then `error`?, `done`, metrics, `turn-sealed`, in that order.
    async fn finish(mut self, mut end: End) {
        let mut effects = std::mem::take(&mut self.effects);
        self.steps.close(&end, Instant::now(), &mut effects);
        if let Some(failed) = self.apply(&mut effects).await
            && !matches!(end, End::Failed { .. })
        {
            end = failed;
        }
        let duration_ms = self.steps.end(&end, Instant::now(), &mut effects);
        self.apply(&mut effects).await;
        let reason = end.reason();
        let turn_metrics = self.steps.tally.metrics(&self.turn_id, duration_ms);
        let mut rest = std::mem::take(&mut self.unwritten);
        rest.extend(self.steps.assembler.take());
        let charge = self.charge();
        let seal = SealTurn {
            conversation_id: &self.conversation_id,
            turn_id: &self.turn_id,
            reason: &reason,
            metrics: &turn_metrics,
            now: now_ms(),
            tokens_per_estimate: self.steps.tokens_per_estimate,
            charge: charge.as_ref().map(|(subject, tokens)| crate::store::Charge { subject, tokens: *tokens }),
        };
        let sealing = self.trace.seal((&self.conversation_id, &self.turn_id), &reason);
        let sealed_now = match tracing::Instrument::instrument(self.store.seal_turn(seal, &rest), sealing).await {
            Ok(status) => Some(status),
            // Marked interrupted by another gateway: nothing of it is to be written any more,
            // and that gateway ends it for the others.
            Err(StoreError::LeaseLost) => {
                self.buffer.leave_bus();
                Some(ConversationStatus::Idle)
            }
            Err(e) => {
                tracing::error!(error = %e, "could not seal the turn; retrying until the database takes it");
                None
            }
        };
        let status = sealed_now.map_or("active", ConversationStatus::as_str);
        self.count_end(&end, &turn_metrics);
        tracing::info!(reason = %reason, status, "turn sealed");
        // Watchers get the end of the turn either way. A turn the database would not take
        // keeps its conversation reserved until a retry commits it, so no later turn's rows
        // can land before its own.
        let (conversation_id, turn_id) = self.ids();
        let sealed = AgentEvent::TurnSealed(TurnSealedEvent { conversation_id, turn_id });
        let Some(sealed_status) = sealed_now else {
            self.turns.busy.hold_for_sealing(&self.conversation_id, &self.turn_id);
            self.turns.hub().seal_turn(self.buffer, &sealed);
            let pending = PendingSeal {
                turns: self.turns.clone(),
                store: self.store.clone(),
                conversation_id: self.conversation_id,
                turn_id: self.turn_id,
                reason,
                metrics: turn_metrics,
                rest,
                tokens_per_estimate: self.steps.tokens_per_estimate,
                charge,
            };
            tokio::spawn(pending.retry());
            return;
        };
        // Steering that arrived too late for this turn becomes the next one, unless the turn
        // was stopped: a stop means stop. The conversation goes to it straight from this turn,
        // never free in between.
        let next = self.queued_turn(&end, sealed_status);
        match next {
            Some(_) => self.turns.busy.hand_over(&self.conversation_id),
            None => self.turns.busy.release(&self.conversation_id),
        }
        self.turns.hub().seal_turn(self.buffer, &sealed);
        let Some(next) = next else {
            self.turns.announce(&self.conversation_id, sealed_status);
            return;
        };
        if let Err(e) = self.turns.start_handed_over(next).await {
            tracing::warn!(conversation = %self.conversation_id, error = %e, "could not start the queued turn");
            self.turns.announce(&self.conversation_id, sealed_status);
        }
    }
}
