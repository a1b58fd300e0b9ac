//! Turn rows: opened with the user's chunk, sealed with their metrics, repaired after a crash.

use super::sql::Query;
use super::{BeginTurn, NewChunk, SealTurn};
use super::{Store, StoreError, StoreResult};
use crate::wire::{Chunk, ConversationStatus, ErrorChunk, ErrorCode, Role, TextChunk, TurnMetrics};

/// The user's text as the chunk that opens its own message.
pub fn user_chunk(text: &str) -> NewChunk {
    NewChunk { role: Role::User, chunk: Chunk::Text(TextChunk { text: text.to_owned() }), new_message: true }
}

/// The error chunk that marks a turn whose process died: appended at the next start, or by
/// another gateway when the turn's lease ends (the wording is docs/storage.md's either way).
pub const INTERRUPTED_MESSAGE: &str = "turn interrupted: server restarted";

/// How long idempotency keys are kept, at least.
pub(super) const IDEMPOTENCY_KEEP_MS: i64 = 24 * 60 * 60 * 1000;

/// The error chunk that marks a turn cut off (docs/storage.md: one per turn, then it is history).
pub(super) fn interrupted_marker() -> NewChunk {
    NewChunk {
        role: Role::Assistant,
        chunk: Chunk::Error(ErrorChunk { message: INTERRUPTED_MESSAGE.to_owned(), code: Some(ErrorCode::Interrupted) }),
        new_message: true,
    }
}

/// The generation time a seal records for throughput: output over the time spent producing
/// it, so a step that reported no output (aborted before its first token, stalled, failed)
/// adds no time either.
pub(super) fn gen_total_ms(metrics: &TurnMetrics) -> i64 {
    metrics.steps.iter().filter(|st| st.usage.output_tokens > 0).filter_map(|st| st.gen_total_ms).sum::<u64>() as i64
}

/// The time to first token a seal records for figures over time: its first step's.
pub(super) fn first_ttft_ms(metrics: &TurnMetrics) -> Option<i64> {
    metrics.steps.first().and_then(|st| st.ttft_ms).map(|ms| ms as i64)
}

/// A write's error, with a reused idempotency key told apart (a unique violation on
/// `idempotency_keys`, as both backends word it).
pub(super) fn duplicate_key(e: StoreError) -> StoreError {
    let duplicate = match &e {
        StoreError::Sqlite(rusqlite::Error::SqliteFailure(failure, Some(message))) => {
            failure.code == rusqlite::ErrorCode::ConstraintViolation && message.contains("idempotency_keys")
        }
        #[cfg(feature = "cluster")]
        StoreError::Postgres(db) => {
            db.as_database_error().is_some_and(|d| d.is_unique_violation() && d.message().contains("idempotency_keys"))
        }
        _ => false,
    };
    if duplicate { StoreError::DuplicateKey } else { e }
}

fn parse_metrics(json: &str) -> StoreResult<TurnMetrics> {
    serde_json::from_str(json).map_err(|e| StoreError::Corrupt(format!("turn metrics: {e}")))
}

