//! Turn rows: opened with the user's chunk, sealed with their metrics, repaired after a crash.

use sqlx::sqlite::SqliteRow;

use super::log::{NewChunk, append_to};
use super::script::Script;
use super::{Store, StoreError, StoreResult};
use crate::wire::{Chunk, ConversationStatus, ErrorChunk, Role, TextChunk, TurnMetrics};

/// The user's text as the chunk that opens its own message.
pub fn user_chunk(text: &str) -> NewChunk {
    NewChunk { role: Role::User, chunk: Chunk::Text(TextChunk { text: text.to_owned() }), new_message: true }
}

/// The error chunk a restart appends to a turn the previous process left open.
pub const INTERRUPTED_MESSAGE: &str = "turn interrupted: server restarted";
pub const INTERRUPTED_CODE: &str = "interrupted";

pub struct BeginTurn<'a> {
    pub conversation_id: &'a str,
    pub turn_id: &'a str,
    pub model: &'a str,
    /// The model the request named: it becomes the conversation's sticky model.
    pub sticky_model: Option<&'a str>,
    pub user_text: &'a str,
    /// Title given to a conversation the turn creates, or one whose title is still empty.
    pub default_title: &'a str,
    /// Recorded in the same transaction, so a retried request finds it whatever happens next.
    pub idempotency: Option<IdempotencyRecord<'a>>,
    pub now: i64,
}

/// An `Idempotency-Key` with the request it came with and the answer it got.
pub struct IdempotencyRecord<'a> {
    pub key: &'a str,
    pub body_hash: &'a str,
    pub response: &'a str,
}

/// How long idempotency keys are kept, at least.
const IDEMPOTENCY_KEEP_MS: i64 = 24 * 60 * 60 * 1000;

pub struct SealTurn<'a> {
    pub conversation_id: &'a str,
    pub turn_id: &'a str,
    pub reason: &'a str,
    pub metrics: &'a TurnMetrics,
    pub now: i64,
}

/// Adds the statements that open a turn to `script` (answered like an append: the seq of the
/// user's chunk). A reused idempotency key fails the script with a unique violation on
/// `idempotency_keys` (see [`duplicate_key`]).
pub(super) fn begin_to(script: &mut Script, t: &BeginTurn<'_>) -> StoreResult<()> {
    script
        .sql(
            "INSERT INTO conversations (id, title, status, created_at, last_activity_at, turn_count, model)
             VALUES (?, ?, 'active', ?, ?, 1, ?)
             ON CONFLICT (id) DO UPDATE SET status = 'active', last_activity_at = excluded.last_activity_at,
                 turn_count = turn_count + 1, title = CASE WHEN title = '' THEN excluded.title ELSE title END,
                 model = coalesce(excluded.model, model);
             INSERT INTO turns (conversation_id, turn_id, ordinal, model, started_at, first_seq)
             SELECT id, ?, turn_count, ?, ?, last_seq + 1 FROM conversations WHERE id = ?;",
        )
        .bind(t.conversation_id)
        .bind(t.default_title)
        .bind(t.now)
        .bind(t.now)
        .bind(t.sticky_model)
        .bind(t.turn_id)
        .bind(t.model)
        .bind(t.now)
        .bind(t.conversation_id);
    if let Some(record) = &t.idempotency {
        script
            .sql(
                "DELETE FROM idempotency_keys WHERE created_at < ?;
                 INSERT INTO idempotency_keys (conversation_id, key, body_hash, response, created_at)
                 VALUES (?, ?, ?, ?, ?);",
            )
            .bind(t.now - IDEMPOTENCY_KEEP_MS)
            .bind(t.conversation_id)
            .bind(record.key)
            .bind(record.body_hash)
            .bind(record.response)
            .bind(t.now);
    }
    append_to(script, t.conversation_id, t.turn_id, &[user_chunk(t.user_text)], t.now)
}

/// A script's error, with a reused idempotency key told apart.
pub(super) fn duplicate_key(e: StoreError) -> StoreError {
    match &e {
        StoreError::Database(db) => match db.as_database_error() {
            Some(d) if d.is_unique_violation() && d.message().contains("idempotency_keys") => StoreError::DuplicateKey,
            _ => e,
        },
        _ => e,
    }
}

/// Adds the statements of a seal to `script`; its last row is the conversation's status
/// (no row when the conversation does not exist).
pub(super) fn seal_to(script: &mut Script, s: &SealTurn<'_>, final_chunks: &[NewChunk]) -> StoreResult<()> {
    let metrics = serde_json::to_string(s.metrics).map_err(|e| StoreError::Corrupt(e.to_string()))?;
    // Throughput is output over the time spent producing it: a step that reported no output
    // (aborted before its first token, stalled, failed) adds no time either.
    let gen_total_ms: u64 =
        s.metrics.steps.iter().filter(|st| st.usage.output_tokens > 0).filter_map(|st| st.gen_total_ms).sum();
    if !final_chunks.is_empty() {
        append_to(script, s.conversation_id, s.turn_id, final_chunks, s.now)?;
    }
    script
        .sql(
            "UPDATE turns SET sealed_at = ?, reason = ?, metrics = ?, output_tokens = ?, gen_total_ms = ?
             WHERE conversation_id = ? AND turn_id = ?;
             UPDATE conversations SET last_activity_at = ?, sealed_seq = last_seq,
                 status = CASE WHEN status = 'closed' THEN 'closed' ELSE 'idle' END
             WHERE id = ? RETURNING status;",
        )
        .bind(s.now)
        .bind(s.reason)
        .bind(metrics)
        .bind(s.metrics.usage.output_tokens as i64)
        .bind(gen_total_ms as i64)
        .bind(s.conversation_id)
        .bind(s.turn_id)
        .bind(s.now)
        .bind(s.conversation_id);
    Ok(())
}

