//! `GET /ws`: the WebSocket protocol of the reference backend's web client (spec 3.4).
//!
//! One JSON object per text frame. A session is served one of two ways:
//! - on a connection whose first request is the upgrade (the usual case), by `net::websocket`:
//!   the gateway writes the frames itself, from one loop that reads the session's hub cursors,
//!   and a session with one subscription parks on the turn like an SSE watcher, so rounds write
//!   its `chat.delta`s straight to the socket ([`crate::hub::Sink`]);
//! - otherwise (an upgrade after other requests on a kept-alive connection), by hyper and
//!   tungstenite: one writer task fed by a bounded queue, and a forwarding task per subscribed
//!   conversation that reads its hub cursor into that queue.
//!
//! Either way a slow socket holds its cursors back (they read further back later, losslessly)
//! and never the turn; the ops are handled by the same [`Session`].

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::ws::{Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::stream::SplitSink;
use futures_util::{SinkExt, StreamExt};
use serde_json::{Map, Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;

use super::AppState;
use super::chat::ChatRequest;
use super::extract::{JsonObject, check_id};
use std::sync::atomic::Ordering::Relaxed;

use super::error::ApiError;
use crate::hub::{Cursor, Delivery, Frame};
use crate::metrics::{StreamPermit, Transport};
use crate::turn::StartError;

/// Messages (or batches of events) queued for one socket before forwarding tasks wait.
const OUTBOUND: usize = 64;
/// Bytes a socket read takes at most (messages may still be up to `max_body_bytes`).
const READ_BUFFER: usize = 4096;
/// Most frames a forwarding task takes from its cursor at once.
const BATCH: usize = 256;

/// Upgrades to the WebSocket protocol. Also answers every path of the `--ws-listen` listener.
#[utoipa::path(
    get,
    path = "/ws",
    tag = "streams",
    responses(
        (status = 101, description = "Switching to the WebSocket protocol: ops chat.send, chat.subscribe, chat.unsubscribe, chat.queue; messages catalog, chat.delta, chat.error, conversation.statusChanged, error"),
        (status = 400, description = "Not a WebSocket upgrade request"),
    )
)]
pub async fn ws(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let (mut parts, _) = request.into_parts();
    if parts.extensions.get::<DirectUpgrade>().is_some() {
        let accept = accept_key(&parts.headers)?;
        let permit = state.stream_permit(Transport::WebSocket)?;
        let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
        let headers = response.headers_mut();
        headers.insert(header::UPGRADE, header::HeaderValue::from_static("websocket"));
        headers.insert(header::CONNECTION, header::HeaderValue::from_static("upgrade"));
        headers.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
        let session = OwnedSession { state, permit };
        response.extensions_mut().insert(TakeSession(Arc::new(std::sync::Mutex::new(Some(session)))));
        return Ok(response);
    }
    let upgrade = match WebSocketUpgrade::from_request_parts(&mut parts, &state).await {
        Ok(upgrade) => upgrade,
        Err(rejection) => return Ok(rejection.into_response()),
    };
    let permit = state.stream_permit(Transport::WebSocket)?;
    Ok(upgrade
        // The read buffer is zeroed before reads (128 KiB by default): clients send small ops,
        // and a smaller buffer makes every read of a busy socket cheaper and an idle one lighter.
        .read_buffer_size(READ_BUFFER)
        .max_message_size(state.config.max_body_bytes)
        .max_frame_size(state.config.max_body_bytes)
        .on_upgrade(move |socket| session(state, socket, permit)))
}

/// Put on an upgrade request by a connection that serves the session itself (`net::direct`).
#[derive(Clone, Copy)]
pub struct DirectUpgrade;

/// What a connection needs to serve a session itself: in the `101` response to a
/// [`DirectUpgrade`] request, for whoever serves it first.
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

