//! The `openai` runtime: any OpenAI-compatible Chat Completions endpoint with streaming.
//!
//! One turn is one request (one step; sent again with older turns left out when the upstream
//! refuses it as too long): the conversation rebuilt from the log (always a valid Chat
//! Completions conversation, trimmed to the context window when one is configured) goes up
//! with `stream: true`, usage asked for unless switched off, and the credential's (and the
//! model's) parameters; `delta.content` comes back as text, `delta.refusal` as text too,
//! `delta.reasoning_content` (else `delta.reasoning`) as reasoning, tool calls as tool calls,
//! the usage chunk as usage, `finish_reason` as `done.reason`. Cancelling drops the request,
//! which closes its connection at once.

use std::borrow::Cow;
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

mod calls;
mod context;
mod stream;

use self::calls::{StepCalls, Toolkit};
use self::context::{context_exceeded, estimated_tokens, fitting_messages, fitting_steps, prompt_tokens_counted};
use self::stream::Gathered;
use super::http_client::{HttpClient, describe};
use super::{EventSink, RawEvent, Runtime, RuntimeError, RuntimeFuture, TurnRequest};
use crate::config::RequestParams;
use crate::wire::ErrorCode;

/// The most real tokens an estimated one may be taken for (and a quarter the least).
const MOST_PER_ESTIMATE: f64 = 8.0;

/// How many times a turn's request is trimmed again after the upstream refused it as too long.
const MAX_REFITS: u32 = 3;

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
    /// The most bytes of messages a request carries (`--max-runtime-request-bytes`).
    pub max_request_bytes: u64,
    /// The most bytes of text, reasoning and tool arguments one step streams (`--max-step-bytes`).
    pub max_step_bytes: usize,
    pub system_prompt: Option<String>,
    /// Tokens the models take; the oldest turns are left out so a request fits.
    pub context_window: Option<u64>,
    /// The credential's request parameters.
    pub params: RequestParams,
    /// Each model's, over the credential's.
    pub model_params: BTreeMap<String, RequestParams>,
    /// The MCP servers whose tools its models get: with them, the runtime runs the agent loop.
    pub tools: Option<ToolSettings>,
}

/// A credential's tools and the loop's bounds (docs/tools.md).
#[derive(Clone)]
pub struct ToolSettings {
    pub toolbox: Arc<crate::tools::Toolbox>,
    /// The `[mcp.<name>]` servers it uses.
    pub servers: Vec<String>,
    /// Model round trips a turn may take.
    pub max_steps: u32,
    /// Calls of one turn running at once.
    pub max_parallel: usize,
    /// Calls one step may run (`max_tool_calls`).
    pub max_calls: usize,
}

impl std::fmt::Debug for ToolSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolSettings").field("servers", &self.servers).field("max_steps", &self.max_steps).finish()
    }
}

/// What a step's request carries besides the history: this turn's earlier steps (assistant
/// calls, tool results, steering), and the tools.
#[derive(Default)]
struct StepInput<'a> {
    added: &'a [Value],
    tools: &'a [Value],
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

