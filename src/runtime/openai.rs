//! The `openai` runtime: any OpenAI-compatible Chat Completions endpoint with streaming.
//!
//! One turn is one request (one step): the conversation rebuilt from the log goes up with
//! `stream: true` and usage included; `delta.content` comes back as text,
//! `delta.reasoning_content` / `delta.reasoning` as reasoning, tool calls as tool calls, the
//! usage chunk as usage, `finish_reason` as `done.reason`. Cancelling drops the request, which
//! closes its connection at once.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use super::{EventSink, HistoryChunk, RawEvent, Runtime, RuntimeError, RuntimeFuture, TurnRequest};
use crate::wire::{Chunk, Role, Usage};

#[derive(Debug, Clone)]
pub struct OpenAiSettings {
    /// Up to and excluding `/chat/completions`, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    /// The key itself, read from the configured environment variable at start.
    pub api_key: Option<String>,
    pub headers: Vec<(String, String)>,
    pub connect_timeout: Duration,
    /// A stream that sends nothing for this long fails.
    pub idle_timeout: Duration,
    pub system_prompt: Option<String>,
}

pub struct OpenAiRuntime {
    client: reqwest::Client,
    settings: OpenAiSettings,
}

impl OpenAiRuntime {
    pub fn new(settings: OpenAiSettings) -> Result<OpenAiRuntime, String> {
        let client = reqwest::Client::builder()
            .connect_timeout(settings.connect_timeout)
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        for (name, value) in &settings.headers {
            reqwest::header::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("bad header name {name:?}"))?;
            reqwest::header::HeaderValue::from_str(value).map_err(|_| format!("bad value for header {name:?}"))?;
        }
        Ok(OpenAiRuntime { client, settings })
    }
}

/// The conversation as Chat Completions messages: a message per log message; thinking and
/// errors stay home; each tool result is a `tool` message. A tool call no result answered is
/// left out, since the API rejects a call without its result.
pub fn messages(history: &[HistoryChunk], system_prompt: Option<&str>) -> Vec<Value> {
    let answered: std::collections::HashSet<&str> = history
        .iter()
        .filter_map(|c| match &c.chunk {
            Chunk::ToolResult(r) => Some(r.tool_call_id.as_str()),
            _ => None,
        })
        .collect();
    let mut out = Vec::new();
    if let Some(system) = system_prompt {
        out.push(json!({"role": "system", "content": system}));
    }
    let mut i = 0;
    while i < history.len() {
        let id = history[i].message_id;
        let role = history[i].role;
        let group: Vec<&HistoryChunk> = history[i..].iter().take_while(|c| c.message_id == id).collect();
        i += group.len();
        let text: String = group
            .iter()
            .filter_map(|c| match &c.chunk {
                Chunk::Text(t) => Some(t.text.as_str()),
                Chunk::System(s) => Some(s.text.as_str()),
                _ => None,
            })
            .collect();
        match role {
            Role::User | Role::System => {
                if !text.is_empty() {
                    out.push(json!({"role": role.as_str(), "content": text}));
                }
            }
            Role::Assistant => {
                let calls: Vec<Value> = group
                    .iter()
                    .filter_map(|c| match &c.chunk {
                        Chunk::ToolCall(call) if answered.contains(call.tool_call_id.as_str()) => Some(json!({
                            "id": call.tool_call_id,
                            "type": "function",
                            "function": {"name": call.tool_name, "arguments": call.input.to_string()},
                        })),
                        _ => None,
                    })
                    .collect();
                if text.is_empty() && calls.is_empty() {
                    continue;
                }
                let mut message =
                    json!({"role": "assistant", "content": if text.is_empty() { Value::Null } else { json!(text) }});
                if !calls.is_empty() {
                    message["tool_calls"] = Value::Array(calls);
                }
                out.push(message);
            }
            Role::Tool => {
                for c in group {
                    if let Chunk::ToolResult(r) = &c.chunk {
                        out.push(json!({"role": "tool", "tool_call_id": r.tool_call_id, "content": r.content}));
                    }
                }
            }
        }
    }
    out
}

/// `finish_reason` in the wire's words.
fn reason(finish: &str) -> String {
    match finish {
        "tool_calls" | "function_call" => "tool-calls".to_owned(),
        "content_filter" => "content-filter".to_owned(),
        other => other.to_owned(),
    }
}

fn usage(u: &Value) -> Option<Usage> {
    let input = u.get("prompt_tokens")?.as_u64()?;
    let output = u.get("completion_tokens").and_then(Value::as_u64).unwrap_or(0);
    let cached = u.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64);
    Some(Usage { input_tokens: input, output_tokens: output, cache_read_tokens: cached, cache_write_tokens: None })
}