/// The status a seal script answered with.
pub(super) fn sealed_status(rows: &[SqliteRow], conversation_id: &str) -> StoreResult<ConversationStatus> {
    use sqlx::Row;
    let row =
        rows.last().ok_or_else(|| StoreError::Corrupt(format!("conversation {conversation_id} does not exist")))?;
    super::status_of(&row.try_get::<String, _>(0)?)
}

impl Store {
    /// Opens a turn: creates the conversation when missing, marks it active, records the turn
    /// and appends the user's chunk, all in one transaction (shared with other writes queued
    /// with it). Returns the user chunk's seq.
    pub async fn begin_turn(&self, t: BeginTurn<'_>) -> StoreResult<u64> {
        let job = super::batch::Write::Begin {
            conversation_id: t.conversation_id.to_owned(),
            turn_id: t.turn_id.to_owned(),
            model: t.model.to_owned(),
            sticky_model: t.sticky_model.map(str::to_owned),
            user_text: t.user_text.to_owned(),
            default_title: t.default_title.to_owned(),
            idempotency: t.idempotency.map(|r| (r.key.to_owned(), r.body_hash.to_owned(), r.response.to_owned())),
            now: t.now,
        };
        self.write(job).await?.seq()
    }

    /// The first answer to an idempotency key, with the hash of the body it came with.
    pub async fn idempotent_response(&self, conversation_id: &str, key: &str) -> StoreResult<Option<(String, String)>> {
        Ok(sqlx::query_as("SELECT body_hash, response FROM idempotency_keys WHERE conversation_id = ? AND key = ?")
            .bind(conversation_id)
            .bind(key)
            .fetch_optional(&self.reader)
            .await?)
    }

    /// Seals a turn: its chunks not yet written, its metrics, and the conversation back to
    /// idle (a closed one stays closed), in one transaction (shared with other writes queued
    /// with it). Returns the conversation's status.
    pub async fn seal_turn(&self, s: SealTurn<'_>, final_chunks: &[NewChunk]) -> StoreResult<ConversationStatus> {
        let job = super::batch::Write::Seal {
            conversation_id: s.conversation_id.to_owned(),
            turn_id: s.turn_id.to_owned(),
            reason: s.reason.to_owned(),
            metrics: s.metrics.clone(),
            now: s.now,
            chunks: final_chunks.to_vec(),
        };
        self.write(job).await?.status()
    }

    /// Every sealed turn's metrics, in turn order.
    pub async fn turn_metrics(&self, conversation_id: &str) -> StoreResult<Vec<TurnMetrics>> {
        let rows: Vec<(String,)> = sqlx::query_as(
            "SELECT metrics FROM turns WHERE conversation_id = ? AND metrics IS NOT NULL ORDER BY ordinal",
        )
        .bind(conversation_id)
        .fetch_all(&self.reader)
        .await?;
        rows.into_iter()
            .map(|(json,)| serde_json::from_str(&json).map_err(|e| StoreError::Corrupt(format!("turn metrics: {e}"))))
            .collect()
    }

    /// The `contextSize` of the conversation's last sealed turn (`None`: no turn, or none
    /// reported one).
    pub async fn last_context_size(&self, conversation_id: &str) -> StoreResult<Option<u64>> {
        let metrics: Option<String> = sqlx::query_scalar(
            "SELECT metrics FROM turns WHERE conversation_id = ? AND metrics IS NOT NULL ORDER BY ordinal DESC LIMIT 1",
        )
        .bind(conversation_id)
        .fetch_optional(&self.reader)
        .await?;
        let Some(json) = metrics else { return Ok(None) };
        let metrics: TurnMetrics =
            serde_json::from_str(&json).map_err(|e| StoreError::Corrupt(format!("turn metrics: {e}")))?;
        Ok(metrics.context_size)
    }