impl OpenAiRuntime {
    /// The request body: the rebuilt conversation, trimmed to the context window at `ratio`
    /// real tokens an estimated one and to `--max-runtime-request-bytes`, and the model's
    /// parameters; and the estimated tokens of
    /// its messages, and how many there are.
    async fn body(
        &self,
        req: &TurnRequest,
        step: &StepInput<'_>,
        ratio: f64,
    ) -> Result<(Value, u64, usize), RuntimeError> {
        let params = match self.settings.model_params.get(&req.model) {
            Some(model) => self.settings.params.overlaid(model),
            None => self.settings.params.clone(),
        };
        let window = self.settings.context_window.map(|window| {
            // Room for the answer: what `max_tokens` asks, else an eighth of the window.
            let reserve = params.max_tokens.unwrap_or(window / 8).min(window / 2);
            ((window - reserve) as f64 / ratio) as u64
        });
        // The size bound, in the estimate's own units (four bytes a token), holds whatever the
        // calibration: it bounds the gateway's read and the request, not the model's count.
        let size = self.settings.max_request_bytes / 4;
        // This turn's earlier steps go up after the history fitted to what they leave (their
        // oldest results left out first when they would take most of the bound).
        let bound = window.map_or(size, |w| w.min(size));
        let (added, dropped) = fitting_steps(step.added, bound);
        if dropped > 0 {
            tracing::info!(dropped, "left older tool results out of the request to fit its size bound");
        }
        let budget = bound.saturating_sub(added.iter().map(estimated_tokens).sum());
        let history = req
            .history
            .as_ref()
            .ok_or_else(|| RuntimeError::turn("the turn came without its history", ErrorCode::Runtime))?;
        let read = |from, to| history.range(from, to);
        let system_prompt = self.settings.system_prompt.as_deref();
        let (messages, left_out) =
            fitting_messages(history.last_seq(), read, system_prompt, budget).await.map_err(|e| {
                RuntimeError::turn(
                    format!("the conversation could not be read for the runtime: {e}"),
                    ErrorCode::Storage,
                )
            })?;
        if left_out > 0 {
            tracing::info!(left_out, "left the oldest messages out of the request to fit the context window");
        }
        let mut messages = messages;
        messages.extend(added.into_owned());
        let (estimate, count) = (messages.iter().map(estimated_tokens).sum(), messages.len());
        let mut body = Map::new();
        body.insert("model".into(), json!(req.model));
        body.insert("messages".into(), Value::Array(messages));
        body.insert("stream".into(), json!(true));
        if !step.tools.is_empty() {
            body.insert("tools".into(), Value::Array(step.tools.to_vec()));
        }
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
        Ok((Value::Object(body), estimate, count))
    }

    /// The request (see [`OpenAiRuntime::body`]), the estimated tokens of its messages and
    /// how many there are.
    async fn request(
        &self,
        req: &TurnRequest,
        step: &StepInput<'_>,
        ratio: f64,
    ) -> Result<(http::Request<Full<Bytes>>, u64, usize), RuntimeError> {
        let (body, estimate, count) = self.body(req, step, ratio).await?;
        let body = Bytes::from(body.to_string());
        let mut request = http::Request::post(self.endpoint.clone()).body(Full::new(body)).expect("a parsed URI");
        *request.headers_mut() = self.headers.clone();
        Ok((request, estimate, count))
    }

