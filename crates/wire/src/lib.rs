//! The `@dispatch/wire` 0.6.0 types: what clients see, with serde only.
//!
//! Field names are camelCase, `type` tags are the seed's strings, and an absent optional is
//! omitted rather than sent as `null`. Nothing here knows about storage or transports.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Who produced a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "system" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            _ => return None,
        })
    }
}

/// Token counters of one step or one turn. Cache counters only when the runtime reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
}

impl Usage {
    /// Adds `other` into `self`; a cache counter stays absent until some report carries it.
    pub fn add(&mut self, other: &Usage) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cache_read_tokens = add_opt(self.cache_read_tokens, other.cache_read_tokens);
        self.cache_write_tokens = add_opt(self.cache_write_tokens, other.cache_write_tokens);
    }
}

fn add_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
    }
}

/// One ordered piece of a message: the unit of the append-only log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type")]
pub enum Chunk {
    #[serde(rename = "text")]
    Text(TextChunk),
    #[serde(rename = "thinking")]
    Thinking(ThinkingChunk),
    #[serde(rename = "tool-call")]
    ToolCall(ToolCallChunk),
    #[serde(rename = "tool-result")]
    ToolResult(ToolResultChunk),
    #[serde(rename = "error")]
    Error(ErrorChunk),
    #[serde(rename = "system")]
    System(SystemChunk),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TextChunk {
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ThinkingChunk {
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ToolCallChunk {
    pub tool_call_id: String,
    pub tool_name: String,
    pub input: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ToolResultChunk {
    pub tool_call_id: String,
    pub tool_name: String,
    pub content: String,
    pub is_error: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_id: Option<String>,
    /// The gateway's: how long the call ran, as the live `tool-result` said (absent where the
    /// runtime did not time it, and in logs written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// The gateway's: what the tool streamed as `tool-output` before its result, joined, while
    /// the turn's `--max-tool-result-bytes` of kept output last (absent when none was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ErrorChunk {
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub code: Option<ErrorCode>,
}

/// The `code` of an `error` event or chunk: one of the gateway's own (docs/wire-choices.md,
/// "Error codes"), or one a runtime reported, passed on as it came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorCode {
    /// The turn's gateway died or restarted; the next start, or another gateway, ended it.
    Interrupted,
    /// The turn's gateway lost its lease (paused past it): what it streamed since its last write
    /// is not in the history.
    Lease,
    /// The database refused a write, or the log could not be read for a stream.
    Storage,
    /// The turn ran past `--max-turn-secs`.
    Timeout,
    /// The runtime could not take the turn (after its retries).
    Unavailable,
    /// The runtime failed where the turn may have reached it: never retried.
    Ambiguous,
    /// An agent program broke its protocol (a line too long, not JSON, a second terminal).
    AgentProtocol,
    /// An agent program ended its turn with an error of its own.
    Agent,
    /// The conversation's agent process is busy with another turn.
    AgentBusy,
    /// The agent program could not be started.
    AgentSpawn,
    /// The agent program exited before its turn's end.
    AgentExit,
    /// The runtime itself failed (the turn went away under it, its history was missing).
    Runtime,
    /// An upstream model endpoint answered with an error, or its stream broke.
    Upstream,
    /// The upstream said the conversation is past its context window: the `openai` runtime's
    /// rebuilt history leaves such a turn's message out, so that it does not fail every later one.
    ContextLength,
    /// The upstream refused for its rate limit, and asked for a wait longer than a turn's.
    RateLimited,
    /// The agent loop reached its credential's `max_steps`.
    MaxSteps,
    /// The gateway shut down before the turn's end reached this stream.
    Shutdown,
    /// A WebSocket session fell too far behind a turn and was cut from it.
    Lagged,
    /// The stream's credential was taken back (a sign-out, a revoked key, a session or token
    /// past its expiry, a key withdrawn from the JWKS): the stream ends.
    Unauthorized,
    /// A code a runtime reported that is not one of the above.
    Other(String),
}

impl ErrorCode {
    /// The gateway's own codes.
    pub const OWN: [ErrorCode; 19] = [
        ErrorCode::Interrupted,
        ErrorCode::Lease,
        ErrorCode::Storage,
        ErrorCode::Timeout,
        ErrorCode::Unavailable,
        ErrorCode::Ambiguous,
        ErrorCode::AgentProtocol,
        ErrorCode::Agent,
        ErrorCode::AgentBusy,
        ErrorCode::AgentSpawn,
        ErrorCode::AgentExit,
        ErrorCode::Runtime,
        ErrorCode::Upstream,
        ErrorCode::ContextLength,
        ErrorCode::RateLimited,
        ErrorCode::MaxSteps,
        ErrorCode::Shutdown,
        ErrorCode::Lagged,
        ErrorCode::Unauthorized,
    ];

    /// The code as the wire spells it.
    pub fn as_str(&self) -> &str {
        match self {
            ErrorCode::Other(code) => code,
            own => own.label(),
        }
    }

    /// The code as a bounded label (metrics): the gateway's own as the wire spells them, and
    /// `other` for any other (a runtime's own codes are whatever its program prints).
    pub fn label(&self) -> &'static str {
        match self {
            ErrorCode::Interrupted => "interrupted",
            ErrorCode::Lease => "lease",
            ErrorCode::Storage => "storage",
            ErrorCode::Timeout => "timeout",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Ambiguous => "ambiguous",
            ErrorCode::AgentProtocol => "agent-protocol",
            ErrorCode::Agent => "agent",
            ErrorCode::AgentBusy => "agent-busy",
            ErrorCode::AgentSpawn => "agent-spawn",
            ErrorCode::AgentExit => "agent-exit",
            ErrorCode::Runtime => "runtime",
            ErrorCode::Upstream => "upstream",
            ErrorCode::ContextLength => "context_length",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::MaxSteps => "max-steps",
            ErrorCode::Shutdown => "shutdown",
            ErrorCode::Lagged => "lagged",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Other(_) => "other",
        }
    }

    /// A code as the wire spells it: one of the gateway's own, or another as it is.
    pub fn parse(code: &str) -> ErrorCode {
        Self::OWN.iter().find(|c| c.as_str() == code).cloned().unwrap_or_else(|| ErrorCode::Other(code.to_owned()))
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<ErrorCode, D::Error> {
        Ok(ErrorCode::parse(&String::deserialize(deserializer)?))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SystemChunk {
    pub text: String,
}

/// A persisted chunk with its sync cursor. Carries no turn id and no message id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct StoredChunk {
    pub seq: u64,
    pub role: Role,
    pub chunk: Chunk,
}

/// Durable metrics of one step: the persisted counterpart of `usage` + `step-complete`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct StepMetrics {
    pub step_id: String,
    pub usage: Usage,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gen_total_ms: Option<u64>,
    /// The gateway's: false when the runtime reported no usage for the step (a stopped
    /// stream, say), whose `usage` then holds zeros that measure nothing. Written only when
    /// false.
    #[serde(default = "reported", skip_serializing_if = "is_reported")]
    pub usage_reported: bool,
}

/// Durable metrics of one sealed turn: the persisted counterpart of `done`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnMetrics {
    pub turn_id: String,
    pub usage: Usage,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    pub steps: Vec<StepMetrics>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_size: Option<u64>,
    /// The gateway's: false when no step of the turn reported usage (`done` then carried
    /// none), so `usage` holds zeros that measure nothing. Written only when false.
    #[serde(default = "reported", skip_serializing_if = "is_reported")]
    pub usage_reported: bool,
    /// The gateway's, in `GET /conversations/:id/metrics`: why the turn ended (its
    /// `done.reason`; `error` for a turn a crash cut off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The gateway's, in `GET /conversations/:id/metrics`: the seq of the turn's user message,
    /// where it starts in the history (stored chunks carry no turn id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_seq: Option<u64>,
}

fn reported() -> bool {
    true
}

fn is_reported(reported: &bool) -> bool {
    *reported
}

/// Where a conversation is: a turn running (`active`), none (`idle`), or closed by `/close`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum ConversationStatus {
    Active,
    Idle,
    Closed,
}

impl ConversationStatus {
    pub const ALL: [ConversationStatus; 3] =
        [ConversationStatus::Active, ConversationStatus::Idle, ConversationStatus::Closed];

