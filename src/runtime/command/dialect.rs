//! What the agent's lines mean in each dialect (the gateway's NDJSON, Claude Code's
//! `stream-json`), and the lines and arguments the gateway gives it.

use serde_json::{Value, json};

use super::MAX_SESSION_ID;
use super::agent::StartedFor;
use crate::config::Dialect;
use crate::runtime::DEFAULT_REASONING_EFFORT;
use crate::runtime::claude::{ClaudeMapper, Mapped};
use crate::runtime::{RawEvent, TurnRequest};
use crate::wire::{ErrorCode, OutputStream};

/// The line that gives the agent a turn.
pub(super) fn user_line(dialect: Dialect, req: &TurnRequest) -> String {
    let value = match dialect {
        Dialect::Ndjson => json!({
            "type": "user",
            "turnId": req.turn_id,
            "text": req.prompt,
            "model": req.model,
            "sessionId": req.session_id,
            "cwd": req.cwd,
            "reasoningEffort": req.reasoning_effort.as_deref().unwrap_or(DEFAULT_REASONING_EFFORT),
        }),
        Dialect::ClaudeStreamJson => json!({
            "type": "user",
            "message": {"role": "user", "content": [{"type": "text", "text": req.prompt}]},
            "uuid": uuid::Uuid::new_v4().to_string(),
        }),
    };
    value.to_string() + "\n"
}

/// The line that interrupts the agent's turn.
pub(super) fn interrupt_line(dialect: Dialect) -> String {
    let value = match dialect {
        Dialect::Ndjson => json!({"type": "interrupt"}),
        Dialect::ClaudeStreamJson => json!({
            "type": "control_request",
            "request_id": uuid::Uuid::new_v4().to_string(),
            "request": {"subtype": "interrupt"},
        }),
    };
    value.to_string() + "\n"
}

/// Maps agent lines to raw events, keeping what a dialect needs across lines.
pub enum Mapper {
    Ndjson,
    Claude(ClaudeMapper),
}

impl Mapper {
    pub fn new(dialect: Dialect, unattended: bool) -> Mapper {
        match dialect {
            Dialect::Ndjson => Mapper::Ndjson,
            Dialect::ClaudeStreamJson => Mapper::Claude(ClaudeMapper::new(unattended)),
        }
    }

    /// The raw events one line stands for (used directly by tests of recorded transcripts).
    pub fn events(&mut self, line: &Value) -> Vec<RawEvent> {
        self.map(line).events
    }

    pub(super) fn map(&mut self, v: &Value) -> Mapped {
        match self {
            Mapper::Ndjson => Mapped { events: ndjson_event(v).into_iter().collect(), replies: Vec::new() },
            Mapper::Claude(claude) => claude.map(v),
        }
    }
}

/// Whether a turn the agent started itself is still open after `line`: its `result` closes
/// it, any other line of a turn opens it.
pub(super) fn foreign_turn_line(line: &str, open: bool) -> bool {
    let kind =
        serde_json::from_str::<Value>(line).ok().and_then(|v| v.get("type").and_then(Value::as_str).map(str::to_owned));
    match kind.as_deref() {
        Some("result") => false,
        Some("assistant" | "user" | "stream_event") => true,
        _ => open,
    }
}

/// The gateway's own dialect: one raw event per line (unknown types are skipped).
fn ndjson_event(v: &Value) -> Option<RawEvent> {
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    Some(match v.get("type")?.as_str()? {
        "step_start" => RawEvent::StepStart,
        "text" => RawEvent::TextDelta(s("delta")?),
        "reasoning" => RawEvent::ReasoningDelta(s("delta")?),
        "tool_call" => {
            RawEvent::ToolCall { id: s("id")?, name: s("name")?, input: v.get("input").cloned().unwrap_or(Value::Null) }
        }
        "tool_output" => RawEvent::ToolOutput {
            id: s("id")?,
            data: s("data")?,
            stream: if s("stream").as_deref() == Some("stderr") { OutputStream::Stderr } else { OutputStream::Stdout },
        },
        "tool_result" => RawEvent::ToolResult {
            id: s("id")?,
            name: s("name").unwrap_or_default(),
            content: s("content").unwrap_or_default(),
            is_error: v.get("isError").and_then(Value::as_bool).unwrap_or(false),
            duration_ms: v.get("durationMs").and_then(Value::as_u64),
        },
        "usage" => RawEvent::Usage(serde_json::from_value(v.get("usage")?.clone()).ok()?),
        "step_end" => RawEvent::StepEnd,
        "done" => RawEvent::Finish { reason: s("reason").unwrap_or_else(|| "stop".into()) },
        "error" => RawEvent::Error {
            message: s("message").unwrap_or_else(|| "the agent failed".into()),
            code: s("code").map(|c| ErrorCode::parse(&c)),
        },
        "session" => RawEvent::SessionId(s("id")?),
        _ => return None,
    })
}

/// Whether a session id an agent reported can be given back to a process (an argument, an
/// environment variable): not empty, at most `MAX_SESSION_ID` bytes, no control character
/// (a NUL would fail every start of the conversation's processes, a long one the system's
/// limit on an argument).
pub(super) fn usable_session(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_SESSION_ID && !id.chars().any(char::is_control)
}

/// The arguments the gateway adds for Claude Code's stream-json mode. Permission requests come
/// over stdio only with `--permission-prompt-tool stdio` (else `unattended` would have nothing
/// to answer); the session is resumed as one argument (`--resume=<id>`), so an id that starts
/// with a dash is not read as a flag. The effort is passed only when the conversation has one
/// (else Claude Code's default), so a CLI older than `--effort` still starts.
pub(super) fn claude_args(started_for: &StartedFor, session: Option<&str>, unattended: bool) -> Vec<String> {
    // Partial messages: the CLI streams tokens (`stream_event` lines) instead of whole blocks.
    let mut args: Vec<String> = [
        "--print",
        "--input-format",
        "stream-json",
        "--output-format",
        "stream-json",
        "--verbose",
        "--include-partial-messages",
        "--model",
        &started_for.model,
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    if let Some(effort) = &started_for.effort {
        args.extend(["--effort".to_owned(), effort.clone()]);
    }
    if unattended {
        args.extend(["--permission-prompt-tool".to_owned(), "stdio".to_owned()]);
    }
    if let Some(session) = session {
        args.push(format!("--resume={session}"));
    }
    args
}
