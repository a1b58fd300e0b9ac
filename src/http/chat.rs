//! `POST /chat`: start a turn and stream it back (NDJSON, or SSE when asked).

use axum::extract::State;
use axum::http::header::ACCEPT;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;

use super::AppState;
use super::error::ApiError;
#[cfg(feature = "openapi")]
use super::error::ErrorBody;
use super::extract::{Caller, JsonObject};
use super::stream::{watch, watch_response};
use crate::encoding::Transport;
use crate::metrics::Holder;
use crate::turn::StartTurn;
#[cfg(feature = "openapi")]
use crate::wire::AgentEvent;

/// The body of `POST /chat`.
/// Documents the body for OpenAPI; it is read field by field through `JsonObject`, so
/// each bad field gets its own error sentence.
#[cfg(feature = "openapi")]
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
#[serde(rename_all = "camelCase")]
pub struct ChatRequest {
    /// Minted (a UUID) when absent.
    pub conversation_id: Option<String>,
    /// Trimmed; must not be empty.
    pub message: String,
    /// `<credential>/<model>`; default: the conversation's sticky model, else the configured one.
    pub model: Option<String>,
    /// Where agent programs start (trimmed; at most 4096 bytes, no NUL); default: the conversation's.
    pub cwd: Option<String>,
    pub reasoning_effort: Option<String>,
}

/// Reads a `ChatRequest` (of `POST /chat` or a WebSocket `chat` operation) with the gateway's
/// error sentences.
pub fn parse_chat(body: &JsonObject, caller: &crate::identity::Identity) -> Result<StartTurn, ApiError> {
    let conversation_id = body.conversation_id("conversationId")?.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    Ok(StartTurn {
        conversation_id,
        message: body.message("message")?,
        model: body.optional_str("model")?.map(str::to_owned),
        caller: caller.clone(),
        cwd: super::settings::check_cwd(body.optional_str("cwd")?)?.map(str::to_owned),
        reasoning_effort: match body.optional_str("reasoningEffort")? {
            Some(effort) => {
                super::settings::check_effort(effort)?;
                Some(effort.to_owned())
            }
            None => None,
        },
    })
}

/// Starts a turn and streams its events until `turn-sealed`.
#[cfg_attr(feature = "openapi", utoipa::path(
    post,
    path = "/chat",
    tag = "chat",
    request_body = ChatRequest,
    responses(
        (status = 200, description = "The turn's events: one JSON object per line (`application/x-ndjson`), or SSE with `Accept: text/event-stream`. Header `X-Conversation-Id` names the conversation.",
            content(
                (AgentEvent = "application/x-ndjson"),
                (String = "text/event-stream"),
            ),
            headers(("X-Conversation-Id" = String, description = "The conversation the turn runs in"))),
        (status = 400, description = "Bad body or unknown model", body = ErrorBody),
        (status = 409, description = "A turn is already running in this conversation, or it is being deleted", body = ErrorBody),
        (status = 413, description = "Body too large", body = ErrorBody),
        (status = 503, description = "Shutting down, or as many turns run as `--max-turns` allows, or as many streams are open as `--max-streams` allows", body = ErrorBody, headers(("Retry-After" = u32, description = "Seconds to wait before trying again, when a cap is reached"))),
    )
))]
pub async fn chat(
    State(state): State<AppState>,
    Caller(caller): Caller,
    headers: HeaderMap,
    body: JsonObject,
) -> Result<Response, ApiError> {
    let start = parse_chat(&body, &caller)?;
    let format = if wants_sse(&headers) { Transport::Sse } else { Transport::Ndjson };
    let permit = state.open_stream(Holder::Live(format), &caller).await?;
    let started = state.turns.start(start).await?;
    let cursor = state.hub.read_turn(&started.buffer);
    let id = started.conversation_id.clone();
    let mut response = watch_response(watch(&state, cursor, format, id, true, false, permit));
    if let Ok(id) = HeaderValue::from_str(&started.conversation_id) {
        response.headers_mut().insert("x-conversation-id", id);
    }
    Ok(response)
}

pub(super) fn wants_sse(headers: &HeaderMap) -> bool {
    headers.get_all(ACCEPT).iter().filter_map(|v| v.to_str().ok()).any(|v| v.contains("text/event-stream"))
}
