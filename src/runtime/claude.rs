//! Claude Code's stream-json output as raw events (as the real CLI behaves).
//!
//! - One model call (one `message.id`) is one step, however many `assistant` lines it takes
//!   (the CLI writes one per content block, each repeating the usage snapshot of the
//!   message's start).
//! - With `--include-partial-messages` the CLI writes `stream_event` lines: text and thinking
//!   deltas stream from them, the step's usage comes from `message_start` and `message_delta`,
//!   and the `assistant` lines' text and thinking (the same, whole) are not sent again. Without
//!   them, each text or thinking block is one delta and the step's usage is the last snapshot,
//!   never their sum. Tool calls come from the `assistant` lines (their input whole).
//! - `inputTokens` counts cache reads and writes too (Anthropic's `input_tokens` leaves them
//!   out), so `contextSize` is the whole context; the cache counts are kept apart as well.
//! - Lines of subagents (`parent_tool_use_id` or `agent_id` set) are left out of the turn: the
//!   tool that ran the subagent reports its result like any tool.
//! - A `result` ends the turn. One of a turn the CLI started itself (`origin.kind` other than
//!   the user's, such as `task-notification`) is not the user's answer: it is skipped.
//! - A failed `result`: the reason from its `errors` (else its `result` text), with the API
//!   status when there is one.

use std::collections::HashMap;

use serde_json::{Value, json};

use super::RawEvent;
use crate::wire::{ErrorCode, Usage};

/// What one line of the CLI becomes: events, and lines to write back.
#[derive(Default)]
pub struct Mapped {
    pub events: Vec<RawEvent>,
    /// Answers to the CLI's own control requests.
    pub replies: Vec<Value>,
}

#[derive(Default)]
pub struct ClaudeMapper {
    unattended: bool,
    /// Tool names by call id (results name the call only).
    tools: HashMap<String, String>,
    /// The open step's message id.
    message: Option<String>,
    /// The open step streamed its text and thinking through `stream_event`s.
    streamed: bool,
    /// The open step's usage so far (replaced by each report, never summed).
    usage: Option<Usage>,
}

fn str_of(v: &Value, k: &str) -> Option<String> {
    v.get(k).and_then(Value::as_str).map(str::to_owned)
}

impl ClaudeMapper {
    pub fn new(unattended: bool) -> ClaudeMapper {
        ClaudeMapper { unattended, ..ClaudeMapper::default() }
    }

    /// Whether a line belongs to a subagent, not to the user's turn.
    fn subagent(v: &Value) -> bool {
        v.get("parent_tool_use_id").is_some_and(|p| !p.is_null()) || v.get("agent_id").is_some_and(|a| !a.is_null())
    }

    /// Whether a `result` answers a turn the CLI started itself.
    pub fn self_started(v: &Value) -> bool {
        v.pointer("/origin/kind").and_then(Value::as_str).is_some_and(|kind| kind != "user")
    }

    /// Opens the step of `message_id` (closing another open one).
    fn step(&mut self, message_id: Option<String>, out: &mut Vec<RawEvent>) {
        if self.message.is_some() && self.message == message_id {
            return;
        }
        self.close(out);
        self.message = Some(message_id.unwrap_or_default());
        out.push(RawEvent::StepStart);
    }

    /// Closes the open step: its usage, then its end.
    fn close(&mut self, out: &mut Vec<RawEvent>) {
        if self.message.take().is_none() {
            return;
        }
        if let Some(usage) = self.usage.take() {
            out.push(RawEvent::Usage(usage));
        }
        self.streamed = false;
        out.push(RawEvent::StepEnd);
    }

