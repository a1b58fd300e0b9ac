//! Group commit: the writes of turns (open, append, seal) go through one writer task, which
//! commits every write queued while it was busy in one transaction. Under many concurrent turns
//! a write waits for one commit instead of one per write ahead of it, and the single writer
//! connection does several writes per round trip of BEGIN and COMMIT.
//!
//! A shared transaction is optimistic: when any of its writes fails (a reused idempotency key,
//! say), the whole transaction is rolled back and each write is tried again in a transaction of
//! its own, in the same order, so every failure reaches the write it belongs to and the others
//! commit. (Failures are rare; a savepoint around every write would cost two more round trips
//! to the database thread per write, every time.) Nothing is answered as written before the
//! COMMIT succeeds.

use sqlx::SqliteConnection;
use tokio::sync::{mpsc, oneshot};

use super::log::{NewChunk, append_to, appended_seq};
use super::script::Script;
use super::turns::{BeginTurn, IdempotencyRecord, SealTurn, begin_to, duplicate_key, seal_to, sealed_status};
use super::{Store, StoreError, StoreResult};
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
        now: i64,
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
    },
}

/// What a write answers: a seq (open, append) or the conversation's status (seal).
#[derive(Debug)]
pub(super) enum Written {
    Seq(u64),
    Status(crate::wire::ConversationStatus),
}

impl Written {
    pub(super) fn seq(self) -> StoreResult<u64> {
        match self {
            Written::Seq(seq) => Ok(seq),
            Written::Status(_) => Err(StoreError::Corrupt("a write answered with the wrong kind".into())),
        }
    }

    pub(super) fn status(self) -> StoreResult<crate::wire::ConversationStatus> {
        match self {
            Written::Status(status) => Ok(status),
            Written::Seq(_) => Err(StoreError::Corrupt("a write answered with the wrong kind".into())),
        }
    }
}

pub(super) struct Queued {
    write: Write,
    reply: oneshot::Sender<StoreResult<Written>>,
}

impl Write {
    /// The write's statements, inside an open transaction: one script, one round trip.
    async fn run_in(&self, conn: &mut SqliteConnection) -> StoreResult<Written> {
        let mut script = Script::default();
        match self {
            Write::Begin {
                conversation_id,
                turn_id,
                model,
                sticky_model,
                user_text,
                default_title,
                idempotency,
                now,
            } => {
                let begin = BeginTurn {
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
                    now: *now,
                };
                begin_to(&mut script, &begin)?;
                let rows = script.run(conn).await.map_err(duplicate_key)?;
                appended_seq(&rows, conversation_id).map(Written::Seq)
            }
            Write::Append { conversation_id, turn_id, chunks, now } => {
                append_to(&mut script, conversation_id, turn_id, chunks, *now)?;
                appended_seq(&script.run(conn).await?, conversation_id).map(Written::Seq)
            }
            Write::Seal { conversation_id, turn_id, reason, metrics, now, chunks } => {
                let seal = SealTurn { conversation_id, turn_id, reason, metrics, now: *now };
                seal_to(&mut script, &seal, chunks)?;
                sealed_status(&script.run(conn).await?, conversation_id).map(Written::Status)
            }
        }
    }
}

impl Store {
    /// Writes through the writer task (or alone, when there is none).
    pub(super) async fn write(&self, write: Write) -> StoreResult<Written> {
        let Some(queue) = &self.queue else {
            return self.write_alone(&write).await;
        };
        let (reply, answer) = oneshot::channel();
        match queue.send(Queued { write, reply }) {
            Ok(()) => {
                answer.await.unwrap_or_else(|_| Err(StoreError::Unwritable("the database writer stopped".into())))
            }
            Err(mpsc::error::SendError(queued)) => self.write_alone(&queued.write).await,
        }
    }

    /// One write in a transaction of its own.
    async fn write_alone(&self, write: &Write) -> StoreResult<Written> {
        let result = async {
            let (mut tx, started) = self.write_tx().await?;
            let written = write.run_in(&mut tx).await?;
            self.commit(tx, started).await?;
            Ok(written)
        }
        .await;
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
                let _ = reply.send(self.write_alone(&write).await);
                continue;
            }
            match self.write_together(&batch).await {
                Ok(answers) => {
                    for (queued, answer) in batch.into_iter().zip(answers) {
                        let _ = queued.reply.send(self.noted(Ok(answer)));
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, writes = batch.len(), "a shared write transaction failed; writing each alone");
                    for Queued { write, reply } in batch {
                        let _ = reply.send(self.write_alone(&write).await);
                    }
                }
            }
        }
    }

    /// Runs the writes in one transaction. An error means nothing was committed.
    async fn write_together(&self, batch: &[Queued]) -> StoreResult<Vec<Written>> {
        let (mut tx, started) = self.write_tx().await?;
        let mut answers = Vec::with_capacity(batch.len());
        for queued in batch {
            match queued.write.run_in(&mut tx).await {
                Ok(written) => answers.push(written),
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(e);
                }
            }
        }
        self.commit(tx, started).await?;
        Ok(answers)
    }
}
