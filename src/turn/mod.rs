//! Turns: starting them (one at a time per conversation), steering, stopping and sealing them.
//!
//! [`Turns`] owns the set of running turns. A started turn runs in its own task
//! (`run.rs`): it maps the runtime's raw events onto the wire, publishes them to the hub,
//! writes the log and the metrics, and seals.

mod assembly;
mod busy;
mod cluster;
mod control;
mod leases;
mod run;
mod steps;
mod tally;
pub mod trace;

use std::sync::Arc;

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

pub use assembly::ChunkAssembler;
use busy::{Busy, Reservations};
pub use cluster::Cluster;
pub use control::{Control, ControlReply};
pub use tally::{OpenStep, StepTiming, TurnTally};

use std::sync::atomic::Ordering::Relaxed;

use tracing::Instrument;

use crate::config::Quotas;
use crate::hub::{Hub, TurnBuffer};
use crate::identity::Identity;
use crate::metrics::Metrics;
use crate::runtime::{Inbox, QueueFull, QueueLimits, QueuedMessage, Registry, TurnRequest};
use crate::status::{StatusChange, Statuses};
use crate::store::{BeginTurn, History, IdempotencyRecord, RuntimeMemory, Store, StoreError, now_ms};
use crate::wire::{AgentEvent, ConversationStatus, TurnInputEvent, TurnStartEvent};

/// A request to start a turn, already validated for shape.
#[derive(Debug, Clone)]
pub struct StartTurn {
    pub conversation_id: String,
    /// Trimmed, non-empty.
    pub message: String,
    pub model: Option<String>,
    pub cwd: Option<String>,
    pub reasoning_effort: Option<String>,
    /// Who asks: a user may start turns only in their own conversations (or a new one, which
    /// becomes theirs), within their quotas.
    pub caller: Identity,
}

/// What an admitted turn runs with: its model (as the gateway names it, and its runtime's name
/// for it), its folder and effort, and whose quotas it counts against.
struct Admitted {
    model: String,
    runtime: Arc<dyn crate::runtime::Runtime>,
    native_model: String,
    cwd: Option<String>,
    reasoning_effort: Option<String>,
    budget: Option<crate::store::TurnBudget>,
}

/// A turn that has begun: its user message is in the log and its buffer is open.
pub struct Started {
    pub conversation_id: String,
    pub turn_id: String,
    pub buffer: Arc<TurnBuffer>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    /// The turn's `cwd` (the request's or the conversation's, as given) is not a folder its
    /// agent may work in.
    #[error("`cwd` {0:?} is not a folder the agent may work in (the credential's cwd_roots)")]
    Folder(String),
    #[error("a turn is already generating for this conversation")]
    Busy,
    /// Another subject's conversation: answered as an unknown one.
    #[error("no conversation {0:?}")]
    NotFound(String),
    /// Past one of the caller's quotas.
    #[error("{}", .0.message)]
    Quota(crate::identity::QuotaExceeded),
    #[error("the gateway is shutting down")]
    ShuttingDown,
    #[error("{}", queue_full(*.0))]
    QueueFull(QueueFull),
    #[error("this gateway runs its most turns at once ({0}, max-turns); try again when one ends")]
    Full(usize),
    #[error(transparent)]
    Store(StoreError),
}

impl From<StoreError> for StartError {
    fn from(e: StoreError) -> StartError {
        match e {
            // Another gateway's turn holds the conversation: the same answer as one of ours.
            StoreError::Busy => StartError::Busy,
            StoreError::OverBudget(over) => StartError::Quota(over.into()),
            e => StartError::Store(e),
        }
    }
}

fn queue_full(full: QueueFull) -> String {
    match full {
        QueueFull::Messages(n) => format!("{n} messages already wait for this turn's next step (max-queued-messages)"),
        QueueFull::Bytes(n) => format!("the waiting messages would pass {n} bytes (max-queued-bytes)"),
    }
}

/// How long a control request for a turn another gateway runs waits for a bus that is down
/// (well within `--request-timeout-secs`' 30 s default).
const CONTROL_OUTAGE: std::time::Duration = std::time::Duration::from_secs(20);

/// What `/queue` did with a message.
pub struct Queued {
    pub started_turn: bool,
    /// Messages still waiting for the running turn's next step.
    pub queue: Vec<QueuedMessage>,
}

