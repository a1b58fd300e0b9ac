//! `GET /ws`: the WebSocket protocol of the reference backend's web client.
//!
//! One JSON object per text frame. Every session is served by `net::websocket`, whichever way
//! its connection reached the upgrade: as its first request (`net::direct` takes the socket at
//! once) or after other requests on a kept-alive connection (hyper hands the socket back once
//! the `101` is written). This module answers the handshake and handles the ops.

use std::sync::Arc;

use axum::extract::ws::{Message, Utf8Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, Version, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::AppState;
use super::chat::ChatRequest;
use super::error::{ApiError, ErrorBody};
use super::extract::{JsonObject, check_id};
use super::subscriptions::Subscriptions;
use crate::metrics::{StreamPermit, Transport};
use crate::turn::StartError;

/// Upgrades to the WebSocket protocol. Also answers every path of the `--ws-listen` listener.
#[utoipa::path(
    get,
    path = "/ws",
    tag = "streams",
    responses(
        (status = 101, description = "Switching to the WebSocket protocol: ops chat.send, chat.subscribe, chat.unsubscribe, chat.queue; messages catalog, chat.delta, chat.error, chat.resync, conversation.statusChanged, error"),
        (status = 400, description = "Not a WebSocket upgrade request, or not version 13 (then with `Sec-WebSocket-Version: 13`)", body = ErrorBody),
        (status = 403, description = "The page's `Origin` is not on the CORS allow-list", body = ErrorBody),
        (status = 426, description = "An upgrade over HTTP/1.0", body = ErrorBody),
    )
)]
pub async fn ws(State(state): State<AppState>, mut request: Request) -> Result<Response, ApiError> {
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
    // A browser page says where it comes from; a page of another site must not get a session
    // (cross-site WebSocket hijacking). Clients that are not browsers send no `Origin`, and the
    // gateway's own console is of the same origin as the socket.
    if let Some(origin) = request.headers().get(header::ORIGIN)
        && !same_origin(origin.as_bytes(), request.headers().get(header::HOST))
        && !state.config.allows_origin(origin.as_bytes())
    {
        return Err(ApiError::Forbidden("this origin is not allowed to open a WebSocket".into()));
    }
    let permit = state.stream_permit(Transport::WebSocket)?;
    let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
    let headers = response.headers_mut();
    headers.insert(header::UPGRADE, header::HeaderValue::from_static("websocket"));
    headers.insert(header::CONNECTION, header::HeaderValue::from_static("upgrade"));
    headers.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
    let session = OwnedSession { state, permit };
    match request.extensions_mut().remove::<hyper::upgrade::OnUpgrade>() {
        // A connection served by hyper: it hands the socket over once the 101 is written.
        Some(upgrade) => {
            tokio::spawn(crate::net::serve_upgraded(upgrade, session));
        }
        // A connection that writes this response itself (`net::direct`) serves the session next.
        None => {
            response.extensions_mut().insert(TakeSession(Arc::new(std::sync::Mutex::new(Some(session)))));
        }
    }
    Ok(response)
}

/// What a connection needs to serve a session itself: in the `101` response, for whoever
/// serves it first.
#[derive(Clone)]
pub struct TakeSession(Arc<std::sync::Mutex<Option<OwnedSession>>>);

