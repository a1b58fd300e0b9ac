//! What a subject has used, for its quotas (docs/identity.md): counted in the database so that every
//! gateway of a cluster sees the same numbers.
//!
//! - Turns running: the conversations the subject owns whose lease a turn holds (a partial
//!   index holds only the leased ones).
//! - Turns per minute: `quota_seconds`, the turns the subject started per second; the minute
//!   is the seconds that began in the last 60 s and the current one.
//! - Tokens per day: `quota_tokens`, the subject's tokens per hour, added by each seal's
//!   transaction (the usage the runtime reported, or the turn's estimate when it ended without
//!   one); the day is the hours that began in the last 24 h and this one.
//!
//! Admission is exact: the counts are read and the turn recorded in one transaction
//! ([`TurnBudget`], checked by each backend's opening write). On SQLite the one writer
//! connection makes that transaction the only one; on PostgreSQL it first takes a lock per
//! subject (`pg_advisory_xact_lock`), so that gateways admitting the same subject at once take
//! turns, each counting what the one before committed.
//! - Streams: `quota_streams`, each gateway's count of the subject's open streams, refreshed
//!   while any is open; a row not refreshed for a minute (its gateway died) stops counting.

use super::sql::Query;
use super::{Store, StoreError, StoreResult};

pub(super) const DAY_MS: i64 = 24 * 60 * 60 * 1000;
pub(super) const HOUR_MS: i64 = 60 * 60 * 1000;

/// The hour `at` falls in (its start, in ms).
pub(super) fn hour_of(at: i64) -> i64 {
    at.div_euclid(HOUR_MS) * HOUR_MS
}

/// The second `at` falls in (its start, in ms).
pub(super) fn second_of(at: i64) -> i64 {
    at.div_euclid(1000) * 1000
}

/// How long a gateway's stream count stands without being refreshed.
pub const STREAM_ROW_FRESH_MS: i64 = 60_000;

pub(super) const MINUTE_MS: i64 = 60_000;

/// The limits a subject's new turn is admitted against (none set: no check, no row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnBudget {
    pub subject: String,
    pub concurrent_turns: Option<u32>,
    pub turns_per_minute: Option<u32>,
    pub tokens_per_day: Option<u64>,
}

/// A limit the new turn would pass: the opening write is refused with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverBudget {
    /// `concurrent_turns`, `turns_per_minute` or `tokens_per_day`.
    pub limit: &'static str,
    pub used: u64,
    pub max: u64,
    /// When the oldest of what counts started (none for running turns): for `Retry-After`.
    pub oldest_ms: Option<i64>,
    /// The window the limit counts over, in ms (0 for running turns).
    pub window_ms: i64,
}

/// What the budget's check reads: turns running, turns and the oldest counted second in the
/// last minute, tokens and the oldest counted hour in the last day.
type BudgetRow = (i64, i64, Option<i64>, i64, Option<i64>);

impl TurnBudget {
    /// The one statement that reads what the subject used (run inside the opening write's
    /// transaction, after the subject's lock on PostgreSQL).
    pub(super) fn usage(&self, now: i64) -> Query {
        let sql = "SELECT
              (SELECT count(*) FROM conversations
                 WHERE owner = $1 AND lease_turn IS NOT NULL AND deleted_at IS NULL),
              (SELECT CAST(coalesce(sum(turns), 0) AS BIGINT) FROM quota_seconds WHERE subject = $1 AND second >= $2),
              (SELECT min(second) FROM quota_seconds WHERE subject = $1 AND second >= $2),
              (SELECT CAST(coalesce(sum(tokens), 0) AS BIGINT) FROM quota_tokens WHERE subject = $1 AND hour >= $3),
              (SELECT min(hour) FROM quota_tokens WHERE subject = $1 AND hour >= $3 AND tokens > 0)";
        Query::new(sql).bind(self.subject.as_str()).bind(second_of(now - MINUTE_MS)).bind(hour_of(now - DAY_MS))
    }

