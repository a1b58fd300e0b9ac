//! The append-only chunk log: gap-free `seq` per conversation, a message id per chunk.

use sqlx::sqlite::SqliteRow;

use super::script::Script;
use super::{Store, StoreError, StoreResult};
use crate::wire::{Chunk, Role};

/// A chunk about to be appended.
#[derive(Debug, Clone)]
pub struct NewChunk {
    pub role: Role,
    pub chunk: Chunk,
    /// True when this chunk opens a new message; false continues the conversation's last one.
    pub new_message: bool,
}

/// A window of the log as JSON: the stored chunks pass through as the exact JSON that was
/// written, each wrapped as `{"seq":..,"role":..,"chunk":..}`.
#[derive(Debug)]
pub struct HistoryPage {
    /// The chunk objects, comma-separated, in seq order (empty for none): JSON text.
    pub items: Vec<u8>,
    /// Seq of the last chunk in the window.
    pub last_seq: Option<u64>,
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

    /// A window of the log. The stored JSON text is joined unparsed, straight from SQLite's
    /// row buffers into the page: the database refuses to store a chunk that is not JSON or a
    /// role outside the four (migration 0003), so what is joined is JSON. Windows of at most
    /// `INLINE_WINDOW_LIMIT` chunks are read on the calling thread (see `readers.rs`), larger ones
    /// on the blocking pool.
    pub async fn history(&self, conversation_id: &str, w: HistoryWindow) -> StoreResult<HistoryPage> {
        let since = i64::try_from(w.since_seq).unwrap_or(i64::MAX);
        let before = w.before_seq.map_or(i64::MAX, |b| i64::try_from(b).unwrap_or(i64::MAX));
        let sql = window_sql(w.limit, w.inflight);
        let conversation_id = conversation_id.to_owned();
        let read = move |c: &rusqlite::Connection| read_window(c, &sql, &conversation_id, since, before);
        if w.limit.is_some_and(|l| l <= INLINE_WINDOW_LIMIT) {
            self.readers.run(read).await
        } else {
            self.readers.run_blocking(read).await
        }
    }

    /// The highest seq a history read shows now: the last sealed turn's (0 for none or unknown);
    /// with `replaying`, no further than just before that turn (a stream replays it whole).
    pub async fn latest_seq(&self, conversation_id: &str, replaying: Option<&str>) -> StoreResult<u64> {
        let row: Option<(i64, Option<i64>)> = sqlx::query_as(
            "SELECT c.sealed_seq, t.first_seq FROM conversations c
             LEFT JOIN turns t ON t.conversation_id = c.id AND t.turn_id = ?2
             WHERE c.id = ?1",
        )
        .bind(conversation_id)
        .bind(replaying)
        .fetch_optional(&self.reader)
        .await?;
        Ok(match row {
            Some((sealed, Some(first))) => sealed.min(first - 1).max(0) as u64,
            Some((sealed, None)) => sealed as u64,
            None => 0,
        })
    }
}

/// The statement of a history window (parameters: conversation id, sinceSeq, beforeSeq):
/// its rows' seq, role and chunk in ascending seq order. Without `inflight`, beforeSeq is
/// lowered to just past the conversation's sealed horizon (an unknown conversation has none:
/// no rows).
///
/// The newest `limit` chunks of the selection are those above the (limit+1)th newest one: that
/// bound is found by walking the index back `limit` entries, so the window itself is one
/// ascending range scan of the primary key, which yields seq order with no sort. LIMIT and
/// OFFSET are written into the statement, not bound: SQLite plans with a bound LIMIT's value
/// and then recompiles the statement at every execution (one cached statement per distinct
/// limit instead).
fn window_sql(limit: Option<u64>, inflight: bool) -> String {
    let upper = if inflight { "?3" } else { "min(?3, (SELECT sealed_seq + 1 FROM conversations WHERE id = ?1))" };
    let floor = match limit.map(|l| l.min(i64::MAX as u64)) {
        Some(limit) => format!(
            "max(?2, coalesce((SELECT seq FROM chunks WHERE conversation_id = ?1 AND seq < {upper}
                               ORDER BY seq DESC LIMIT 1 OFFSET {limit}), 0))"
        ),
        None => "?2".to_owned(),
    };
    format!(
        "SELECT seq, role, chunk FROM chunks WHERE conversation_id = ?1 AND seq < {upper} AND seq > {floor} ORDER BY seq"
    )
}