/// What `Turns` allows at once.
#[derive(Debug, Clone, Copy)]
pub struct TurnLimits {
    /// Messages waiting for a running turn's next step.
    pub queue: QueueLimits,
    /// Conversations busy with a turn (or a deletion).
    pub max_turns: usize,
    /// The longest a turn runs before it ends with `error{code:"timeout"}`.
    pub max_duration: std::time::Duration,
    /// The most of a tool call's streamed output the log keeps with its result, in bytes
    /// (`--max-tool-result-bytes`, the bound of the result itself).
    pub max_tool_output: usize,
}

pub struct Turns {
    store: Store,
    hub: Arc<Hub>,
    registry: Arc<Registry>,
    busy: Reservations,
    statuses: Statuses,
    /// Set at shutdown: no new turn starts.
    closing: CancellationToken,
    metrics: Arc<Metrics>,
    limits: TurnLimits,
    /// The other gateways, when there are some.
    cluster: Option<Arc<dyn Cluster>>,
    /// What users may use (administrators have no quota).
    quotas: Quotas,
}

/// Who may do what with turns: the quotas, and whether users (not only administrators) call.
#[derive(Debug, Clone, Copy, Default)]
pub struct Identities {
    pub quotas: Quotas,
    pub users: bool,
}

impl Turns {
    pub fn new(
        store: Store,
        hub: Arc<Hub>,
        registry: Arc<Registry>,
        metrics: Arc<Metrics>,
        limits: TurnLimits,
        cluster: Option<Arc<dyn Cluster>>,
        identities: Identities,
    ) -> Arc<Turns> {
        let statuses = Statuses::new(store.clone(), identities.users);
        let turns = Arc::new(Turns {
            store: store.clone(),
            hub,
            registry,
            busy: Reservations::new(limits.max_turns),
            statuses,
            closing: CancellationToken::new(),
            metrics,
            limits,
            cluster: cluster.clone(),
            quotas: identities.quotas,
        });
        tokio::spawn(leases::keep(Arc::downgrade(&turns), store));
        if let Some(cluster) = cluster {
            cluster.serve(Arc::downgrade(&turns));
        }
        turns
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Every status change from now on (a receiver that lags loses the oldest).
    pub fn status_changes(&self) -> broadcast::Receiver<StatusChange> {
        self.statuses.subscribe()
    }

    pub(super) fn announce(&self, conversation_id: &str, status: ConversationStatus) {
        self.statuses.tell(conversation_id, status);
        if let Some(cluster) = &self.cluster {
            cluster.announce(conversation_id, status);
        }
    }

    /// A status change another gateway made: this gateway's sessions hear it like its own.
    pub fn hear_status(&self, conversation_id: &str, status: ConversationStatus) {
        self.statuses.tell(conversation_id, status);
    }

    /// Whether a turn is running (or starting) in this conversation.
    pub fn is_active(&self, conversation_id: &str) -> bool {
        self.busy.is_active(conversation_id)
    }

    /// Starts a turn: picks the model, reserves the conversation (409 when busy), writes the
    /// user's chunk, opens the replay buffer with `user-message` and `turn-start`, and spawns
    /// the turn. Nothing is emitted when it fails.
    pub async fn start(self: &Arc<Self>, req: StartTurn) -> Result<Started, StartError> {
        self.start_with(req, None::<fn(&str) -> (String, String)>, None).await
    }

    /// [`Turns::start`], recording an idempotency key with the answer `respond(turn_id)` gives
    /// (as `(body_hash, response)`) in the turn's first transaction.
    pub async fn start_with<F>(
        self: &Arc<Self>,
        req: StartTurn,
        respond: Option<F>,
        key: Option<&str>,
    ) -> Result<Started, StartError>
    where
        F: FnOnce(&str) -> (String, String),
    {
        self.begin(req, respond, key, false).await
    }

    /// Starts the turn of the messages queued too late for the turn that just ended, in the
    /// reservation that turn handed over (`hand_over`): the conversation is never free in
    /// between, so nobody is told it is idle and then refused a turn (409) because this one
    /// took it.
    pub(super) async fn start_handed_over(self: &Arc<Self>, req: StartTurn) -> Result<Started, StartError> {
        self.begin(req, None::<fn(&str) -> (String, String)>, None, true).await
    }

    /// A turn in three phases: admitted (the caller, its quotas, the model and the folder),
    /// opened (the store's turn, the hub's buffer, the conversation running), launched (the
    /// runtime's request, in a task of its own).
    async fn begin<F>(
        self: &Arc<Self>,
        req: StartTurn,
        respond: Option<F>,
        key: Option<&str>,
        handed_over: bool,
    ) -> Result<Started, StartError>
    where
        F: FnOnce(&str) -> (String, String),
    {
        // A reservation handed over is this start's from the first line: a failure below lets
        // it go.
        let conversation_id = req.conversation_id.clone();
        let handed = handed_over.then(|| self.busy.adopt(&conversation_id));
        let admitted = self.admit(&req).await?;
        let reservation = match handed {
            Some(handed) => handed,
            None => self.busy.reserve(&conversation_id, Busy::Starting)?,
        };

        let turn_id = uuid::Uuid::now_v7().to_string();
        let recorded = respond.map(|f| f(&turn_id));
        let idempotency = match (&recorded, key) {
            (Some((body_hash, response)), Some(key)) => Some(IdempotencyRecord { key, body_hash, response }),
            _ => None,
        };
        let user_seq = self
            .store
            .begin_turn(BeginTurn {
                conversation_id: &req.conversation_id,
                turn_id: &turn_id,
                model: &admitted.model,
                sticky_model: req.model.as_deref(),
                user_text: &req.message,
                default_title: &default_title(&req.message),
                idempotency,
                owner: req.caller.owner(),
                budget: admitted.budget.as_ref(),
                now: now_ms(),
            })
            .await?;

        let opening = [
            AgentEvent::UserMessage(TurnInputEvent {
                conversation_id: req.conversation_id.clone(),
                turn_id: turn_id.clone(),
                text: req.message.clone(),
            }),
            AgentEvent::TurnStart(TurnStartEvent {
                conversation_id: req.conversation_id.clone(),
                turn_id: turn_id.clone(),
            }),
        ];
        let buffer = self.hub.begin_turn(&req.conversation_id, &turn_id, &opening);

        let cancel = CancellationToken::new();
        let lease_lost = CancellationToken::new();
        let inbox = Arc::new(Inbox::default());
        let running = Busy::Running {
            turn_id: turn_id.clone(),
            cancel: cancel.clone(),
            lease_lost: lease_lost.clone(),
            inbox: inbox.clone(),
        };
        self.busy.run(&req.conversation_id, running);
        reservation.keep();
        self.announce(&req.conversation_id, ConversationStatus::Active);
        self.metrics.turns_started.fetch_add(1, Relaxed);

        let run =
            run::TurnRun::new(self.clone(), self.store.clone(), buffer.clone(), cancel, inbox.clone(), &admitted.model)
                .for_caller(req.caller.clone(), admitted.budget.is_some())
                .with_lease(lease_lost);
        self.launch(run, req, admitted, &turn_id, user_seq, inbox).await;
        Ok(Started { conversation_id: conversation_id.clone(), turn_id, buffer })
    }

    /// Whether the caller may start this turn, and with what: the request's settings, else
    /// the conversation's, else the defaults.
    async fn admit(&self, req: &StartTurn) -> Result<Admitted, StartError> {
        if self.closing.is_cancelled() {
            return Err(StartError::ShuttingDown);
        }
        let settings = self.store.settings(&req.conversation_id).await?;
        if let crate::store::Ownership::Owned(owner) = &settings.ownership
            && !req.caller.may_see(owner.as_deref())
        {
            return Err(StartError::NotFound(req.conversation_id.clone()));
        }
        // Checked, and the turn counted, by the opening write itself (exact under races).
        let quotas = req.caller.quotas(&self.quotas);
        let budget = req.caller.viewer().and_then(|subject| crate::identity::turn_budget(quotas, subject));
        let model = req.model.clone().or(settings.model).unwrap_or_else(|| self.registry.default_model().to_owned());
        let Some((runtime, native_model)) = self.registry.resolve(&model) else {
            return Err(StartError::UnknownModel(model));
        };
        let cwd = match req.cwd.clone().or(settings.cwd) {
            Some(asked) => Some(runtime.folder(&asked).ok_or(StartError::Folder(asked))?),
            None => None,
        };
        let reasoning_effort = req.reasoning_effort.clone().or(settings.reasoning_effort);
        let native_model = native_model.to_owned();
        Ok(Admitted { model, runtime, native_model, cwd, reasoning_effort, budget })
    }

    /// Hands the turn to its runtime, in a task of its own, with what the runtime is owed: the
    /// conversation so far (read by the runtime, as far back as it needs) and what its last
    /// turn left. A read that fails ends the turn (`storage`): a runtime must never go on with
    /// a made-up history, nor start a fresh session where a resume was due.
    async fn launch(
        &self,
        run: run::TurnRun,
        req: StartTurn,
        admitted: Admitted,
        turn_id: &str,
        user_seq: u64,
        inbox: Arc<Inbox>,
    ) {
        let Admitted { model, runtime, native_model, cwd, reasoning_effort, .. } = admitted;
        let history = runtime.needs_history().then(|| History::new(self.store.clone(), &req.conversation_id, user_seq));
        // The turn before matters to a runtime that keeps a process per conversation.
        let previous_of = runtime.processes().is_some().then_some(turn_id);
        let memory = self.store.runtime_memory(&req.conversation_id, &model, previous_of).await;
        let span = run.span();
        match memory {
            Ok(RuntimeMemory { session_id, tokens_per_estimate, previous_turn_id }) => {
                let request = TurnRequest {
                    conversation_id: req.conversation_id,
                    turn_id: turn_id.to_owned(),
                    model: native_model,
                    prompt: req.message,
                    cwd,
                    reasoning_effort,
                    history,
                    session_id,
                    previous_turn_id,
                    tokens_per_estimate,
                    inbox,
                };
                tokio::spawn(run.drive(runtime, request).instrument(span));
            }
            Err(e) => {
                tracing::error!(conversation = %req.conversation_id, error = %e, "cannot read the conversation for the runtime");
                let message = format!("the conversation could not be read for the runtime: {e}");
                tokio::spawn(run.refuse(message).instrument(span));
            }
        }
    }

    /// Aborts the running turn, if any, on this gateway or (over the bus) the one running it:
    /// it ends `done{aborted}` + `turn-sealed`. Returns whether there was one.
    pub async fn stop(&self, conversation_id: &str) -> bool {
        if self.busy.stop(conversation_id) {
            return true;
        }
        let request = Control::Stop { conversation_id: conversation_id.to_owned() };
        matches!(self.elsewhere(&request).await, Some(ControlReply::Stopped(true)))
    }

    /// Asks the gateway whose turn holds the conversation's lease, if another does.
    async fn elsewhere(&self, request: &Control) -> Option<ControlReply> {
        let cluster = self.cluster.as_ref()?;
        let conversation_id = request.conversation_id();
        if self.busy.holds(conversation_id) {
            return None; // the lease is this gateway's own (a turn starting or sealing here)
        }
        match self.store.leased(conversation_id).await {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => {
                tracing::warn!(conversation = %conversation_id, error = %e, "cannot tell whether another gateway runs the turn");
                return None;
            }
        }
        // Unanswered (the bus is down, or the turn's gateway is not back on it yet after an
        // outage), the request is asked again until a gateway answers, the turn has ended (its
        // lease let go: its gateway died, or it sealed), or `CONTROL_OUTAGE` passed: a `/stop`
        // through another gateway during an outage stops the turn once the bus returns, rather
        // than answering that there was nothing to stop.
        let deadline = tokio::time::Instant::now() + CONTROL_OUTAGE;
        loop {
            match cluster.control(request).await {
                Ok(Some(reply)) => return Some(reply),
                Ok(None) => {}
                Err(e) if cluster.connected() => {
                    tracing::warn!(conversation = %conversation_id, error = %e, "the bus did not carry a control request");
                    return None;
                }
                Err(_) => {}
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(conversation = %conversation_id, "no gateway answered a control request for a turn that holds its lease");
                return None;
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            if !matches!(self.store.leased(conversation_id).await, Ok(true)) {
                return None; // the turn ended meanwhile
            }
        }
    }

    /// A request from another gateway, answered when this one runs the conversation's turn.
    pub fn answer(&self, request: Control) -> Option<ControlReply> {
        self.busy.answer(request, self.limits.queue)
    }

    /// A conversation was created without a turn: watchers of the list learn of it as of any
    /// conversation that goes idle.
    pub fn created(&self, conversation_id: &str) {
        self.announce(conversation_id, ConversationStatus::Idle);
    }

    /// Stops the running turn and marks the conversation closed (idempotent; an unknown id is
    /// fine). Returns whether a turn was aborted.
    pub async fn close(&self, conversation_id: &str) -> Result<bool, StoreError> {
        let existed = self.store.close_conversation(conversation_id).await?;
        let aborted = self.stop(conversation_id).await;
        if existed && !aborted {
            self.announce(conversation_id, ConversationStatus::Closed);
        }
        Ok(aborted)
    }

    /// Steers the running turn with `text` (delivered at its next step boundary), or starts a
    /// turn with it when none runs.
    pub async fn queue(
        self: &Arc<Self>,
        conversation_id: &str,
        text: String,
        caller: &Identity,
    ) -> Result<Queued, StartError> {
        let message = QueuedMessage { id: uuid::Uuid::now_v7().to_string(), text, queued_at: now_ms() };
        if let Some(queued) = self.busy.queue(conversation_id, message.clone(), self.limits.queue) {
            return Ok(Queued { started_turn: false, queue: queued.map_err(StartError::QueueFull)? });
        }
        let request = Control::Queue { conversation_id: conversation_id.to_owned(), message: message.clone() };
        if let Some(ControlReply::Queued(queued)) = self.elsewhere(&request).await {
            return Ok(Queued { started_turn: false, queue: queued.map_err(StartError::QueueFull)? });
        }
        let req = StartTurn {
            conversation_id: conversation_id.to_owned(),
            message: message.text,
            model: None,
            cwd: None,
            reasoning_effort: None,
            caller: caller.clone(),
        };
        self.start(req).await?;
        Ok(Queued { started_turn: true, queue: Vec::new() })
    }

    /// Deletes a conversation unless a turn runs in it. `Ok(false)` when it did not exist.
    pub async fn delete(&self, conversation_id: &str) -> Result<bool, StartError> {
        let holder = uuid::Uuid::now_v7().to_string();
        let _reservation = match self.busy.reserve(conversation_id, Busy::Deleting { holder: holder.clone() }) {
            // Being deleted here already: gone, as the database says on any other gateway.
            Err(StartError::Store(StoreError::Deleting)) => return Ok(false),
            reserved => reserved?,
        };
        let deleted = self.store.delete_conversation(conversation_id, &holder).await?;
        if deleted {
            self.release_runtimes(conversation_id);
        }
        Ok(deleted)
    }

    /// What the runtimes keep for a deleted conversation goes (its agent processes here).
    fn release_runtimes(&self, conversation_id: &str) {
        for runtime in self.registry.runtimes() {
            runtime.release(conversation_id);
        }
        self.registry.tools().release(conversation_id);
    }

    /// Finishes a deletion whose lease (held by `expired`) ended; see `leases::keep`.
    pub(super) async fn resume_deletion(&self, conversation_id: &str, expired: &str) {
        let holder = uuid::Uuid::now_v7().to_string();
        let Ok(_reservation) = self.busy.reserve(conversation_id, Busy::Deleting { holder: holder.clone() }) else {
            return;
        };
        match self.store.resume_deletion(conversation_id, expired, &holder).await {
            Ok(true) => {
                tracing::warn!(conversation = %conversation_id, "finished a deletion that was cut off");
                self.release_runtimes(conversation_id);
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(conversation = %conversation_id, error = %e, "could not finish a deletion that was cut off")
            }
        }
    }

    /// The stop fence of every runtime: after the turns have sealed, let each runtime settle
    /// and end what it spawned, all at once (agent processes get a few seconds each to exit).
    pub async fn shutdown_runtimes(&self) {
        let runtimes = self.registry.runtimes();
        futures_util::future::join_all(runtimes.iter().map(|runtime| runtime.shutdown())).await;
        // After the turns: a turn's last calls were cancelled with it.
        self.registry.tools().shutdown().await;
    }

    /// Refuses new turns and asks every running turn to end (`done{aborted}`); for shutdown.
    pub fn abort_all(&self) {
        self.closing.cancel();
        self.busy.stop_all();
    }

    /// Whether shutdown has begun.
    pub fn is_closing(&self) -> bool {
        self.closing.is_cancelled()
    }

    /// Number of turns running now.
    pub fn running(&self) -> usize {
        self.busy.running()
    }

    fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }
}

/// The title a conversation gets from its first message: its first line without control
/// characters (U+0000 included, which PostgreSQL's text cannot hold), at most 80 chars.
fn default_title(message: &str) -> String {
    let line: String = message.lines().next().unwrap_or("").chars().filter(|c| !c.is_control()).collect();
    let line = line.trim();
    match line.char_indices().nth(80) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_owned(),
    }
}
