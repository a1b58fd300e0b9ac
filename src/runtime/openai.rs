//! The `openai` runtime: any OpenAI-compatible Chat Completions endpoint with streaming.
//!
//! One turn is one request (one step): the conversation rebuilt from the log (always a valid
//! Chat Completions conversation, trimmed to the context window when one is configured) goes
//! up with `stream: true`, usage asked for unless switched off, and the credential's (and the
//! model's) parameters; `delta.content` comes back as text, `delta.refusal` as text too,
//! `delta.reasoning_content` (else `delta.reasoning`) as reasoning, tool calls as tool calls,
//! the usage chunk as usage, `finish_reason` as `done.reason`. Cancelling drops the request,
//! which closes its connection at once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use http_body_util::{BodyExt, Full};
use serde_json::{Map, Value, json};
use sse_stream::SseByteStream;
use tokio_util::sync::CancellationToken;

use super::http_client::{HttpClient, describe};
use super::{EventSink, HistoryChunk, RawEvent, Runtime, RuntimeError, RuntimeFuture, TurnRequest};
use crate::config::RequestParams;
use crate::wire::{Chunk, Role, Usage};

/// The `code` of a turn the upstream refused because it does not fit the model's context;
/// the rebuilt history leaves such a turn's message out, so it does not fail every later one.
pub const CONTEXT_EXCEEDED: &str = "context_length";

/// The longest `Retry-After` a 429 may ask for and still be retried within the turn.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct OpenAiSettings {
    /// Up to and excluding `/chat/completions`, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    /// The key itself, read from the configured environment variable at start.
    pub api_key: Option<String>,
    pub headers: Vec<(String, String)>,
    pub connect_timeout: Duration,
    /// A stream that sends no byte for this long fails (a keep-alive comment is a byte: an
    /// upstream that holds a queued request open with comments is still there).
    pub idle_timeout: Duration,
    /// The most bytes an event may take (`--max-runtime-line-bytes`).
    pub max_event_bytes: usize,
    pub system_prompt: Option<String>,
    /// Tokens the models take; the oldest turns are left out so a request fits.
    pub context_window: Option<u64>,
    /// The credential's request parameters.
    pub params: RequestParams,
    /// Each model's, over the credential's.
    pub model_params: BTreeMap<String, RequestParams>,
}

/// What the event parser reads: the upstream's bytes, or why it stopped.
#[derive(Debug, thiserror::Error)]
enum Upstream {
    #[error(transparent)]
    Transport(hyper::Error),
    #[error("an event longer than {0} bytes")]
    TooLong(usize),
    #[error("nothing for {}s", .0.as_secs())]
    Idle(Duration),
}

#[derive(Clone)]
pub struct OpenAiRuntime {
    client: HttpClient,
    /// `base_url` + `/chat/completions`.
    endpoint: http::Uri,
    /// The credential's headers and its key, parsed once.
    headers: HeaderMap,
    settings: Arc<OpenAiSettings>,
}

impl OpenAiRuntime {
    pub fn new(settings: OpenAiSettings) -> Result<OpenAiRuntime, String> {
        let url = format!("{}/chat/completions", settings.base_url.trim_end_matches('/'));
        let endpoint: http::Uri =
            url.parse().map_err(|e| format!("base_url {:?} is not a URL: {e}", settings.base_url))?;
        if !matches!(endpoint.scheme_str(), Some("http" | "https")) || endpoint.host().is_none() {
            return Err(format!("base_url {:?} is not an http:// or https:// URL", settings.base_url));
        }
        let mut headers = HeaderMap::new();
        for (name, value) in &settings.headers {
            let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("bad header name {name:?}"))?;
            let value = HeaderValue::from_str(value).map_err(|_| format!("bad value for header {name:?}"))?;
            headers.append(name, value);
        }
        if let Some(key) = &settings.api_key {
            let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
                .map_err(|_| "the API key has characters a header cannot carry".to_owned())?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let client = HttpClient::new(&endpoint, settings.connect_timeout)?;
        Ok(OpenAiRuntime { client, endpoint, headers, settings: Arc::new(settings) })
    }
}

