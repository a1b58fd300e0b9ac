//! The append-only chunk log: gap-free `seq` per conversation, a message id per chunk.

use serde::Serialize;
use serde_json::value::RawValue;
use sqlx::{FromRow, Sqlite, Transaction};

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

/// A stored chunk as read back: the chunk stays the exact JSON that was written.
#[derive(Debug, Serialize)]
pub struct RawStoredChunk {
    pub seq: u64,
    pub role: Role,
    pub chunk: Box<RawValue>,
}

/// `sinceSeq < seq < beforeSeq`, newest `limit` of that, ascending.
#[derive(Debug, Clone, Copy)]
pub struct HistoryWindow {
    pub since_seq: u64,
    pub before_seq: Option<u64>,
    pub limit: Option<u64>,
}

#[derive(FromRow)]
struct ChunkRow {
    seq: i64,
    role: String,
    chunk: String,
}

impl Store {
    /// Appends `chunks` in one transaction; returns the seq of the last one (0 if none).
    pub async fn append_chunks(&self, conversation_id: &str, turn_id: &str, chunks: &[NewChunk]) -> StoreResult<u64> {
        let result = self.write_append_chunks(conversation_id, turn_id, chunks).await;
        self.noted(result)
    }

    async fn write_append_chunks(&self, conversation_id: &str, turn_id: &str, chunks: &[NewChunk]) -> StoreResult<u64> {
        let (mut tx, started) = self.write_tx().await?;
        let last = append_in(&mut tx, conversation_id, turn_id, chunks, super::now_ms()).await?;
        self.commit(tx, started).await?;
        Ok(last)
    }

    pub async fn history(&self, conversation_id: &str, w: HistoryWindow) -> StoreResult<Vec<RawStoredChunk>> {
        let since = i64::try_from(w.since_seq).unwrap_or(i64::MAX);
        let before = w.before_seq.map_or(i64::MAX, |b| i64::try_from(b).unwrap_or(i64::MAX));
        let rows: Vec<ChunkRow> = match w.limit {
            Some(limit) => {
                let mut rows: Vec<ChunkRow> = sqlx::query_as(
                    "SELECT seq, role, chunk FROM chunks
                     WHERE conversation_id = ? AND seq > ? AND seq < ?
                     ORDER BY seq DESC LIMIT ?",
                )
                .bind(conversation_id)
                .bind(since)
                .bind(before)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(&self.reader)
                .await?;
                rows.reverse();
                rows
            }
            None => {
                sqlx::query_as(
                    "SELECT seq, role, chunk FROM chunks
                     WHERE conversation_id = ? AND seq > ? AND seq < ?
                     ORDER BY seq ASC",
                )
                .bind(conversation_id)
                .bind(since)
                .bind(before)
                .fetch_all(&self.reader)
                .await?
            }
        };
        rows.into_iter()
            .map(|r| {
                let role = Role::parse(&r.role)
                    .ok_or_else(|| StoreError::Corrupt(format!("unknown role {:?} at seq {}", r.role, r.seq)))?;
                let chunk = RawValue::from_string(r.chunk)
                    .map_err(|e| StoreError::Corrupt(format!("chunk at seq {} is not JSON: {e}", r.seq)))?;
                Ok(RawStoredChunk { seq: r.seq as u64, role, chunk })
            })
            .collect()
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
    tx: &mut Transaction<'static, Sqlite>,
    conversation_id: &str,
    turn_id: &str,
    chunks: &[NewChunk],
    now: i64,
) -> StoreResult<u64> {
    let (mut seq, mut message_id): (i64, i64) =
        sqlx::query_as("SELECT last_seq, last_message_id FROM conversations WHERE id = ?")
            .bind(conversation_id)
            .fetch_optional(&mut **tx)
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
        .execute(&mut **tx)
        .await?;
    }
    sqlx::query("UPDATE conversations SET last_seq = ?, last_message_id = ?, last_activity_at = ? WHERE id = ?")
        .bind(seq)
        .bind(message_id)
        .bind(now)
        .bind(conversation_id)
        .execute(&mut **tx)
        .await?;
    Ok(seq as u64)
}
