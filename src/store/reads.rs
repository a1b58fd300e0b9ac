//! Reads that aggregate: the whole log for a runtime, the last assistant text of a
//! conversation, throughput per model.

use super::sql::Query;
use super::{Store, StoreError, StoreResult};
use crate::wire::{Chunk, Role};

/// A chunk of the log with the message it belongs to (what runtimes send upstream).
#[derive(Debug, Clone)]
pub struct HistoryChunk {
    pub message_id: i64,
    pub role: Role,
    pub chunk: Chunk,
}

/// What runtimes left with a conversation for its next turn.
#[derive(Debug, Default)]
pub struct RuntimeMemory {
    /// The runtime's native session, to resume.
    pub session_id: Option<String>,
    /// How many tokens the upstream counted per estimated token in the last counted request.
    pub tokens_per_estimate: Option<f64>,
    /// The conversation's turn before this one, wherever it ran.
    pub previous_turn_id: Option<String>,
}

/// A conversation's log up to a turn's user message, read from its end backwards as far as a
/// runtime needs: a request that keeps only the conversation's tail never reads it whole.
#[derive(Clone)]
pub struct History {
    store: Store,
    conversation_id: String,
    /// The seq of the last chunk (seqs are gap-free from 1).
    last: u64,
}

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("History").field("conversation_id", &self.conversation_id).field("last", &self.last).finish()
    }
}

impl History {
    pub fn new(store: Store, conversation_id: &str, last: u64) -> History {
        History { store, conversation_id: conversation_id.to_owned(), last }
    }

    /// The seq of its last chunk: how many chunks it holds.
    pub fn last_seq(&self) -> u64 {
        self.last
    }

    /// The chunks of seqs `from..=to` (1-based), with their message ids, in order.
    pub async fn range(&self, from: u64, to: u64) -> StoreResult<Vec<HistoryChunk>> {
        let to = to.min(self.last);
        let sql = "SELECT seq, message_id, role, chunk FROM chunks
                   WHERE conversation_id = $1 AND seq >= $2 AND seq <= $3 ORDER BY seq";
        let q = Query::new(sql).bind(self.conversation_id.as_str()).bind(from as i64).bind(to as i64);
        let rows: Vec<(i64, i64, String, String)> = self.store.fetch_all(q).await?;
        if rows.len() as u64 != (to + 1).saturating_sub(from) {
            return Err(StoreError::Corrupt(format!("seqs {from} to {to} are not all in the log")));
        }
        rows.into_iter()
            .map(|(seq, message_id, role, chunk)| {
                let role =
                    Role::parse(&role).ok_or_else(|| StoreError::Corrupt(format!("unknown role at seq {seq}")))?;
                let chunk = serde_json::from_str(&chunk)
                    .map_err(|e| StoreError::Corrupt(format!("chunk at seq {seq}: {e}")))?;
                Ok(HistoryChunk { message_id, role, chunk })
            })
            .collect()
    }
}

/// The last assistant text of a conversation's most recent finished turn.
#[derive(Debug, Default)]
pub struct LastText {
    pub turn_id: Option<String>,
    pub content: String,
}

/// Output tokens and generation time of one model over a period.
#[derive(Debug, PartialEq, Eq)]
pub struct ModelThroughput {
    pub model: String,
    pub output_tokens: i64,
    pub gen_ms: i64,
    pub turns: i64,
}

impl Store {
    /// What runtimes left with a conversation for its next turn on `model` (a calibration
    /// only when that model's request measured it: tokenizers differ); with `previous_of`
    /// (that turn's id), which turn came before it, for runtimes that keep a process per
    /// conversation (a subquery more; the others do without).
    pub async fn runtime_memory(
        &self,
        conversation_id: &str,
        model: &str,
        previous_of: Option<&str>,
    ) -> StoreResult<RuntimeMemory> {
        let previous = match previous_of {
            Some(_) => {
                "(SELECT turn_id FROM turns WHERE conversation_id = $1 AND turn_id <> $3 ORDER BY ordinal DESC LIMIT 1)"
            }
            None => "CAST(NULL AS TEXT)",
        };
        let sql = format!(
            "SELECT session_id, CASE WHEN calibrated_model = $2 THEN tokens_per_estimate END, {previous}
             FROM conversations WHERE id = $1"
        );
        let mut q = Query::new(sql).bind(conversation_id).bind(model);
        if let Some(turn_id) = previous_of {
            q = q.bind(turn_id);
        }
        let row: Option<(Option<String>, Option<f64>, Option<String>)> = self.fetch_optional(q).await?;
        let (session_id, tokens_per_estimate, previous_turn_id) = row.unwrap_or_default();
        Ok(RuntimeMemory { session_id, tokens_per_estimate, previous_turn_id })
    }