    pub fn map(&mut self, v: &Value) -> Mapped {
        let mut out = Mapped::default();
        if Self::subagent(v) {
            return out;
        }
        match v.get("type").and_then(Value::as_str) {
            Some("system") if v.get("subtype").and_then(Value::as_str) == Some("init") => {
                if let Some(id) = str_of(v, "session_id") {
                    out.events.push(RawEvent::SessionId(id));
                }
            }
            Some("stream_event") => self.stream_event(v.get("event").unwrap_or(&Value::Null), &mut out.events),
            Some("assistant") => {
                let message = v.get("message").cloned().unwrap_or(Value::Null);
                // A line the CLI makes up itself (an API error's text) has no id of a model call.
                self.step(str_of(&message, "id"), &mut out.events);
                for block in message.get("content").and_then(Value::as_array).into_iter().flatten() {
                    match block.get("type").and_then(Value::as_str) {
                        Some("text") if !self.streamed => {
                            if let Some(t) = str_of(block, "text").filter(|t| !t.is_empty()) {
                                out.events.push(RawEvent::TextDelta(t));
                            }
                        }
                        Some("thinking") if !self.streamed => {
                            if let Some(t) = str_of(block, "thinking").filter(|t| !t.is_empty()) {
                                out.events.push(RawEvent::ReasoningDelta(t));
                            }
                        }
                        Some("tool_use") => {
                            let id = str_of(block, "id").unwrap_or_default();
                            let name = str_of(block, "name").unwrap_or_default();
                            self.tools.insert(id.clone(), name.clone());
                            let input = block.get("input").cloned().unwrap_or(Value::Null);
                            out.events.push(RawEvent::ToolCall { id, name, input });
                        }
                        _ => {}
                    }
                }
                if !self.streamed
                    && let Some(u) = message.get("usage").and_then(usage)
                {
                    self.usage = Some(u);
                }
            }
            Some("user") => {
                let content = v.pointer("/message/content").and_then(Value::as_array);
                for block in content.into_iter().flatten() {
                    if block.get("type").and_then(Value::as_str) != Some("tool_result") {
                        continue;
                    }
                    // Tool results follow their step's end.
                    self.close(&mut out.events);
                    let id = str_of(block, "tool_use_id").unwrap_or_default();
                    let name = self.tools.get(&id).cloned().unwrap_or_default();
                    let content = match block.get("content") {
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(parts)) => parts
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Value::as_str))
                            .collect::<Vec<_>>()
                            .join(""),
                        Some(other) => other.to_string(),
                        None => String::new(),
                    };
                    let is_error = block.get("is_error").and_then(Value::as_bool).unwrap_or(false);
                    out.events.push(RawEvent::ToolResult { id, name, content, is_error, duration_ms: None });
                }
            }
            Some("result") if Self::self_started(v) => {
                let origin = v.pointer("/origin/kind").and_then(Value::as_str).unwrap_or_default();
                tracing::info!(origin, "skipped the result of a turn the agent started itself");
            }
            Some("result") => {
                if let Some(id) = str_of(v, "session_id") {
                    out.events.push(RawEvent::SessionId(id));
                }
                self.close(&mut out.events);
                out.events.push(terminal(v));
            }
            Some("control_request") => {
                let request_id = str_of(v, "request_id").unwrap_or_default();
                let request = v.get("request").cloned().unwrap_or(Value::Null);
                if request.get("subtype").and_then(Value::as_str) == Some("can_use_tool") {
                    let response = if self.unattended {
                        json!({"behavior": "allow", "updatedInput": request.get("input").cloned().unwrap_or(json!({}))})
                    } else {
                        json!({"behavior": "deny", "message": "tool use needs an operator; this gateway runs unattended only when configured to"})
                    };
                    out.replies.push(json!({"type": "control_response", "response": {"subtype": "success", "request_id": request_id, "response": response}}));
                }
            }
            _ => {}
        }
        out
    }

    fn stream_event(&mut self, event: &Value, out: &mut Vec<RawEvent>) {
        match event.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                let message = event.get("message").unwrap_or(&Value::Null);
                self.step(str_of(message, "id"), out);
                self.streamed = true;
                self.usage = message.get("usage").and_then(usage);
            }
            Some("content_block_delta") => {
                let delta = event.get("delta").unwrap_or(&Value::Null);
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => {
                        if let Some(t) = str_of(delta, "text").filter(|t| !t.is_empty()) {
                            out.push(RawEvent::TextDelta(t));
                        }
                    }
                    Some("thinking_delta") => {
                        if let Some(t) = str_of(delta, "thinking").filter(|t| !t.is_empty()) {
                            out.push(RawEvent::ReasoningDelta(t));
                        }
                    }
                    // Tool input streams as JSON pieces; the `assistant` line has it whole.
                    _ => {}
                }
            }
            Some("message_delta") => {
                // The output so far, counted by the API; the input is the start's.
                if let (Some(current), Some(output)) =
                    (self.usage.as_mut(), event.pointer("/usage/output_tokens").and_then(Value::as_u64))
                {
                    current.output_tokens = output;
                }
            }
            _ => {}
        }
    }
}