    pub fn as_str(self) -> &'static str {
        match self {
            ConversationStatus::Active => "active",
            ConversationStatus::Idle => "idle",
            ConversationStatus::Closed => "closed",
        }
    }

    /// The status a name spells (`active`, `idle`, `closed`).
    pub fn parse(name: &str) -> Option<ConversationStatus> {
        ConversationStatus::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

/// A conversation as listed and created over REST. Times are epoch milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ConversationMeta {
    pub id: String,
    pub created_at: i64,
    pub last_activity_at: i64,
    pub title: String,
    pub status: ConversationStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The subject that created it (docs/identity.md); absent for one created with auth off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The gateway's: why its newest ended turn ended (that turn's `done.reason`; `error` for
    /// one a crash cut off); absent before a turn ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reason: Option<String>,
}

/// Every event a turn emits outward, discriminated by `type`.
///
/// The gateway emits all of these but `status`, which the wire defines without a meaning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type")]
pub enum AgentEvent {
    #[serde(rename = "status")]
    Status(StatusEvent),
    #[serde(rename = "turn-start")]
    TurnStart(TurnStartEvent),
    #[serde(rename = "user-message")]
    UserMessage(TurnInputEvent),
    #[serde(rename = "text-delta")]
    TextDelta(TurnTextDeltaEvent),
    #[serde(rename = "reasoning-delta")]
    ReasoningDelta(TurnReasoningDeltaEvent),
    #[serde(rename = "tool-call")]
    ToolCall(TurnToolCallEvent),
    #[serde(rename = "tool-result")]
    ToolResult(TurnToolResultEvent),
    #[serde(rename = "tool-output")]
    ToolOutput(TurnToolOutputEvent),
    #[serde(rename = "usage")]
    Usage(TurnUsageEvent),
    #[serde(rename = "step-complete")]
    StepComplete(TurnStepCompleteEvent),
    #[serde(rename = "error")]
    Error(TurnErrorEvent),
    #[serde(rename = "done")]
    Done(TurnDoneEvent),
    #[serde(rename = "turn-sealed")]
    TurnSealed(TurnSealedEvent),
}

impl AgentEvent {
    /// The conversation and turn the event is of (a `status` event names no turn).
    pub fn ids(&self) -> (&str, Option<&str>) {
        match self {
            AgentEvent::Status(e) => (&e.conversation_id, None),
            AgentEvent::TurnStart(e) => (&e.conversation_id, Some(&e.turn_id)),
            AgentEvent::UserMessage(e) => (&e.conversation_id, Some(&e.turn_id)),
            AgentEvent::TextDelta(e) => (&e.conversation_id, Some(&e.turn_id)),
            AgentEvent::ReasoningDelta(e) => (&e.conversation_id, Some(&e.turn_id)),
            AgentEvent::ToolCall(e) => (&e.conversation_id, Some(&e.turn_id)),
            AgentEvent::ToolResult(e) => (&e.conversation_id, Some(&e.turn_id)),
            AgentEvent::ToolOutput(e) => (&e.conversation_id, Some(&e.turn_id)),
            AgentEvent::Usage(e) => (&e.conversation_id, Some(&e.turn_id)),
            AgentEvent::StepComplete(e) => (&e.conversation_id, Some(&e.turn_id)),
            AgentEvent::Error(e) => (&e.conversation_id, Some(&e.turn_id)),
            AgentEvent::Done(e) => (&e.conversation_id, Some(&e.turn_id)),
            AgentEvent::TurnSealed(e) => (&e.conversation_id, Some(&e.turn_id)),
        }
    }

