//! Agent runtimes: what produces the raw stream of one turn.
//!
//! A runtime knows nothing of turn ids, step ids, metrics, the log or watchers; it sends
//! [`RawEvent`]s into a sink and the turn (`crate::turn`) makes the wire out of them.

mod claude;
pub mod command;
pub mod http_client;
mod lines;
pub mod openai;
pub mod scripted;
mod timer;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::Processes;
use crate::wire::{ErrorCode, OutputStream, Usage};

/// One raw event of a runtime, in the order the runtime produced it.
#[derive(Debug, Clone, PartialEq)]
pub enum RawEvent {
    /// The runtime is asking its model for a new step (optional: a step also opens implicitly
    /// at its first event).
    StepStart,
    TextDelta(String),
    ReasoningDelta(String),
    ToolCall {
        id: String,
        name: String,
        input: Value,
    },
    ToolOutput {
        id: String,
        data: String,
        stream: OutputStream,
    },
    ToolResult {
        id: String,
        name: String,
        content: String,
        is_error: bool,
        duration_ms: Option<u64>,
    },
    Usage(Usage),
    /// The step's generation has ended; its tool results may follow.
    StepEnd,
    /// The turn ended normally; `reason` becomes `done.reason`.
    Finish {
        reason: String,
    },
    /// The turn failed.
    Error {
        message: String,
        code: Option<ErrorCode>,
    },
    /// The runtime's native session, to resume on the next turn.
    SessionId(String),
    /// How many tokens the upstream counted per token the runtime estimated in the request it
    /// sent: kept with the conversation and handed to its next turn.
    TokensPerEstimate(f64),
    /// The runtime sent the open step's request: about this many tokens, by the estimator
    /// that trims context. A step that ends without usage (stopped, failed, cut) is charged
    /// it (with its output) against its subject's `tokens_per_day`; without it, the turn's
    /// first step is charged its prompt.
    RequestSize(u64),
    /// The runtime took a steering message from its inbox and passes it to its model now.
    UserInput(String),
}

/// What a runtime gets to run one turn.
#[derive(Debug, Clone)]
pub struct TurnRequest {
    pub conversation_id: String,
    pub turn_id: String,
    /// The model's name inside its credential (`scripted` for `demo/scripted`).
    pub model: String,
    pub prompt: String,
    pub cwd: Option<String>,
    pub reasoning_effort: Option<String>,
    /// The conversation's log so far, the user's message of this turn included, to read as
    /// far back as needed (for runtimes that send the conversation, such as chat completion
    /// endpoints: `None` unless [`Runtime::needs_history`]).
    pub history: Option<History>,
    /// The runtime's native session of this conversation, to resume.
    pub session_id: Option<String>,
    /// The conversation's turn before this one, on whichever gateway and runtime ran it: a
    /// process kept for the conversation that did not run it has missed it.
    pub previous_turn_id: Option<String>,
    /// What the conversation's last turn reported as [`RawEvent::TokensPerEstimate`], for
    /// runtimes that estimate a request's size.
    pub tokens_per_estimate: Option<f64>,
    /// Steering messages queued while the turn runs; a runtime that can take them drains it at
    /// each step boundary and reports each as [`RawEvent::UserInput`].
    pub inbox: Arc<Inbox>,
}

/// The conversation so far, as the store reads it for a turn.
pub use crate::store::{History, HistoryChunk};

/// A message waiting to be delivered to a running turn (or to start the next one).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct QueuedMessage {
    pub id: String,
    pub text: String,
    /// Epoch milliseconds.
    pub queued_at: i64,
}

/// The steering queue of one running turn.
#[derive(Debug, Default)]
pub struct Inbox {
    messages: std::sync::Mutex<Vec<QueuedMessage>>,
}

/// The reasoning efforts a turn may ask for (the reference backend's).
pub const REASONING_EFFORTS: &[&str] = &["low", "medium", "high", "xhigh", "max"];

/// The effort an agent program is told when neither the request nor the conversation sets one.
pub const DEFAULT_REASONING_EFFORT: &str = "high";

/// Why a message could not be queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum QueueFull {
    /// As many messages wait as may.
    Messages(usize),
    /// The waiting text would pass this many bytes.
    Bytes(usize),
}

/// How much may wait in an inbox.
#[derive(Debug, Clone, Copy)]
pub struct QueueLimits {
    pub messages: usize,
    pub bytes: usize,
}

impl Inbox {
    /// Queues `message` within `limits`; what waits then (bounded by the limits).
    pub fn push(&self, message: QueuedMessage, limits: QueueLimits) -> Result<Vec<QueuedMessage>, QueueFull> {
        let mut queue = self.lock();
        if queue.len() >= limits.messages {
            return Err(QueueFull::Messages(limits.messages));
        }
        let bytes: usize = queue.iter().map(|m| m.text.len()).sum();
        if bytes + message.text.len() > limits.bytes {
            return Err(QueueFull::Bytes(limits.bytes));
        }
        queue.push(message);
        Ok(queue.clone())
    }