impl TakeSession {
    pub fn take(&self) -> Option<OwnedSession> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

pub struct OwnedSession {
    pub state: AppState,
    /// Holds the session's place under the stream cap.
    pub permit: StreamPermit,
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
    let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
    Ok(header::HeaderValue::from_str(&accept).expect("base64 is a valid header value"))
}

/// Whether `origin` (`scheme://host[:port]`) names the host the request was sent to.
fn same_origin(origin: &[u8], host: Option<&header::HeaderValue>) -> bool {
    let authority = origin.strip_prefix(b"http://").or_else(|| origin.strip_prefix(b"https://"));
    matches!((authority, host), (Some(authority), Some(host)) if authority.eq_ignore_ascii_case(host.as_bytes()))
}

/// Whether a comma-separated header value lists `token` (any case).
pub fn has_token(value: &[u8], token: &[u8]) -> bool {
    value.split(|b| *b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

fn text(value: Value) -> Message {
    Message::Text(Utf8Bytes::from(value.to_string()))
}

/// `conversation.statusChanged`: encoded by the first session that writes the change, shared
/// by every other.
pub fn status_changed(change: &crate::turn::StatusChange) -> Message {
    let bytes = change.encoded(|conversation_id, status| {
        let message =
            json!({"type": "conversation.statusChanged", "conversationId": conversation_id, "status": status});
        bytes::Bytes::from(message.to_string())
    });
    Message::Text(Utf8Bytes::try_from(bytes).expect("JSON text is UTF-8"))
}

/// The message a session opens with.
pub fn catalog() -> Value {
    json!({"type": "catalog", "catalog": []})
}

/// One WebSocket's ops; its loop (`net::websocket`) writes what [`Session::outbox`] holds and
/// delivers what its [`Subscriptions`] have.
pub struct Session {
    state: AppState,
    out: Vec<Message>,
    subscriptions: Subscriptions,
}

impl Session {
    pub fn new(state: AppState) -> Session {
        let subscriptions = Subscriptions::new(state.hub.clone(), state.config.max_ws_subscriptions);
        Session { state, out: Vec::new(), subscriptions }
    }

    pub fn send(&mut self, value: Value) {
        self.push(text(value));
    }

    pub fn push(&mut self, message: Message) {
        self.out.push(message);
    }

    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.state.metrics
    }

    /// The messages queued for the session's loop to write.
    pub fn outbox(&mut self) -> &mut Vec<Message> {
        &mut self.out
    }

    pub fn subscriptions(&mut self) -> &mut Subscriptions {
        &mut self.subscriptions
    }

    /// The `chat.resync` message for a subscription whose position was coalesced away: the
    /// client refetches history, and the turn's replay follows from its start. `None` when the
    /// log cannot be read: the session must end (the client comes back and resubscribes),
    /// never point the client at a made-up position.
    pub async fn resync(&mut self, conversation_id: &str) -> Option<Message> {
        self.state.metrics.lag_recoveries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.state.store.latest_seq(conversation_id).await {
            Ok(latest_seq) => {
                Some(text(json!({"type": "chat.resync", "conversationId": conversation_id, "latestSeq": latest_seq})))
            }
            Err(e) => {
                tracing::error!(conversation_id, error = %e, "cannot read the log for a resync; closing the session");
                None
            }
        }
    }

    fn chat_error(&mut self, conversation_id: Option<&str>, message: impl Into<String>) {
        let mut body = Map::new();
        body.insert("type".into(), "chat.error".into());
        if let Some(id) = conversation_id {
            body.insert("conversationId".into(), id.into());
        }
        body.insert("message".into(), message.into().into());
        self.send(Value::Object(body));
    }

    pub async fn handle(&mut self, raw: &str) {
        let Ok(Value::Object(op)) = serde_json::from_str::<Value>(raw) else {
            self.send(json!({"type": "error", "message": "Invalid JSON"}));
            return;
        };
        let op = JsonObject(op);
        let kind = op.0.get("type").and_then(Value::as_str).unwrap_or_default().to_owned();
        let conversation_id = op.0.get("conversationId").and_then(Value::as_str).map(str::to_owned);
        match kind.as_str() {
            "chat.send" => self.chat_send(&op, conversation_id.as_deref()).await,
            "chat.subscribe" => {
                // Never answered with an error, whatever the id; only past the cap.
                if let Some(id) = conversation_id.filter(|id| check_id(id).is_ok()) {
                    self.subscribe(&id);
                }
            }
            "chat.unsubscribe" => {
                if let Some(id) = conversation_id {
                    self.subscriptions.remove(&id);
                }
            }
            "chat.queue" => self.chat_queue(&op, conversation_id.as_deref()).await,
            // UI-surface ops: the gateway exposes no surfaces.
            "subscribe" | "unsubscribe" | "invoke" => {}
            other => tracing::debug!(op = other, "ignored an unknown WebSocket op"),
        }
    }

    async fn chat_send(&mut self, op: &JsonObject, conversation_id: Option<&str>) {
        let start = match ChatRequest::parse(op) {
            Ok(start) => start,
            Err(e) => return self.chat_error(conversation_id, e.to_string()),
        };
        // Subscribe first, so the turn is watched from its first event.
        let id = start.conversation_id.clone();
        if !self.subscribe(&id) {
            return;
        }
        match self.state.turns.start(start).await {
            Ok(_) => {}
            Err(StartError::Busy) => self.chat_error(Some(&id), StartError::Busy.to_string()),
            Err(e) => {
                let message = ApiError::from(e).to_string();
                self.chat_error(Some(&id), message);
            }
        }
    }

    async fn chat_queue(&mut self, op: &JsonObject, conversation_id: Option<&str>) {
        let Some(id) = conversation_id.filter(|id| check_id(id).is_ok()) else {
            return self.chat_error(conversation_id, "`conversationId` is required");
        };
        let text = match op.message("text") {
            Ok(t) => t,
            Err(e) => return self.chat_error(Some(id), e.to_string()),
        };
        if !self.subscribe(id) {
            return;
        }
        if let Err(e) = self.state.turns.queue(id, text).await {
            let message = ApiError::from(e).to_string();
            self.chat_error(Some(id), message);
        }
    }

    /// Idempotent; false (and a `chat.error` naming the cap) when the session holds as many
    /// subscriptions as it may.
    fn subscribe(&mut self, conversation_id: &str) -> bool {
        if self.subscriptions.add(conversation_id) {
            return true;
        }
        let cap = self.subscriptions.cap();
        self.chat_error(
            Some(conversation_id),
            format!(
                "this connection already follows {cap} conversations (max-ws-subscriptions); unsubscribe from one first"
            ),
        );
        false
    }
}
