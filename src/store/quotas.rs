//! What a subject has used, for its quotas (docs/identity.md): counted in the database so that every
//! gateway of a cluster sees the same numbers.
//!
//! - Turns running: the conversations the subject owns whose lease a turn holds.
//! - Turns per minute and tokens per day: `quota_turns`, a row per turn the subject started
//!   (written in the turn's first transaction), its tokens added at the seal.
//! - Streams: `quota_streams`, each gateway's count of the subject's open streams, refreshed
//!   while any is open; a row not refreshed for a minute (its gateway died) stops counting.

use super::sql::Query;
use super::{Store, StoreResult};

pub(super) const DAY_MS: i64 = 24 * 60 * 60 * 1000;

/// How long a gateway's stream count stands without being refreshed.
pub const STREAM_ROW_FRESH_MS: i64 = 60_000;

/// What a subject used in a window: how much, and when the oldest of it started (for
/// `Retry-After`).
#[derive(Debug, Clone, Copy, Default)]
pub struct QuotaUse {
    pub amount: u64,
    pub oldest_ms: Option<i64>,
}

impl Store {
    /// Turns running now in conversations `subject` owns.
    pub async fn running_turns(&self, subject: &str) -> StoreResult<u64> {
        let sql = "SELECT count(*) FROM conversations
                   WHERE owner = $1 AND lease_turn IS NOT NULL AND deleted_at IS NULL";
        let (n,): (i64,) = self.fetch_optional(Query::new(sql).bind(subject)).await?.unwrap_or((0,));
        Ok(n.max(0) as u64)
    }

    /// Turns `subject` started since `since_ms`.
    pub async fn turns_since(&self, subject: &str, since_ms: i64) -> StoreResult<QuotaUse> {
        let sql = "SELECT count(*), min(started_at) FROM quota_turns WHERE subject = $1 AND started_at > $2";
        let row: Option<(i64, Option<i64>)> = self.fetch_optional(Query::new(sql).bind(subject).bind(since_ms)).await?;
        let (n, oldest) = row.unwrap_or((0, None));
        Ok(QuotaUse { amount: n.max(0) as u64, oldest_ms: oldest })
    }

    /// Tokens of the turns `subject` started since `since_ms`.
    pub async fn tokens_since(&self, subject: &str, since_ms: i64) -> StoreResult<QuotaUse> {
        let sql = "SELECT CAST(coalesce(sum(tokens), 0) AS BIGINT), min(started_at) FROM quota_turns
                   WHERE subject = $1 AND started_at > $2 AND tokens > 0";
        let row: Option<(i64, Option<i64>)> = self.fetch_optional(Query::new(sql).bind(subject).bind(since_ms)).await?;
        let (n, oldest) = row.unwrap_or((0, None));
        Ok(QuotaUse { amount: n.max(0) as u64, oldest_ms: oldest })
    }

    /// Adds a sealed turn's tokens to its subject's day (no row: the turn was not counted).
    pub async fn add_turn_tokens(&self, subject: &str, turn_id: &str, tokens: u64) -> StoreResult<()> {
        let sql = "UPDATE quota_turns SET tokens = tokens + $3 WHERE subject = $1 AND turn_id = $2";
        self.execute(Query::new(sql).bind(subject).bind(turn_id).bind(tokens.min(i64::MAX as u64) as i64)).await?;
        Ok(())
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