    /// Each turn with a user message but neither metrics nor a marker gets one
    /// `interrupted` error chunk, and its conversation goes idle. Returns how many were repaired.
    pub async fn recover_interrupted(&self, now: i64) -> StoreResult<usize> {
        let open: Vec<(String, String)> = sqlx::query_as(
            "SELECT conversation_id, turn_id FROM turns
             WHERE sealed_at IS NULL AND interrupted_at IS NULL ORDER BY conversation_id, ordinal",
        )
        .fetch_all(&self.writer)
        .await?;
        for (conversation_id, turn_id) in &open {
            let (mut tx, started) = self.write_tx().await?;
            let marker = NewChunk {
                role: Role::Assistant,
                chunk: Chunk::Error(ErrorChunk {
                    message: INTERRUPTED_MESSAGE.to_owned(),
                    code: Some(INTERRUPTED_CODE.to_owned()),
                }),
                new_message: true,
            };
            let mut script = Script::default();
            append_to(&mut script, conversation_id, turn_id, &[marker], now)?;
            script
                .sql("UPDATE turns SET interrupted_at = ? WHERE conversation_id = ? AND turn_id = ?;")
                .bind(now)
                .bind(conversation_id.as_str())
                .bind(turn_id.as_str())
                // The cut turn, marker included, is history from now on.
                .sql("UPDATE conversations SET sealed_seq = last_seq WHERE id = ?;")
                .bind(conversation_id.as_str());
            script.run(&mut tx).await?;
            self.commit(tx, started).await?;
        }
        // Whatever was active when the process died is not active now.
        sqlx::query("UPDATE conversations SET status = 'idle' WHERE status = 'active'").execute(&self.writer).await?;
        Ok(open.len())
    }
}

#[cfg(test)]
impl Store {
    /// Opens a turn whose user message is "hi" (for tests).
    pub(crate) async fn begin_test_turn(&self, conversation_id: &str, turn_id: &str) {
        let begin = BeginTurn {
            conversation_id,
            turn_id,
            model: "demo/scripted",
            sticky_model: None,
            user_text: "hi",
            default_title: "hi",
            idempotency: None,
            now: 1,
        };
        self.begin_turn(begin).await.unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::store::HistoryWindow;
    use crate::wire::Usage;
    use std::sync::Arc;

    async fn begin(store: &Store, conversation_id: &str, turn_id: &str) {
        store.begin_test_turn(conversation_id, turn_id).await;
    }

    #[tokio::test]
    async fn seals_queued_together_commit_in_one_transaction_and_each_gets_its_answer() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(Metrics::default());
        let store = Store::open(&dir.path().join("seal.db"), metrics.clone()).await.unwrap();
        let ids: Vec<(String, String)> = (0..20).map(|i| (format!("c{i}"), format!("t{i}"))).collect();
        for (c, t) in &ids {
            begin(&store, c, t).await;
        }
        let turn_metrics: Vec<TurnMetrics> = ids
            .iter()
            .map(|(_, t)| TurnMetrics {
                turn_id: t.clone(),
                usage: Usage::default(),
                duration_ms: Some(1),
                steps: vec![],
                context_size: None,
            })
            .collect();
        let writes = metrics.writes();
        // All 20 are queued before the writer task runs (one thread): one transaction takes them.
        let seals = ids.iter().zip(&turn_metrics).map(|((c, t), m)| {
            let seal = SealTurn { conversation_id: c, turn_id: t, reason: "stop", metrics: m, now: 2 };
            let store = store.clone();
            async move { store.seal_turn(seal, &[user_chunk("the end")]).await }
        });
        let statuses = futures_util::future::join_all(seals).await;
        assert!(statuses.iter().all(|s| matches!(s, Ok(ConversationStatus::Idle))), "{statuses:?}");
        assert_eq!(metrics.writes() - writes, 1, "one transaction for the 20 seals");
        for ((c, _), m) in ids.iter().zip(&turn_metrics) {
            let all = HistoryWindow { since_seq: 0, before_seq: None, limit: None, inflight: true };
            assert_eq!(store.history(c, all).await.unwrap().last_seq, Some(2), "{c}: the final chunk was written");
            assert_eq!(store.turn_metrics(c).await.unwrap(), vec![m.clone()]);
        }
        // A seal that fails inside a shared transaction fails alone: the transaction is rolled
        // back and each seal tried on its own, so the others still seal.
        let mut begun = Vec::new();
        for i in 0..3 {
            let (c, t) = (format!("d{i}"), format!("u{i}"));
            begin(&store, &c, &t).await;
            begun.push((c, t));
        }
        begun[1].0 = "never-begun".into(); // no conversation row: its seal fails
        let m = &turn_metrics[0];
        let seals = begun.iter().map(|(c, t)| {
            let seal = SealTurn { conversation_id: c, turn_id: t, reason: "stop", metrics: m, now: 3 };
            let store = store.clone();
            async move { store.seal_turn(seal, &[]).await }
        });
        let writes = metrics.writes();
        let statuses = futures_util::future::join_all(seals).await;
        assert!(statuses[0].is_ok() && statuses[2].is_ok(), "{statuses:?}");
        assert!(statuses[1].is_err(), "{statuses:?}");
        assert_eq!(metrics.writes() - writes, 2, "the two good seals, each in its own commit");
        for (c, _) in [&begun[0], &begun[2]] {
            assert_eq!(store.turn_metrics(c).await.unwrap().len(), 1, "{c} sealed");
        }
    }
}
