//! Turn control: start without a stream, stop, close, steer, status, last answer.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::Value;

use super::AppState;
use super::error::ApiError;
#[cfg(feature = "openapi")]
use super::error::ErrorBody;
use super::extract::{Caller, ConversationId, JsonObject, QueryParams, SeenId};
use crate::hub::Delivery;
use crate::runtime::QueuedMessage;
use crate::turn::{StartError, StartTurn};

/// `/last` waits this long by default, and at most `MAX_LAST_WAIT_MS`.
const DEFAULT_LAST_WAIT_MS: u64 = 30_000;
const MAX_LAST_WAIT_MS: u64 = 300_000;
/// A request racing another with the same idempotency key waits this long for its answer.
const IDEMPOTENCY_RACE_WAIT: Duration = Duration::from_secs(2);

/// Documents the body of `POST /conversations/:id/messages`.
#[cfg(feature = "openapi")]
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct MessageRequest {
    /// Trimmed; must not be empty.
    pub message: String,
    pub model: Option<String>,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnAccepted {
    pub conversation_id: String,
    pub turn_id: String,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct StopResponse {
    pub conversation_id: String,
    pub aborted_turn: bool,
}

/// Documents the body of `POST /conversations/:id/queue`.
#[cfg(feature = "openapi")]
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct QueueRequest {
    pub text: String,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct QueueResponse {
    pub conversation_id: String,
    pub started_turn: bool,
    /// Messages waiting for the running turn's next step.
    pub queue: Vec<QueuedMessage>,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct StatusResponse {
    pub conversation_id: String,
    pub is_active: bool,
    pub status: crate::wire::ConversationStatus,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct LastResponse {
    pub conversation_id: String,
    /// The text of the last assistant message of the latest finished turn ("" when none).
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<String>,
}

/// FNV-1a: a stable hash of the request body, to tell a retry from a different request.
fn body_hash(body: &Value) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in body.to_string().bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{hash:016x}")
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else { return Ok(None) };
    let key = value.to_str().map_err(|_| ApiError::bad("`Idempotency-Key` must be printable ASCII"))?;
    if key.is_empty() || key.len() > 255 || !key.bytes().all(|b| (0x21..0x7f).contains(&b)) {
        return Err(ApiError::bad("`Idempotency-Key` must be 1 to 255 printable ASCII characters"));
    }
    Ok(Some(key.to_owned()))
}

/// The stored answer to a repeated key: 200 with it, or 409 when the body differs.
async fn replay(state: &AppState, id: &str, key: &str, hash: &str) -> Result<Option<Response>, ApiError> {
    let Some((stored_hash, response)) = state.store.idempotent_response(id, key).await? else {
        return Ok(None);
    };
    if stored_hash != hash {
        return Err(ApiError::Conflict("this Idempotency-Key was used with a different request body".into()));
    }
    let body: Value = serde_json::from_str(&response).map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Some((StatusCode::OK, Json(body)).into_response()))
}

/// Starts a turn without holding a stream; watchers follow it on `/events`.
#[cfg_attr(feature = "openapi", utoipa::path(
    post,
    path = "/conversations/{id}/messages",
    tag = "control",
    params(
        ("id" = String, Path, description = "Conversation id (created when new)"),
        ("Idempotency-Key" = Option<String>, Header, description = "A retry with the same key and body returns the first answer (200) and starts nothing; kept 24 h"),
    ),
    request_body = MessageRequest,
    responses(
        (status = 202, description = "The turn started", body = TurnAccepted),
        (status = 200, description = "A repeated Idempotency-Key: the first answer", body = TurnAccepted),
        (status = 400, body = ErrorBody),
        (status = 409, description = "A turn is running, the conversation is being deleted, or the key was used with another body", body = ErrorBody),
        (status = 413, body = ErrorBody),
        (status = 503, description = "Shutting down, or as many turns run as `--max-turns` allows", body = ErrorBody, headers(("Retry-After" = u32, description = "Seconds to wait before trying again, when a cap is reached"))),
    )
))]
pub async fn messages(
    State(state): State<AppState>,
    ConversationId(id): ConversationId,
    Caller(caller): Caller,
    headers: HeaderMap,
    body: JsonObject,
) -> Result<Response, ApiError> {
    let message = body.message("message")?;
    let model = body.optional_str("model")?.map(str::to_owned);
    let key = idempotency_key(&headers)?;
    let hash = body_hash(&serde_json::json!({"message": message, "model": model}));
    if let Some(key) = &key
        && let Some(answer) = replay(&state, &id, key, &hash).await?
    {
        return Ok(answer);
    }
    let req = StartTurn { conversation_id: id.clone(), message, model, cwd: None, reasoning_effort: None, caller };
    let respond = |turn_id: &str| {
        let answer = TurnAccepted { conversation_id: id.clone(), turn_id: turn_id.to_owned() };
        (hash.clone(), serde_json::to_string(&answer).unwrap_or_default())
    };
    match state.turns.start_with(req, key.as_ref().map(|_| respond), key.as_deref()).await {
        Ok(started) => Ok((
            StatusCode::ACCEPTED,
            Json(TurnAccepted { conversation_id: started.conversation_id, turn_id: started.turn_id }),
        )
            .into_response()),
        Err(e @ (StartError::Busy | StartError::Store(crate::store::StoreError::DuplicateKey))) => {
            // Another request with this key may be starting the same turn right now.
            if let Some(key) = &key {
                let deadline = tokio::time::Instant::now() + IDEMPOTENCY_RACE_WAIT;
                loop {
                    if let Some(answer) = replay(&state, &id, key, &hash).await? {
                        return Ok(answer);
                    }
                    if tokio::time::Instant::now() >= deadline {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Err(e.into())
        }
        Err(e) => Err(e.into()),
    }
}

/// Aborts the running turn: it ends `done{reason:"aborted"}` + `turn-sealed`, keeping the
/// text already streamed.
#[cfg_attr(feature = "openapi", utoipa::path(
    post,
    path = "/conversations/{id}/stop",
    tag = "control",
    params(("id" = String, Path, description = "Conversation id")),
    responses((status = 200, body = StopResponse), (status = 400, body = ErrorBody))
))]
pub async fn stop(State(state): State<AppState>, seen: SeenId) -> Json<StopResponse> {
    // Another subject's conversation: nothing to stop, as for an unknown one.
    let aborted_turn = seen.visible && state.turns.stop(&seen.id).await;
    Json(StopResponse { conversation_id: seen.id, aborted_turn })
}

