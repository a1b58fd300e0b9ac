//! Turn rows in SQLite: each write of a turn (open, append, seal) is one script, run on the
//! writer thread inside the transaction it shares with the writes queued with it.

use rusqlite::Connection;
use rusqlite::types::Value as Column;

use super::log::{append_to, appended_seq};
use super::script::Script;
use crate::store::NewChunk;
use crate::store::batch::{Write, Written};
use crate::store::quotas::{DAY_MS, MINUTE_MS, hour_of, second_of};
use crate::store::turns::{
    IDEMPOTENCY_KEEP_MS, duplicate_key, first_ttft_ms, gen_total_ms, interrupted_marker, user_chunk,
};
use crate::store::{BeginTurn, SealTurn};
use crate::store::{StoreError, StoreResult};
use crate::wire::ConversationStatus;

/// The write's statements, inside the open transaction.
pub(super) fn apply(conn: &Connection, write: &Write) -> StoreResult<Written> {
    let mut script = Script::default();
    match write {
        Write::Begin { lease_ms, .. } => {
            let begin = write.as_begin().expect("an opening write");
            // The one writer connection runs this transaction alone: what it counts is all
            // there is, including the turns opened earlier in the same transaction.
            if let Some(budget) = begin.budget {
                budget.judge(budget.usage(begin.now).sqlite_rows(conn)?.pop())?;
            }
            begin_to(&mut script, &begin, *lease_ms)?;
            let rows = script.run(conn).map_err(|e| duplicate_key(e.into()))?;
            // No row: the conversation's lease is another turn's.
            appended_seq(&rows).map_err(|_| StoreError::Busy).map(Written::Seq)
        }
        Write::Append { conversation_id, turn_id, chunks, now } => {
            append_to(&mut script, conversation_id, turn_id, chunks, *now)?;
            appended_seq(&script.run(conn)?).map(Written::Seq)
        }
        Write::Seal { .. } => {
            let (seal, chunks) = write.as_seal().expect("a seal");
            seal_to(&mut script, &seal, chunks)?;
            sealed_status(&script.run(conn)?).map(Written::Status)
        }
        Write::Renew { turn_ids, lease_ms } => {
            let mut renewed = 0;
            for ids in turn_ids.chunks(crate::store::lease::RENEW_AT_ONCE) {
                let renew = crate::store::lease::renew(super::NOW_MS, ids, *lease_ms);
                renewed += renew.sqlite_execute(conn)?;
            }
            Ok(Written::Count(renewed))
        }
        Write::Interrupt { conversation_id, turn_id, now, only_expired } => {
            // The lease is taken in the cut turn's name first (whatever held it, or only when it
            // expired), so the marker's append is fenced like any other.
            script
                .sql(
                    "UPDATE conversations SET lease_turn = ? WHERE id = ?
                       AND (NOT ? OR (lease_turn = ? AND lease_expires_at < ",
                )
                .sql(super::NOW_MS)
                .sql(")) RETURNING 1;")
                .bind(turn_id.as_str())
                .bind(conversation_id.as_str())
                .bind(*only_expired)
                .bind(turn_id.as_str());
            append_to(&mut script, conversation_id, turn_id, &[interrupted_marker()], *now)?;
            script
                .sql(
                    "UPDATE turns SET interrupted_at = ? WHERE conversation_id = ? AND turn_id = ?
                       AND EXISTS (SELECT 1 FROM conversations WHERE id = ? AND lease_turn = ?);",
                )
                .bind(*now)
                .bind(conversation_id.as_str())
                .bind(turn_id.as_str())
                .bind(conversation_id.as_str())
                .bind(turn_id.as_str())
                // The cut turn, marker included, is history from now on.
                .sql(
                    "UPDATE conversations SET sealed_seq = last_seq, lease_turn = NULL, lease_expires_at = NULL,
                         status = CASE WHEN status = 'closed' THEN 'closed' ELSE 'idle' END
                     WHERE id = ? AND lease_turn = ?;",
                )
                .bind(conversation_id.as_str())
                .bind(turn_id.as_str());
            let rows = script.run(conn)?;
            // The take's row and the append's: fewer, the interrupt did not apply.
            if rows.len() < 2 {
                return Err(StoreError::LeaseLost);
            }
            appended_seq(&rows).map(Written::Seq)
        }
    }
}

/// Adds the statements that open a turn to `script` (answered like an append: the seq of the
/// user's chunk). A reused idempotency key fails the script with a unique violation on
/// `idempotency_keys` (see [`duplicate_key`]).
fn begin_to(script: &mut Script, t: &BeginTurn<'_>, lease_ms: i64) -> StoreResult<()> {
    // The turn takes the conversation's lease unless another turn holds it; then the rest
    // (fenced by the lease) writes nothing and the script answers no row.
    script
        .sql(
            "INSERT INTO conversations
                 (id, title, status, created_at, last_activity_at, turn_count, model, lease_turn, lease_expires_at, owner)
             VALUES (?, ?, 'active', ?, ?, 1, ?, ?, ? + ",
        )
        .sql(super::NOW_MS)
        .sql(
            ", ?)
             ON CONFLICT (id) DO UPDATE SET status = 'active', last_activity_at = excluded.last_activity_at,
                 turn_count = turn_count + 1, title = CASE WHEN title = '' THEN excluded.title ELSE title END,
                 model = coalesce(excluded.model, model),
                 lease_turn = excluded.lease_turn, lease_expires_at = excluded.lease_expires_at
             WHERE lease_turn IS NULL;
             INSERT INTO turns (conversation_id, turn_id, ordinal, model, started_at, first_seq)
             SELECT id, ?, turn_count, ?, ?, last_seq + 1 FROM conversations WHERE id = ? AND lease_turn = ?;",
        )
        .bind(t.conversation_id)
        .bind(t.default_title)
        .bind(t.now)
        .bind(t.now)
        .bind(t.sticky_model)
        .bind(t.turn_id)
        .bind(lease_ms)
        .bind(t.owner)
        .bind(t.turn_id)
        .bind(t.model)
        .bind(t.now)
        .bind(t.conversation_id)
        .bind(t.turn_id);
    if let Some(budget) = t.budget {
        let subject = budget.subject.as_str();
        script
            .sql(
                "DELETE FROM quota_seconds WHERE subject = ? AND second < ?;
                 INSERT INTO quota_seconds (subject, second, turns)
                 SELECT ?, ?, 1 WHERE EXISTS (SELECT 1 FROM conversations WHERE id = ? AND lease_turn = ?)
                 ON CONFLICT (subject, second) DO UPDATE SET turns = turns + 1;",
            )
            .bind(subject)
            .bind(second_of(t.now - MINUTE_MS))
            .bind(subject)
            .bind(second_of(t.now))
            .bind(t.conversation_id)
            .bind(t.turn_id);
    }
    if let Some(record) = &t.idempotency {
        script
            .sql(
                "DELETE FROM idempotency_keys WHERE created_at < ?;
                 INSERT INTO idempotency_keys (conversation_id, key, body_hash, response, created_at)
                 VALUES (?, ?, ?, ?, ?);",
            )
            .bind(t.now - IDEMPOTENCY_KEEP_MS)
            .bind(t.conversation_id)
            .bind(record.key)
            .bind(record.body_hash)
            .bind(record.response)
            .bind(t.now);
    }
    append_to(script, t.conversation_id, t.turn_id, &[user_chunk(t.user_text)], t.now)
}

/// Adds the statements of a seal to `script`; its last row is the conversation's status
/// (no row when the conversation does not exist).
fn seal_to(script: &mut Script, s: &SealTurn<'_>, final_chunks: &[NewChunk]) -> StoreResult<()> {
    let metrics = serde_json::to_string(s.metrics).map_err(|e| StoreError::Corrupt(e.to_string()))?;
    if !final_chunks.is_empty() {
        append_to(script, s.conversation_id, s.turn_id, final_chunks, s.now)?;
    }
    // Before the status row, which must stay the script's last.
    if let Some(charge) = s.charge {
        script
            .sql(
                "DELETE FROM quota_tokens WHERE subject = ? AND hour < ?;
                 INSERT INTO quota_tokens (subject, hour, tokens) VALUES (?, ?, ?)
                 ON CONFLICT (subject, hour) DO UPDATE SET tokens = tokens + excluded.tokens;",
            )
            .bind(charge.subject)
            .bind(hour_of(s.now - DAY_MS))
            .bind(charge.subject)
            .bind(hour_of(s.now))
            .bind(charge.tokens.min(i64::MAX as u64) as i64);
    }
    script
        .sql(
            "UPDATE turns SET sealed_at = ?, reason = ?, metrics = ?, output_tokens = ?, gen_total_ms = ?, ttft_ms = ?
             WHERE conversation_id = ? AND turn_id = ?;
             UPDATE conversations SET last_activity_at = ?, sealed_seq = last_seq,
                 status = CASE WHEN status = 'closed' THEN 'closed' ELSE 'idle' END,
                 lease_turn = NULL, lease_expires_at = NULL,
                 tokens_per_estimate = coalesce(?, tokens_per_estimate),
                 calibrated_model = CASE WHEN ? IS NULL THEN calibrated_model
                     ELSE (SELECT model FROM turns WHERE conversation_id = ? AND turn_id = ?) END
             WHERE id = ? AND lease_turn = ? RETURNING status;",
        )
        .bind(s.now)
        .bind(s.reason)
        .bind(metrics)
        .bind(s.metrics.usage.output_tokens as i64)
        .bind(gen_total_ms(s.metrics))
        .bind(first_ttft_ms(s.metrics))
        .bind(s.conversation_id)
        .bind(s.turn_id)
        .bind(s.now)
        .bind(s.tokens_per_estimate)
        .bind(s.tokens_per_estimate)
        .bind(s.conversation_id)
        .bind(s.turn_id)
        .bind(s.conversation_id)
        .bind(s.turn_id);
    Ok(())
}

/// The status a seal script answered with; none: the turn does not hold the lease (an error,
/// which rolls the seal's other statements back).
fn sealed_status(rows: &[Column]) -> StoreResult<ConversationStatus> {
    match rows.last() {
        Some(Column::Text(status)) => crate::store::status_of(status),
        Some(other) => Err(StoreError::Corrupt(format!("a seal answered {other:?}"))),
        None => Err(StoreError::LeaseLost),
    }
}
