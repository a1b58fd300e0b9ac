//! Turn rows in PostgreSQL: open (the conversation row and the turn's in one statement, the
//! user's chunk in a second), append, seal (the turn and the conversation in one statement).

use sqlx::{PgConnection, Postgres as Driver, Transaction};

use super::log::append;
use crate::store::batch::{Write, Written};
use crate::store::quotas::{DAY_MS, MINUTE_MS, hour_of, second_of};
use crate::store::turns::{
    IDEMPOTENCY_KEEP_MS, duplicate_key, first_ttft_ms, gen_total_ms, interrupted_marker, user_chunk,
};
use crate::store::{BeginTurn, SealTurn};
use crate::store::{StoreError, StoreResult};

/// The write's statements, inside an open transaction.
pub(super) async fn apply(tx: &mut Transaction<'static, Driver>, write: &Write) -> StoreResult<Written> {
    let conn: &mut PgConnection = tx;
    match write {
        Write::Begin { lease_ms, .. } => {
            let begin = write.as_begin().expect("an opening write");
            if let Some(budget) = begin.budget {
                // Gateways admitting the same subject take turns (the lock is held to the
                // commit), and each counts what the one before committed.
                sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 7201))")
                    .bind(budget.subject.as_str())
                    .execute(&mut *conn)
                    .await?;
                budget.judge(budget.usage(begin.now).postgres_rows(&mut *conn).await?.pop())?;
            }
            begin_turn(conn, &begin, *lease_ms).await.map_err(duplicate_key).map(Written::Seq)
        }
        Write::Append { conversation_id, turn_id, chunks, now } => {
            append(conn, conversation_id, turn_id, chunks, *now).await.map(Written::Seq)
        }
        Write::Seal { .. } => {
            let (seal, chunks) = write.as_seal().expect("a seal");
            if !chunks.is_empty() {
                append(conn, seal.conversation_id, seal.turn_id, chunks, seal.now).await?;
            }
            seal_turn(conn, &seal).await.map(Written::Status)
        }
        Write::Renew { turn_ids, lease_ms } => {
            let mut renewed = 0;
            for ids in turn_ids.chunks(crate::store::lease::RENEW_AT_ONCE) {
                let renew = crate::store::lease::renew(super::NOW_MS, ids, *lease_ms);
                renewed += renew.postgres_execute(&mut *conn).await?;
            }
            Ok(Written::Count(renewed))
        }
        Write::Interrupt { conversation_id, turn_id, now, only_expired } => {
            // The lease is taken in the cut turn's name (whatever held it, or only when it
            // expired: the row lock makes one gateway of several do it), so the marker's append
            // is fenced like any other. A refusal is an error: the transaction is rolled back.
            let sql = format!(
                "UPDATE conversations SET lease_turn = $2 WHERE id = $1
                   AND (NOT $3 OR (lease_turn = $2 AND lease_expires_at < {}))",
                super::NOW_MS
            );
            let taken = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(conversation_id)
                .bind(turn_id)
                .bind(*only_expired)
                .execute(&mut *conn)
                .await?;
            if taken.rows_affected() == 0 {
                return Err(StoreError::LeaseLost);
            }
            let seq = append(conn, conversation_id, turn_id, &[interrupted_marker()], *now).await?;
            // The cut turn, marker included, is history from now on.
            sqlx::query(
                "WITH t AS (UPDATE turns SET interrupted_at = $3 WHERE conversation_id = $1 AND turn_id = $2)
                 UPDATE conversations SET sealed_seq = last_seq, lease_turn = NULL, lease_expires_at = NULL,
                     status = CASE WHEN status = 'closed' THEN 'closed' ELSE 'idle' END
                 WHERE id = $1",
            )
            .bind(conversation_id)
            .bind(turn_id)
            .bind(*now)
            .execute(&mut *conn)
            .await?;
            Ok(Written::Seq(seq))
        }
    }
}