/// Checks an upgrade request the way tungstenite's server does; the `Sec-WebSocket-Accept` value.
fn accept_key(headers: &HeaderMap) -> Result<header::HeaderValue, ApiError> {
    let lists = |name: header::HeaderName, token: &str| {
        headers.get_all(name).iter().any(|v| has_token(v.as_bytes(), token.as_bytes()))
    };
    if !lists(header::CONNECTION, "upgrade") {
        return Err(ApiError::BadRequest("`Connection` must include `upgrade`".into()));
    }
    if !lists(header::UPGRADE, "websocket") {
        return Err(ApiError::BadRequest("`Upgrade` must be `websocket`".into()));
    }
    if headers.get(header::SEC_WEBSOCKET_VERSION).is_none_or(|v| v.as_bytes() != b"13") {
        return Err(ApiError::BadRequest("`Sec-WebSocket-Version` must be 13".into()));
    }
    let key = headers
        .get(header::SEC_WEBSOCKET_KEY)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| ApiError::BadRequest("`Sec-WebSocket-Key` is required".into()))?;
    let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
    Ok(header::HeaderValue::from_str(&accept).expect("base64 is a valid header value"))
}

/// Whether a comma-separated header value lists `token` (any case).
pub fn has_token(value: &[u8], token: &[u8]) -> bool {
    value.split(|b| *b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

fn text(value: Value) -> Message {
    Message::Text(Utf8Bytes::from(value.to_string()))
}

/// What the writer task sends: one message, or a batch of hub events as `chat.delta`s.
enum Outbound {
    Message(Message),
    Events(Vec<Arc<Frame>>),
}

impl Outbound {
    /// Queues the messages into the sink without flushing.
    async fn feed(self, sink: &mut SplitSink<WebSocket, Message>) -> Result<(), axum::Error> {
        match self {
            Outbound::Message(m) => sink.feed(m).await,
            Outbound::Events(frames) => {
                for frame in frames {
                    sink.feed(Message::Text(frame.ws().clone())).await?;
                }
                Ok(())
            }
        }
    }
}

/// Where a session's replies go.
enum Outbox {
    /// The writer task's queue (a session served by tungstenite).
    Queue(mpsc::Sender<Outbound>),
    /// Messages the session's own loop writes next (see `net::websocket`).
    Local(Vec<Message>),
}

/// A session's subscriptions.
enum Subscriptions {
    /// A forwarding task per conversation, feeding the writer's queue.
    Tasks(HashMap<String, JoinHandle<()>>),
    /// Cursors the session's own loop reads, in subscription order.
    Cursors(Vec<(String, Cursor)>),
}

/// One WebSocket's ops: what every op does, whichever way the session is served.
pub struct Session {
    state: AppState,
    out: Outbox,
    subscriptions: Subscriptions,
}

async fn session(state: AppState, socket: WebSocket, _permit: StreamPermit) {
    let (mut sink, mut incoming) = socket.split();
    let (out, mut queue) = mpsc::channel::<Outbound>(OUTBOUND);
    let keepalive = state.keepalive();
    let writer = tokio::spawn(async move {
        let mut ping = keepalive.map(|period| tokio::time::interval_at(tokio::time::Instant::now() + period, period));
        loop {
            let message = match ping.as_mut() {
                Some(ping) => tokio::select! {
                    m = queue.recv() => m,
                    _ = ping.tick() => Some(Outbound::Message(Message::Ping(Default::default()))),
                },
                None => queue.recv().await,
            };
            let Some(message) = message else { break };
            // Write everything already queued in one flush.
            if message.feed(&mut sink).await.is_err() {
                break;
            }
            while let Ok(more) = queue.try_recv() {
                if more.feed(&mut sink).await.is_err() {
                    return;
                }
            }
            if sink.flush().await.is_err() {
                break;
            }
        }
        let _ = sink.close().await;
    });

    let mut session = Session {
        state: state.clone(),
        out: Outbox::Queue(out.clone()),
        subscriptions: Subscriptions::Tasks(HashMap::new()),
    };
    session.send(catalog()).await;
    let mut statuses = state.turns.status_changes();
    loop {
        tokio::select! {
            frame = incoming.next() => match frame {
                Some(Ok(Message::Text(t))) => session.handle(t.as_str()).await,
                Some(Ok(Message::Binary(b))) => match std::str::from_utf8(&b) {
                    Ok(t) => session.handle(t).await,
                    Err(_) => session.send(json!({"type": "error", "message": "Invalid JSON"})).await,
                },
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
            change = statuses.recv() => match change {
                Ok(change) => session.push(Message::Text(change.message)).await,
                Err(broadcast::error::RecvError::Lagged(n)) => tracing::debug!(missed = n, "status changes lagged on a WebSocket"),
                Err(broadcast::error::RecvError::Closed) => break,
            },
            _ = out.closed() => break,
            _ = state.drained.cancelled() => break,
        }
        if writer.is_finished() {
            break;
        }
    }
    if let Subscriptions::Tasks(tasks) = &mut session.subscriptions {
        if state.drained.is_cancelled() {
            // Shutdown: the forwarding tasks deliver what is left, then end.
            for (_, task) in tasks.drain() {
                let _ = task.await;
            }
        }
        for (_, task) in tasks.drain() {
            task.abort();
        }
    }
    drop(session);
    drop(out);
    let _ = writer.await;
}

/// Tells the client that its position in a conversation was coalesced away: it refetches
/// history, and the turn's replay follows from its start.
async fn resync(state: &AppState, conversation_id: &str) -> Message {
    state.metrics.lag_recoveries.fetch_add(1, Relaxed);
    let latest_seq = state.store.latest_seq(conversation_id).await.unwrap_or(0);
    text(json!({"type": "chat.resync", "conversationId": conversation_id, "latestSeq": latest_seq}))
}

/// The message a session opens with.
pub fn catalog() -> Value {
    json!({"type": "catalog", "catalog": []})
}

impl Session {
    /// A session whose loop writes its messages and reads its cursors itself.
    pub fn local(state: AppState) -> Session {
        Session { state, out: Outbox::Local(Vec::new()), subscriptions: Subscriptions::Cursors(Vec::new()) }
    }

    pub async fn send(&mut self, value: Value) {
        self.push(text(value)).await;
    }

    pub async fn push(&mut self, message: Message) {
        match &mut self.out {
            Outbox::Queue(out) => drop(out.send(Outbound::Message(message)).await),
            Outbox::Local(out) => out.push(message),
        }
    }

    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.state.metrics
    }

    /// The messages queued for a session's own loop to write.
    pub fn outbox(&mut self) -> &mut Vec<Message> {
        match &mut self.out {
            Outbox::Local(out) => out,
            Outbox::Queue(_) => unreachable!("only a local session has an outbox"),
        }
    }

    /// The cursors of a session's own loop, with their conversations.
    pub fn cursors(&mut self) -> &mut Vec<(String, Cursor)> {
        match &mut self.subscriptions {
            Subscriptions::Cursors(cursors) => cursors,
            Subscriptions::Tasks(_) => unreachable!("only a local session reads its cursors"),
        }
    }

    /// The `chat.resync` message for a subscription whose position was coalesced away.
    pub async fn resync(&self, conversation_id: &str) -> Message {
        resync(&self.state, conversation_id).await
    }

    async fn chat_error(&mut self, conversation_id: Option<&str>, message: impl Into<String>) {
        let mut body = Map::new();
        body.insert("type".into(), "chat.error".into());
        if let Some(id) = conversation_id {
            body.insert("conversationId".into(), id.into());
        }
        body.insert("message".into(), message.into().into());
        self.send(Value::Object(body)).await;
    }

    pub async fn handle(&mut self, raw: &str) {
        let Ok(Value::Object(op)) = serde_json::from_str::<Value>(raw) else {
            self.send(json!({"type": "error", "message": "Invalid JSON"})).await;
            return;
        };
        let op = JsonObject(op);
        let kind = op.0.get("type").and_then(Value::as_str).unwrap_or_default().to_owned();
        let conversation_id = op.0.get("conversationId").and_then(Value::as_str).map(str::to_owned);
        match kind.as_str() {
            "chat.send" => self.chat_send(&op, conversation_id.as_deref()).await,
            "chat.subscribe" => {
                // Never answered with an error, whatever the id.
                if let Some(id) = conversation_id.filter(|id| check_id(id).is_ok()) {
                    self.subscribe(&id);
                }
            }
            "chat.unsubscribe" => {
                if let Some(id) = conversation_id {
                    self.unsubscribe(&id);
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
            Err(e) => return self.chat_error(conversation_id, e.to_string()).await,
        };
        // Subscribe first, so the turn is watched from its first event.
        self.subscribe(&start.conversation_id);
        let id = start.conversation_id.clone();
        match self.state.turns.start(start).await {
            Ok(_) => {}
            Err(StartError::Busy) => self.chat_error(Some(&id), StartError::Busy.to_string()).await,
            Err(e) => {
                let message = super::error::ApiError::from(e).to_string();
                self.chat_error(Some(&id), message).await;
            }
        }
    }

    async fn chat_queue(&mut self, op: &JsonObject, conversation_id: Option<&str>) {
        let Some(id) = conversation_id.filter(|id| check_id(id).is_ok()) else {
            return self.chat_error(conversation_id, "`conversationId` is required").await;
        };
        let text = match op.message("text") {
            Ok(t) => t,
            Err(e) => return self.chat_error(Some(id), e.to_string()).await,
        };
        self.subscribe(id);
        if let Err(e) = self.state.turns.queue(id, text).await {
            let message = super::error::ApiError::from(e).to_string();
            self.chat_error(Some(id), message).await;
        }
    }

    fn unsubscribe(&mut self, conversation_id: &str) {
        match &mut self.subscriptions {
            Subscriptions::Tasks(tasks) => {
                if let Some(task) = tasks.remove(conversation_id) {
                    task.abort();
                }
            }
            Subscriptions::Cursors(cursors) => cursors.retain(|(id, _)| id != conversation_id),
        }
    }

    /// Idempotent: a second subscribe to the same conversation changes nothing.
    fn subscribe(&mut self, conversation_id: &str) {
        let tasks = match &mut self.subscriptions {
            Subscriptions::Cursors(cursors) => {
                if !cursors.iter().any(|(id, _)| id == conversation_id) {
                    let (cursor, _) = self.state.hub.subscribe(conversation_id, None);
                    cursors.push((conversation_id.to_owned(), cursor));
                }
                return;
            }
            Subscriptions::Tasks(tasks) => tasks,
        };
        if tasks.get(conversation_id).is_some_and(|t| !t.is_finished()) {
            return;
        }
        let Outbox::Queue(out) = &self.out else { unreachable!("forwarding tasks feed a queue") };
        let (mut cursor, _) = self.state.hub.subscribe(conversation_id, None);
        let out = out.clone();
        let state = self.state.clone();
        let id = conversation_id.to_owned();
        let task = tokio::spawn(async move {
            // Polled on every batch: a flag check, not the token's lock (see `Cancelled`).
            let mut drained = crate::net::Cancelled::new(&state.drained);
            loop {
                let delivery = tokio::select! {
                    biased;
                    d = cursor.next_batch(BATCH) => d,
                    _ = &mut drained => cursor.try_batch(BATCH).unwrap_or(Delivery::End),
                };
                match delivery {
                    Delivery::Frames(frames) => {
                        state.metrics.events_delivered.fetch_add(frames.len() as u64, Relaxed);
                        if out.send(Outbound::Events(frames)).await.is_err() {
                            return;
                        }
                    }
                    Delivery::Lost => {
                        if out.send(Outbound::Message(resync(&state, &id).await)).await.is_err() {
                            return;
                        }
                    }
                    Delivery::End => return,
                }
            }
        });
        tasks.insert(conversation_id.to_owned(), task);
    }
}
