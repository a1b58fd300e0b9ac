//! Turn leases: a conversation's running turn holds its lease, so one turn at a time runs in a
//! conversation across every gateway on one database, and a gateway that lost a turn cannot
//! write to its log again.
//!
//! Opening a turn takes the lease (`lease_turn` = the turn's id, `lease_expires_at`) unless
//! another turn holds it; every append and the seal name the turn and are refused
//! (`LeaseLost`) once the lease is not its own; the seal releases it. The gateway running a
//! turn renews its lease (`renew_leases`, from `Turns`); when a gateway dies its leases
//! expire, and a sweeping gateway marks each such turn interrupted (`interrupt_expired`):
//! the row lock and the expiry check make exactly one of them do it. The turn's id is the
//! fencing token: it is new for every turn, so no later turn can hold a lease under it.
//! Lease times are the database's clock (`NOW_MS` of each backend), written and compared in
//! SQL, so the gateways' own clocks may disagree.

use std::time::Duration;

use super::batch::Write;
use super::sql::Query;
use super::{Backend, Store, StoreError, StoreResult};

/// Most turn ids in one renewal statement.
pub(super) const RENEW_AT_ONCE: usize = 500;

/// The renewal of the leases of `turn_ids` (at most `RENEW_AT_ONCE`) by `lease_ms`, on a
/// database whose clock is `clock`.
pub(super) fn renew(clock: &str, turn_ids: &[String], lease_ms: i64) -> Query {
    let marks: Vec<String> = (2..turn_ids.len() + 2).map(|i| format!("${i}")).collect();
    let sql =
        format!("UPDATE conversations SET lease_expires_at = {clock} + $1 WHERE lease_turn IN ({})", marks.join(", "));
    turn_ids.iter().fold(Query::new(sql).bind(lease_ms), |q, id| q.bind(id))
}

impl Store {
    /// How long a lease taken or renewed lasts, in ms.
    pub(super) fn lease_ms(&self) -> i64 {
        self.lease_ttl.as_millis().min(i64::MAX as u128) as i64
    }

