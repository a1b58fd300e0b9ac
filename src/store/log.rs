//! The append-only chunk log: gap-free `seq` per conversation, a message id per chunk.

use sqlx::SqliteConnection;

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
        // The newest `limit` chunks of the selection are those above the (limit+1)th newest
        // one: that bound is found by walking the index back `limit` entries, so the window
        // itself is one ascending range scan with nothing to sort. LIMIT and OFFSET are written
        // into the statement, not bound: SQLite plans with a bound LIMIT's value and then
        // recompiles the statement at every execution (one cached statement per distinct limit
        // instead).
        let floor = match w.limit.map(|l| l.min(i64::MAX as u64)) {
            Some(limit) => format!(
                "max(?2, coalesce((SELECT seq FROM chunks WHERE conversation_id = ?1 AND seq < ?3
                                   ORDER BY seq DESC LIMIT 1 OFFSET {limit}), 0))"
            ),
            None => "?2".to_owned(),
        };
        let sql = format!(
            r#"SELECT group_concat('{{"seq":' || seq || ',"role":"' || role || '","chunk":' || chunk || '}}', ','
                                   ORDER BY seq),
                      max(seq)
               FROM chunks WHERE conversation_id = ?1 AND seq < ?3 AND seq > {floor}"#
        );
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

/// Appends inside an open write transaction: reads the counters, inserts, bumps them.
pub(super) async fn append_in(
    tx: &mut SqliteConnection,
    conversation_id: &str,
    turn_id: &str,
    chunks: &[NewChunk],
    now: i64,
) -> StoreResult<u64> {
    let (mut seq, mut message_id): (i64, i64) =
        sqlx::query_as("SELECT last_seq, last_message_id FROM conversations WHERE id = ?")
            .bind(conversation_id)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("conversation {conversation_id} vanished during a turn")))?;
    if chunks.is_empty() {
        return Ok(seq as u64);
    }
    for c in chunks {
        seq += 1;
        if c.new_message || message_id == 0 {
            message_id += 1;
        }
        let json = serde_json::to_string(&c.chunk).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        sqlx::query(
            "INSERT INTO chunks (conversation_id, seq, message_id, turn_id, role, chunk) VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(conversation_id)
        .bind(seq)
        .bind(message_id)
        .bind(turn_id)
        .bind(c.role.as_str())
        .bind(json)
        .execute(&mut *tx)
        .await?;
    }
    sqlx::query("UPDATE conversations SET last_seq = ?, last_message_id = ?, last_activity_at = ? WHERE id = ?")
        .bind(seq)
        .bind(message_id)
        .bind(now)
        .bind(conversation_id)
        .execute(&mut *tx)
        .await?;
    Ok(seq as u64)
}
