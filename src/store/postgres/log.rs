//! The chunk log in PostgreSQL: an append is one statement (the conversation's counters bumped
//! under its row lock, the rows inserted from arrays), windows read as the stored text.

use sqlx::{PgConnection, Row};

use super::Postgres;
use crate::store::NewChunk;
use crate::store::log::{HistoryPage, HistoryWindow};
use crate::store::{StoreError, StoreResult};

impl Postgres {
    pub(crate) async fn history(
        &self,
        conversation_id: &str,
        w: HistoryWindow,
        max_bytes: usize,
        viewer: Option<&str>,
    ) -> StoreResult<HistoryPage> {
        use futures_util::TryStreamExt;
        let (since, before) = w.bounds();
        let sql = window_sql(w.limit, w.inflight);
        // Row by row, so that a page cut at `max_bytes` holds no more than that (and a row).
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(conversation_id).bind(since).bind(before).bind(viewer);
        let mut rows = rows.fetch(&self.pool);
        let mut page = HistoryPage::default();
        while let Some(row) = rows.try_next().await? {
            if page.full(max_bytes) {
                page.cut = true;
                break;
            }
            let (role, chunk): (&str, &str) = (row.try_get(1)?, row.try_get(2)?);
            page.push(row.try_get(0)?, role.as_bytes(), chunk.as_bytes());
        }
        Ok(page)
    }
}

/// The statement of a history window (parameters: conversation id, sinceSeq, beforeSeq, the
/// viewer whose conversation alone it reads, NULL for an administrator), as
/// SQLite's (`sqlite/log.rs`): the newest `limit` rows are those above the (limit+1)th newest,
/// found by walking the primary key back, so the window is one ascending range scan. beforeSeq
/// is lowered to just past the sealed horizon, or with `inflight` the last committed chunk
/// (neither for an unknown or deleted conversation).
fn window_sql(limit: Option<u64>, inflight: bool) -> String {
    let horizon = if inflight { "last_seq" } else { "sealed_seq" };
    let upper = format!(
        "coalesce((SELECT LEAST($3, {horizon} + 1) FROM conversations WHERE id = $1 AND deleted_at IS NULL
                   AND ($4::text IS NULL OR owner = $4)), 0)"
    );
    let floor = match limit.map(|l| l.min(i64::MAX as u64)) {
        Some(limit) => format!(
            "GREATEST($2, coalesce((SELECT seq FROM chunks WHERE conversation_id = $1 AND seq < {upper}
                                    ORDER BY seq DESC LIMIT 1 OFFSET {limit}), 0))"
        ),
        None => "$2".to_owned(),
    };
    format!(
        "SELECT seq, role, chunk FROM chunks WHERE conversation_id = $1 AND seq < {upper} AND seq > {floor} ORDER BY seq"
    )
}

/// Appends `chunks` inside the open transaction while `turn_id` holds the conversation's lease;
/// the seq of the last one (the current one for none). `LeaseLost` when the turn does not hold
/// it (a lost lease, or no such conversation).
///
/// The conversation's counters are bumped first (which locks its row until the commit, so
/// writers of one conversation, on any node, take turns) and the rows numbered from the new
/// values: chunk i's seq is the new last_seq - n + i, and its message id the new
/// last_message_id - (messages opened by the append) + (opened up to chunk i). A chunk opens a
/// message when it says so or when the conversation has none yet.
pub(super) async fn append(
    conn: &mut PgConnection,
    conversation_id: &str,
    turn_id: &str,
    chunks: &[NewChunk],
    now: i64,
) -> StoreResult<u64> {
    if chunks.is_empty() {
        let seq: Option<i64> =
            sqlx::query_scalar("SELECT last_seq FROM conversations WHERE id = $1 AND lease_turn = $2")
                .bind(conversation_id)
                .bind(turn_id)
                .fetch_optional(&mut *conn)
                .await?;
        return seq.map(|s| s as u64).ok_or(StoreError::LeaseLost);
    }
    let first_not_new = !chunks[0].new_message;
    let (mut offsets, mut opened, mut roles, mut texts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut opened_so_far = 0i64;
    for (i, c) in chunks.iter().enumerate() {
        opened_so_far += i64::from(c.new_message);
        offsets.push(i as i64 + 1);
        opened.push(opened_so_far);
        roles.push(c.role.as_str());
        texts.push(serde_json::to_string(&c.chunk).map_err(|e| StoreError::Corrupt(e.to_string()))?);
    }
    let seq: Option<i64> = sqlx::query_scalar(
        "WITH c AS (
             UPDATE conversations SET last_seq = last_seq + $3,
                 last_message_id = last_message_id + $4 + CASE WHEN last_message_id = 0 AND $5 THEN 1 ELSE 0 END,
                 last_activity_at = $6
             WHERE id = $1 AND lease_turn = $2 RETURNING id, last_seq, last_message_id
         ), rows AS (
             INSERT INTO chunks (conversation_id, seq, message_id, turn_id, role, chunk)
             SELECT c.id, c.last_seq - $3 + v.n, c.last_message_id - $4 + v.opened, $2, v.role, v.chunk
             FROM c, unnest($7::bigint[], $8::bigint[], $9::text[], $10::text[]) AS v (n, opened, role, chunk)
         )
         SELECT last_seq FROM c",
    )
    .bind(conversation_id)
    .bind(turn_id)
    .bind(chunks.len() as i64)
    .bind(opened_so_far)
    .bind(first_not_new)
    .bind(now)
    .bind(offsets)
    .bind(opened)
    .bind(roles)
    .bind(texts)
    .fetch_optional(&mut *conn)
    .await?;
    seq.map(|s| s as u64).ok_or(StoreError::LeaseLost)
}
