//! The chunk log in SQLite: appends as multi-row INSERTs numbered from the conversation's
//! counters, windows read in place from SQLite's row buffers.

use rusqlite::types::Value as Column;

use super::Sqlite;
use super::script::Script;
use crate::store::NewChunk;
use crate::store::log::{HistoryPage, HistoryWindow};
use crate::store::{StoreError, StoreResult};

impl Sqlite {
    /// A window of the log. The stored JSON text is joined unparsed, straight from SQLite's
    /// row buffers into the page (the database refuses to store a chunk that is not JSON or a
    /// role outside the four, migration 0003). Windows of at most `INLINE_WINDOW_LIMIT` chunks
    /// are read on the calling thread (see `readers.rs`), larger ones on the blocking pool.
    pub(crate) async fn history(
        &self,
        conversation_id: &str,
        w: HistoryWindow,
        max_bytes: usize,
        viewer: Option<&str>,
    ) -> StoreResult<HistoryPage> {
        let (since, before) = w.bounds();
        let sql = window_sql(w.limit, w.inflight);
        let (conversation_id, viewer) = (conversation_id.to_owned(), viewer.map(str::to_owned));
        let read = move |c: &rusqlite::Connection| {
            read_window(c, &sql, (&conversation_id, since, before, viewer.as_deref()), max_bytes)
        };
        if w.limit.is_some_and(|l| l <= INLINE_WINDOW_LIMIT) {
            self.readers.run(read).await
        } else {
            self.readers.run_blocking(read).await
        }
    }
}

/// The statement of a history window (parameters: conversation id, sinceSeq, beforeSeq, the
/// viewer: a user sees rows only of their own conversation, an administrator's NULL all):
/// its rows' seq, role and chunk in ascending seq order. beforeSeq is lowered to just past the
/// conversation's sealed horizon, or with `inflight` its last committed chunk (an unknown or
/// deleted conversation has neither: no rows).
///
/// The newest `limit` chunks of the selection are those above the (limit+1)th newest one: that
/// bound is found by walking the index back `limit` entries, so the window itself is one
/// ascending range scan of the primary key, which yields seq order with no sort. LIMIT and
/// OFFSET are written into the statement, not bound: SQLite plans with a bound LIMIT's value
/// and then recompiles the statement at every execution (one cached statement per distinct
/// limit instead).
fn window_sql(limit: Option<u64>, inflight: bool) -> String {
    let horizon = if inflight { "last_seq" } else { "sealed_seq" };
    let upper = format!(
        "(SELECT min(?3, {horizon} + 1) FROM conversations WHERE id = ?1 AND deleted_at IS NULL
                                AND (?4 IS NULL OR owner = ?4))"
    );
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
    params: (&str, i64, i64, Option<&str>),
    max_bytes: usize,
) -> rusqlite::Result<HistoryPage> {
    let mut statement = c.prepare_cached(sql)?;
    let mut rows = statement.query(params)?;
    let mut page = HistoryPage::default();
    while let Some(row) = rows.next()? {
        if page.full(max_bytes) {
            page.cut = true;
            break;
        }
        page.push(row.get(0)?, text(row, 1)?, text(row, 2)?);
    }
    Ok(page)
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
/// counters bumped, only while `turn_id` holds the conversation's lease. The script's last row
/// is the seq of the last chunk (no row when the turn does not hold the lease: a lost lease or
/// a missing conversation).
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
        script
            .sql("SELECT last_seq FROM conversations WHERE id = ? AND lease_turn = ?;")
            .bind(conversation_id)
            .bind(turn_id);
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
        script.sql(") v WHERE c.id = ? AND c.lease_turn = ?;").bind(conversation_id).bind(turn_id);
    }
    script
        .sql(
            "UPDATE conversations SET last_seq = last_seq + ?,
                 last_message_id = last_message_id + ? + (last_message_id = 0 AND ?), last_activity_at = ?
             WHERE id = ? AND lease_turn = ? RETURNING last_seq;",
        )
        .bind(chunks.len() as i64)
        .bind(opened)
        .bind(first_not_new)
        .bind(now)
        .bind(conversation_id)
        .bind(turn_id);
    Ok(())
}