/// The conversation as Chat Completions messages, always one a strict chat template takes
/// (alternating user and assistant turns):
/// - a message per log message; thinking and error chunks stay home, and each tool result is
///   a `tool` message; a tool call no later result answered is left out (the API rejects it);
/// - an assistant message that had only reasoning is kept, with empty content;
/// - the message of a turn the upstream refused as too long for the context is left out;
/// - consecutive user messages (a turn that failed or was stopped before any answer, then the
///   next one) are merged into one, and so are consecutive assistant messages.
pub fn messages(history: &[HistoryChunk], system_prompt: Option<&str>) -> Vec<Value> {
    // A call is answered by the next result with its id that follows it, and a result answers
    // one call (ids may repeat across turns: an upstream that sends none gets `call_<index>`).
    let mut answered = vec![false; history.len()];
    let mut results = std::collections::HashSet::new();
    for (i, c) in history.iter().enumerate().rev() {
        match &c.chunk {
            Chunk::ToolResult(r) => {
                results.insert(r.tool_call_id.as_str());
            }
            Chunk::ToolCall(call) => answered[i] = results.remove(call.tool_call_id.as_str()),
            _ => {}
        }
    }
    let mut out: Vec<Value> = Vec::new();
    if let Some(system) = system_prompt {
        out.push(json!({"role": "system", "content": system}));
    }
    let mut i = 0;
    while i < history.len() {
        let id = history[i].message_id;
        let role = history[i].role;
        let start = i;
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
        let too_long =
            group.iter().any(|c| matches!(&c.chunk, Chunk::Error(e) if e.code.as_deref() == Some(CONTEXT_EXCEEDED)));
        if too_long {
            // The unanswered user message before it is what did not fit.
            if out.last().is_some_and(|m| m["role"] == "user") {
                out.pop();
            }
            continue;
        }
        match role {
            Role::User | Role::System => {
                if !text.is_empty() {
                    push_merged(&mut out, json!({"role": role.as_str(), "content": text}));
                }
            }
            Role::Assistant => {
                let calls: Vec<Value> = group
                    .iter()
                    .zip(&answered[start..])
                    .filter_map(|(c, answered)| match &c.chunk {
                        Chunk::ToolCall(call) if *answered => Some(json!({
                            "id": call.tool_call_id,
                            "type": "function",
                            "function": {"name": call.tool_name, "arguments": call.input.to_string()},
                        })),
                        _ => None,
                    })
                    .collect();
                let thought = group.iter().any(|c| matches!(c.chunk, Chunk::Thinking(_)));
                if text.is_empty() && calls.is_empty() && !thought {
                    continue;
                }
                let content = if text.is_empty() && !calls.is_empty() { Value::Null } else { json!(text) };
                let mut message = json!({"role": "assistant", "content": content});
                if !calls.is_empty() {
                    message["tool_calls"] = Value::Array(calls);
                }
                push_merged(&mut out, message);
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

/// Appends `message`, merged into the last one when both are user (or both assistant)
/// messages: their texts joined by a blank line, their tool calls in order.
fn push_merged(out: &mut Vec<Value>, message: Value) {
    let Some(last) = out.last_mut().filter(|l| l["role"] == message["role"] && l["role"] != "system") else {
        out.push(message);
        return;
    };
    let texts: Vec<&str> = [&last["content"], &message["content"]]
        .into_iter()
        .filter_map(Value::as_str)
        .filter(|t| !t.is_empty())
        .collect();
    let content = if texts.is_empty() && (last.get("tool_calls").is_some() || message.get("tool_calls").is_some()) {
        Value::Null
    } else {
        json!(texts.join("\n\n"))
    };
    let mut calls: Vec<Value> = last.get("tool_calls").and_then(Value::as_array).cloned().unwrap_or_default();
    calls.extend(message.get("tool_calls").and_then(Value::as_array).cloned().unwrap_or_default());
    last["content"] = content;
    if !calls.is_empty() {
        last["tool_calls"] = Value::Array(calls);
    }
}

/// A message's size in tokens, roughly: four bytes of text a token, and a few for the message.
fn estimated_tokens(message: &Value) -> u64 {
    let text =
        message["content"].as_str().map_or(0, str::len) + message.get("tool_calls").map_or(0, |c| c.to_string().len());
    (text as u64).div_ceil(4) + 4
}

/// Leaves out the oldest turns (a user message and what answered it) until the messages fit
/// `budget` tokens; never the `keep` first (the system prompt), nor the last user message (the
/// new one) and what follows it. Returns how many messages were left out.
fn trim_to_fit(messages: &mut Vec<Value>, keep: usize, budget: u64) -> usize {
    let first = keep.min(messages.len());
    let Some(newest) = messages.iter().rposition(|m| m["role"] == "user").filter(|n| *n >= first) else { return 0 };
    let mut total: u64 = messages.iter().map(estimated_tokens).sum();
    let mut end = first;
    // Whole turns from the oldest, while what remains is over budget.
    while total > budget && end < newest {
        let next_user =
            messages[end + 1..newest].iter().position(|m| m["role"] == "user").map_or(newest, |p| end + 1 + p);
        total -= messages[end..next_user].iter().map(estimated_tokens).sum::<u64>();
        end = next_user;
    }
    messages.drain(first..end);
    end - first
}

/// How many of the log's last chunks the first read for a trimmed request takes; each read
/// after it goes twice as far back.
const FIRST_TAIL: u64 = 64;

/// The request's messages from a log of `len` chunks that `read(from, to)` reads (seqs
/// `from..=to`): all of it without a `budget`; with one, the oldest turns left out until the
/// estimate fits, reading from the log's end only as far back as that needs. Once a read's
/// tail has a turn left out, nothing older could be kept (an older message only adds to every
/// longer tail), so the log before it is never read: docs/upstreams.md has the argument.
/// Also returns how many messages of the read tail were left out.
async fn fitting_messages<F, Fut, E>(
    len: u64,
    mut read: F,
    system_prompt: Option<&str>,
    budget: Option<u64>,
) -> Result<(Vec<Value>, usize), E>
where
    F: FnMut(u64, u64) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<HistoryChunk>, E>>,
{
    let keep = usize::from(system_prompt.is_some());
    let Some(budget) = budget else { return Ok((messages(&read(1, len).await?, system_prompt), 0)) };
    let (mut tail, mut from, mut page) = (Vec::new(), len + 1, FIRST_TAIL);
    loop {
        let start = from.saturating_sub(page).max(1);
        let mut older = read(start, from - 1).await?;
        older.append(&mut tail);
        (tail, from) = (older, start);
        let mut messages = messages(&tail, system_prompt);
        let left_out = trim_to_fit(&mut messages, keep, budget);
        if left_out > 0 || from == 1 {
            return Ok((messages, left_out));
        }
        page = page.saturating_mul(2);
    }
}

/// Whether an upstream's 400 says the request does not fit the model's context (OpenAI,
/// vLLM, llama.cpp and LiteLLM each word it their way).
fn context_exceeded(body: &str) -> bool {
    let body = body.to_ascii_lowercase();
    [
        "context_length_exceeded",
        "context length",
        "context size",
        "context window",
        "exceed_context",
        "contextwindowexceeded",
    ]
    .iter()
    .any(|needle| body.contains(needle))
}

/// A `Retry-After` in seconds (the HTTP-date form is rare on these APIs and taken as absent).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    value.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0).map(Duration::from_secs_f64)
}

/// An error response's body as text: at most `max` bytes of it, and what came before the
/// upstream went quiet for `idle`.
async fn error_body(mut body: hyper::body::Incoming, max: usize, idle: Duration) -> String {
    let mut bytes = Vec::new();
    while bytes.len() < max {
        match tokio::time::timeout(idle, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    bytes.extend_from_slice(&data[..data.len().min(max - bytes.len())]);
                }
            }
            _ => break,
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
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
    /// The estimated tokens of the request's messages, to calibrate by the usage.
    estimate: u64,
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
        // Servers that send both say the same thing twice: one is taken.
        let reasoning = ["reasoning_content", "reasoning"]
            .iter()
            .find_map(|key| delta.get(*key).and_then(Value::as_str).filter(|t| !t.is_empty()));
        if let Some(text) = reasoning {
            self.content = true;
            send(RawEvent::ReasoningDelta(text.to_owned())).await?;
        }
        // A refusal is what the model answered: the user reads it as the reply.
        for key in ["content", "refusal"] {
            if let Some(text) = delta.get(key).and_then(Value::as_str).filter(|t| !t.is_empty()) {
                self.content = true;
                send(RawEvent::TextDelta(text.to_owned())).await?;
            }
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
            // The request's own count: once older turns are left out, the last turn's
            // `contextSize` counts only what was kept, and calibrates nothing.
            if u.input_tokens > 0 && self.estimate > 0 {
                events.push(RawEvent::TokensPerEstimate(u.input_tokens as f64 / self.estimate as f64));
            }
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
    /// The request body: the rebuilt conversation, trimmed to the context window, and the
    /// model's parameters; and the estimated tokens of its messages.
    async fn body(&self, req: &TurnRequest) -> Result<(Value, u64), RuntimeError> {
        let params = match self.settings.model_params.get(&req.model) {
            Some(model) => self.settings.params.overlaid(model),
            None => self.settings.params.clone(),
        };
        let budget = self.settings.context_window.map(|window| {
            // Room for the answer: what `max_tokens` asks, else an eighth of the window.
            let reserve = params.max_tokens.unwrap_or(window / 8).min(window / 2);
            // The estimate scaled by what the upstream counted for the last request; bounded,
            // so one odd report cannot make the trimming keep everything or nothing.
            let ratio = req.tokens_per_estimate.filter(|r| r.is_finite()).map_or(1.0, |r| r.clamp(0.25, 8.0));
            ((window - reserve) as f64 / ratio) as u64
        });
        let history =
            req.history.as_ref().ok_or_else(|| RuntimeError::turn("the turn came without its history", "runtime"))?;
        let read = |from, to| history.range(from, to);
        let system_prompt = self.settings.system_prompt.as_deref();
        let (messages, left_out) = fitting_messages(history.len(), read, system_prompt, budget).await.map_err(|e| {
            RuntimeError::turn(format!("the conversation could not be read for the runtime: {e}"), "storage")
        })?;
        if left_out > 0 {
            tracing::info!(left_out, "left the oldest messages out of the request to fit the context window");
        }
        let estimate = messages.iter().map(estimated_tokens).sum();
        let mut body = Map::new();
        body.insert("model".into(), json!(req.model));
        body.insert("messages".into(), Value::Array(messages));
        body.insert("stream".into(), json!(true));
        if params.include_usage.unwrap_or(true) {
            body.insert("stream_options".into(), json!({"include_usage": true}));
        }
        if let Some(effort) = &req.reasoning_effort {
            body.insert("reasoning_effort".into(), json!(effort));
        }
        for (key, value) in [
            ("max_tokens", params.max_tokens.map(|v| json!(v))),
            ("temperature", params.temperature.map(|v| json!(v))),
            ("top_p", params.top_p.map(|v| json!(v))),
            ("stop", params.stop.as_ref().map(|v| json!(v))),
        ] {
            if let Some(value) = value {
                body.insert(key.into(), value);
            }
        }
        body.extend(params.extra_body.unwrap_or_default());
        Ok((Value::Object(body), estimate))
    }

    /// The request, and the estimated tokens of its messages.
    async fn request(&self, req: &TurnRequest) -> Result<(http::Request<Full<Bytes>>, u64), RuntimeError> {
        let (body, estimate) = self.body(req).await?;
        let body = Bytes::from(body.to_string());
        let mut request = http::Request::post(self.endpoint.clone()).body(Full::new(body)).expect("a parsed URI");
        *request.headers_mut() = self.headers.clone();
        Ok((request, estimate))
    }

    async fn turn(&self, req: TurnRequest, sink: EventSink) -> Result<(), RuntimeError> {
        let idle = self.settings.idle_timeout;
        sink.send(RawEvent::StepStart).await.map_err(|_| RuntimeError::turn("the turn went away", "runtime"))?;
        let (request, estimate) = self.request(&req).await?;
        let response = match tokio::time::timeout(idle, self.client.send(request)).await {
            // The request went out and no answer came: the upstream may be working on it.
            Err(_) => {
                return Err(RuntimeError::Ambiguous("the upstream took the request but did not answer in time".into()));
            }
            // Never connected (the connect timeout included): nothing reached the upstream.
            Ok(Err(e)) if e.is_connect() => {
                return Err(RuntimeError::Failed(format!("cannot reach the upstream: {}", describe(&e))));
            }
            // The request may have been sent before the failure: it may have been taken.
            Ok(Err(e)) => {
                return Err(RuntimeError::Ambiguous(format!("the upstream request failed: {}", describe(&e))));
            }
            Ok(Ok(r)) => r,
        };
        let status = response.status();
        if !status.is_success() {
            let wait = retry_after(response.headers());
            let moved = status.is_redirection().then(|| response.headers().get(http::header::LOCATION).cloned());
            let body = error_body(response.into_body(), self.settings.max_event_bytes, idle).await;
            let detail: String = body.chars().take(300).collect();
            let mut message = format!("the upstream answered {status}: {detail}");
            if let Some(location) = moved {
                let to = location.as_ref().and_then(|l| l.to_str().ok()).unwrap_or("nowhere it says");
                message = format!("{message} (redirects are not followed: base_url moved to {to}?)");
            }
            return Err(match status.as_u16() {
                429 => match wait {
                    Some(after) if after > MAX_RETRY_AFTER => RuntimeError::turn(
                        format!("{message} (it asks to retry in {}s)", after.as_secs()),
                        "rate_limited",
                    ),
                    Some(after) => RuntimeError::Throttled { message, retry_after: after },
                    None => RuntimeError::Failed(message),
                },
                400 if context_exceeded(&body) => RuntimeError::turn(
                    format!("the conversation does not fit the model's context: {detail}"),
                    CONTEXT_EXCEEDED,
                ),
                _ if status.is_server_error() => RuntimeError::Failed(message),
                _ => RuntimeError::turn(message, "upstream"),
            });
        }
        let mut gathered = Gathered { estimate, ..Gathered::default() };
        // The bytes since the last whole event, bounded: an upstream that never ends an
        // event must not grow the parser's buffer without end.
        let since_event = Arc::new(AtomicUsize::new(0));
        let max = self.settings.max_event_bytes;
        // The idle timeout runs between the body's bytes, not between parsed events: the parser
        // swallows comments, which some upstreams send while a request waits in their queue.
        let body = tokio_stream::StreamExt::timeout(response.into_body().into_data_stream(), idle);
        let counted = body.map({
            let since_event = since_event.clone();
            move |chunk| {
                let chunk = chunk.map_err(|_| Upstream::Idle(idle))?.map_err(Upstream::Transport)?;
                if since_event.fetch_add(chunk.len(), Ordering::Relaxed) + chunk.len() > max {
                    return Err(Upstream::TooLong(max));
                }
                Ok(chunk)
            }
        });
        // Pinned: the timeout's sleep is not Unpin.
        let mut events = std::pin::pin!(SseByteStream::new(counted));
        // Before any content a broken stream is as good as never accepted.
        let broken = |gathered: &Gathered, message: String| {
            if gathered.content { RuntimeError::turn(message, "upstream") } else { RuntimeError::Failed(message) }
        };
        loop {
            let event = match events.next().await {
                None => break,
                Some(Err(sse_stream::Error::Body(e))) if matches!(e.downcast_ref(), Some(Upstream::TooLong(_))) => {
                    return Err(RuntimeError::turn(format!("the upstream sent {e}"), "upstream"));
                }
                Some(Err(sse_stream::Error::Body(e))) if matches!(e.downcast_ref(), Some(Upstream::Idle(_))) => {
                    return Err(broken(&gathered, format!("the upstream sent {e}")));
                }
                Some(Err(sse_stream::Error::Body(e))) => {
                    tracing::debug!(error = %e, "the upstream stream ended abruptly");
                    return Err(broken(&gathered, "the upstream closed the stream before the turn finished".into()));
                }
                Some(Err(e)) => {
                    return Err(broken(&gathered, format!("the upstream's event stream is malformed: {e}")));
                }
                Some(Ok(event)) => {
                    since_event.store(0, Ordering::Relaxed);
                    event
                }
            };
            let data = event.data.as_deref().unwrap_or_default().trim();
            if data.is_empty() {
                continue;
            }
            if data == "[DONE]" {
                return gathered.finish(&sink).await;
            }
            match serde_json::from_str::<Value>(data) {
                Ok(value) => gathered.chunk(&sink, &value).await?,
                Err(e) => {
                    return Err(RuntimeError::turn(
                        format!("the upstream sent an event that is not JSON: {e}"),
                        "upstream",
                    ));
                }
            }
        }
        if gathered.finish.is_some() {
            // Some servers close without `[DONE]` after the last chunk.
            return gathered.finish(&sink).await;
        }
        Err(broken(&gathered, "the upstream closed the stream before the turn finished".into()))
    }
}

impl Runtime for OpenAiRuntime {
    fn run_turn(&self, request: TurnRequest, sink: EventSink, cancel: CancellationToken) -> RuntimeFuture {
        let runtime = self.clone();
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
    use crate::wire::{ErrorChunk, SystemChunk, TextChunk, ThinkingChunk, ToolCallChunk, ToolResultChunk};
    use futures_util::FutureExt;
    use proptest::prelude::*;

    /// One log message's chunks, by kind: what the turns of a real log are made of, failed,
    /// stopped and refused ones included.
    fn message() -> impl Strategy<Value = (Role, Vec<Chunk>)> {
        let text = |n: usize| "x".repeat(n);
        let call = |i: u8| {
            Chunk::ToolCall(ToolCallChunk {
                tool_call_id: format!("c{i}"),
                tool_name: "t".into(),
                input: json!({"q": i}),
                step_id: None,
            })
        };
        let result = |i: u8, n: usize| {
            Chunk::ToolResult(ToolResultChunk {
                tool_call_id: format!("c{i}"),
                tool_name: "t".into(),
                content: "r".repeat(n),
                is_error: false,
                step_id: None,
            })
        };
        let assistant_chunk = prop_oneof![
            4 => (0usize..120).prop_map(move |n| Chunk::Text(TextChunk { text: text(n) })),
            1 => (0usize..40).prop_map(move |n| Chunk::Thinking(ThinkingChunk { text: text(n) })),
            2 => (0u8..6).prop_map(call),
            1 => prop_oneof![Just(Some(CONTEXT_EXCEEDED.to_owned())), Just(None)]
                .prop_map(|code| Chunk::Error(ErrorChunk { message: "e".into(), code })),
        ];
        prop_oneof![
            4 => (0usize..200).prop_map(move |n| (Role::User, vec![Chunk::Text(TextChunk { text: text(n) })])),
            4 => proptest::collection::vec(assistant_chunk, 1..4).prop_map(|c| (Role::Assistant, c)),
            2 => proptest::collection::vec((0u8..6, 0usize..80).prop_map(move |(i, n)| result(i, n)), 1..3)
                .prop_map(|c| (Role::Tool, c)),
            1 => (1usize..30).prop_map(move |n| (Role::System, vec![Chunk::System(SystemChunk { text: text(n) })])),
        ]
    }

    /// An upstream that names no call ids gets `call_0` in every turn: a call nobody answered
    /// stays home even when a later turn's call of the same id was answered.
    #[test]
    fn a_result_answers_the_call_before_it_not_an_older_one_with_the_same_id() {
        let call = |n| {
            Chunk::ToolCall(ToolCallChunk {
                tool_call_id: "call_0".into(),
                tool_name: "t".into(),
                input: json!({"n": n}),
                step_id: None,
            })
        };
        let result = Chunk::ToolResult(ToolResultChunk {
            tool_call_id: "call_0".into(),
            tool_name: "t".into(),
            content: "r".into(),
            is_error: false,
            step_id: None,
        });
        let text = |t: &str| Chunk::Text(TextChunk { text: t.into() });
        let history = vec![
            chunk(1, Role::User, text("one")),
            chunk(2, Role::Assistant, text("a")),
            chunk(2, Role::Assistant, call(1)),
            chunk(3, Role::User, text("two")),
            chunk(4, Role::Assistant, call(2)),
            chunk(5, Role::Tool, result),
            chunk(6, Role::User, text("three")),
        ];
        let sent = messages(&history, None);
        assert_eq!(sent[1], json!({"role": "assistant", "content": "a"}), "{sent:?}");
        assert_eq!(sent[3]["tool_calls"][0]["function"]["arguments"], "{\"n\":2}");
        assert_eq!(sent.len(), 6);
    }

    proptest! {
        /// Reading the log's tail as far back as the trimming needs sends exactly what
        /// trimming the whole log would, whatever the log's turns and the budget.
        #[test]
        fn the_tail_read_sends_what_trimming_the_whole_log_sends(
            log in proptest::collection::vec(message(), 0..300),
            budget in 0u64..3000,
            prompt in prop_oneof![Just(None), Just(Some("be brief"))],
        ) {
            let mut history = Vec::new();
            for (id, (role, chunks)) in log.into_iter().enumerate() {
                history.extend(chunks.into_iter().map(|c| chunk(id as i64 + 1, role, c)));
            }
            history.push(chunk(1_000, Role::User, Chunk::Text(TextChunk { text: "new".into() })));
            let mut whole = messages(&history, prompt);
            trim_to_fit(&mut whole, usize::from(prompt.is_some()), budget);
            let reads = std::cell::Cell::new(0);
            let read = |from: u64, to: u64| {
                reads.set(reads.get() + 1);
                std::future::ready(Ok::<_, ()>(history[from as usize - 1..to as usize].to_vec()))
            };
            let len = history.len() as u64;
            let (tail, _) = fitting_messages(len, read, prompt, Some(budget)).now_or_never().unwrap().unwrap();
            prop_assert_eq!(tail, whole);
            prop_assert!(reads.get() <= 1 + (len / FIRST_TAIL + 1).ilog2() as usize + 1);
        }
    }

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
