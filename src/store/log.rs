//! The append-only chunk log: gap-free `seq` per conversation, a message id per chunk.

use super::sql::Query;
use super::{NewChunk, Store, StoreError, StoreResult, on_backend};

/// A window of the log as JSON: the stored chunks pass through as the exact JSON that was
/// written, each wrapped as `{"seq":..,"role":..,"chunk":..}`.
#[derive(Debug, Default)]
pub struct HistoryPage {
    /// The chunk objects, comma-separated, in seq order (empty for none): JSON text.
    pub items: Vec<u8>,
    /// Seq of the last chunk in the window.
    pub last_seq: Option<u64>,
    /// The window ended at its byte limit: chunks after `last_seq` were left for another read.
    pub cut: bool,
}

impl HistoryPage {
    /// Whether the page holds `max_bytes` or more (a page takes at least one chunk, whatever
    /// its size).
    pub(super) fn full(&self, max_bytes: usize) -> bool {
        self.items.len() >= max_bytes && self.last_seq.is_some()
    }

    /// Adds one stored row, its role and chunk text as stored. Both backends refuse to store a
    /// chunk that is not JSON or a role outside the four, so what is joined is JSON.
    pub(super) fn push(&mut self, seq: i64, role: &[u8], chunk: &[u8]) {
        let items = &mut self.items;
        items.reserve(chunk.len() + role.len() + 48);
        items.extend_from_slice(if self.last_seq.is_some() { b",{\"seq\":" } else { b"{\"seq\":" });
        // Writing to a Vec cannot fail; serde_json writes integers without `fmt`.
        let _ = serde_json::to_writer(&mut *items, &seq);
        items.extend_from_slice(b",\"role\":\"");
        items.extend_from_slice(role);
        items.extend_from_slice(b"\",\"chunk\":");
        items.extend_from_slice(chunk);
        items.push(b'}');
        self.last_seq = Some(seq as u64);
    }
}

/// `sinceSeq < seq < beforeSeq`, newest `limit` of that, ascending; of the sealed turns only,
/// unless `inflight` asks for the running turn's committed chunks too.
#[derive(Debug, Clone, Copy)]
pub struct HistoryWindow {
    pub since_seq: u64,
    pub before_seq: Option<u64>,
    pub limit: Option<u64>,
    pub inflight: bool,
}

impl HistoryWindow {
    /// The bounds as the databases' signed integers: (sinceSeq, beforeSeq or the largest).
    pub(super) fn bounds(&self) -> (i64, i64) {
        let since = i64::try_from(self.since_seq).unwrap_or(i64::MAX);
        let before = self.before_seq.map_or(i64::MAX, |b| i64::try_from(b).unwrap_or(i64::MAX));
        (since, before)
    }
}

impl Store {
    /// Appends `chunks` in one transaction (shared with other writes queued with it); returns
    /// the seq of the last one (0 if none).
    pub async fn append_chunks(&self, conversation_id: &str, turn_id: &str, chunks: &[NewChunk]) -> StoreResult<u64> {
        let job = super::batch::Write::Append {
            conversation_id: conversation_id.to_owned(),
            turn_id: turn_id.to_owned(),
            chunks: chunks.to_vec(),
            now: super::now_ms(),
        };
        self.write(job).await?.seq()
    }

    /// A window of the log, the stored JSON text joined unparsed.
    pub async fn history(&self, conversation_id: &str, w: HistoryWindow) -> StoreResult<HistoryPage> {
        self.history_within(conversation_id, w, usize::MAX, None).await
    }

    /// [`Store::history`], ending the window once it holds `max_bytes` (at least one chunk):
    /// then `cut` is set, and the chunks after `last_seq` are left for another read.
    /// With `viewer` (a user), a conversation that is not theirs reads as an unknown one: empty
    /// (checked in the read itself, at no extra round trip).
    pub async fn history_within(
        &self,
        conversation_id: &str,
        w: HistoryWindow,
        max_bytes: usize,
        viewer: Option<&str>,
    ) -> StoreResult<HistoryPage> {
        on_backend!(self, b => b.history(conversation_id, w, max_bytes, viewer).await)
    }