/// A tool call being streamed in pieces, by its index.
#[derive(Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

/// What one streamed turn has gathered.
#[derive(Default)]
struct Gathered {
    content: bool,
    calls: BTreeMap<u64, PartialCall>,
    finish: Option<String>,
    usage: Option<Usage>,
}

impl Gathered {
    /// Maps one `data:` chunk, sending what it carries.
    async fn chunk(&mut self, sink: &EventSink, data: &Value) -> Result<(), RuntimeError> {
        if let Some(error) = data.get("error") {
            let message = error.get("message").and_then(Value::as_str).unwrap_or("the upstream reported an error");
            return Err(RuntimeError::turn(message, "upstream"));
        }
        if let Some(u) = data.get("usage").and_then(usage) {
            self.usage = Some(u);
        }
        let Some(choice) = data.get("choices").and_then(|c| c.get(0)) else { return Ok(()) };
        let delta = choice.get("delta").cloned().unwrap_or(Value::Null);
        let send =
            |event| async { sink.send(event).await.map_err(|_| RuntimeError::turn("the turn went away", "runtime")) };
        for key in ["reasoning_content", "reasoning"] {
            if let Some(text) = delta.get(key).and_then(Value::as_str).filter(|t| !t.is_empty()) {
                self.content = true;
                send(RawEvent::ReasoningDelta(text.to_owned())).await?;
            }
        }
        if let Some(text) = delta.get("content").and_then(Value::as_str).filter(|t| !t.is_empty()) {
            self.content = true;
            send(RawEvent::TextDelta(text.to_owned())).await?;
        }
        for call in delta.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
            self.content = true;
            let index = call.get("index").and_then(Value::as_u64).unwrap_or(0);
            let partial = self.calls.entry(index).or_default();
            if let Some(id) = call.get("id").and_then(Value::as_str) {
                partial.id = id.to_owned();
            }
            if let Some(name) = call.pointer("/function/name").and_then(Value::as_str) {
                partial.name.push_str(name);
            }
            if let Some(args) = call.pointer("/function/arguments").and_then(Value::as_str) {
                partial.arguments.push_str(args);
            }
        }
        if let Some(finish) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish = Some(reason(finish));
        }
        Ok(())
    }

    /// Ends the step: tool calls, usage, the step's end, the finish.
    async fn finish(self, sink: &EventSink) -> Result<(), RuntimeError> {
        let mut events = Vec::new();
        for (index, call) in self.calls {
            let input = serde_json::from_str(&call.arguments).unwrap_or(Value::String(call.arguments));
            let id = if call.id.is_empty() { format!("call_{index}") } else { call.id };
            events.push(RawEvent::ToolCall { id, name: call.name, input });
        }
        if let Some(u) = self.usage {
            events.push(RawEvent::Usage(u));
        }
        events.push(RawEvent::StepEnd);
        events.push(RawEvent::Finish { reason: self.finish.unwrap_or_else(|| "stop".to_owned()) });
        for e in events {
            sink.send(e).await.map_err(|_| RuntimeError::turn("the turn went away", "runtime"))?;
        }
        Ok(())
    }
}

impl OpenAiRuntime {
    fn request(&self, req: &TurnRequest) -> reqwest::RequestBuilder {
        let mut body = Map::new();
        body.insert("model".into(), json!(req.model));
        body.insert("messages".into(), Value::Array(messages(&req.history, self.settings.system_prompt.as_deref())));
        body.insert("stream".into(), json!(true));
        body.insert("stream_options".into(), json!({"include_usage": true}));
        if let Some(effort) = &req.reasoning_effort {
            body.insert("reasoning_effort".into(), json!(effort));
        }
        let url = format!("{}/chat/completions", self.settings.base_url.trim_end_matches('/'));
        let mut request = self.client.post(url).json(&Value::Object(body));
        if let Some(key) = &self.settings.api_key {
            request = request.bearer_auth(key);
        }
        for (name, value) in &self.settings.headers {
            request = request.header(name, value);
        }
        request
    }