/// The seq an append script answered with; none: the turn does not hold the lease.
pub(super) fn appended_seq(rows: &[Column]) -> StoreResult<u64> {
    match rows.last() {
        Some(Column::Integer(seq)) => Ok(*seq as u64),
        Some(other) => Err(StoreError::Corrupt(format!("an append answered {other:?}"))),
        None => Err(StoreError::LeaseLost),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::Database;
    use crate::metrics::Metrics;
    use crate::store::Store;
    use crate::wire::{Chunk, Role, TextChunk};

    fn chunk(i: usize, new_message: bool) -> NewChunk {
        NewChunk { role: Role::Assistant, chunk: Chunk::Text(TextChunk { text: format!("c{i}") }), new_message }
    }

    async fn open(path: &std::path::Path) -> Store {
        Store::open(&Database::Sqlite(path.to_owned()), Arc::new(Metrics::default())).await.unwrap()
    }

    #[tokio::test]
    async fn committed_writes_of_every_kind_reach_the_database_file_by_background_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.db");
        let store = open(&path).await;
        store.begin_test_turn("c", "t").await;
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
        // A write that is no turn's (a rename here; a deletion's batches alike) is copied out
        // too: the database file alone, as a copy of it without its WAL, has the new title.
        assert!(store.set_title("c", "renamed").await.unwrap());
        let copy = dir.path().join("copy.db");
        let title = || -> rusqlite::Result<String> {
            std::fs::copy(&path, &copy).expect("a copy of the database file");
            let file = rusqlite::Connection::open(&copy)?;
            file.query_row("SELECT title FROM conversations WHERE id = 'c'", [], |r| r.get(0))
        };
        let mut seen = Err(rusqlite::Error::QueryReturnedNoRows);
        for _ in 0..100 {
            // A copy taken while a checkpoint writes the file can be torn: read again.
            seen = title();
            if seen.as_deref().is_ok_and(|t| t == "renamed") {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(seen.as_deref().ok(), Some("renamed"), "the rename never reached the database file: {seen:?}");
        store.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn windows_read_inline_and_on_the_blocking_pool_agree_with_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir.path().join("windows.db")).await;
        // The turn's user chunk is seq 1; chunk i appended after it is seq i + 2.
        store.begin_test_turn("c", "t").await;
        let total = INLINE_WINDOW_LIMIT as usize + 500;
        let batch: Vec<NewChunk> = (0..total).map(|i| chunk(i, i % 7 == 0)).collect();
        store.append_chunks("c", "t", &batch).await.unwrap();
        let item =
            |seq: u64| format!(r#"{{"seq":{seq},"role":"assistant","chunk":{{"type":"text","text":"c{}"}}}}"#, seq - 2);
        let expected = |seqs: std::ops::RangeInclusive<u64>| seqs.map(item).collect::<Vec<_>>().join(",");
        let window = |since_seq, before_seq, limit| HistoryWindow { since_seq, before_seq, limit, inflight: true };
        let last = total as u64 + 1;
        // Inline (limit <= INLINE_WINDOW_LIMIT) and blocking (larger or no limit) reads.
        let cases = [
            (window(0, None, Some(100)), last - 99..=last),
            (window(0, None, Some(INLINE_WINDOW_LIMIT)), last - INLINE_WINDOW_LIMIT + 1..=last),
            (window(0, None, Some(INLINE_WINDOW_LIMIT + 1)), last - INLINE_WINDOW_LIMIT..=last),
            (window(1, None, None), 2..=last),
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
                store.history("c", window(i * 10 + 1, Some(i * 10 + 52), limit)).await.unwrap()
            })
        });
        for (i, read) in (0..24u64).zip(reads.collect::<Vec<_>>()) {
            let page = read.await.unwrap();
            assert_eq!(String::from_utf8(page.items).unwrap(), expected(i * 10 + 2..=i * 10 + 51));
        }
        assert!((1..=super::super::readers::IDLE_CONNECTIONS).contains(&store.sqlite().readers.idle()));
        // Closed: no connection stays open.
        store.close().await;
        assert_eq!(store.sqlite().readers.idle(), 0);
    }

    #[tokio::test]
    async fn a_history_window_is_read_in_key_order_without_a_sort() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir.path().join("plan.db")).await;
        for (limit, inflight) in [(None, true), (Some(100), true), (None, false), (Some(100), false)] {
            let sql = format!("EXPLAIN QUERY PLAN {}", window_sql(limit, inflight));
            let plan: Vec<String> = store
                .sqlite()
                .readers
                .run_blocking(move |c| {
                    let mut statement = c.prepare(&sql)?;
                    let rows = statement.query_map(("c", 0i64, i64::MAX, None::<&str>), |row| row.get(3))?;
                    rows.collect()
                })
                .await
                .unwrap();
            let steps: Vec<&str> = plan.iter().map(String::as_str).collect();
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
