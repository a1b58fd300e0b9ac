//! Group commit: the writes of turns (open, append, seal) go through one writer task, which
//! commits every write queued while it was busy in one transaction. Under many concurrent turns
//! a write waits for one commit instead of one per write ahead of it, and the single writer
//! connection does several writes per round trip of BEGIN and COMMIT.
//!
//! A shared transaction is optimistic: when any of its writes fails (a reused idempotency key,
//! say), the whole transaction is rolled back and each write is tried again in a transaction of
//! its own, in the same order, so every failure reaches the write it belongs to and the others
//! commit. (Failures are rare; a savepoint around every write would cost two more round trips
//! to the database per write, every time.) Nothing is answered as written before the COMMIT
//! succeeds. Each backend says how a write is done in SQL ([`Writes`]); this file is the
//! queue and the transactions around it, the same for both.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use super::writes::{BeginTurn, IdempotencyRecord, NewChunk, SealTurn};
use super::{Store, StoreError, StoreResult, on_backend};
use crate::wire::TurnMetrics;

/// Most writes in one transaction.
const MOST: usize = 64;

/// A write of a turn, owning what it writes.
pub(super) enum Write {
    Begin {
        conversation_id: String,
        turn_id: String,
        model: String,
        sticky_model: Option<String>,
        user_text: String,
        default_title: String,
        /// Key, body hash, response.
        idempotency: Option<(String, String, String)>,
        owner: Option<String>,
        budget: Option<super::TurnBudget>,
        now: i64,
        /// How long the turn's lease on its conversation lasts unless renewed, in ms (from the
        /// database's clock: see `lease`).
        lease_ms: i64,
    },
    Append {
        conversation_id: String,
        turn_id: String,
        chunks: Vec<NewChunk>,
        now: i64,
    },
    Seal {
        conversation_id: String,
        turn_id: String,
        reason: String,
        metrics: TurnMetrics,
        now: i64,
        chunks: Vec<NewChunk>,
        tokens_per_estimate: Option<f64>,
        /// Subject and tokens.
        charge: Option<(String, u64)>,
    },
    /// A turn found cut off: its one `interrupted` marker, the history horizon moved past it,
    /// its lease released. With `only_expired`, only when the turn's lease has ended (another
    /// gateway may hold it); without, whatever holds it (SQLite at start: the file is this
    /// process's). Refused (`LeaseLost`) when it does not apply.
    Interrupt {
        conversation_id: String,
        turn_id: String,
        now: i64,
        only_expired: bool,
    },
    /// The leases of these turns (the gateway's running ones) extended by `lease_ms`. A write of
    /// the writer task like the others, so it never waits on the task's locks in another
    /// transaction (a deadlock the database would end by refusing one of them).
    Renew {
        turn_ids: Vec<String>,
        lease_ms: i64,
    },
}

/// What a write answers: a seq (open, append, interrupt) or the conversation's status (seal).
#[derive(Debug)]
pub(super) enum Written {
    Seq(u64),
    Status(crate::wire::ConversationStatus),
    /// Rows a renewal touched.
    Count(u64),
}

impl Written {
    pub(super) fn seq(self) -> StoreResult<u64> {
        match self {
            Written::Seq(seq) => Ok(seq),
            _ => Err(StoreError::Corrupt("a write answered with the wrong kind".into())),
        }
    }

    pub(super) fn status(self) -> StoreResult<crate::wire::ConversationStatus> {
        match self {
            Written::Status(status) => Ok(status),
            _ => Err(StoreError::Corrupt("a write answered with the wrong kind".into())),
        }
    }

    pub(super) fn count(self) -> StoreResult<u64> {
        match self {
            Written::Count(n) => Ok(n),
            _ => Err(StoreError::Corrupt("a write answered with the wrong kind".into())),
        }
    }
}

pub(super) struct Queued {
    write: Arc<Write>,
    reply: oneshot::Sender<StoreResult<Written>>,
}