    async fn turn(&self, req: TurnRequest, sink: EventSink) -> Result<(), RuntimeError> {
        let idle = self.settings.idle_timeout;
        sink.send(RawEvent::StepStart).await.map_err(|_| RuntimeError::turn("the turn went away", "runtime"))?;
        let response = match tokio::time::timeout(idle, self.request(&req).send()).await {
            Err(_) => return Err(RuntimeError::Failed("the upstream did not answer in time".into())),
            Ok(Err(e)) if e.is_connect() || e.is_timeout() => {
                return Err(RuntimeError::Failed(format!("cannot reach the upstream: {e}")));
            }
            // The request may have been sent before the failure: it may have been taken.
            Ok(Err(e)) => return Err(RuntimeError::Ambiguous(format!("the upstream request failed: {e}"))),
            Ok(Ok(r)) => r,
        };
        let status = response.status();
        if !status.is_success() {
            let body = response.text().await.unwrap_or_default();
            let detail: String = body.chars().take(300).collect();
            let message = format!("the upstream answered {status}: {detail}");
            return Err(if status.as_u16() == 429 || status.is_server_error() {
                RuntimeError::Failed(message)
            } else {
                RuntimeError::turn(message, "upstream")
            });
        }
        let mut gathered = Gathered::default();
        let mut body = response.bytes_stream();
        let mut buffer: Vec<u8> = Vec::new();
        // Before any content a broken stream is as good as never accepted.
        let broken = |gathered: &Gathered, message: String| {
            if gathered.content { RuntimeError::turn(message, "upstream") } else { RuntimeError::Failed(message) }
        };
        loop {
            let next = match tokio::time::timeout(idle, body.next()).await {
                Err(_) => return Err(broken(&gathered, format!("the upstream sent nothing for {}s", idle.as_secs()))),
                Ok(next) => next,
            };
            match next {
                None => break,
                Some(Err(e)) => return Err(broken(&gathered, format!("the upstream stream broke: {e}"))),
                Some(Ok(bytes)) => buffer.extend_from_slice(&bytes),
            }
            while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buffer.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim_end().strip_prefix("data:") else { continue };
                let data = data.trim_start();
                if data == "[DONE]" {
                    return gathered.finish(&sink).await;
                }
                match serde_json::from_str::<Value>(data) {
                    Ok(value) => gathered.chunk(&sink, &value).await?,
                    Err(e) => {
                        return Err(RuntimeError::turn(
                            format!("the upstream sent a line that is not JSON: {e}"),
                            "upstream",
                        ));
                    }
                }
            }
        }
        if gathered.finish.is_some() {
            // Some servers close without `[DONE]` after the last chunk.
            return gathered.finish(&sink).await;
        }
        Err(broken(&gathered, "the upstream stream ended before the turn finished".into()))
    }
}

impl Runtime for OpenAiRuntime {
    fn run_turn(&self, request: TurnRequest, sink: EventSink, cancel: CancellationToken) -> RuntimeFuture {
        let runtime = OpenAiRuntime { client: self.client.clone(), settings: self.settings.clone() };
        Box::pin(async move {
            tokio::select! {
                result = runtime.turn(request, sink) => result,
                // Dropping the request future closes its connection now, not at the next chunk.
                _ = cancel.cancelled() => Ok(()),
            }
        })
    }

    fn needs_history(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{TextChunk, ThinkingChunk, ToolCallChunk, ToolResultChunk};

    fn chunk(message_id: i64, role: Role, chunk: Chunk) -> HistoryChunk {
        HistoryChunk { message_id, role, chunk }
    }

    #[test]
    fn answered_tool_calls_and_their_results_go_up_thinking_stays_home() {
        let history = vec![
            chunk(1, Role::User, Chunk::Text(TextChunk { text: "find it".into() })),
            chunk(2, Role::Assistant, Chunk::Thinking(ThinkingChunk { text: "hmm".into() })),
            chunk(2, Role::Assistant, Chunk::Text(TextChunk { text: "Looking".into() })),
            chunk(
                2,
                Role::Assistant,
                Chunk::ToolCall(ToolCallChunk {
                    tool_call_id: "c1".into(),
                    tool_name: "find".into(),
                    input: json!({"q": 1}),
                    step_id: None,
                }),
            ),
            chunk(
                3,
                Role::Tool,
                Chunk::ToolResult(ToolResultChunk {
                    tool_call_id: "c1".into(),
                    tool_name: "find".into(),
                    content: "here".into(),
                    is_error: false,
                    step_id: None,
                }),
            ),
            chunk(4, Role::Assistant, Chunk::Text(TextChunk { text: "Found".into() })),
        ];
        assert_eq!(
            messages(&history, Some("be brief")),
            vec![
                json!({"role": "system", "content": "be brief"}),
                json!({"role": "user", "content": "find it"}),
                json!({"role": "assistant", "content": "Looking", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "find", "arguments": "{\"q\":1}"}}
                ]}),
                json!({"role": "tool", "tool_call_id": "c1", "content": "here"}),
                json!({"role": "assistant", "content": "Found"}),
            ]
        );
    }
}