/// Opens a turn: the conversation created or marked active with its lease taken, the turn's
/// row numbered from it, the idempotency key recorded, the user's chunk appended. The user
/// chunk's seq; `Busy` when another turn holds the lease.
async fn begin_turn(conn: &mut PgConnection, t: &BeginTurn<'_>, lease_ms: i64) -> StoreResult<u64> {
    let sql = format!(
        "WITH c AS (
             INSERT INTO conversations
                 (id, title, status, created_at, last_activity_at, turn_count, model, lease_turn, lease_expires_at, owner)
             VALUES ($1, $2, 'active', $3, $3, 1, $4, $5, {} + $7, $8)
             ON CONFLICT (id) DO UPDATE SET status = 'active', last_activity_at = excluded.last_activity_at,
                 turn_count = conversations.turn_count + 1,
                 title = CASE WHEN conversations.title = '' THEN excluded.title ELSE conversations.title END,
                 model = coalesce(excluded.model, conversations.model),
                 lease_turn = excluded.lease_turn, lease_expires_at = excluded.lease_expires_at
             WHERE conversations.lease_turn IS NULL
             RETURNING id, turn_count, last_seq
         )
         INSERT INTO turns (conversation_id, turn_id, ordinal, model, started_at, first_seq)
         SELECT id, $5, turn_count, $6, $3, last_seq + 1 FROM c",
        super::NOW_MS
    );
    let opened = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(t.conversation_id)
        .bind(t.default_title)
        .bind(t.now)
        .bind(t.sticky_model)
        .bind(t.turn_id)
        .bind(t.model)
        .bind(lease_ms)
        .bind(t.owner)
        .execute(&mut *conn)
        .await?;
    if opened.rows_affected() == 0 {
        return Err(StoreError::Busy);
    }
    if let Some(budget) = t.budget {
        let subject = budget.subject.as_str();
        sqlx::query("DELETE FROM quota_seconds WHERE subject = $1 AND second < $2")
            .bind(subject)
            .bind(second_of(t.now - MINUTE_MS))
            .execute(&mut *conn)
            .await?;
        sqlx::query(
            "INSERT INTO quota_seconds (subject, second, turns) VALUES ($1, $2, 1)
             ON CONFLICT (subject, second) DO UPDATE SET turns = quota_seconds.turns + 1",
        )
        .bind(subject)
        .bind(second_of(t.now))
        .execute(&mut *conn)
        .await?;
    }
    if let Some(record) = &t.idempotency {
        sqlx::query("DELETE FROM idempotency_keys WHERE created_at < $1")
            .bind(t.now - IDEMPOTENCY_KEEP_MS)
            .execute(&mut *conn)
            .await?;
        sqlx::query(
            "INSERT INTO idempotency_keys (conversation_id, key, body_hash, response, created_at)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(t.conversation_id)
        .bind(record.key)
        .bind(record.body_hash)
        .bind(record.response)
        .bind(t.now)
        .execute(&mut *conn)
        .await?;
    }
    append(conn, t.conversation_id, t.turn_id, &[user_chunk(t.user_text)], t.now).await
}

/// Seals a turn (its metrics; the conversation's horizon moved to its last seq, the
/// conversation idle unless closed, the lease released). The conversation's status;
/// `LeaseLost` when the turn does not hold the lease.
async fn seal_turn(conn: &mut PgConnection, s: &SealTurn<'_>) -> StoreResult<crate::wire::ConversationStatus> {
    let metrics = serde_json::to_string(s.metrics).map_err(|e| StoreError::Corrupt(e.to_string()))?;
    let status: Option<String> = sqlx::query_scalar(
        "WITH t AS (
             UPDATE turns SET sealed_at = $3, reason = $4, metrics = $5, output_tokens = $6, gen_total_ms = $7,
                 ttft_ms = $9
             WHERE conversation_id = $1 AND turn_id = $2
         )
         UPDATE conversations SET last_activity_at = $3, sealed_seq = last_seq,
             status = CASE WHEN status = 'closed' THEN 'closed' ELSE 'idle' END,
             lease_turn = NULL, lease_expires_at = NULL,
             tokens_per_estimate = coalesce($8, tokens_per_estimate),
             calibrated_model = CASE WHEN $8 IS NULL THEN calibrated_model
                 ELSE (SELECT model FROM turns WHERE conversation_id = $1 AND turn_id = $2) END
         WHERE id = $1 AND lease_turn = $2 RETURNING status",
    )
    .bind(s.conversation_id)
    .bind(s.turn_id)
    .bind(s.now)
    .bind(s.reason)
    .bind(metrics)
    .bind(s.metrics.usage.output_tokens as i64)
    .bind(gen_total_ms(s.metrics))
    .bind(s.tokens_per_estimate)
    .bind(first_ttft_ms(s.metrics))
    .fetch_optional(&mut *conn)
    .await?;
    // None: the turn does not hold the lease (an error: the seal's other statements roll back).
    let status = crate::store::status_of(&status.ok_or(StoreError::LeaseLost)?)?;
    if let Some(charge) = s.charge {
        sqlx::query("DELETE FROM quota_tokens WHERE subject = $1 AND hour < $2")
            .bind(charge.subject)
            .bind(hour_of(s.now - DAY_MS))
            .execute(&mut *conn)
            .await?;
        sqlx::query(
            "INSERT INTO quota_tokens (subject, hour, tokens) VALUES ($1, $2, $3)
             ON CONFLICT (subject, hour) DO UPDATE SET tokens = quota_tokens.tokens + excluded.tokens",
        )
        .bind(charge.subject)
        .bind(hour_of(s.now))
        .bind(charge.tokens.min(i64::MAX as u64) as i64)
        .execute(&mut *conn)
        .await?;
    }
    Ok(status)
}