    /// The window `w` read in pages of at most `page` chunks, one read after another, so that a
    /// long log is never held whole. The window's end is fixed before the first page (seqs are
    /// gap-free, so the pages are ranges of seq): the pages add up to what one read would have
    /// returned then. A deletion that overtakes the read ends it with `DeletedDuringRead`.
    pub fn history_pages(
        &self,
        conversation_id: String,
        w: HistoryWindow,
        page: u64,
        page_bytes: usize,
    ) -> impl futures_util::Stream<Item = StoreResult<HistoryPage>> + Send + 'static {
        let page = page.max(1);
        let start = (self.clone(), conversation_id, None::<(u64, u64, Option<String>)>);
        futures_util::stream::try_unfold(start, move |(store, id, at)| async move {
            // Pages after `lo`, up to (not including) `end`, of the conversation born then.
            let (lo, end, born) = match at {
                Some(at) => at,
                None => {
                    let born = store.incarnation(&id).await?;
                    let end = store.history_end(&id, w.inflight).await?.min(w.before_seq.unwrap_or(u64::MAX));
                    let newest = w.limit.map_or(0, |k| end.saturating_sub(k.saturating_add(1)));
                    (w.since_seq.max(newest), end, born)
                }
            };
            if lo.saturating_add(1) >= end {
                return Ok(None);
            }
            let hi = end.min(lo.saturating_add(page).saturating_add(1));
            let range = HistoryWindow { since_seq: lo, before_seq: Some(hi), limit: None, inflight: true };
            let got = store.history_within(&id, range, page_bytes, None).await?;
            store.still(&id, &born).await?;
            // A page cut at its bytes goes on after its last chunk.
            let last = match got.last_seq {
                Some(last) if got.cut && last > lo => last,
                // Rows below the fixed end only go with the conversation's deletion, which
                // `still` reports: a short page is a log that lost rows otherwise.
                Some(last) if last == hi - 1 => last,
                _ => {
                    return Err(StoreError::Corrupt(format!("seqs {} to {} are not all in the log", lo + 1, hi - 1)));
                }
            };
            Ok(Some((got, (store, id, Some((last, end, born))))))
        })
    }

    /// The seq just past the last chunk a history read shows now: past the sealed horizon, or
    /// with `inflight` past the last committed chunk (1 for an empty, unknown or deleted
    /// conversation).
    async fn history_end(&self, conversation_id: &str, inflight: bool) -> StoreResult<u64> {
        if !inflight {
            return Ok(self.latest_seq(conversation_id, None).await? + 1);
        }
        let sql = "SELECT last_seq FROM conversations WHERE id = $1 AND deleted_at IS NULL";
        let row: Option<(i64,)> = self.fetch_optional(Query::new(sql).bind(conversation_id)).await?;
        Ok(row.map_or(0, |(seq,)| seq).max(0) as u64 + 1)
    }

    /// The highest seq a history read shows now: the last sealed turn's (0 for none or unknown);
    /// with `replaying`, no further than just before that turn (a stream replays it whole).
    pub async fn latest_seq(&self, conversation_id: &str, replaying: Option<&str>) -> StoreResult<u64> {
        let sql = "SELECT c.sealed_seq, t.first_seq FROM conversations c
                   LEFT JOIN turns t ON t.conversation_id = c.id AND t.turn_id = $2
                   WHERE c.id = $1 AND c.deleted_at IS NULL";
        let row: Option<(i64, Option<i64>)> =
            self.fetch_optional(Query::new(sql).bind(conversation_id).bind(replaying)).await?;
        Ok(match row {
            Some((sealed, Some(first))) => sealed.min(first - 1).max(0) as u64,
            Some((sealed, None)) => sealed.max(0) as u64,
            None => 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::every_backend;
    use crate::wire::{Chunk, Role, TextChunk};

    fn chunk(i: usize, new_message: bool) -> NewChunk {
        NewChunk { role: Role::Assistant, chunk: Chunk::Text(TextChunk { text: format!("c{i}") }), new_message }
    }

    /// The numbering the log promises, chunk by chunk: seq + 1; a new message id when the chunk
    /// opens one or the conversation has none yet.
    fn expected(flags: &[bool]) -> Vec<i64> {
        let mut message_id = 0;
        flags
            .iter()
            .map(|&new| {
                if new || message_id == 0 {
                    message_id += 1;
                }
                message_id
            })
            .collect()
    }

    #[tokio::test]
    async fn appends_number_seqs_and_message_ids_across_writes_and_multi_row_inserts() {
        for t in every_backend().await {
            let store = &t.store;
            // The turn's user chunk is seq 1 and opens message 1; then appends of every size,
            // one past the rows of one SQLite INSERT, continuing or opening messages.
            store.begin_test_turn("c", "t").await;
            let sizes = [1, 3, 507, 2];
            let mut flags = vec![true];
            let mut appended = Vec::new();
            for size in sizes {
                let batch: Vec<NewChunk> =
                    (0..size).map(|i| chunk(flags.len() - 1 + i, (flags.len() + i) % 3 == 1)).collect();
                flags.extend(batch.iter().map(|c| c.new_message));
                appended.push(store.append_chunks("c", "t", &batch).await.unwrap());
            }
            let mut ends = Vec::new();
            for size in sizes {
                ends.push(ends.last().copied().unwrap_or(1u64) + size as u64);
            }
            assert_eq!(appended, ends, "{}: each append answers the seq of its last chunk", t.backend);
            let last = *ends.last().unwrap();
            let log = crate::store::History::new(store.clone(), "c", last).range(1, last).await.unwrap();
            assert_eq!(log.len(), flags.len(), "{}", t.backend);
            let ids: Vec<i64> = log.iter().map(|c| c.message_id).collect();
            assert_eq!(ids, expected(&flags), "{}", t.backend);
            let texts: Vec<String> = log[1..]
                .iter()
                .map(|c| match &c.chunk {
                    Chunk::Text(t) => t.text.clone(),
                    other => panic!("{other:?}"),
                })
                .collect();
            assert_eq!(
                texts,
                (0..flags.len() - 1).map(|i| format!("c{i}")).collect::<Vec<_>>(),
                "{}: in seq order",
                t.backend
            );
            // An empty append answers the current seq; a turn that does not hold the
            // conversation's lease, or a conversation that does not exist, is refused.
            let total = *ends.last().unwrap();
            assert_eq!(store.append_chunks("c", "t", &[]).await.unwrap(), total, "{}", t.backend);
            for (c, turn) in [("c", "another-turn"), ("missing", "t")] {
                let refused = store.append_chunks(c, turn, &[chunk(0, true)]).await;
                assert!(matches!(refused, Err(StoreError::LeaseLost)), "{}: {refused:?}", t.backend);
            }
            // Appends alone seal nothing: what a history read (and a resync) shows is unmoved.
            assert_eq!(store.latest_seq("c", None).await.unwrap(), 0, "{}", t.backend);
            // Windows: the newest `limit` of a range, in seq order, as the stored JSON.
            let item = |seq: u64| {
                format!(r#"{{"seq":{seq},"role":"assistant","chunk":{{"type":"text","text":"c{}"}}}}"#, seq - 2)
            };
            let expect = |seqs: std::ops::RangeInclusive<u64>| seqs.map(item).collect::<Vec<_>>().join(",");
            let window = |since_seq, before_seq, limit| HistoryWindow { since_seq, before_seq, limit, inflight: true };
            for (w, seqs) in [
                (window(0, None, Some(100)), total - 99..=total),
                (window(1, None, None), 2..=total),
                (window(10, Some(200), None), 11..=199),
                (window(10, Some(200), Some(3)), 197..=199),
            ] {
                let page = store.history("c", w).await.unwrap();
                assert_eq!(page.last_seq, Some(*seqs.end()), "{}: {w:?}", t.backend);
                assert_eq!(String::from_utf8(page.items).unwrap(), expect(seqs), "{}: {w:?}", t.backend);
            }
            // Without `inflight`, only sealed turns show: none here.
            let sealed_only = HistoryWindow { inflight: false, ..window(0, None, None) };
            assert_eq!(store.history("c", sealed_only).await.unwrap().last_seq, None, "{}", t.backend);
            store.close().await;
        }
    }
}