/// A sealed turn's row as a metrics page reads it: ordinal, metrics JSON, the page's count, why
/// it ended, the seq of its user message.
type MetricsRow = (i64, String, i64, Option<String>, Option<i64>);

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
            owner: t.owner.map(str::to_owned),
            budget: t.budget.cloned(),
            now: t.now,
            lease_ms: self.lease_ms(),
        };
        match self.write(job).await {
            // What holds the lease: another turn, or the conversation's deletion.
            Err(StoreError::Busy) if self.being_deleted(t.conversation_id).await? => Err(StoreError::Deleting),
            written => written?.seq(),
        }
    }

    async fn being_deleted(&self, conversation_id: &str) -> StoreResult<bool> {
        let sql = "SELECT 1 FROM conversations WHERE id = $1 AND deleted_at IS NOT NULL";
        let row: Option<(i32,)> = self.fetch_optional(Query::new(sql).bind(conversation_id)).await?;
        Ok(row.is_some())
    }

    /// The first answer to an idempotency key, with the hash of the body it came with.
    pub async fn idempotent_response(&self, conversation_id: &str, key: &str) -> StoreResult<Option<(String, String)>> {
        let sql = "SELECT body_hash, response FROM idempotency_keys WHERE conversation_id = $1 AND key = $2";
        self.fetch_optional(Query::new(sql).bind(conversation_id).bind(key)).await
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
            tokens_per_estimate: s.tokens_per_estimate,
            charge: s.charge.map(|c| (c.subject.to_owned(), c.tokens)),
        };
        self.write(job).await?.status()
    }

    /// Every sealed turn's metrics, in turn order, `page` turns at a time and at most
    /// `page_bytes` of their JSON (at least one turn): each page is read when the stream is
    /// polled for it, after the turns of the one before.
    pub fn turn_metrics_pages(
        &self,
        conversation_id: String,
        page: u64,
        page_bytes: u64,
    ) -> impl futures_util::Stream<Item = StoreResult<Vec<TurnMetrics>>> + Send + 'static {
        let page = page.clamp(1, i64::MAX as u64) as i64;
        let page_bytes = page_bytes.clamp(1, i64::MAX as u64) as i64;
        // After which ordinal the next page starts, and the log the read began with
        // (`Store::incarnation`); `None` once the last page is out.
        let start = (self.clone(), conversation_id, None::<Option<(i64, Option<String>)>>);
        futures_util::stream::try_unfold(start, move |(store, id, at)| async move {
            let (after, born) = match at {
                Some(Some(at)) => at,
                Some(None) => return Ok(None),
                None => (0, store.incarnation(&id).await?),
            };
            // The page's first `page` turns, then of those the ones whose JSON before them is
            // under `page_bytes` (the first always): `taken` counts the turns before that cut.
            let sql = "SELECT ordinal, metrics, taken, reason, first_seq FROM (
                           SELECT ordinal, metrics, reason, first_seq, count(*) OVER () AS taken,
                                  sum(length(metrics)) OVER (ORDER BY ordinal) - length(metrics) AS before
                           FROM (SELECT ordinal, metrics, reason, first_seq FROM turns
                                 WHERE conversation_id = $1 AND metrics IS NOT NULL AND ordinal > $2
                                   AND EXISTS (SELECT 1 FROM conversations WHERE id = $1 AND deleted_at IS NULL)
                                 ORDER BY ordinal LIMIT $3) AS first_turns
                       ) AS sized
                       WHERE before < $4 ORDER BY ordinal";
            let query = Query::new(sql).bind(id.as_str()).bind(after).bind(page).bind(page_bytes);
            let rows: Vec<MetricsRow> = store.fetch_all(query).await?;
            // A page cut short by a deletion must not pass for the last.
            store.still(&id, &born).await?;
            let Some(&(last, _, taken, ..)) = rows.last() else { return Ok(None) };
            // More may follow a full page, or one its bytes cut.
            let more = taken == page || (rows.len() as i64) < taken;
            let next = more.then_some((last, born));
            // Why each turn ended and where it starts in the log are the turn row's columns.
            let metrics = rows
                .into_iter()
                .map(|(_, json, _, reason, first_seq)| {
                    let mut metrics = parse_metrics(&json)?;
                    metrics.reason = reason;
                    metrics.first_seq = first_seq.map(|seq| seq as u64);
                    Ok(metrics)
                })
                .collect::<StoreResult<Vec<_>>>()?;
            Ok(Some((metrics, (store, id, Some(next)))))
        })
    }
}