    /// Sends the turn's request, trimmed again while the upstream refuses it as too long for
    /// its context; the response to stream, and the estimated tokens of its request.
    async fn open<F, Fut>(
        &self,
        req: &TurnRequest,
        step: &StepInput<'_>,
        send: F,
    ) -> Result<(http::Response<hyper::body::Incoming>, u64), RuntimeError>
    where
        F: Fn(RawEvent) -> Fut,
        Fut: std::future::Future<Output = Result<(), RuntimeError>>,
    {
        let idle = self.settings.idle_timeout;
        // The estimate scaled by what the upstream counted for the last request; bounded, so
        // one odd report cannot make the trimming keep everything or nothing.
        let mut ratio =
            req.tokens_per_estimate.filter(|r| r.is_finite()).map_or(1.0, |r| r.clamp(0.25, MOST_PER_ESTIMATE));
        // A request the upstream refused as too long for its context, and how many messages
        // it had: the next one must have fewer.
        let mut refused: Option<(usize, RuntimeError)> = None;
        let mut refits = 0;
        loop {
            let (request, estimate, count) = self.request(req, step, ratio).await?;
            if let Some((before, error)) = refused.take()
                && count >= before
            {
                return Err(error);
            }
            let response = self.send(request).await?;
            let status = response.status();
            if !status.is_success() {
                let wait = retry_after(response.headers());
                let moved = status.is_redirection().then(|| response.headers().get(http::header::LOCATION).cloned());
                let body = error_body(response.into_body(), self.settings.max_event_bytes, idle).await;
                let detail = readable(&body);
                let mut message = format!("the upstream answered {status}: {detail}");
                if let Some(location) = moved {
                    let to = location.as_ref().and_then(|l| l.to_str().ok()).unwrap_or("nowhere it says");
                    message = format!("{message} (redirects are not followed: base_url moved to {to}?)");
                }
                return Err(match status.as_u16() {
                    429 => match wait {
                        Some(after) if after > MAX_RETRY_AFTER => RuntimeError::turn(
                            format!("{message} (it asks to retry in {}s)", after.as_secs()),
                            ErrorCode::RateLimited,
                        ),
                        Some(after) => RuntimeError::Throttled { message, retry_after: after },
                        None => RuntimeError::Failed(message),
                    },
                    400 if context_exceeded(&body) => {
                        let error = RuntimeError::turn(
                            format!("the conversation does not fit the model's context: {detail}"),
                            ErrorCode::ContextLength,
                        );
                        // Refused, so never run: trimmed again as if tokens were dearer (what the
                        // upstream says it counted, else twice the last guess), until the request
                        // has nothing more to leave out.
                        let counted = prompt_tokens_counted(&body).filter(|_| estimate > 0);
                        let measured = counted.map(|c| c as f64 / estimate as f64);
                        if let Some(measured) = measured {
                            send(RawEvent::TokensPerEstimate(measured)).await?;
                        }
                        let next = measured.filter(|m| *m > ratio).unwrap_or(ratio * 2.0).min(MOST_PER_ESTIMATE);
                        if self.settings.context_window.is_none() || refits == MAX_REFITS || next <= ratio {
                            error
                        } else {
                            tracing::info!(
                                ratio,
                                next,
                                "the upstream refused the request as too long; trimming it again"
                            );
                            (refits, ratio, refused) = (refits + 1, next, Some((count, error)));
                            continue;
                        }
                    }
                    _ if status.is_server_error() => RuntimeError::Failed(message),
                    _ => RuntimeError::turn(message, ErrorCode::Upstream),
                });
            }
            return Ok((self.event_stream(response).await?, estimate));
        }
    }