    /// The database's clock in epoch ms, as SQL.
    pub(super) fn clock(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite(_) => super::sqlite::NOW_MS,
            #[cfg(feature = "cluster")]
            Backend::Postgres(_) => super::postgres::NOW_MS,
        }
    }

    /// How long a lease lasts unless renewed.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// Whether the database is this process's alone, so every lease in it at start is a dead
    /// turn's (SQLite); with PostgreSQL, other gateways may hold live ones.
    pub fn exclusive(&self) -> bool {
        matches!(self.backend, Backend::Sqlite(_))
    }

    /// Renews the leases of the turns named (the ones this gateway runs). Returns how many
    /// leases were renewed: fewer than named means some turns lost theirs.
    pub async fn renew_leases(&self, turn_ids: &[String]) -> StoreResult<u64> {
        self.write(Write::Renew { turn_ids: turn_ids.to_vec(), lease_ms: self.lease_ms() }).await?.count()
    }

    /// Which of `turn_ids` hold their conversation's lease now.
    pub async fn holding_leases(&self, turn_ids: &[String]) -> StoreResult<Vec<String>> {
        let marks: Vec<String> = (1..=turn_ids.len()).map(|i| format!("${i}")).collect();
        let sql = format!(
            "SELECT lease_turn FROM conversations WHERE lease_turn IN ({}) AND lease_expires_at >= {}",
            marks.join(", "),
            self.clock()
        );
        let q = turn_ids.iter().fold(Query::new(sql), |q, id| q.bind(id.as_str()));
        let rows: Vec<(String,)> = self.fetch_all(q).await?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    /// Whether a turn holds the conversation's lease now (on this gateway or another).
    pub async fn leased(&self, conversation_id: &str) -> StoreResult<bool> {
        let sql = format!(
            "SELECT 1 FROM conversations WHERE id = $1 AND lease_turn IS NOT NULL AND lease_expires_at >= {}",
            self.clock()
        );
        let row: Option<(i32,)> = self.fetch_optional(Query::new(sql).bind(conversation_id)).await?;
        Ok(row.is_some())
    }

    /// The turn holding the conversation's lease, expired or not (a dead gateway's turn holds
    /// it until a sweep marks it interrupted); None when no turn holds it.
    pub async fn lease_holder(&self, conversation_id: &str) -> StoreResult<Option<String>> {
        let sql = "SELECT lease_turn FROM conversations WHERE id = $1 AND lease_turn IS NOT NULL";
        let row: Option<(String,)> = self.fetch_optional(Query::new(sql).bind(conversation_id)).await?;
        Ok(row.map(|(turn,)| turn))
    }

    /// The turns whose lease has ended: (conversation, turn). (A deletion's is in
    /// `expired_deletions`.)
    pub async fn expired_leases(&self) -> StoreResult<Vec<(String, String)>> {
        let sql = format!(
            "SELECT id, lease_turn FROM conversations
             WHERE lease_turn IS NOT NULL AND lease_expires_at < {} AND deleted_at IS NULL
             ORDER BY lease_expires_at",
            self.clock()
        );
        self.fetch_all(Query::new(sql)).await
    }

    /// Marks a turn whose lease has ended interrupted (one `interrupted` marker written at
    /// `now`, the conversation idle unless closed, the lease released). False when it did not
    /// apply: the lease was renewed meanwhile, or another gateway did it first.
    pub async fn interrupt_expired(&self, conversation_id: &str, turn_id: &str, now: i64) -> StoreResult<bool> {
        let write = Write::Interrupt {
            conversation_id: conversation_id.to_owned(),
            turn_id: turn_id.to_owned(),
            now,
            only_expired: true,
        };
        match self.write(write).await {
            Ok(_) => Ok(true),
            Err(StoreError::LeaseLost) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// At start: SQLite marks every turn left open interrupted (the file is this process's);
    /// PostgreSQL only those whose lease has ended (another gateway may be running the rest).
    /// Returns how many were marked.
    pub async fn recover_interrupted(&self, now: i64) -> StoreResult<usize> {
        if !self.exclusive() {
            let mut marked = 0;
            for (conversation_id, turn_id) in self.expired_leases().await? {
                marked += usize::from(self.interrupt_expired(&conversation_id, &turn_id, now).await?);
            }
            return Ok(marked);
        }
        // A deleted conversation's open turn goes with it.
        let sql = "SELECT conversation_id, turn_id FROM turns
                   WHERE sealed_at IS NULL AND interrupted_at IS NULL
                     AND NOT EXISTS (SELECT 1 FROM conversations c WHERE c.id = turns.conversation_id AND c.deleted_at IS NOT NULL)
                   ORDER BY conversation_id, ordinal";
        let open: Vec<(String, String)> = self.fetch_all(Query::new(sql)).await?;
        for (conversation_id, turn_id) in open.iter().cloned() {
            self.write(Write::Interrupt { conversation_id, turn_id, now, only_expired: false }).await?;
        }
        // Whatever was active when the process died is not active now.
        let sql = "UPDATE conversations SET status = 'idle' WHERE status = 'active'";
        self.execute(Query::new(sql)).await?;
        Ok(open.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::{every_backend_with, once_some};
    use crate::store::{BeginTurn, HistoryWindow, NewChunk, StoreOptions, now_ms};
    use crate::wire::{Chunk, Role, TextChunk};

    #[tokio::test]
    async fn a_turns_lease_admits_one_turn_and_fences_a_turn_marked_interrupted() {
        // Long enough that the lease cannot end between the steps that need it alive, short
        // enough to wait for.
        let options = StoreOptions { lease_ttl: Duration::from_millis(1500), ..Default::default() };
        for t in every_backend_with(options).await {
            let (store, b) = (&t.store, t.backend);
            store.begin_test_turn("c", "t1").await;
            // The lease admits one turn at a time, and keeps the conversation from deletion.
            let second = BeginTurn {
                conversation_id: "c",
                turn_id: "t2",
                model: "demo/scripted",
                sticky_model: None,
                user_text: "again",
                default_title: "again",
                idempotency: None,
                owner: None,
                budget: None,
                now: 2,
            };
            assert!(matches!(store.begin_turn(second).await, Err(StoreError::Busy)), "{b}");
            assert!(matches!(store.delete_conversation("c", "d1").await, Err(StoreError::Busy)), "{b}");
            assert!(store.leased("c").await.unwrap(), "{b}");
            // Renewing names turns; an unknown one renews nothing.
            assert_eq!(store.renew_leases(&["t1".into(), "nobody".into()]).await.unwrap(), 1, "{b}");
            assert_eq!(store.expired_leases().await.unwrap(), vec![], "{b}");
            assert!(!store.interrupt_expired("c", "t1", now_ms()).await.unwrap(), "{b}: not expired yet");
            // Unrenewed, it ends (on the database's clock).
            let expired = once_some(|| store.expired_leases()).await;
            assert_eq!(expired, vec![("c".into(), "t1".into())], "{b}");
            assert!(!store.leased("c").await.unwrap(), "{b}");
            // One marker, however many gateways sweep.
            assert!(store.interrupt_expired("c", "t1", now_ms()).await.unwrap(), "{b}");
            assert!(!store.interrupt_expired("c", "t1", now_ms()).await.unwrap(), "{b}: marked once");
            assert_eq!(store.expired_leases().await.unwrap(), vec![], "{b}");
            // The turn's own gateway, back, is refused: nothing of it lands after the marker.
            let text = NewChunk {
                role: Role::Assistant,
                chunk: Chunk::Text(TextChunk { text: "late".into() }),
                new_message: true,
            };
            let late = store.append_chunks("c", "t1", std::slice::from_ref(&text)).await;
            assert!(matches!(late, Err(StoreError::LeaseLost)), "{b}: {late:?}");
            let sealed = store.seal_test_turn("c", "t1", None, &[text]).await;
            assert!(matches!(sealed, Err(StoreError::LeaseLost)), "{b}");
            let all = HistoryWindow { since_seq: 0, before_seq: None, limit: None, inflight: false };
            let page = store.history("c", all).await.unwrap();
            let items: serde_json::Value =
                serde_json::from_slice(&[b"[", page.items.as_slice(), b"]"].concat()).unwrap();
            let kinds: Vec<&str> =
                items.as_array().unwrap().iter().map(|c| c["chunk"]["type"].as_str().unwrap()).collect();
            assert_eq!(kinds, ["text", "error"], "{b}: the user's text, the marker");
            assert_eq!(items[1]["chunk"]["code"], "interrupted", "{b}");
            assert_eq!(store.turn_metrics("c").await.unwrap(), vec![], "{b}: never sealed");
            let meta = store.conversation("c").await.unwrap().unwrap();
            assert_eq!(meta.status, crate::wire::ConversationStatus::Idle, "{b}");
            // The lease is free: the next turn opens after the marker.
            store.begin_test_turn("c", "t3").await;
            assert_eq!(store.append_chunks("c", "t3", &[]).await.unwrap(), 3, "{b}");
            store.close().await;
        }
    }
}