/// Like stop, and the conversation's status becomes `closed` (idempotent).
#[cfg_attr(feature = "openapi", utoipa::path(
    post,
    path = "/conversations/{id}/close",
    tag = "control",
    params(("id" = String, Path, description = "Conversation id")),
    responses((status = 200, body = StopResponse), (status = 400, body = ErrorBody))
))]
pub async fn close(State(state): State<AppState>, seen: SeenId) -> Result<Json<StopResponse>, ApiError> {
    let aborted_turn = if seen.visible { state.turns.close(&seen.id).await? } else { false };
    Ok(Json(StopResponse { conversation_id: seen.id, aborted_turn }))
}

/// Steers the running turn (delivered at its next step boundary) or starts a turn.
#[cfg_attr(feature = "openapi", utoipa::path(
    post,
    path = "/conversations/{id}/queue",
    tag = "control",
    params(("id" = String, Path, description = "Conversation id")),
    request_body = QueueRequest,
    responses(
        (status = 200, body = QueueResponse),
        (status = 400, body = ErrorBody),
        (status = 409, description = "As many messages wait as `--max-queued-messages` allows", body = ErrorBody),
        (status = 413, description = "The body is too large, or the waiting text would pass `--max-queued-bytes`", body = ErrorBody),
        (status = 503, description = "No turn runs and none can start: shutting down, or as many turns run as `--max-turns` allows", body = ErrorBody, headers(("Retry-After" = u32, description = "Seconds to wait before trying again, when a cap is reached"))),
    )
))]
pub async fn queue(
    State(state): State<AppState>,
    ConversationId(id): ConversationId,
    Caller(caller): Caller,
    body: JsonObject,
) -> Result<Json<QueueResponse>, ApiError> {
    let text = body.message("text")?;
    let queued = state.turns.queue(&id, text, &caller).await?;
    Ok(Json(QueueResponse { conversation_id: id, started_turn: queued.started_turn, queue: queued.queue }))
}

/// Whether a turn runs, and the conversation's status.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/conversations/{id}/status",
    tag = "control",
    params(("id" = String, Path, description = "Conversation id")),
    responses(
        (status = 200, body = StatusResponse),
        (status = 400, body = ErrorBody),
        (status = 404, description = "Unknown conversation", body = ErrorBody),
    )
))]
pub async fn status(
    State(state): State<AppState>,
    ConversationId(id): ConversationId,
) -> Result<Json<StatusResponse>, ApiError> {
    let Some(meta) = state.store.conversation(&id).await? else {
        return Err(ApiError::NotFound(format!("no conversation {id:?}")));
    };
    // A turn of this gateway's, or one another gateway on the same database runs.
    let is_active = state.turns.is_active(&id) || state.store.leased(&id).await?;
    Ok(Json(StatusResponse { conversation_id: id, is_active, status: meta.status }))
}

/// Waits (bounded by `timeoutMs`) for the running turn to seal, then returns the last
/// assistant text.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/conversations/{id}/last",
    tag = "control",
    params(
        ("id" = String, Path, description = "Conversation id"),
        ("timeoutMs" = Option<u64>, Query, description = "How long to wait for a running turn (default 30000, max 300000)"),
    ),
    responses(
        (status = 200, body = LastResponse),
        (status = 400, body = ErrorBody),
        (status = 409, description = "The turn was still running when the wait ended", body = ErrorBody),
        (status = 503, description = "As many streams are open as `--max-streams` allows (a wait counts as one)", body = ErrorBody, headers(("Retry-After" = u32, description = "Seconds to wait before trying again, when a cap is reached"))),
    )
))]
pub async fn last(
    State(state): State<AppState>,
    seen: SeenId,
    query: QueryParams,
) -> Result<Json<LastResponse>, ApiError> {
    let wait = query.integer("timeoutMs", 0, MAX_LAST_WAIT_MS)?.unwrap_or(DEFAULT_LAST_WAIT_MS);
    let id = seen.id;
    if !seen.visible {
        return Ok(Json(LastResponse { conversation_id: id, content: String::new(), turn_id: None }));
    }
    if let Some(buffer) = state.hub.current(&id).await {
        // A wait holds its connection as long as a stream does: it counts as one.
        let _permit = state.open_stream(crate::metrics::Holder::Last, &seen.caller).await?;
        let mut cursor = state.hub.read_turn(&buffer);
        drop(buffer);
        let sealed = async { while !matches!(cursor.next_batch(usize::MAX).await, Delivery::End) {} };
        if tokio::time::timeout(Duration::from_millis(wait), sealed).await.is_err() {
            return Err(ApiError::Conflict("the turn is still running".into()));
        }
    }
    let last = state.store.last_text(&id).await?;
    Ok(Json(LastResponse { conversation_id: id, content: last.content, turn_id: last.turn_id }))
}
