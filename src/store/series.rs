//! Turn figures over time (`GET /metrics/series`): per model and time slot, what the database
//! counts and sums of the sealed turns, and their times to first token counted into fixed
//! classes. An answer's rows are bounded by models x slots x classes, however many turns the
//! period holds: no turn's row leaves the database.

use super::sql::Query;
use super::{Store, StoreResult};
use crate::metrics::TTFT_BUCKETS;

/// Upper bounds (ms) of the classes a turn's time to first token is counted in: the bounds of
/// `dispatch_model_ttft_seconds`, so the two read alike. A class past the last holds the slower
/// ones.
pub const TTFT_BOUNDS_MS: [i64; TTFT_BUCKETS.len()] = {
    let mut bounds = [0; TTFT_BUCKETS.len()];
    let mut i = 0;
    while i < bounds.len() {
        bounds[i] = (TTFT_BUCKETS[i] * 1000.0 + 0.5) as i64;
        i += 1;
    }
    bounds
};

/// One model's turns in one slot, in one class of time to first token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotRow {
    pub model: String,
    /// The slot's index from the period's start.
    pub slot: i64,
    /// The class of `TTFT_BOUNDS_MS` (one past the last: slower), or none (no first token).
    pub class: Option<usize>,
    pub turns: i64,
    pub failed: i64,
    pub aborted: i64,
    pub output_tokens: i64,
    pub gen_ms: i64,
}

/// model, slot, class (-1: none), turns, failed, aborted, output tokens, generation ms.
type Row = (String, i64, i64, i64, i64, i64, i64, i64);

/// How much of a failed turn's error chunk a listing reads: an agent program's error can be
/// as long as a line it may print (16 MiB by default), a hundred of them an answer of 1.6 GB.
pub const MOST_ERROR_CHUNK_BYTES: i64 = 4096;

/// A turn that ended `error`, with the error chunk its log ends with (absent for a turn whose
/// error was not written: the database refused it), its first `MOST_ERROR_CHUNK_BYTES` only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedTurn {
    pub conversation_id: String,
    pub turn_id: String,
    pub model: String,
    pub sealed_at: i64,
    pub error_chunk: Option<String>,
}

impl Store {
    /// The turns sealed in `[start, end)` by model, slot of `slot_ms` from `start`, and class of
    /// time to first token; with `owner`, only that subject's conversations' turns.
    pub async fn series(&self, start: i64, end: i64, slot_ms: i64, owner: Option<&str>) -> StoreResult<Vec<SlotRow>> {
        let classes: String =
            TTFT_BOUNDS_MS.iter().enumerate().map(|(i, bound)| format!(" WHEN ttft_ms <= {bound} THEN {i}")).collect();
        let mut sql = format!(
            "SELECT model, (sealed_at - $1) / $3 AS slot,
                    CAST(CASE WHEN ttft_ms IS NULL THEN -1{classes} ELSE {} END AS BIGINT) AS class,
                    count(*),
                    CAST(coalesce(sum(CASE WHEN reason = 'error' THEN 1 ELSE 0 END), 0) AS BIGINT),
                    CAST(coalesce(sum(CASE WHEN reason = 'aborted' THEN 1 ELSE 0 END), 0) AS BIGINT),
                    CAST(coalesce(sum(output_tokens), 0) AS BIGINT),
                    CAST(coalesce(sum(gen_total_ms), 0) AS BIGINT)
             FROM turns WHERE sealed_at >= $1 AND sealed_at < $2
             AND conversation_id NOT IN (SELECT id FROM conversations WHERE deleted_at IS NOT NULL",
            TTFT_BOUNDS_MS.len()
        );
        // Turns of deleted conversations count for nobody; with `owner`, others' for nobody either.
        if owner.is_some() {
            sql.push_str(" OR owner IS NULL OR owner <> $4");
        }
        sql.push_str(") GROUP BY model, slot, class ORDER BY model, slot, class");
        let mut query = Query::new(sql).bind(start).bind(end).bind(slot_ms.max(1));
        if let Some(owner) = owner {
            query = query.bind(owner);
        }
        let rows: Vec<Row> = self.fetch_all(query).await?;
        Ok(rows
            .into_iter()
            .map(|(model, slot, class, turns, failed, aborted, output_tokens, gen_ms)| SlotRow {
                model,
                slot,
                class: usize::try_from(class).ok(),
                turns,
                failed,
                aborted,
                output_tokens,
                gen_ms,
            })
            .collect())
    }
}

impl Store {
    /// The newest turns sealed since `since` that ended `error`, at most `limit`, each with its
    /// last error chunk (found in the turn's own chunks, from its first seq); with `owner`, only
    /// that subject's conversations'.
    pub async fn failed_turns(&self, since: i64, limit: u32, owner: Option<&str>) -> StoreResult<Vec<FailedTurn>> {
        // Chunks are kept as the JSON text written, whose first key is the type. (PostgreSQL's
        // substr takes an integer length.)
        let mut sql = "SELECT t.conversation_id, t.turn_id, t.model, t.sealed_at,
                              (SELECT substr(c.chunk, 1, CAST($3 AS INTEGER)) FROM chunks c
                               WHERE c.conversation_id = t.conversation_id AND c.seq >= coalesce(t.first_seq, 0)
                                 AND c.turn_id = t.turn_id AND c.chunk LIKE '{\"type\":\"error\"%'
                               ORDER BY c.seq DESC LIMIT 1)
                       FROM turns t WHERE t.sealed_at >= $1 AND t.reason = 'error'
                       AND t.conversation_id NOT IN (SELECT id FROM conversations WHERE deleted_at IS NOT NULL"
            .to_owned();
        if owner.is_some() {
            sql.push_str(" OR owner IS NULL OR owner <> $4");
        }
        sql.push_str(") ORDER BY t.sealed_at DESC, t.turn_id LIMIT $2");
        let mut query = Query::new(sql).bind(since).bind(i64::from(limit)).bind(MOST_ERROR_CHUNK_BYTES);
        if let Some(owner) = owner {
            query = query.bind(owner);
        }
        let rows: Vec<(String, String, String, i64, Option<String>)> = self.fetch_all(query).await?;
        Ok(rows
            .into_iter()
            .map(|(conversation_id, turn_id, model, sealed_at, error_chunk)| FailedTurn {
                conversation_id,
                turn_id,
                model,
                sealed_at,
                error_chunk,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use crate::store::testing::every_backend;

    #[test]
    fn the_classes_are_the_histograms_bounds_in_milliseconds() {
        assert_eq!(super::TTFT_BOUNDS_MS[..4], [25, 50, 100, 250]);
        assert_eq!(*super::TTFT_BOUNDS_MS.last().unwrap(), 120_000);
    }

    /// Turns are counted by slot and class of time to first token, on both backends.
    #[tokio::test]
    async fn turns_count_by_slot_and_class_of_first_token() {
        for t in every_backend().await {
            let (store, b) = (&t.store, t.backend);
            store.begin_test_turn("s1", "t1").await;
            store.seal_test_turn("s1", "t1", None, &[]).await.unwrap();
            // The test seal is at 2 ms with no steps: slot 0 of 1 s slots, no first token.
            let rows = store.series(0, 10_000, 1_000, None).await.unwrap();
            assert_eq!(rows.len(), 1, "{b}: {rows:?}");
            assert_eq!((rows[0].slot, rows[0].class, rows[0].turns, rows[0].failed), (0, None, 1, 0), "{b}");
            assert!(store.series(10_000, 20_000, 1_000, None).await.unwrap().is_empty(), "{b}");
        }
    }
}