#[cfg(test)]
impl Store {
    /// Every sealed turn's metrics in one list (for tests), read in pages that end at their
    /// first turn's bytes, so that the bytes' cut is read on both backends.
    pub(crate) async fn turn_metrics(&self, conversation_id: &str) -> StoreResult<Vec<TurnMetrics>> {
        use futures_util::TryStreamExt;
        let pages: Vec<Vec<TurnMetrics>> =
            self.turn_metrics_pages(conversation_id.to_owned(), 2, 1).try_collect().await?;
        Ok(pages.concat())
    }

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
            owner: None,
            budget: None,
            now: 1,
        };
        self.begin_turn(begin).await.unwrap();
    }

    /// Seals a turn with empty metrics, appending `chunks` first (for tests).
    pub(crate) async fn seal_test_turn(
        &self,
        conversation_id: &str,
        turn_id: &str,
        tokens_per_estimate: Option<f64>,
        chunks: &[NewChunk],
    ) -> StoreResult<ConversationStatus> {
        let metrics = TurnMetrics {
            turn_id: turn_id.into(),
            usage: Default::default(),
            duration_ms: None,
            steps: vec![],
            context_size: None,
            usage_reported: true,
            reason: None,
            first_seq: None,
        };
        let seal = SealTurn {
            conversation_id,
            turn_id,
            reason: "stop",
            metrics: &metrics,
            now: 2,
            tokens_per_estimate,
            charge: None,
        };
        self.seal_turn(seal, chunks).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::HistoryWindow;
    use crate::store::testing::every_backend;
    use crate::wire::Usage;

    async fn begin(store: &Store, conversation_id: &str, turn_id: &str) {
        store.begin_test_turn(conversation_id, turn_id).await;
    }

    #[tokio::test]
    async fn seals_queued_together_commit_in_one_transaction_and_each_gets_its_answer() {
        for t in every_backend().await {
            seals_commit_together_and_fail_alone(&t.store, &t.metrics, t.backend).await;
        }
    }

    async fn seals_commit_together_and_fail_alone(store: &Store, metrics: &crate::metrics::Metrics, backend: &str) {
        let ids: Vec<(String, String)> = (0..20).map(|i| (format!("c{i}"), format!("t{i}"))).collect();
        for (c, t) in &ids {
            begin(store, c, t).await;
        }
        let turn_metrics: Vec<TurnMetrics> = ids
            .iter()
            .map(|(_, t)| TurnMetrics {
                turn_id: t.clone(),
                usage: Usage::default(),
                duration_ms: Some(1),
                steps: vec![],
                context_size: None,
                usage_reported: true,
                reason: None,
                first_seq: None,
            })
            .collect();
        let writes = metrics.writes();
        // All 20 are queued before the writer task runs (one thread): one transaction takes them.
        let seals = ids.iter().zip(&turn_metrics).map(|((c, t), m)| {
            let seal = SealTurn {
                conversation_id: c,
                turn_id: t,
                reason: "stop",
                metrics: m,
                now: 2,
                tokens_per_estimate: None,
                charge: None,
            };
            let store = store.clone();
            async move { store.seal_turn(seal, &[user_chunk("the end")]).await }
        });
        let statuses = futures_util::future::join_all(seals).await;
        assert!(statuses.iter().all(|s| matches!(s, Ok(ConversationStatus::Idle))), "{backend}: {statuses:?}");
        assert_eq!(metrics.writes() - writes, 1, "{backend}: one transaction for the 20 seals");
        for ((c, _), m) in ids.iter().zip(&turn_metrics) {
            let all = HistoryWindow { since_seq: 0, before_seq: None, limit: None, inflight: true };
            assert_eq!(
                store.history(c, all).await.unwrap().last_seq,
                Some(2),
                "{backend} {c}: the final chunk was written"
            );
            // Read back with why it ended and where it starts, from the turn's row.
            let read = TurnMetrics { reason: Some("stop".into()), first_seq: Some(1), ..m.clone() };
            assert_eq!(store.turn_metrics(c).await.unwrap(), vec![read]);
        }
        // A seal that fails inside a shared transaction fails alone: the transaction is rolled
        // back and each seal tried on its own, so the others still seal.
        let mut begun = Vec::new();
        for i in 0..3 {
            let (c, t) = (format!("d{i}"), format!("u{i}"));
            begin(store, &c, &t).await;
            begun.push((c, t));
        }
        begun[1].0 = "never-begun".into(); // no conversation row: its seal fails
        let m = &turn_metrics[0];
        let seals = begun.iter().map(|(c, t)| {
            let seal = SealTurn {
                conversation_id: c,
                turn_id: t,
                reason: "stop",
                metrics: m,
                now: 3,
                tokens_per_estimate: None,
                charge: None,
            };
            let store = store.clone();
            async move { store.seal_turn(seal, &[]).await }
        });
        let writes = metrics.writes();
        let statuses = futures_util::future::join_all(seals).await;
        assert!(statuses[0].is_ok() && statuses[2].is_ok(), "{backend}: {statuses:?}");
        assert!(statuses[1].is_err(), "{backend}: {statuses:?}");
        assert_eq!(metrics.writes() - writes, 2, "{backend}: the two good seals, each in its own commit");
        for (c, _) in [&begun[0], &begun[2]] {
            assert_eq!(store.turn_metrics(c).await.unwrap().len(), 1, "{backend} {c} sealed");
        }
        store.close().await;
    }
}
