//! `GET /ws`: the WebSocket protocol of the reference backend's web client (spec 3.4).
//!
//! One JSON object per text frame. The connection has one writer task fed by a bounded queue;
//! each subscribed conversation has a forwarding task that reads its hub cursor into that
//! queue (a batch of shared frames at a time), so a slow socket holds its cursors back (they
//! read further back later, losslessly) and never the turn.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::State;
use axum::extract::ws::{Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::response::Response;
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
use crate::hub::{Delivery, Frame};
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
pub async fn ws(State(state): State<AppState>, upgrade: WebSocketUpgrade) -> Result<Response, ApiError> {
    let permit = state.stream_permit(Transport::WebSocket)?;
    Ok(upgrade
        // The read buffer is zeroed before reads (128 KiB by default): clients send small ops,
        // and a smaller buffer makes every read of a busy socket cheaper and an idle one lighter.
        .read_buffer_size(READ_BUFFER)
        .max_message_size(state.config.max_body_bytes)
        .max_frame_size(state.config.max_body_bytes)
        .on_upgrade(move |socket| session(state, socket, permit)))
}

fn text(value: Value) -> Outbound {
    Outbound::Message(Message::Text(Utf8Bytes::from(value.to_string())))
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

struct Session {
    state: AppState,
    out: mpsc::Sender<Outbound>,
    subscriptions: HashMap<String, JoinHandle<()>>,
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

    let mut session = Session { state: state.clone(), out: out.clone(), subscriptions: HashMap::new() };
    let _ = out.send(text(json!({"type": "catalog", "catalog": []}))).await;
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
                Ok(c) => {
                    session.send(json!({"type": "conversation.statusChanged", "conversationId": c.conversation_id, "status": c.status})).await;
                }
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
    if state.drained.is_cancelled() {
        // Shutdown: the forwarding tasks deliver what is left, then end.
        for (_, task) in session.subscriptions.drain() {
            let _ = task.await;
        }
    }
    for (_, task) in session.subscriptions.drain() {
        task.abort();
    }
    drop(session);
    drop(out);
    let _ = writer.await;
}

impl Session {
    async fn send(&self, value: Value) {
        let _ = self.out.send(text(value)).await;
    }

    async fn chat_error(&self, conversation_id: Option<&str>, message: impl Into<String>) {
        let mut body = Map::new();
        body.insert("type".into(), "chat.error".into());
        if let Some(id) = conversation_id {
            body.insert("conversationId".into(), id.into());
        }
        body.insert("message".into(), message.into().into());
        self.send(Value::Object(body)).await;
    }

    async fn handle(&mut self, raw: &str) {
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
                if let Some(task) = conversation_id.and_then(|id| self.subscriptions.remove(&id)) {
                    task.abort();
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

    /// Idempotent: a second subscribe to the same conversation changes nothing.
    fn subscribe(&mut self, conversation_id: &str) {
        if self.subscriptions.get(conversation_id).is_some_and(|t| !t.is_finished()) {
            return;
        }
        let (mut cursor, _) = self.state.hub.subscribe(conversation_id, None);
        let out = self.out.clone();
        let store = self.state.store.clone();
        let metrics = self.state.metrics.clone();
        let id = conversation_id.to_owned();
        let drained = self.state.drained.clone();
        let task = tokio::spawn(async move {
            // Polled on every batch: a flag check, not the token's lock (see `Cancelled`).
            let mut drained = crate::net::Cancelled::new(&drained);
            loop {
                let delivery = tokio::select! {
                    biased;
                    d = cursor.next_batch(BATCH) => d,
                    _ = &mut drained => cursor.try_batch(BATCH).unwrap_or(Delivery::End),
                };
                match delivery {
                    Delivery::Frames(frames) => {
                        metrics.events_delivered.fetch_add(frames.len() as u64, Relaxed);
                        if out.send(Outbound::Events(frames)).await.is_err() {
                            return;
                        }
                    }
                    Delivery::Lost => {
                        // The position was coalesced away: tell the client to refetch history;
                        // the turn's replay follows from its start.
                        metrics.lag_recoveries.fetch_add(1, Relaxed);
                        let latest_seq = store.latest_seq(&id).await.unwrap_or(0);
                        let message = json!({"type": "chat.resync", "conversationId": id, "latestSeq": latest_seq});
                        if out.send(text(message)).await.is_err() {
                            return;
                        }
                    }
                    Delivery::End => return,
                }
            }
        });
        self.subscriptions.insert(conversation_id.to_owned(), task);
    }
}