impl Write {
    /// The parts of an opening write, borrowed.
    pub(super) fn as_begin(&self) -> Option<BeginTurn<'_>> {
        let Write::Begin {
            conversation_id,
            turn_id,
            model,
            sticky_model,
            user_text,
            default_title,
            idempotency,
            owner,
            budget,
            now,
            ..
        } = self
        else {
            return None;
        };
        Some(BeginTurn {
            conversation_id,
            turn_id,
            model,
            sticky_model: sticky_model.as_deref(),
            user_text,
            default_title,
            idempotency: idempotency.as_ref().map(|(key, body_hash, response)| IdempotencyRecord {
                key,
                body_hash,
                response,
            }),
            owner: owner.as_deref(),
            budget: budget.as_ref(),
            now: *now,
        })
    }

    /// The parts of a seal, borrowed, and the chunks it appends first.
    pub(super) fn as_seal(&self) -> Option<(SealTurn<'_>, &[NewChunk])> {
        let Write::Seal { conversation_id, turn_id, reason, metrics, now, chunks, tokens_per_estimate, charge } = self
        else {
            return None;
        };
        let seal = SealTurn {
            conversation_id,
            turn_id,
            reason,
            metrics,
            now: *now,
            tokens_per_estimate: *tokens_per_estimate,
            charge: charge.as_ref().map(|(subject, tokens)| super::writes::Charge { subject, tokens: *tokens }),
        };
        Some((seal, chunks))
    }
}

/// A backend's side of the writes of turns: each write's statements, in one transaction.
pub(super) trait Writes {
    /// Runs the writes, in order, in one transaction and commits it; their answers, in the
    /// same order. An error means nothing was committed.
    fn commit(&self, writes: Vec<Arc<Write>>) -> impl Future<Output = StoreResult<Vec<Written>>> + Send;
}

/// The writes in one transaction; the transaction's time is recorded.
async fn together<B: Writes>(
    backend: &B,
    metrics: &crate::metrics::Metrics,
    writes: Vec<Arc<Write>>,
) -> StoreResult<Vec<Written>> {
    let started = Instant::now();
    let answers = backend.commit(writes).await?;
    metrics.observe_write(started.elapsed());
    Ok(answers)
}

impl Store {
    /// Writes through the writer task (or alone, when there is none).
    pub(super) async fn write(&self, write: Write) -> StoreResult<Written> {
        let write = Arc::new(write);
        let Some(queue) = &self.queue else {
            return self.write_alone(write).await;
        };
        let (reply, answer) = oneshot::channel();
        match queue.send(Queued { write, reply }) {
            Ok(()) => {
                answer.await.unwrap_or_else(|_| Err(StoreError::Unwritable("the database writer stopped".into())))
            }
            Err(mpsc::error::SendError(queued)) => self.write_alone(queued.write).await,
        }
    }

    /// One write in a transaction of its own.
    async fn write_alone(&self, write: Arc<Write>) -> StoreResult<Written> {
        let result = on_backend!(self, b => together(b, &self.metrics, vec![write]).await).and_then(|answers| {
            answers.into_iter().next().ok_or_else(|| StoreError::Corrupt("a write went unanswered".into()))
        });
        self.noted(result)
    }

    /// The writer task: takes every write queued, commits them in one transaction, answers
    /// each. Ends when the last handle to the store is gone.
    pub(super) async fn run_writer(self, mut queue: mpsc::UnboundedReceiver<Queued>) {
        while let Some(first) = queue.recv().await {
            let mut batch = vec![first];
            while batch.len() < MOST
                && let Ok(next) = queue.try_recv()
            {
                batch.push(next);
            }
            if batch.len() == 1 {
                let Queued { write, reply } = batch.pop().expect("one");
                let _ = reply.send(self.write_alone(write).await);
                continue;
            }
            let writes = batch.iter().map(|q| q.write.clone()).collect();
            match on_backend!(self, b => together(b, &self.metrics, writes).await) {
                Ok(answers) => {
                    for (queued, answer) in batch.into_iter().zip(answers) {
                        let _ = queued.reply.send(self.noted(Ok(answer)));
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, writes = batch.len(), "a shared write transaction failed; writing each alone");
                    for Queued { write, reply } in batch {
                        let _ = reply.send(self.write_alone(write).await);
                    }
                }
            }
        }
    }
}