    /// Sends one request, waiting at most the idle timeout for its answer's head. How it
    /// failed says whether the upstream may have taken it (ambiguous) or not (failed).
    async fn send(
        &self,
        request: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<hyper::body::Incoming>, RuntimeError> {
        match tokio::time::timeout(self.settings.idle_timeout, self.client.send(request)).await {
            // The request went out and no answer came: the upstream may be working on it.
            Err(_) => Err(RuntimeError::Ambiguous("the upstream took the request but did not answer in time".into())),
            // Never connected (the connect timeout included): nothing reached the upstream.
            Ok(Err(e)) if e.is_connect() => {
                Err(RuntimeError::Failed(format!("cannot reach the upstream: {}", describe(&e))))
            }
            // The request may have been sent before the failure: it may have been taken.
            Ok(Err(e)) => Err(RuntimeError::Ambiguous(format!("the upstream request failed: {}", describe(&e)))),
            Ok(Ok(r)) => Ok(r),
        }
    }

    /// A successful answer, as the event stream it must be. A 200 that is not a stream (a
    /// server that ignored `stream: true`, a proxy's error or sign-in page): the upstream took
    /// the request, so not retried; what came is said. A stream without a media type is read
    /// as one.
    async fn event_stream(
        &self,
        response: http::Response<hyper::body::Incoming>,
    ) -> Result<http::Response<hyper::body::Incoming>, RuntimeError> {
        let (status, idle) = (response.status(), self.settings.idle_timeout);
        if let Some(kind) =
            response.headers().get(CONTENT_TYPE).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            && !kind.trim_start().to_ascii_lowercase().starts_with("text/event-stream")
        {
            let body = error_body(response.into_body(), self.settings.max_event_bytes, idle).await;
            let detail = readable(&body);
            return Err(RuntimeError::turn(
                format!("the upstream answered {status} with {kind}, not an event stream: {detail}"),
                ErrorCode::Upstream,
            ));
        }
        Ok(response)
    }

    /// The turn: one step, or with tools the agent loop (docs/tools.md): a step whose model asks
    /// for calls runs them, sends their results back up and takes the next step, until a step
    /// asks for none or `max_steps` is reached.
    async fn turn(&self, req: TurnRequest, sink: EventSink, cancel: CancellationToken) -> Result<(), RuntimeError> {
        let send = |event| async {
            sink.send(event).await.map_err(|_| RuntimeError::turn("the turn went away", ErrorCode::Runtime))
        };
        let Some(settings) = &self.settings.tools else {
            let (reason, _, _) = self.step(&req, &sink, &StepInput::default(), None).await?;
            return send(RawEvent::Finish { reason }).await;
        };
        let folder = req.cwd.as_deref().map(std::path::Path::new);
        let tools = settings.toolbox.for_turn(&settings.servers, &req.conversation_id, folder).await;
        let definitions = tools.definitions();
        // Calls in flight are cancelled when the turn is stopped, and when it ends otherwise.
        let calls_cancel = cancel.child_token();
        let _cancel_calls = calls_cancel.clone().drop_guard();
        let kit = Toolkit {
            tools: Arc::new(tools),
            places: Arc::new(tokio::sync::Semaphore::new(settings.max_parallel.max(1))),
            max_calls: settings.max_calls.max(1),
            cancel: calls_cancel,
        };
        let mut added: Vec<Value> = Vec::new();
        for _ in 0..settings.max_steps.max(1) {
            let step = StepInput { added: &added, tools: &definitions };
            let (reason, text, calls) = self.step(&req, &sink, &step, Some(kit.clone())).await?;
            let Some(calls) = calls else { return send(RawEvent::Finish { reason }).await };
            added.extend(calls.finish(&sink, text).await?);
            // What the turn holds of its steps stays within what a request may carry: older
            // results are replaced by a note now, not only left out of each request.
            // (The size bound in the estimate's units, four bytes a token, as `body` counts it.)
            if let (Cow::Owned(fitted), _) = fitting_steps(&added, self.settings.max_request_bytes / 4) {
                added = fitted;
            }
            // Steering: what was queued meanwhile goes to the model before its next step.
            for message in req.inbox.drain() {
                send(RawEvent::UserInput(message.text.clone())).await?;
                added.push(json!({"role": "user", "content": message.text}));
            }
        }
        Err(RuntimeError::turn(
            format!("the turn reached {} steps (the credential's max_steps) and was ended", settings.max_steps.max(1)),
            ErrorCode::MaxSteps,
        ))
    }

    /// One step: a request, its streamed answer; the finish reason, the step's text, and its
    /// started calls (with tools, when it asked for any).
    async fn step(
        &self,
        req: &TurnRequest,
        sink: &EventSink,
        step: &StepInput<'_>,
        kit: Option<Toolkit>,
    ) -> Result<(String, String, Option<StepCalls>), RuntimeError> {
        let idle = self.settings.idle_timeout;
        let send = |event| async {
            sink.send(event).await.map_err(|_| RuntimeError::turn("the turn went away", ErrorCode::Runtime))
        };
        send(RawEvent::StepStart).await?;
        let (response, estimate) = self.open(req, step, &send).await?;
        send(RawEvent::RequestSize(estimate)).await?;
        let mut gathered = Gathered::new(estimate, kit.map(StepCalls::new), self.settings.max_step_bytes);
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
            if gathered.content {
                RuntimeError::turn(message, ErrorCode::Upstream)
            } else {
                RuntimeError::Failed(message)
            }
        };
        loop {
            let event = match events.next().await {
                None => break,
                Some(Err(sse_stream::Error::Body(e))) if matches!(e.downcast_ref(), Some(Upstream::TooLong(_))) => {
                    return Err(RuntimeError::turn(format!("the upstream sent {e}"), ErrorCode::Upstream));
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
                return gathered.end(sink).await;
            }
            match serde_json::from_str::<Value>(data) {
                Ok(value) => gathered.chunk(sink, &value).await?,
                Err(e) => {
                    return Err(RuntimeError::turn(
                        format!("the upstream sent an event that is not JSON: {e}"),
                        ErrorCode::Upstream,
                    ));
                }
            }
        }
        if gathered.finish.is_some() {
            // Some servers close without `[DONE]` after the last chunk.
            return gathered.end(sink).await;
        }
        Err(broken(&gathered, "the upstream closed the stream before the turn finished".into()))
    }
}

impl Runtime for OpenAiRuntime {
    fn run_turn(&self, request: TurnRequest, sink: EventSink, cancel: CancellationToken) -> RuntimeFuture {
        let runtime = self.clone();
        Box::pin(async move {
            tokio::select! {
                result = runtime.turn(request, sink, cancel.clone()) => result,
                // Dropping the request future closes its connection now, not at the next chunk.
                _ = cancel.cancelled() => Ok(()),
            }
        })
    }

