//! Deleting a conversation: marked at once, removed in batches.
//!
//! One `DELETE` of a long conversation's row (its chunks going by cascade) would hold SQLite's
//! one writer for as long as the log is long, and every other conversation's writes with it.
//! Instead the deletion marks the row (`deleted_at`) and takes its lease in its own name, as a
//! turn would: from then on reads leave the conversation out and no turn opens in it. It then
//! removes the rows `delete_batch_rows` at a time, each batch a write of its own (the turns'
//! writes go between them), and the conversation's row last, which frees its id. Each batch is
//! fenced by the lease like a turn's appends; the gateway renews it while it deletes, and a
//! deletion cut off (the process died, the request was dropped) is finished by whichever
//! gateway's sweep finds its lease ended (`resume_deletion`).

use super::sql::Query;
use super::{Store, StoreError, StoreResult};

/// A conversation's tables other than its row, each with a column that orders its rows.
const ROWS: [(&str, &str); 3] = [("chunks", "seq"), ("turns", "ordinal"), ("idempotency_keys", "key")];

impl Store {
    /// Deletes the conversation with its log and turns, in the name of `holder` (a new id the
    /// caller renews as a turn's lease while this runs). False when there is no conversation
    /// (or it is being deleted already); `Busy` while a turn holds its lease (on any gateway).
    pub async fn delete_conversation(&self, id: &str, holder: &str) -> StoreResult<bool> {
        if !self.mark_deleted(id, holder).await? {
            return Ok(false);
        }
        self.remove(id, holder).await?;
        Ok(true)
    }

    /// Marks the conversation deleted and takes its lease for `holder`: from here on it is
    /// gone for reads, and no turn opens in it.
    async fn mark_deleted(&self, id: &str, holder: &str) -> StoreResult<bool> {
        let sql = format!(
            "UPDATE conversations SET deleted_at = {clock}, lease_turn = $2, lease_expires_at = {clock} + $3
             WHERE id = $1 AND deleted_at IS NULL AND (lease_turn IS NULL OR lease_expires_at < {clock})",
            clock = self.clock()
        );
        if self.execute(Query::new(sql).bind(id).bind(holder).bind(self.lease_ms())).await? > 0 {
            return Ok(true);
        }
        match self.conversation(id).await? {
            Some(_) => Err(StoreError::Busy),
            None => Ok(false),
        }
    }

    /// The deletions whose lease has ended (their gateway died, or dropped the request):
    /// (conversation, holder).
    pub async fn expired_deletions(&self) -> StoreResult<Vec<(String, String)>> {
        let sql = format!(
            "SELECT id, lease_turn FROM conversations
             WHERE deleted_at IS NOT NULL AND lease_expires_at < {} ORDER BY lease_expires_at",
            self.clock()
        );
        self.fetch_all(Query::new(sql)).await
    }

    /// Finishes a deletion whose lease (held by `expired`) has ended, in the name of `holder`.
    /// False when it did not apply: its lease was renewed, or another gateway took it first.
    pub async fn resume_deletion(&self, id: &str, expired: &str, holder: &str) -> StoreResult<bool> {
        let sql = format!(
            "UPDATE conversations SET lease_turn = $3, lease_expires_at = {clock} + $4
             WHERE id = $1 AND lease_turn = $2 AND deleted_at IS NOT NULL AND lease_expires_at < {clock}",
            clock = self.clock()
        );
        let q = Query::new(sql).bind(id).bind(expired).bind(holder).bind(self.lease_ms());
        if self.execute(q).await? == 0 {
            return Ok(false);
        }
        self.remove(id, holder).await?;
        Ok(true)
    }