    /// Takes every queued message, oldest first.
    pub fn drain(&self) -> Vec<QueuedMessage> {
        std::mem::take(&mut *self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<QueuedMessage>> {
        self.messages.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Where a runtime sends its raw events: a queue to its turn bounded in events and in bytes.
/// A runtime that produces faster than its turn writes (a burst of tool results of MiBs, an
/// upstream's large events) waits for room, as for a full queue of small ones, instead of
/// making the gateway hold all of it.
#[derive(Clone)]
pub struct EventSink {
    queue: mpsc::Sender<Queued>,
    bytes: Arc<tokio::sync::Semaphore>,
    most: usize,
}

/// A raw event in the queue, with the room it takes there (none for a small one: those are
/// bounded by the queue's length).
struct Queued {
    event: RawEvent,
    _room: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// The turn's end of an [`EventSink`].
pub struct EventQueue(mpsc::Receiver<Queued>);

/// A queue of at most `events` raw events and `bytes` bytes of their text (an event larger
/// than that takes all of it: it waits for the queue to empty).
pub fn event_queue(events: usize, bytes: usize) -> (EventSink, EventQueue) {
    let (queue, receiver) = mpsc::channel(events.max(1));
    let most = bytes.clamp(1, u32::MAX as usize);
    (EventSink { queue, bytes: Arc::new(tokio::sync::Semaphore::new(most)), most }, EventQueue(receiver))
}

/// Events at most this large take no room in the queue's bytes: the queue's length bounds them.
const SMALL_EVENT: usize = 4096;

impl EventSink {
    /// Queues `event`, waiting for room; an error (with the event) once the turn no longer
    /// reads its queue.
    pub async fn send(&self, event: RawEvent) -> Result<(), mpsc::error::SendError<RawEvent>> {
        let size = event.bytes();
        let room = if size > SMALL_EVENT {
            let n = size.min(self.most) as u32;
            match self.bytes.clone().acquire_many_owned(n).await {
                Ok(room) => Some(room),
                Err(_) => return Err(mpsc::error::SendError(event)),
            }
        } else {
            None
        };
        self.queue.send(Queued { event, _room: room }).await.map_err(|e| mpsc::error::SendError(e.0.event))
    }
}

impl EventQueue {
    /// The next event, its room in the queue given back; `None` once every sink is gone.
    pub async fn recv(&mut self) -> Option<RawEvent> {
        self.0.recv().await.map(|queued| queued.event)
    }
}

impl RawEvent {
    /// About how many bytes the event holds (its text and JSON).
    fn bytes(&self) -> usize {
        match self {
            RawEvent::TextDelta(text) | RawEvent::ReasoningDelta(text) | RawEvent::UserInput(text) => text.len(),
            RawEvent::ToolCall { id, name, input } => {
                id.len() + name.len() + serde_json::to_vec(input).map_or(0, |json| json.len())
            }
            RawEvent::ToolOutput { id, data, .. } => id.len() + data.len(),
            RawEvent::ToolResult { id, name, content, .. } => id.len() + name.len() + content.len(),
            RawEvent::Error { message, .. } => message.len(),
            RawEvent::Finish { reason } => reason.len(),
            RawEvent::SessionId(id) => id.len(),
            RawEvent::StepStart
            | RawEvent::Usage(_)
            | RawEvent::StepEnd
            | RawEvent::TokensPerEstimate(_)
            | RawEvent::RequestSize(_) => 0,
        }
    }
}

pub type RuntimeFuture = Pin<Box<dyn Future<Output = Result<(), RuntimeError>> + Send>>;

/// How a runtime failed, by what its failure proves about admission (the Dreamux rule):
/// only a failure that provably never reached the runtime may be retried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuntimeError {
    /// Provably never accepted (connection refused, 429, 5xx before any content, a process
    /// gone before its input was written): safe to retry.
    #[error("{0}")]
    Failed(String),
    /// Refused for now with a time to come back (a 429 with `Retry-After`): retried as
    /// `Failed`, after that time.
    #[error("{message}")]
    Throttled { message: String, retry_after: std::time::Duration },
    /// May have crossed the runtime's boundary (a write that failed part-way, an untyped
    /// error): never retried automatically.
    #[error("{0}")]
    Ambiguous(String),
    /// Accepted, then failed, or refused for good: the turn ends with this error.
    #[error("{message}")]
    Turn { message: String, code: ErrorCode },
}

impl RuntimeError {
    pub fn turn(message: impl Into<String>, code: ErrorCode) -> RuntimeError {
        RuntimeError::Turn { message: message.into(), code }
    }

    /// The `code` of the turn's `error` event.
    pub fn code(&self) -> ErrorCode {
        match self {
            RuntimeError::Failed(_) | RuntimeError::Throttled { .. } => ErrorCode::Unavailable,
            RuntimeError::Ambiguous(_) => ErrorCode::Ambiguous,
            RuntimeError::Turn { code, .. } => code.clone(),
        }
    }
}

/// A kind of runtime. `run_turn` drives one turn: it sends raw events into `sink`, ends with
/// exactly one terminal (`Finish` or `Error`) or an `Err`, and returns promptly once `cancel`
/// fires, having dropped whatever it had in flight (the request, the process's turn).
///
/// The contract, from the Dreamux provider rules:
/// - **Admission**: `Err(Failed)` only when the input provably never crossed the runtime's
///   boundary; the turn retries it with bounded backoff, and only while nothing of the turn
///   reached a client. Anything uncertain is `Ambiguous` and is never retried.
/// - **One terminal**, published before the turn settles anything on it.
/// - **Resume**: a runtime with a native session reports it (`SessionId`); the next turn gets it
///   in [`TurnRequest::session_id`], and a resume that fails is an error of that turn, never a
///   silent fresh start.
pub trait Runtime: Send + Sync + 'static {
    fn run_turn(&self, request: TurnRequest, sink: EventSink, cancel: CancellationToken) -> RuntimeFuture;

    /// The folder a turn asked for (`cwd`), as the runtime will use it: for a runtime that runs
    /// programs on this host, resolved and checked against the folders it may work in;
    /// `None` when it may not work there (the caller answers with the request's own value only:
    /// no host path, no word on whether it exists). Runtimes that use no folder take any.
    fn folder(&self, cwd: &str) -> Option<String> {
        Some(cwd.to_owned())
    }

    /// Whether `TurnRequest::history` should be given.
    fn needs_history(&self) -> bool {
        false
    }

    /// The agent processes it runs, for a runtime that runs them (`/metrics`).
    fn processes(&self) -> Option<Processes> {
        None
    }

    /// Lets go of what it keeps for a conversation that is gone (deleted, so no turn runs in
    /// it): an agent process it kept for it is stopped, in the background.
    fn release(&self, _conversation_id: &str) {}

    /// The stop fence: refuse new turns at once, then wait until every turn already started
    /// has settled and whatever the runtime spawned is gone. Called at shutdown.
    fn shutdown(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async {})
    }
}

/// What `GET /models` says of one model.
#[derive(Debug, Clone, Default, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ModelInfo {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_window: Option<u64>,
    /// The gateway's: the conversation settings a turn on this model reads (`cwd`,
    /// `reasoningEffort`, `session`), so a client can leave out controls that would do nothing.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub settings: Vec<&'static str>,
}

struct ModelEntry {
    runtime: Arc<dyn Runtime>,
    native_name: String,
    info: ModelInfo,
}

/// The models the gateway can run, by `<credential>/<model>` name, and the MCP servers whose
/// tools they use.
pub struct Registry {
    models: BTreeMap<String, ModelEntry>,
    default_model: String,
    tools: Arc<crate::tools::Toolbox>,
}

impl Registry {
    pub fn new(default_model: impl Into<String>, tools: Arc<crate::tools::Toolbox>) -> Registry {
        Registry { models: BTreeMap::new(), default_model: default_model.into(), tools }
    }

