//! `GET /ws`: the WebSocket protocol of the reference backend's web client.
//!
//! One JSON object per text frame. This module answers the handshake and handles the ops; the
//! `101` hands the session to the connection (`live::Handoff`), which serves it.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, Version, header};
use axum::response::{IntoResponse, Response};
use futures_util::future::BoxFuture;
use serde_json::{Map, Value, json};

use super::AppState;
use super::chat::parse_chat;
use super::error::{ApiError, ErrorBody};
use super::extract::{Caller, JsonObject, check_id};
use crate::encoding::{Transport, has_token};
use crate::live::{Handoff, Live, Ops, Session, SessionSetup};
use crate::metrics::Holder;
use crate::turn::StartError;

/// Upgrades to the WebSocket protocol. Also answers every path of the `--ws-listen` listener.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/ws",
    tag = "streams",
    responses(
        (status = 101, description = "Switching to the WebSocket protocol: ops chat.send, chat.subscribe, chat.unsubscribe, chat.queue; messages catalog, chat.delta, chat.error, chat.resync, conversation.statusChanged, error"),
        (status = 400, description = "Not a WebSocket upgrade request, or not version 13 (then with `Sec-WebSocket-Version: 13`)", body = ErrorBody),
        (status = 403, description = "The page's `Origin` is not on the CORS allow-list", body = ErrorBody),
        (status = 426, description = "An upgrade over HTTP/1.0", body = ErrorBody),
        (status = 503, description = "As many streams are open as `--max-streams` allows", body = ErrorBody, headers(("Retry-After" = u32, description = "Seconds to wait before trying again, when a cap is reached"))),
    )
))]
pub async fn ws(State(state): State<AppState>, Caller(caller): Caller, request: Request) -> Result<Response, ApiError> {
    if request.version() < Version::HTTP_11 {
        let body = ErrorBody { error: "a WebSocket upgrade needs HTTP/1.1".into() };
        return Ok((StatusCode::UPGRADE_REQUIRED, axum::Json(body)).into_response());
    }
    let accept = match accept_key(request.headers()) {
        Ok(accept) => accept,
        Err(Handshake::Bad(message)) => return Err(ApiError::BadRequest(message.into())),
        Err(Handshake::Version) => {
            let mut response = ApiError::bad("`Sec-WebSocket-Version` must be 13").into_response();
            response.headers_mut().insert(header::SEC_WEBSOCKET_VERSION, header::HeaderValue::from_static("13"));
            return Ok(response);
        }
    };
    // The page's `Origin` was checked with the request's head (`layers::guard`): a page of
    // another site gets no session (cross-site WebSocket hijacking).
    let permit = state.open_stream(Holder::Live(Transport::WebSocket), &caller).await?;
    let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
    let headers = response.headers_mut();
    headers.insert(header::UPGRADE, header::HeaderValue::from_static("websocket"));
    headers.insert(header::CONNECTION, header::HeaderValue::from_static("upgrade"));
    headers.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
    let session = Session::new(SessionSetup {
        ops: Arc::new(WsOps { state: state.clone(), caller: caller.clone() }),
        hub: state.hub.clone(),
        max_subscriptions: state.config.max_ws_subscriptions,
        store: state.store.clone(),
        metrics: state.metrics.clone(),
        statuses: state.turns.status_changes(),
        keepalive: state.keepalive(),
        // The caller's credential taken back ends it too (1008).
        drained: permit.end_token(&state.drained).clone(),
        max_message: state.config.max_body_bytes,
        message_timeout: Duration::from_secs(state.config.ws_message_timeout_secs.max(1)),
        reading: state.reading.clone(),
        permit,
        viewer: caller.viewer().cloned(),
    });
    Handoff::attach(&mut response, Live::Session(Box::new(session)));
    Ok(response)
}