/// Largest window read on the calling thread (a window's SQLite work grows with its chunks;
/// larger ones go to the blocking pool).
const INLINE_WINDOW_LIMIT: u64 = 1000;

/// Reads the window `sql` (from `window_sql`) selects, each row wrapped as
/// `{"seq":..,"role":..,"chunk":..}`. The text is copied as stored, without a UTF-8 check:
/// it entered as Rust strings.
fn read_window(
    c: &rusqlite::Connection,
    sql: &str,
    conversation_id: &str,
    since: i64,
    before: i64,
) -> rusqlite::Result<HistoryPage> {
    let mut statement = c.prepare_cached(sql)?;
    let mut rows = statement.query((conversation_id, since, before))?;
    let (mut items, mut last_seq) = (Vec::new(), None);
    while let Some(row) = rows.next()? {
        let seq: i64 = row.get(0)?;
        let (role, chunk) = (text(row, 1)?, text(row, 2)?);
        items.reserve(chunk.len() + role.len() + 48);
        items.extend_from_slice(if last_seq.is_some() { b",{\"seq\":" } else { b"{\"seq\":" });
        // Writing to a Vec cannot fail; serde_json writes integers without `fmt`.
        let _ = serde_json::to_writer(&mut items, &seq);
        items.extend_from_slice(b",\"role\":\"");
        items.extend_from_slice(role);
        items.extend_from_slice(b"\",\"chunk\":");
        items.extend_from_slice(chunk);
        items.push(b'}');
        last_seq = Some(seq as u64);
    }
    Ok(HistoryPage { items, last_seq })
}

/// Column `i` of `row` as text, borrowed from SQLite's buffer.
fn text<'r>(row: &'r rusqlite::Row<'_>, i: usize) -> rusqlite::Result<&'r [u8]> {
    match row.get_ref(i)? {
        rusqlite::types::ValueRef::Text(bytes) => Ok(bytes),
        other => Err(rusqlite::Error::InvalidColumnType(i, format!("column {i}"), other.data_type())),
    }
}

/// Most rows in one INSERT (four parameters each, well under SQLite's limit of 32,766).
const ROWS_PER_INSERT: usize = 500;