    fn needs_history(&self) -> bool {
        true
    }

    /// With servers run in the conversation's folder, the folder must lie in their roots.
    fn folder(&self, cwd: &str) -> Option<String> {
        match &self.settings.tools {
            Some(t) if t.toolbox.uses_folders(&t.servers) => {
                t.toolbox.folder(&t.servers, cwd).map(|p| p.to_string_lossy().into_owned())
            }
            _ => Some(cwd.to_owned()),
        }
    }
}

/// An error body as a person reads it, in 300 characters at most: an HTML page (a proxy's or a
/// load balancer's error page, a sign-in page) by its title, else its text without the markup;
/// anything else as it came.
fn readable(body: &str) -> String {
    let head = body.trim_start().chars().take(512).collect::<String>().to_ascii_lowercase();
    let html = ["<!doctype html", "<html", "<head", "<body"].iter().any(|tag| head.contains(tag));
    if !html {
        return body.chars().take(300).collect();
    }
    // ASCII lowercasing keeps every byte where it was: offsets found in `lower` hold in `body`.
    let lower = body.to_ascii_lowercase();
    let title = lower.find("<title").and_then(|at| {
        let start = at + lower[at..].find('>')? + 1;
        let end = start + lower[start..].find("</title")?;
        Some(&body[start..end])
    });
    let text = match title.map(str::trim).filter(|t| !t.is_empty()) {
        Some(title) => title.to_owned(),
        None => {
            let mut text = String::new();
            let mut in_tag = false;
            for c in body.chars() {
                match c {
                    '<' => in_tag = true,
                    '>' if in_tag => {
                        in_tag = false;
                        text.push(' ');
                    }
                    c if !in_tag => text.push(c),
                    _ => {}
                }
            }
            text
        }
    };
    let words = text.split_whitespace().collect::<Vec<_>>().join(" ");
    format!("an HTML page: {words}").chars().take(300).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_html_error_page_reads_as_its_title_or_its_text() {
        let nginx = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";
        assert_eq!(super::readable(nginx), "an HTML page: 502 Bad Gateway");
        assert_eq!(
            super::readable("<html><body>Sign in to continue</body></html>"),
            "an HTML page: Sign in to continue"
        );
        let json = r#"{"error":{"message":"quota <exceeded>"}}"#;
        assert_eq!(super::readable(json), json, "not a page: as it came");
        assert_eq!(super::readable(&"é".repeat(400)).chars().count(), 300);
    }
}