enum Handshake {
    Bad(&'static str),
    /// Not version 13: answered with the version the gateway speaks (RFC 6455 4.4).
    Version,
}

/// Checks an upgrade request (RFC 6455 4.2.1); the `Sec-WebSocket-Accept` value.
fn accept_key(headers: &HeaderMap) -> Result<header::HeaderValue, Handshake> {
    let lists = |name: header::HeaderName, token: &str| {
        headers.get_all(name).iter().any(|v| has_token(v.as_bytes(), token.as_bytes()))
    };
    if !lists(header::CONNECTION, "upgrade") {
        return Err(Handshake::Bad("`Connection` must include `upgrade`"));
    }
    if !lists(header::UPGRADE, "websocket") {
        return Err(Handshake::Bad("`Upgrade` must be `websocket`"));
    }
    if headers.get(header::SEC_WEBSOCKET_VERSION).is_none_or(|v| v.as_bytes() != b"13") {
        return Err(Handshake::Version);
    }
    let key = headers
        .get(header::SEC_WEBSOCKET_KEY)
        .filter(|k| !k.is_empty())
        .ok_or(Handshake::Bad("`Sec-WebSocket-Key` is required"))?;
    Ok(header::HeaderValue::from_str(&accept_value(key.as_bytes())).expect("base64 is a valid header value"))
}

/// `Sec-WebSocket-Accept` for a key: the base64 of the SHA-1 of the key and the protocol's GUID.
fn accept_value(key: &[u8]) -> String {
    use base64::Engine;
    let mut sha = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
    sha.update(key);
    sha.update(b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11");
    base64::engine::general_purpose::STANDARD.encode(sha.finish())
}

/// The ops of the reference web client's protocol.
struct WsOps {
    state: AppState,
    /// Who opened the session: its ops act as them.
    caller: crate::identity::Identity,
}

impl Ops for WsOps {
    fn handle<'a>(&'a self, session: &'a mut Session, op: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(self.dispatch(session, op))
    }
}

fn chat_error(session: &mut Session, conversation_id: Option<&str>, message: impl Into<String>) {
    let mut body = Map::new();
    body.insert("type".into(), "chat.error".into());
    if let Some(id) = conversation_id {
        body.insert("conversationId".into(), id.into());
    }
    body.insert("message".into(), message.into().into());
    session.send(&Value::Object(body));
}

impl WsOps {
    async fn dispatch(&self, session: &mut Session, raw: &str) {
        let Ok(Value::Object(op)) = serde_json::from_str::<Value>(raw) else {
            session.send(&json!({"type": "error", "message": "Invalid JSON"}));
            return;
        };
        let op = JsonObject(op);
        let kind = op.0.get("type").and_then(Value::as_str).unwrap_or_default().to_owned();
        let conversation_id = op.0.get("conversationId").and_then(Value::as_str).map(str::to_owned);
        match kind.as_str() {
            "chat.send" => self.chat_send(session, &op, conversation_id.as_deref()).await,
            "chat.subscribe" => {
                // Never answered with an error, whatever the id; only past the cap.
                // Another subject's conversation is followed as an id nobody uses: silently.
                if let Some(id) = conversation_id.filter(|id| check_id(id).is_ok())
                    && self.claim(session, &id).await
                {
                    subscribe(session, &id).await;
                }
            }
            "chat.unsubscribe" => {
                if let Some(id) = conversation_id {
                    session.subscriptions().remove(&id);
                }
            }
            "chat.queue" => self.chat_queue(session, &op, conversation_id.as_deref()).await,
            // UI-surface ops: the gateway exposes no surfaces.
            "subscribe" | "unsubscribe" | "invoke" => {}
            other => tracing::debug!(op = other, "ignored an unknown WebSocket op"),
        }
    }

    async fn chat_send(&self, session: &mut Session, op: &JsonObject, conversation_id: Option<&str>) {
        tracing::info!(target: "dispatch::audit", subject = %crate::log_text::Escaped(&self.caller.subject), admin = self.caller.admin, op = "chat.send", conversation = %crate::log_text::Escaped(conversation_id.unwrap_or("(new)")), "state change");
        let start = match parse_chat(op, &self.caller) {
            Ok(start) => start,
            Err(e) => return chat_error(session, conversation_id, e.to_string()),
        };
        // Subscribe first, so the turn is watched from its first event.
        let id = start.conversation_id.clone();
        if !self.claim(session, &id).await {
            return chat_error(session, Some(&id), format!("no conversation {id:?}"));
        }
        if !subscribe(session, &id).await {
            return;
        }
        match self.state.turns.start(start).await {
            Ok(_) => {}
            Err(StartError::Busy) => chat_error(session, Some(&id), StartError::Busy.to_string()),
            Err(e) => {
                let message = ApiError::from(e).to_string();
                chat_error(session, Some(&id), message);
            }
        }
    }

    async fn chat_queue(&self, session: &mut Session, op: &JsonObject, conversation_id: Option<&str>) {
        tracing::info!(target: "dispatch::audit", subject = %crate::log_text::Escaped(&self.caller.subject), admin = self.caller.admin, op = "chat.queue", conversation = %crate::log_text::Escaped(conversation_id.unwrap_or("")), "state change");
        let Some(id) = conversation_id.filter(|id| check_id(id).is_ok()) else {
            return chat_error(session, conversation_id, "`conversationId` is required");
        };
        let text = match op.message("text") {
            Ok(t) => t,
            Err(e) => return chat_error(session, Some(id), e.to_string()),
        };
        if !self.claim(session, id).await {
            return chat_error(session, Some(id), format!("no conversation {id:?}"));
        }
        if !subscribe(session, id).await {
            return;
        }
        if let Err(e) = self.state.turns.queue(id, text, &self.caller).await {
            let message = ApiError::from(e).to_string();
            chat_error(session, Some(id), message);
        }
    }
}

/// Idempotent; false (and a `chat.error` naming the cap) when the session holds as many
/// subscriptions as it may.
impl WsOps {
    /// Whether the session's subject may follow `id` (claiming it when nobody has used it); a
    /// database failure is said in a `chat.error` and answers false.
    async fn claim(&self, session: &mut Session, id: &str) -> bool {
        match super::claim(&self.state, id, &self.caller).await {
            Ok(ok) => ok,
            Err(e) => {
                chat_error(session, Some(id), e.to_string());
                false
            }
        }
    }
}

async fn subscribe(session: &mut Session, conversation_id: &str) -> bool {
    if session.subscriptions().add(conversation_id).await {
        return true;
    }
    let cap = session.subscriptions().cap();
    chat_error(
        session,
        Some(conversation_id),
        format!(
            "this connection already follows {cap} conversations (max-ws-subscriptions); unsubscribe from one first"
        ),
    );
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_accept_key_is_the_rfc_6455_example() {
        assert_eq!(super::accept_value(b"dGhlIHNhbXBsZSBub25jZQ=="), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
    }
}