    /// Which log of this id a read in pages began with: the turn id of its first chunk (a
    /// turn's id is new for every turn, so a conversation deleted and created again under the
    /// id has another); `None` for no conversation, one marked deleted, or an empty log. Each
    /// page checks it after its read, so a read that a deletion overtook ends with
    /// `DeletedDuringRead` instead of passing for the whole log, or going on in another.
    pub(super) async fn incarnation(&self, id: &str) -> StoreResult<Option<String>> {
        let sql = "SELECT ch.turn_id FROM conversations c JOIN chunks ch ON ch.conversation_id = c.id AND ch.seq = 1
                   WHERE c.id = $1 AND c.deleted_at IS NULL";
        let row: Option<(String,)> = self.fetch_optional(Query::new(sql).bind(id)).await?;
        Ok(row.map(|(turn_id,)| turn_id))
    }

    /// Checks that the log a page was read from is still the one a read began with (`born`; a
    /// read that began with no log has nothing to mix up).
    pub(super) async fn still(&self, id: &str, born: &Option<String>) -> StoreResult<()> {
        if born.is_some() && self.incarnation(id).await? != *born {
            return Err(StoreError::DeletedDuringRead);
        }
        Ok(())
    }

    /// Removes a marked conversation's rows a batch at a time, then its row, while `holder`
    /// holds its lease. A holder that lost it stops removing (its batches touch nothing); the
    /// gateway that took the lease over finishes.
    async fn remove(&self, id: &str, holder: &str) -> StoreResult<()> {
        let batch = self.delete_batch_rows.min(i64::MAX as u64) as i64;
        for (table, column) in ROWS {
            let sql = format!(
                "DELETE FROM {table} WHERE conversation_id = $1 AND {column} IN (
                     SELECT {column} FROM {table} WHERE conversation_id = $1 ORDER BY {column} DESC LIMIT $3)
                   AND EXISTS (SELECT 1 FROM conversations WHERE id = $1 AND lease_turn = $2)"
            );
            while self.execute(Query::new(sql.clone()).bind(id).bind(holder).bind(batch)).await? > 0 {}
        }
        let sql = "DELETE FROM conversations WHERE id = $1 AND lease_turn = $2 AND deleted_at IS NOT NULL";
        if self.execute(Query::new(sql).bind(id).bind(holder)).await? == 0 {
            tracing::info!(conversation = %id, "another gateway took over the conversation's deletion");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::testing::{every_backend_with, once_some};
    use crate::store::{ConversationFilter, HistoryWindow, NewChunk, Setting, StoreOptions};
    use crate::wire::{Chunk, Role, TextChunk};

    fn text(i: usize) -> NewChunk {
        NewChunk { role: Role::Assistant, chunk: Chunk::Text(TextChunk { text: format!("t{i}") }), new_message: i == 0 }
    }

    /// Rows of `table` the conversation still has (reads of the API leave a marked one out).
    async fn rows(store: &Store, table: &str, id: &str) -> i64 {
        let sql = format!("SELECT count(*) FROM {table} WHERE conversation_id = $1");
        let (n,): (i64,) = store.fetch_optional(Query::new(sql).bind(id)).await.unwrap().unwrap();
        n
    }

    /// Two sealed turns of 6 chunks each (with the user's), in `id`.
    async fn conversation(store: &Store, id: &str) {
        for turn in ["t1", "t2"] {
            store.begin_test_turn(id, &format!("{id}-{turn}")).await;
            let chunks: Vec<NewChunk> = (0..5).map(text).collect();
            store.seal_test_turn(id, &format!("{id}-{turn}"), None, &chunks).await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_deleted_conversation_leaves_every_read_at_once_and_a_deletion_cut_off_is_finished_by_a_sweep() {
        let options =
            StoreOptions { lease_ttl: Duration::from_millis(1500), delete_batch_rows: 2, ..Default::default() };
        for t in every_backend_with(options).await {
            let (store, b) = (&t.store, t.backend);
            conversation(store, "c").await;
            conversation(store, "other").await;
            // The deletion's gateway dies right after marking it.
            assert!(store.mark_deleted("c", "d1").await.unwrap(), "{b}");
            assert!(store.conversation("c").await.unwrap().is_none(), "{b}");
            let listed = store.list_conversations(&ConversationFilter { limit: 10, ..Default::default() }).await;
            let listed: Vec<String> = listed.unwrap().into_iter().map(|c| c.id).collect();
            assert_eq!(listed, ["other"], "{b}");
            for inflight in [false, true] {
                for limit in [None, Some(3)] {
                    let w = HistoryWindow { since_seq: 0, before_seq: None, limit, inflight };
                    assert_eq!(store.history("c", w).await.unwrap().last_seq, None, "{b} {w:?}");
                }
            }
            assert_eq!(store.latest_seq("c", None).await.unwrap(), 0, "{b}");
            assert_eq!(store.turn_metrics("c").await.unwrap(), vec![], "{b}");
            let counted: Vec<i64> = store.throughput(0, 10, None).await.unwrap().iter().map(|m| m.turns).collect();
            assert_eq!(counted, [2], "{b}: only the other conversation's turns");
            assert!(!store.set_title("c", "x").await.unwrap(), "{b}");
            assert!(!store.close_conversation("c").await.unwrap(), "{b}");
            assert!(matches!(
                store.set_setting("c", Setting::Model, Some("m"), None, 1).await,
                Err(StoreError::Deleting)
            ));
            assert_eq!(store.settings("c").await.unwrap().model, None, "{b}");
            // No turn opens in it, and a second deletion finds nothing to delete.
            let begin = crate::store::BeginTurn {
                conversation_id: "c",
                turn_id: "t3",
                model: "demo/scripted",
                sticky_model: None,
                user_text: "hi",
                default_title: "hi",
                idempotency: None,
                owner: None,
                budget: None,
                now: 3,
            };
            assert!(matches!(store.begin_turn(begin).await, Err(StoreError::Deleting)), "{b}");
            assert!(!store.delete_conversation("c", "d2").await.unwrap(), "{b}");
            // A holder without the lease removes nothing.
            store.remove("c", "d2").await.unwrap();
            assert_eq!(rows(store, "chunks", "c").await, 12, "{b}");
            // Its lease ends unrenewed; it is a deletion's, not a turn's to interrupt.
            let cut = once_some(|| store.expired_deletions()).await;
            assert_eq!(cut, vec![("c".to_owned(), "d1".to_owned())], "{b}");
            assert_eq!(store.expired_leases().await.unwrap(), vec![], "{b}");
            assert!(!store.resume_deletion("c", "someone", "d3").await.unwrap(), "{b}: only the expired holder's");
            assert!(store.resume_deletion("c", "d1", "d3").await.unwrap(), "{b}");
            assert!(!store.resume_deletion("c", "d1", "d4").await.unwrap(), "{b}: finished once");
            for table in ["chunks", "turns", "idempotency_keys"] {
                assert_eq!(rows(store, table, "c").await, 0, "{b} {table}");
            }
            // The id is free: a new conversation under it starts its log at seq 1.
            store.begin_test_turn("c", "t4").await;
            assert_eq!(store.append_chunks("c", "t4", &[]).await.unwrap(), 1, "{b}");
            assert_eq!(rows(store, "chunks", "other").await, 12, "{b}: another conversation is untouched");
            assert_eq!(store.turn_metrics("other").await.unwrap().len(), 2, "{b}");
            store.close().await;
        }
    }

    type Pages<T> = std::pin::Pin<Box<dyn futures_util::Stream<Item = StoreResult<T>> + Send>>;

    /// A history read of "c" in pages of 5 chunks and a metrics read in pages of one turn, each
    /// with its first page read.
    async fn reads_begun(store: &Store) -> (Pages<crate::store::HistoryPage>, Pages<Vec<crate::wire::TurnMetrics>>) {
        use futures_util::TryStreamExt;
        let all = HistoryWindow { since_seq: 0, before_seq: None, limit: None, inflight: false };
        let mut chunks: Pages<_> = Box::pin(store.history_pages("c".into(), all, 5, usize::MAX));
        let mut turns: Pages<_> = Box::pin(store.turn_metrics_pages("c".into(), 1, u64::MAX));
        assert_eq!(chunks.try_next().await.unwrap().unwrap().last_seq, Some(5));
        assert_eq!(turns.try_next().await.unwrap().unwrap().len(), 1);
        (chunks, turns)
    }

    #[tokio::test]
    async fn a_read_in_pages_that_a_deletion_overtakes_fails_instead_of_ending_short_or_going_on_in_another_log() {
        use futures_util::TryStreamExt;
        let all = HistoryWindow { since_seq: 0, before_seq: None, limit: None, inflight: false };
        for t in every_backend_with(StoreOptions::default()).await {
            let (store, b) = (&t.store, t.backend);
            conversation(store, "c").await;
            // Overtaken by a deletion under way: the next page is an error, not the end.
            let (mut chunks, mut turns) = reads_begun(store).await;
            assert!(store.mark_deleted("c", "d1").await.unwrap(), "{b}");
            assert!(matches!(chunks.try_next().await, Err(StoreError::DeletedDuringRead)), "{b}");
            assert!(matches!(turns.try_next().await, Err(StoreError::DeletedDuringRead)), "{b}");
            store.remove("c", "d1").await.unwrap();
            // Overtaken by a deletion and a longer log under the same id: not a page of it.
            conversation(store, "c").await;
            let (mut chunks, mut turns) = reads_begun(store).await;
            assert!(store.delete_conversation("c", "d2").await.unwrap(), "{b}");
            for turn in ["a", "b", "c"] {
                store.begin_test_turn("c", turn).await;
                store.seal_test_turn("c", turn, None, &(0..5).map(text).collect::<Vec<_>>()).await.unwrap();
            }
            assert!(matches!(chunks.try_next().await, Err(StoreError::DeletedDuringRead)), "{b}");
            assert!(matches!(turns.try_next().await, Err(StoreError::DeletedDuringRead)), "{b}");
            // Untouched, the same reads run to their end.
            let pages: Vec<_> = store.history_pages("c".into(), all, 5, usize::MAX).try_collect().await.unwrap();
            assert_eq!(pages.iter().map(|p| p.last_seq.unwrap()).collect::<Vec<_>>(), [5, 10, 15, 18], "{b}");
            let pages: Vec<_> = store.turn_metrics_pages("c".into(), 1, u64::MAX).try_collect().await.unwrap();
            assert_eq!(pages.len(), 3, "{b}");
            store.close().await;
        }
    }

    /// The point of the batches: on SQLite's one writer, another conversation's write goes
    /// between two of a long deletion's batches instead of waiting for all of them.
    #[tokio::test]
    async fn another_conversations_write_goes_between_a_long_deletions_batches() {
        let options = StoreOptions { delete_batch_rows: 1, ..Default::default() };
        let t = every_backend_with(options).await.remove(0);
        let store = t.store.clone();
        const LONG: i64 = 20_000;
        store.begin_test_turn("long", "t1").await;
        let chunks: Vec<NewChunk> = (0..LONG as usize - 1).map(text).collect();
        store.append_chunks("long", "t1", &chunks).await.unwrap();
        store.seal_test_turn("long", "t1", None, &[]).await.unwrap();
        store.begin_test_turn("other", "t2").await;
        let deleting = tokio::spawn({
            let store = store.clone();
            async move { store.delete_conversation("long", "d1").await }
        });
        while rows(&store, "chunks", "long").await == LONG {
            tokio::task::yield_now().await;
        }
        // Once the deletion has begun, a write of another conversation lands before it ends.
        assert_eq!(store.append_chunks("other", "t2", &[text(0)]).await.unwrap(), 2);
        let left = rows(&store, "chunks", "long").await;
        assert!(left > 0, "the write waited for the whole deletion");
        assert!(deleting.await.unwrap().unwrap());
        assert_eq!(rows(&store, "chunks", "long").await, 0);
        store.close().await;
    }
}