/// The terminal a `result` stands for.
fn terminal(v: &Value) -> RawEvent {
    let subtype = str_of(v, "subtype").unwrap_or_default();
    let is_error = v.get("is_error").and_then(Value::as_bool).unwrap_or(false);
    if str_of(v, "terminal_reason").is_some_and(|t| t.starts_with("aborted")) {
        return RawEvent::Finish { reason: "aborted".into() };
    }
    if !is_error && subtype == "success" {
        return RawEvent::Finish { reason: "stop".into() };
    }
    let errors: Vec<String> = v
        .get("errors")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            e.as_str().map(str::to_owned).or_else(|| e.get("message").and_then(Value::as_str).map(str::to_owned))
        })
        .collect();
    let reason =
        if errors.is_empty() { str_of(v, "result").filter(|r| !r.is_empty()) } else { Some(errors.join("; ")) };
    let status = v.get("api_error_status").and_then(Value::as_u64);
    let mut message = reason.unwrap_or_else(|| format!("the agent failed: {subtype}"));
    // Claude Code finds a session only under the folder it was started in, on the machine
    // it ran on (a cluster's gateways may not share it: docs/cluster.md).
    if message.starts_with("No conversation found with session ID") {
        message.push_str(
            " (Claude Code keeps a session under the folder it started in, on its machine: if the conversation's \
             cwd changed, set it back; or forget the session (DELETE /conversations/:id/session) to go on in a new one)",
        );
    }
    if let Some(status) = status
        && !message.contains(&status.to_string())
    {
        message = format!("{message} (API status {status})");
    }
    let code = match (status, subtype.as_str()) {
        (Some(_), _) => ErrorCode::Upstream,
        (None, "" | "success") => ErrorCode::Agent,
        (None, other) => ErrorCode::parse(other),
    };
    RawEvent::Error { message, code: Some(code) }
}

/// Anthropic usage as the wire's: input counts the cache reads and writes too.
fn usage(u: &Value) -> Option<Usage> {
    let n = |k: &str| u.get(k).and_then(Value::as_u64);
    let (read, write) = (n("cache_read_input_tokens"), n("cache_creation_input_tokens"));
    Some(Usage {
        input_tokens: n("input_tokens")? + read.unwrap_or(0) + write.unwrap_or(0),
        output_tokens: n("output_tokens").unwrap_or(0),
        cache_read_tokens: read,
        cache_write_tokens: write,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map_all(lines: &[Value]) -> Vec<RawEvent> {
        let mut mapper = ClaudeMapper::new(false);
        lines.iter().flat_map(|l| mapper.map(l).events).collect()
    }

    fn usage_of(events: &[RawEvent]) -> Vec<Usage> {
        events.iter().filter_map(|e| if let RawEvent::Usage(u) = e { Some(*u) } else { None }).collect()
    }

    #[test]
    fn a_session_not_found_says_it_lives_under_its_folder() {
        let line = json!({"type": "result", "subtype": "error_during_execution", "is_error": true,
            "errors": ["No conversation found with session ID: s-1"]});
        let RawEvent::Error { message, code } = terminal(&line) else { panic!("an error") };
        assert_eq!(code.as_ref().map(ErrorCode::as_str), Some("error_during_execution"));
        assert!(message.starts_with("No conversation found with session ID: s-1 (Claude Code keeps"), "{message}");
        assert!(message.contains("DELETE /conversations/:id/session"), "the way on is named: {message}");
    }

    #[test]
    fn one_message_id_is_one_step_and_its_usage_is_not_summed() {
        let snapshot = json!({"input_tokens": 10, "output_tokens": 1, "cache_read_input_tokens": 100});
        let line = |content: Value| json!({"type": "assistant", "message": {"id": "msg_1", "content": [content], "usage": snapshot}});
        let events = map_all(&[
            line(json!({"type": "thinking", "thinking": "hmm"})),
            line(json!({"type": "text", "text": "hi"})),
            line(json!({"type": "tool_use", "id": "t1", "name": "ls", "input": {}})),
            json!({"type": "result", "subtype": "success", "is_error": false}),
        ]);
        assert_eq!(events.iter().filter(|e| matches!(e, RawEvent::StepStart)).count(), 1);
        assert_eq!(
            usage_of(&events),
            vec![Usage { input_tokens: 110, output_tokens: 1, cache_read_tokens: Some(100), cache_write_tokens: None }]
        );
    }

    #[test]
    fn subagent_lines_and_self_started_results_stay_out_of_the_turn() {
        let events = map_all(&[
            json!({"type": "assistant", "parent_tool_use_id": "t1", "message": {"id": "sub", "content": [{"type": "text", "text": "inner"}]}}),
            json!({"type": "result", "subtype": "success", "origin": {"kind": "task-notification"}}),
        ]);
        assert!(events.is_empty(), "{events:?}");
    }

    #[test]
    fn a_failed_result_says_why() {
        let events = map_all(&[
            json!({"type": "result", "subtype": "error_during_execution", "is_error": true, "errors": ["overloaded"], "api_error_status": 529}),
        ]);
        match &events[..] {
            [RawEvent::Error { message, code }] => {
                assert_eq!(message, "overloaded (API status 529)");
                assert_eq!(code, &Some(ErrorCode::Upstream));
            }
            other => panic!("{other:?}"),
        }
    }
}
