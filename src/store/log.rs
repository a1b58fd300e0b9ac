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
    /// The chunk objects, comma-separated, in seq order (empty for none).
    pub items: String,
    /// Seq of the last chunk in the window.
    pub last_seq: Option<u64>,
}

/// `sinceSeq < seq < beforeSeq`, newest `limit` of that, ascending.
#[derive(Debug, Clone, Copy)]
pub struct HistoryWindow {
    pub since_seq: u64,
    pub before_seq: Option<u64>,
    pub limit: Option<u64>,
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

    /// A window of the log, assembled by SQLite in one row: a window of 100 chunks is one
    /// result row instead of 100 (each row crosses a thread and is copied; the JSON text is
    /// joined where it lies). The text is joined unparsed: the database refuses to store a
    /// chunk that is not JSON or a role outside the four (migration 0003), so what is joined is
    /// JSON.
    pub async fn history(&self, conversation_id: &str, w: HistoryWindow) -> StoreResult<HistoryPage> {
        let since = i64::try_from(w.since_seq).unwrap_or(i64::MAX);
        let before = w.before_seq.map_or(i64::MAX, |b| i64::try_from(b).unwrap_or(i64::MAX));
        let sql = window_sql(w.limit);
        let (items, last_seq): (Option<String>, Option<i64>) = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(conversation_id)
            .bind(since)
            .bind(before)
            .fetch_one(&self.reader)
            .await?;
        Ok(HistoryPage { items: items.unwrap_or_default(), last_seq: last_seq.map(|s| s as u64) })
    }

    /// The conversation's highest seq (0 for none or unknown).
    pub async fn latest_seq(&self, conversation_id: &str) -> StoreResult<u64> {
        let seq: Option<i64> = sqlx::query_scalar("SELECT last_seq FROM conversations WHERE id = ?")
            .bind(conversation_id)
            .fetch_optional(&self.reader)
            .await?;
        Ok(seq.unwrap_or(0) as u64)
    }
}

/// The statement of a history window (parameters: conversation id, sinceSeq, beforeSeq).
///
/// The newest `limit` chunks of the selection are those above the (limit+1)th newest one: that
/// bound is found by walking the index back `limit` entries, so the window itself is one
/// ascending range scan. LIMIT and OFFSET are written into the statement, not bound: SQLite
/// plans with a bound LIMIT's value and then recompiles the statement at every execution (one
/// cached statement per distinct limit instead). The order comes from the subquery's ORDER BY,
/// which the primary key's range scan satisfies with no sort: SQLite keeps a subquery's ORDER
/// BY under an aggregate other than count/min/max, and does not flatten it into the aggregate.
/// (`group_concat(... ORDER BY seq)` would sort the window again in a temporary b-tree.)
fn window_sql(limit: Option<u64>) -> String {
    let floor = match limit.map(|l| l.min(i64::MAX as u64)) {
        Some(limit) => format!(
            "max(?2, coalesce((SELECT seq FROM chunks WHERE conversation_id = ?1 AND seq < ?3
                               ORDER BY seq DESC LIMIT 1 OFFSET {limit}), 0))"
        ),
        None => "?2".to_owned(),
    };
    format!(
        r#"SELECT group_concat(item, ','), max(seq) FROM (
             SELECT '{{"seq":' || seq || ',"role":"' || role || '","chunk":' || chunk || '}}' AS item, seq
             FROM chunks WHERE conversation_id = ?1 AND seq < ?3 AND seq > {floor} ORDER BY seq)"#
    )
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
        assert_eq!(store.latest_seq("c").await.unwrap(), total);
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

    #[tokio::test]
    async fn a_history_window_is_read_in_key_order_without_a_sort() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("plan.db"), Arc::new(Metrics::default())).await.unwrap();
        for limit in [None, Some(100)] {
            let sql = format!("EXPLAIN QUERY PLAN {}", window_sql(limit));
            let plan: Vec<(i64, i64, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind("c")
                .bind(0i64)
                .bind(i64::MAX)
                .fetch_all(&store.reader)
                .await
                .unwrap();
            let steps: Vec<&str> = plan.iter().map(|row| row.3.as_str()).collect();
            // The ordered subquery stays a subquery (its ORDER BY decides the order), is read
            // by the primary key, and nothing is sorted in a temporary b-tree.
            assert!(steps.iter().any(|s| s.starts_with("CO-ROUTINE")), "{steps:?}");
            assert!(
                steps.iter().any(|s| s.contains("USING PRIMARY KEY (conversation_id=? AND seq>? AND seq<?)")),
                "{steps:?}"
            );
            assert!(!steps.iter().any(|s| s.contains("TEMP B-TREE")), "{steps:?}");
        }
        store.close().await;
    }
}