    /// Remembers the runtime session a conversation's next turn resumes.
    pub async fn set_session_id(&self, conversation_id: &str, session_id: &str) -> StoreResult<()> {
        self.update("UPDATE conversations SET session_id = $2 WHERE id = $1", conversation_id, Some(session_id))
            .await
            .map(drop)
    }

    /// Forgets the runtime session: the next turn starts a new one. False for no
    /// conversation (or one being deleted); `Busy` while a turn holds its lease on any
    /// gateway (a turn reads the session after taking the lease, so none resumes what this
    /// forgot).
    pub async fn forget_session(&self, conversation_id: &str) -> StoreResult<bool> {
        let sql = format!(
            "UPDATE conversations SET session_id = NULL
             WHERE id = $1 AND deleted_at IS NULL AND (lease_turn IS NULL OR lease_expires_at < {})",
            self.clock()
        );
        if self.execute(Query::new(sql).bind(conversation_id)).await? > 0 {
            return Ok(true);
        }
        match self.conversation(conversation_id).await? {
            Some(_) => Err(StoreError::Busy),
            None => Ok(false),
        }
    }

    /// The text of the last assistant message that has text, in the latest finished turn.
    pub async fn last_text(&self, conversation_id: &str) -> StoreResult<LastText> {
        let sql = "SELECT turn_id FROM turns WHERE conversation_id = $1
                     AND (sealed_at IS NOT NULL OR interrupted_at IS NOT NULL)
                   ORDER BY ordinal DESC LIMIT 1";
        let turn_id: Option<(String,)> = self.fetch_optional(Query::new(sql).bind(conversation_id)).await?;
        let Some((turn_id,)) = turn_id else {
            return Ok(LastText::default());
        };
        let sql = "SELECT message_id, chunk FROM chunks
                   WHERE conversation_id = $1 AND turn_id = $2 AND role = 'assistant' ORDER BY seq";
        let rows: Vec<(i64, String)> = self.fetch_all(Query::new(sql).bind(conversation_id).bind(&turn_id)).await?;
        let texts: Vec<(i64, String)> = rows
            .into_iter()
            .filter_map(|(message, json)| match serde_json::from_str(&json) {
                Ok(Chunk::Text(t)) => Some((message, t.text)),
                _ => None,
            })
            .collect();
        let last_message = texts.last().map(|(m, _)| *m);
        let content = texts.into_iter().filter(|(m, _)| Some(*m) == last_message).map(|(_, t)| t).collect();
        Ok(LastText { turn_id: Some(turn_id), content })
    }