/// Adds an append to `script`: the rows, numbered from the conversation's counters, then the
/// counters bumped. The script's last row is the seq of the last chunk (no row when the
/// conversation does not exist).
///
/// A chunk opens a new message when it says so or when the conversation has none yet, so its
/// message id is the old counter plus the chunks up to it that open one, plus one when the
/// counter was 0 and the first chunk does not open one itself.
pub(super) fn append_to(
    script: &mut Script,
    conversation_id: &str,
    turn_id: &str,
    chunks: &[NewChunk],
    now: i64,
) -> StoreResult<()> {
    let Some(first) = chunks.first() else {
        script.sql("SELECT last_seq FROM conversations WHERE id = ?;").bind(conversation_id);
        return Ok(());
    };
    let first_not_new = !first.new_message;
    let mut opened = 0i64;
    for (batch, rows) in chunks.chunks(ROWS_PER_INSERT).enumerate() {
        script
            .sql(
                "INSERT INTO chunks (conversation_id, seq, message_id, turn_id, role, chunk)
                 SELECT c.id, c.last_seq + v.column1, c.last_message_id + v.column2 + (c.last_message_id = 0 AND ?), ?,
                        v.column3, v.column4
                 FROM conversations c, (VALUES ",
            )
            .bind(first_not_new)
            .bind(turn_id);
        for (i, c) in rows.iter().enumerate() {
            let offset = (batch * ROWS_PER_INSERT + i + 1) as i64;
            opened += i64::from(c.new_message);
            let json = serde_json::to_string(&c.chunk).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            script.sql(if i == 0 { "(?, ?, ?, ?)" } else { ", (?, ?, ?, ?)" });
            script.bind(offset).bind(opened).bind(c.role.as_str()).bind(json);
        }
        script.sql(") v WHERE c.id = ?;").bind(conversation_id);
    }
    script
        .sql(
            "UPDATE conversations SET last_seq = last_seq + ?,
                 last_message_id = last_message_id + ? + (last_message_id = 0 AND ?), last_activity_at = ?
             WHERE id = ? RETURNING last_seq;",
        )
        .bind(chunks.len() as i64)
        .bind(opened)
        .bind(first_not_new)
        .bind(now)
        .bind(conversation_id);
    Ok(())
}

/// The seq an append script answered with.
pub(super) fn appended_seq(rows: &[SqliteRow], conversation_id: &str) -> StoreResult<u64> {
    use sqlx::Row;
    let row = rows
        .last()
        .ok_or_else(|| StoreError::Corrupt(format!("conversation {conversation_id} vanished during a turn")))?;
    Ok(row.try_get::<i64, _>(0)? as u64)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::metrics::Metrics;
    use crate::wire::TextChunk;

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
    async fn appends_number_seqs_and_message_ids_across_scripts_and_multi_row_inserts() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("log.db"), Arc::new(Metrics::default())).await.unwrap();
        let new = super::super::NewConversation { id: "c", title: "", model: None, now: 1 };
        store.create_conversation(new).await.unwrap();
        // The first chunk continues a message that does not exist yet; then appends of every
        // size, one past the rows of one INSERT.
        let sizes = [1, 3, ROWS_PER_INSERT + 7, 2];
        let mut flags = Vec::new();
        let mut appended = Vec::new();
        for size in sizes {
            let batch: Vec<NewChunk> = (0..size).map(|i| chunk(flags.len() + i, (flags.len() + i) % 3 == 1)).collect();
            flags.extend(batch.iter().map(|c| c.new_message));
            appended.push(store.append_chunks("c", "t", &batch).await.unwrap());
        }
        let mut ends = Vec::new();
        let mut total = 0u64;
        for size in sizes {
            total += size as u64;
            ends.push(total);
        }
        assert_eq!(appended, ends, "each append answers the seq of its last chunk");
        let log = store.history_chunks("c").await.unwrap();
        assert_eq!(log.len(), flags.len());
        let ids: Vec<i64> = log.iter().map(|c| c.message_id).collect();
        assert_eq!(ids, expected(&flags));
        let texts: Vec<String> = log
            .iter()
            .map(|c| match &c.chunk {
                Chunk::Text(t) => t.text.clone(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(texts, (0..flags.len()).map(|i| format!("c{i}")).collect::<Vec<_>>(), "in seq order");
        // An empty append answers the current seq; an unknown conversation is an error.
        assert_eq!(store.append_chunks("c", "t", &[]).await.unwrap(), total);
        assert!(store.append_chunks("missing", "t", &[chunk(0, true)]).await.is_err());
        // Appends alone seal nothing: what a history read (and a resync) shows is unmoved.
        assert_eq!(store.latest_seq("c", None).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn committed_writes_reach_the_database_file_by_background_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.db");
        let store = Store::open(&path, Arc::new(Metrics::default())).await.unwrap();
        let new = super::super::NewConversation { id: "c", title: "", model: None, now: 1 };
        store.create_conversation(new).await.unwrap();
        let before = std::fs::metadata(&path).unwrap().len();
        // About 1 MiB of chunks: far below the writer's own checkpoint threshold, so only the
        // background checkpointer copies them out of the WAL.
        let text = "x".repeat(1000);
        let batch: Vec<NewChunk> = (0..1000)
            .map(|_| NewChunk {
                role: Role::Assistant,
                chunk: Chunk::Text(TextChunk { text: text.clone() }),
                new_message: true,
            })
            .collect();
        store.append_chunks("c", "t", &batch).await.unwrap();
        let mut grown = 0;
        for _ in 0..100 {
            grown = std::fs::metadata(&path).unwrap().len();
            if grown > before + 1_000_000 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(grown > before + 1_000_000, "the database file went from {before} to {grown} bytes");
        store.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn windows_read_inline_and_on_the_blocking_pool_agree_with_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("windows.db"), Arc::new(Metrics::default())).await.unwrap();
        let new = super::super::NewConversation { id: "c", title: "", model: None, now: 1 };
        store.create_conversation(new).await.unwrap();
        let total = INLINE_WINDOW_LIMIT as usize + 500;
        let batch: Vec<NewChunk> = (0..total).map(|i| chunk(i, i % 7 == 0)).collect();
        store.append_chunks("c", "t", &batch).await.unwrap();
        let item =
            |seq: u64| format!(r#"{{"seq":{seq},"role":"assistant","chunk":{{"type":"text","text":"c{}"}}}}"#, seq - 1);
        let expected = |seqs: std::ops::RangeInclusive<u64>| seqs.map(item).collect::<Vec<_>>().join(",");
        let window = |since_seq, before_seq, limit| HistoryWindow { since_seq, before_seq, limit, inflight: true };
        let last = total as u64;
        // Inline (limit <= INLINE_WINDOW_LIMIT) and blocking (larger or no limit) reads.
        let cases = [
            (window(0, None, Some(100)), last - 99..=last),
            (window(0, None, Some(INLINE_WINDOW_LIMIT)), last - INLINE_WINDOW_LIMIT + 1..=last),
            (window(0, None, Some(INLINE_WINDOW_LIMIT + 1)), last - INLINE_WINDOW_LIMIT..=last),
            (window(0, None, None), 1..=last),
            (window(10, Some(1_200), None), 11..=1_199),
            (window(10, Some(1_200), Some(3)), 1_197..=1_199),
        ];
        for (w, seqs) in cases {
            let page = store.history("c", w).await.unwrap();
            assert_eq!(page.last_seq, Some(*seqs.end()), "{w:?}");
            assert_eq!(String::from_utf8(page.items).unwrap(), expected(seqs), "{w:?}");
        }
        let empty = store.history("c", window(last, None, Some(5))).await.unwrap();
        assert_eq!((empty.items.len(), empty.last_seq), (0, None));
        // A chunk committed is in the next window read.
        store.append_chunks("c", "t", &[chunk(total, true)]).await.unwrap();
        assert_eq!(store.history("c", window(0, None, Some(1))).await.unwrap().last_seq, Some(last + 1));
        // Many reads at once, on both paths: each gets a connection; a few stay open after.
        let reads = (0..24u64).map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let limit = if i % 2 == 0 { Some(50) } else { None };
                store.history("c", window(i * 10, Some(i * 10 + 51), limit)).await.unwrap()
            })
        });
        for (i, read) in (0..24u64).zip(reads.collect::<Vec<_>>()) {
            let page = read.await.unwrap();
            assert_eq!(String::from_utf8(page.items).unwrap(), expected(i * 10 + 1..=i * 10 + 50));
        }
        assert!((1..=super::super::readers::IDLE_CONNECTIONS).contains(&store.readers.idle()));
        // Closed: no connection stays open.
        store.close().await;
        assert_eq!(store.readers.idle(), 0);
    }

    #[tokio::test]
    async fn a_history_window_is_read_in_key_order_without_a_sort() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("plan.db"), Arc::new(Metrics::default())).await.unwrap();
        for (limit, inflight) in [(None, true), (Some(100), true), (None, false), (Some(100), false)] {
            let sql = format!("EXPLAIN QUERY PLAN {}", window_sql(limit, inflight));
            let plan: Vec<(i64, i64, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind("c")
                .bind(0i64)
                .bind(i64::MAX)
                .fetch_all(&store.reader)
                .await
                .unwrap();
            let steps: Vec<&str> = plan.iter().map(|row| row.3.as_str()).collect();
            // The window is read by the primary key, and nothing is sorted in a temporary
            // b-tree.
            assert!(
                steps.iter().any(|s| s.contains("USING PRIMARY KEY (conversation_id=? AND seq>? AND seq<?)")),
                "{steps:?}"
            );
            assert!(!steps.iter().any(|s| s.contains("TEMP B-TREE")), "{steps:?}");
        }
        store.close().await;
    }
}