    /// The seed's `type` string of this event.
    pub fn type_name(&self) -> &'static str {
        match self {
            AgentEvent::Status(_) => "status",
            AgentEvent::TurnStart(_) => "turn-start",
            AgentEvent::UserMessage(_) => "user-message",
            AgentEvent::TextDelta(_) => "text-delta",
            AgentEvent::ReasoningDelta(_) => "reasoning-delta",
            AgentEvent::ToolCall(_) => "tool-call",
            AgentEvent::ToolResult(_) => "tool-result",
            AgentEvent::ToolOutput(_) => "tool-output",
            AgentEvent::Usage(_) => "usage",
            AgentEvent::StepComplete(_) => "step-complete",
            AgentEvent::Error(_) => "error",
            AgentEvent::Done(_) => "done",
            AgentEvent::TurnSealed(_) => "turn-sealed",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct StatusEvent {
    pub conversation_id: String,
    pub status: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnStartEvent {
    pub conversation_id: String,
    pub turn_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnInputEvent {
    pub conversation_id: String,
    pub turn_id: String,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnTextDeltaEvent {
    pub conversation_id: String,
    pub turn_id: String,
    pub delta: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnReasoningDeltaEvent {
    pub conversation_id: String,
    pub turn_id: String,
    pub delta: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnToolCallEvent {
    pub conversation_id: String,
    pub turn_id: String,
    pub step_id: String,
    pub tool_call_id: String,
    pub tool_name: String,
    pub input: Value,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnToolResultEvent {
    pub conversation_id: String,
    pub turn_id: String,
    pub step_id: String,
    pub tool_call_id: String,
    pub tool_name: String,
    pub content: String,
    pub is_error: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
}

/// Which stream of a tool a `tool-output` event carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum OutputStream {
    Stdout,
    Stderr,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnToolOutputEvent {
    pub conversation_id: String,
    pub turn_id: String,
    pub tool_call_id: String,
    pub data: String,
    pub stream: OutputStream,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnUsageEvent {
    pub conversation_id: String,
    pub turn_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_id: Option<String>,
    pub usage: Usage,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnStepCompleteEvent {
    pub conversation_id: String,
    pub turn_id: String,
    pub step_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gen_total_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnErrorEvent {
    pub conversation_id: String,
    pub turn_id: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub code: Option<ErrorCode>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnDoneEvent {
    pub conversation_id: String,
    pub turn_id: String,
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_size: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnSealedEvent {
    pub conversation_id: String,
    pub turn_id: String,
}
