//! `GET /conversations/:id/events`: the live stream of a conversation, SSE or NDJSON.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::header::ACCEPT;
use axum::response::Response;

use super::AppState;
use super::error::ApiError;
#[cfg(feature = "openapi")]
use super::error::ErrorBody;
use super::extract::{QueryParams, SeenId};
use super::stream::{blind_watch, watch, watch_response};
use crate::encoding::Transport;
use crate::hub::EventId;
use crate::metrics::Holder;

/// Follows a conversation: the in-flight turn's events replayed from its start (or right after
/// the resume cursor), then every event of every later turn, until the client leaves.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/conversations/{id}/events",
    tag = "streams",
    params(
        ("id" = String, Path, description = "Conversation id (need not exist yet)"),
        ("format" = Option<String>, Query, description = "`sse` (default) or `ndjson`; overrides `Accept`"),
        ("lastEventId" = Option<String>, Query, description = "SSE resume cursor `<turnId>:<n>` (the `Last-Event-ID` header wins)"),
        ("until" = Option<String>, Query, description = "`sealed`: end the stream after the next `turn-sealed`"),
        ("Last-Event-ID" = Option<String>, Header, description = "SSE resume cursor"),
    ),
    responses(
        (status = 200, description = "SSE: each event is `id: <turnId>:<n>` + `data: <AgentEvent>`; `event: resync` with `{conversationId, latestSeq}` when the cursor cannot be resumed; `: keep-alive` comments. NDJSON: one AgentEvent per line, empty keep-alive lines.",
            content(
                (String = "text/event-stream"),
                (crate::wire::AgentEvent = "application/x-ndjson"),
            )),
        (status = 400, description = "Bad id or parameter", body = ErrorBody),
        (status = 503, description = "As many streams are open as `--max-streams` allows", body = ErrorBody, headers(("Retry-After" = u32, description = "Seconds to wait before trying again, when a cap is reached"))),
    )
))]
pub async fn events(
    State(state): State<AppState>,
    seen: SeenId,
    headers: HeaderMap,
    query: QueryParams,
) -> Result<Response, ApiError> {
    let format = match query.get("format") {
        Some("sse") => Transport::Sse,
        Some("ndjson") => Transport::Ndjson,
        Some(other) => return Err(ApiError::bad(format!("`format` takes sse or ndjson, got {other:?}"))),
        None if accepts_ndjson(&headers) => Transport::Ndjson,
        None => Transport::Sse,
    };
    let until_sealed = match query.get("until") {
        None => false,
        Some("sealed") => true,
        Some(other) => return Err(ApiError::bad(format!("`until` takes sealed, got {other:?}"))),
    };
    // NDJSON carries nothing but AgentEvents, so it has no ids and no resume.
    let resume =
        if format == Transport::Sse {
            let header = headers.get("last-event-id").map(|v| v.to_str().unwrap_or("\u{0}"));
            match header.or(query.get("lastEventId")).filter(|s| !s.is_empty()) {
                Some(raw) => Some(EventId::parse(raw).ok_or_else(|| {
                    ApiError::bad(format!("`Last-Event-ID` must look like <turnId>:<n>, got {raw:?}"))
                })?),
                None => None,
            }
        } else {
            None
        };
    let permit = state.open_stream(Holder::Live(format), &seen.caller).await?;
    let id = seen.id;
    // Another subject's conversation is watched as an id nobody uses: nothing ever comes, and a
    // resume cursor answers `resync` at 0, as it does for an unused id (claimed just now, empty).
    if !seen.visible || !super::claim(&state, &id, &seen.caller).await? {
        return Ok(watch_response(blind_watch(&state, format, id, resume.is_some(), permit)));
    }
    let (cursor, resync_first) = state.hub.subscribe(&id, resume.as_ref()).await;
    Ok(watch_response(watch(&state, cursor, format, id, until_sealed, resync_first, permit)))
}

fn accepts_ndjson(headers: &HeaderMap) -> bool {
    let accepts =
        |needle: &str| headers.get_all(ACCEPT).iter().filter_map(|v| v.to_str().ok()).any(|v| v.contains(needle));
    accepts("application/x-ndjson") && !accepts("text/event-stream")
}