    /// Per model: output tokens, generation time and turns of the turns sealed in
    /// `[start, end)` (epoch ms), those of a conversation being deleted left out like every
    /// other read of it (the few marked rows, from their partial index).
    /// Output tokens and generation time per model of the turns sealed in `[start, end)`; with
    /// `owner`, only the turns of that subject's conversations.
    pub async fn throughput(&self, start: i64, end: i64, owner: Option<&str>) -> StoreResult<Vec<ModelThroughput>> {
        // Turns of deleted conversations count for nobody; with `owner`, others' for nobody either.
        let mut sql = "SELECT model, CAST(coalesce(sum(output_tokens), 0) AS BIGINT),
                              CAST(coalesce(sum(gen_total_ms), 0) AS BIGINT), count(*)
                       FROM turns WHERE sealed_at >= $1 AND sealed_at < $2
                       AND conversation_id NOT IN (SELECT id FROM conversations WHERE deleted_at IS NOT NULL"
            .to_owned();
        if owner.is_some() {
            sql.push_str(" OR owner IS NULL OR owner <> $3");
        }
        sql.push_str(") GROUP BY model");
        let mut query = Query::new(sql).bind(start).bind(end);
        if let Some(owner) = owner {
            query = query.bind(owner);
        }
        let rows: Vec<(String, i64, i64, i64)> = self.fetch_all(query).await?;
        Ok(rows
            .into_iter()
            .map(|(model, output_tokens, gen_ms, turns)| ModelThroughput { model, output_tokens, gen_ms, turns })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use crate::store::testing::every_backend;

    /// A runtime's calibration and session outlive the gateway in the conversation's row (a
    /// REAL column, bound and read back on both backends); a seal without a calibration keeps
    /// the last one; a turn on another model than the one it was measured on gets none.
    #[tokio::test]
    async fn what_a_runtime_leaves_is_kept_with_its_conversation() {
        const MODEL: &str = "demo/scripted";
        for t in every_backend().await {
            let store = &t.store;
            let ratio = |c: &'static str, model: &'static str| async move {
                store.runtime_memory(c, model, None).await.unwrap().tokens_per_estimate
            };
            let seal = |turn_id: &'static str, ratio| async move {
                store.seal_test_turn("c", turn_id, ratio, &[]).await.unwrap();
            };
            assert_eq!(ratio("c", MODEL).await, None, "{}: no conversation", t.backend);
            store.begin_test_turn("c", "t1").await;
            let first = store.runtime_memory("c", MODEL, Some("t1")).await.unwrap();
            assert_eq!(first.previous_turn_id, None, "{}: no turn before the first", t.backend);
            seal("t1", None).await;
            assert_eq!(ratio("c", MODEL).await, None, "{}: none reported", t.backend);
            store.begin_test_turn("c", "t2").await;
            seal("t2", Some(2.375)).await;
            store.begin_test_turn("c", "t3").await;
            seal("t3", None).await;
            store.set_session_id("c", "s1").await.unwrap();
            let memory = store.runtime_memory("c", MODEL, None).await.unwrap();
            assert_eq!(
                (memory.session_id.as_deref(), memory.tokens_per_estimate),
                (Some("s1"), Some(2.375)),
                "{}",
                t.backend
            );
            assert_eq!(ratio("c", "other/model").await, None, "{}: measured on another model", t.backend);
            // A turn on the other model measures its own; the first model's is gone with it.
            let begin = crate::store::BeginTurn {
                conversation_id: "c",
                turn_id: "t4",
                model: "other/model",
                sticky_model: None,
                user_text: "hi",
                default_title: "hi",
                idempotency: None,
                owner: None,
                budget: None,
                now: 1,
            };
            store.begin_turn(begin).await.unwrap();
            let previous = store.runtime_memory("c", "other/model", Some("t4")).await.unwrap().previous_turn_id;
            assert_eq!(previous.as_deref(), Some("t3"), "{}: the turn before t4", t.backend);
            seal("t4", Some(1.25)).await;
            assert_eq!(ratio("c", "other/model").await, Some(1.25), "{}", t.backend);
            assert_eq!(ratio("c", MODEL).await, None, "{}", t.backend);
        }
    }

    /// A session is forgotten only between turns: while a turn holds the lease the turn
    /// could resume it after the forgetting, so that is refused; an unknown conversation is
    /// no conversation; the calibration stays.
    #[tokio::test]
    async fn a_session_is_forgotten_between_turns_only() {
        for t in every_backend().await {
            let store = &t.store;
            let session = || async { store.runtime_memory("c", "demo/scripted", None).await.unwrap().session_id };
            assert!(!store.forget_session("c").await.unwrap(), "{}: no conversation", t.backend);
            store.begin_test_turn("c", "t1").await;
            store.set_session_id("c", "s1").await.unwrap();
            let busy = store.forget_session("c").await;
            assert!(matches!(busy, Err(crate::store::StoreError::Busy)), "{}: {busy:?}", t.backend);
            assert_eq!(session().await.as_deref(), Some("s1"), "{}", t.backend);
            store.seal_test_turn("c", "t1", Some(2.0), &[]).await.unwrap();
            assert!(store.forget_session("c").await.unwrap(), "{}", t.backend);
            assert_eq!(session().await, None, "{}", t.backend);
            let memory = store.runtime_memory("c", "demo/scripted", None).await.unwrap();
            assert_eq!(memory.tokens_per_estimate, Some(2.0), "{}", t.backend);
        }
    }
}