    /// Whether one more turn fits what [`TurnBudget::usage`] read.
    pub(super) fn judge(&self, row: Option<BudgetRow>) -> StoreResult<()> {
        let (running, minute, minute_oldest, tokens, day_oldest) = row.unwrap_or((0, 0, None, 0, None));
        let over = |limit, used: i64, max: u64, oldest_ms, window_ms| {
            let used = used.max(0) as u64;
            (used >= max).then_some(OverBudget { limit, used, max, oldest_ms, window_ms })
        };
        let refusal = self
            .concurrent_turns
            .and_then(|max| over("concurrent_turns", running, u64::from(max), None, 0))
            .or_else(|| {
                self.turns_per_minute
                    .and_then(|max| over("turns_per_minute", minute, u64::from(max), minute_oldest, MINUTE_MS + 1000))
            })
            .or_else(|| {
                self.tokens_per_day.and_then(|max| over("tokens_per_day", tokens, max, day_oldest, DAY_MS + HOUR_MS))
            });
        refusal.map_or(Ok(()), |over| Err(StoreError::OverBudget(over)))
    }
}

impl Store {
    /// Tokens charged to `subject` in the hours from the one `since_ms` falls in (what
    /// `tokens_per_day` counts).
    pub async fn tokens_since(&self, subject: &str, since_ms: i64) -> StoreResult<u64> {
        let sql = "SELECT CAST(coalesce(sum(tokens), 0) AS BIGINT) FROM quota_tokens WHERE subject = $1 AND hour >= $2";
        let q = Query::new(sql).bind(subject).bind(hour_of(since_ms));
        let (n,): (i64,) = self.fetch_optional(q).await?.unwrap_or((0,));
        Ok(n.max(0) as u64)
    }

    /// Records `open` streams of `subject` on `gateway` as of `now`.
    pub async fn set_open_streams(&self, gateway: &str, subject: &str, open: u64, now: i64) -> StoreResult<()> {
        let q = if open == 0 {
            Query::new("DELETE FROM quota_streams WHERE gateway = $1 AND subject = $2").bind(gateway).bind(subject)
        } else {
            let sql = "INSERT INTO quota_streams (gateway, subject, open, seen_at) VALUES ($1, $2, $3, $4)
                       ON CONFLICT (gateway, subject) DO UPDATE SET open = excluded.open, seen_at = excluded.seen_at";
            Query::new(sql).bind(gateway).bind(subject).bind(open as i64).bind(now)
        };
        self.execute(q).await?;
        Ok(())
    }

    /// Removes the stream counts no gateway has refreshed for a minute (their gateway stopped).
    pub async fn forget_stale_streams(&self, now: i64) -> StoreResult<u64> {
        let sql = "DELETE FROM quota_streams WHERE seen_at < $1";
        self.execute(Query::new(sql).bind(now - STREAM_ROW_FRESH_MS)).await
    }

    /// Streams `subject` has open on the other gateways (rows refreshed within the last minute).
    pub async fn open_streams_elsewhere(&self, gateway: &str, subject: &str, now: i64) -> StoreResult<u64> {
        let sql = "SELECT CAST(coalesce(sum(open), 0) AS BIGINT) FROM quota_streams
                   WHERE subject = $1 AND gateway <> $2 AND seen_at > $3";
        let q = Query::new(sql).bind(subject).bind(gateway).bind(now - STREAM_ROW_FRESH_MS);
        let (n,): (i64,) = self.fetch_optional(q).await?.unwrap_or((0,));
        Ok(n.max(0) as u64)
    }
}

#[cfg(test)]
mod tests {
    use crate::store::testing::every_backend;

    /// A gateway's stream count stops counting once it is not refreshed for a minute, and is
    /// then removed: a gateway that died leaves nothing behind.
    #[tokio::test]
    async fn stale_stream_counts_stop_counting_and_go() {
        for t in every_backend().await {
            let (store, b) = (&t.store, t.backend);
            store.set_open_streams("dead", "alice", 3, 1_000).await.unwrap();
            store.set_open_streams("alive", "alice", 2, 100_000).await.unwrap();
            assert_eq!(store.open_streams_elsewhere("here", "alice", 100_000).await.unwrap(), 2, "{b}");
            assert_eq!(store.forget_stale_streams(100_000).await.unwrap(), 1, "{b}");
            assert_eq!(store.forget_stale_streams(100_000).await.unwrap(), 0, "{b}");
            assert_eq!(store.open_streams_elsewhere("here", "alice", 100_000).await.unwrap(), 2, "{b}");
            store.set_open_streams("alive", "alice", 0, 100_000).await.unwrap();
            assert_eq!(store.open_streams_elsewhere("here", "alice", 100_000).await.unwrap(), 0, "{b}");
        }
    }
}