    /// The MCP servers.
    pub fn tools(&self) -> &Arc<crate::tools::Toolbox> {
        &self.tools
    }

    pub fn add(&mut self, credential: &str, model: &str, runtime: Arc<dyn Runtime>, info: ModelInfo) {
        self.models
            .insert(format!("{credential}/{model}"), ModelEntry { runtime, native_name: model.to_owned(), info });
    }

    pub fn default_model(&self) -> &str {
        &self.default_model
    }

    pub fn contains(&self, name: &str) -> bool {
        self.models.contains_key(name)
    }

    /// The agent processes of every runtime that runs them, by credential.
    pub fn processes(&self) -> Vec<Processes> {
        let mut all: Vec<Processes> = self.runtimes().iter().filter_map(|r| r.processes()).collect();
        all.sort_by(|a, b| a.credential.cmp(&b.credential));
        all
    }

    /// Every distinct runtime (for shutdown, deletions and `/metrics`).
    pub fn runtimes(&self) -> Vec<Arc<dyn Runtime>> {
        let mut out: Vec<Arc<dyn Runtime>> = Vec::new();
        for m in self.models.values() {
            if !out.iter().any(|r| Arc::ptr_eq(r, &m.runtime)) {
                out.push(m.runtime.clone());
            }
        }
        out
    }

    pub fn resolve(&self, name: &str) -> Option<(Arc<dyn Runtime>, &str)> {
        self.models.get(name).map(|m| (m.runtime.clone(), m.native_name.as_str()))
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.models.keys().map(String::as_str)
    }

    pub fn infos(&self) -> impl Iterator<Item = (&str, &ModelInfo)> {
        self.models.iter().map(|(k, m)| (k.as_str(), &m.info))
    }
}
