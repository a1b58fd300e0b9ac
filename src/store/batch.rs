//! Group commit: the writes of turns (open, append, seal) go through one writer task, which
//! commits every write queued while it was busy in one transaction. Under many concurrent turns
//! a write waits for one commit instead of one per write ahead of it, and the single writer
//! connection does several writes per round trip of BEGIN and COMMIT.
//!
//! Each write in a shared transaction runs inside a savepoint, so a write that fails (a reused
//! idempotency key, say) is rolled back alone and answered with its own error. Nothing is
//! answered as written before the COMMIT succeeds; when the shared transaction fails as a whole,
//! each write is tried again in a transaction of its own, so every failure reaches the write it
//! belongs to.

use sqlx::{Acquire, SqliteConnection};
use tokio::sync::{mpsc, oneshot};

use super::log::{NewChunk, append_in};
use super::turns::{BeginTurn, IdempotencyRecord, SealTurn, begin_in, seal_in};
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
    Status(String),
}

impl Written {
    pub(super) fn seq(self) -> StoreResult<u64> {
        match self {
            Written::Seq(seq) => Ok(seq),
            Written::Status(_) => Err(StoreError::Corrupt("a write answered with the wrong kind".into())),
        }
    }

    pub(super) fn status(self) -> StoreResult<String> {
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
    /// The write's statements, inside an open transaction.
    async fn run_in(&self, conn: &mut SqliteConnection) -> StoreResult<Written> {
        match self {
            Write::Begin { conversation_id, turn_id, model, user_text, default_title, idempotency, now } => {
                let begin = BeginTurn {
                    conversation_id,
                    turn_id,
                    model,
                    user_text,
                    default_title,
                    idempotency: idempotency.as_ref().map(|(key, body_hash, response)| IdempotencyRecord {
                        key,
                        body_hash,
                        response,
                    }),
                    now: *now,
                };
                begin_in(conn, begin).await.map(Written::Seq)
            }
            Write::Append { conversation_id, turn_id, chunks, now } => {
                append_in(conn, conversation_id, turn_id, chunks, *now).await.map(Written::Seq)
            }
            Write::Seal { conversation_id, turn_id, reason, metrics, now, chunks } => {
                let seal = SealTurn { conversation_id, turn_id, reason, metrics, now: *now };
                seal_in(conn, seal, chunks).await.map(Written::Status)
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
                        let _ = queued.reply.send(self.noted(answer));
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

    /// Runs the writes in one transaction, each inside a savepoint. The outer error means
    /// nothing was committed; the inner results are final once this returns `Ok`.
    async fn write_together(&self, batch: &[Queued]) -> StoreResult<Vec<StoreResult<Written>>> {
        let (mut tx, started) = self.write_tx().await?;
        let mut answers = Vec::with_capacity(batch.len());
        for queued in batch {
            let mut savepoint = (&mut *tx).begin().await?;
            match queued.write.run_in(&mut savepoint).await {
                Ok(written) => {
                    savepoint.commit().await?;
                    answers.push(Ok(written));
                }
                Err(e) => {
                    savepoint.rollback().await?;
                    answers.push(Err(e));
                }
            }
        }
        self.commit(tx, started).await?;
        Ok(answers)
    }
}
