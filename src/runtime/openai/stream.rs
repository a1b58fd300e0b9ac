//! What one streamed step gathers from the upstream's chunks: its text, its tool calls as they
//! complete, its finish reason and usage, each sent on as it comes.

use std::collections::BTreeMap;

use serde_json::Value;

use super::calls::StepCalls;
use crate::runtime::{EventSink, RawEvent, RuntimeError};
use crate::wire::{ErrorCode, Usage};

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

/// What one streamed step has gathered.
#[derive(Default)]
pub(super) struct Gathered {
    pub(super) content: bool,
    /// The step's text, for the next step's request.
    text: String,
    calls: BTreeMap<u64, PartialCall>,
    /// With tools: the calls started so far (a call starts once the next one begins in the
    /// stream, or the stream ends: its arguments are complete then).
    started: Option<StepCalls>,
    /// How many of `calls`, in index order, have been started.
    launched: usize,
    pub(super) finish: Option<String>,
    usage: Option<Usage>,
    /// The estimated tokens of the request's messages, to calibrate by the usage.
    estimate: u64,
    /// Bytes of text, reasoning and call arguments streamed so far, and the most a step may
    /// stream (`--max-step-bytes`): each event is bounded on its own, and this bounds their
    /// sum, which the step holds (its text and arguments go up again in the next request).
    streamed: usize,
    most: usize,
}

impl Gathered {
    /// A step's gathering, for a request of `estimate` tokens; with tools, its calls start as
    /// they complete.
    pub(super) fn new(estimate: u64, started: Option<StepCalls>, most: usize) -> Gathered {
        Gathered { estimate, started, most, ..Gathered::default() }
    }

    /// Counts `bytes` more of the step; past the bound the turn ends (`upstream`).
    fn count(&mut self, bytes: usize) -> Result<(), RuntimeError> {
        self.streamed += bytes;
        if self.streamed > self.most {
            return Err(RuntimeError::turn(
                format!(
                    "the upstream streamed more than {} bytes of text and tool arguments in one step (--max-step-bytes)",
                    self.most
                ),
                ErrorCode::Upstream,
            ));
        }
        Ok(())
    }

    /// Maps one `data:` chunk, sending what it carries.
    pub(super) async fn chunk(&mut self, sink: &EventSink, data: &Value) -> Result<(), RuntimeError> {
        if let Some(error) = data.get("error") {
            // `{"message": ...}` as OpenAI sends it, or the text alone.
            let message = error
                .as_str()
                .or_else(|| error.get("message").and_then(Value::as_str))
                .unwrap_or("the upstream reported an error");
            return Err(RuntimeError::turn(message, ErrorCode::Upstream));
        }
        if let Some(u) = data.get("usage").and_then(usage) {
            self.usage = Some(u);
        }
        let Some(choice) = data.get("choices").and_then(|c| c.get(0)) else { return Ok(()) };
        let delta = choice.get("delta").cloned().unwrap_or(Value::Null);
        let send = |event| async {
            sink.send(event).await.map_err(|_| RuntimeError::turn("the turn went away", ErrorCode::Runtime))
        };
        // Servers that send both say the same thing twice: one is taken.
        let reasoning = ["reasoning_content", "reasoning"]
            .iter()
            .find_map(|key| delta.get(*key).and_then(Value::as_str).filter(|t| !t.is_empty()));
        if let Some(text) = reasoning {
            self.count(text.len())?;
            self.content = true;
            send(RawEvent::ReasoningDelta(text.to_owned())).await?;
        }
        // A refusal is what the model answered: the user reads it as the reply.
        for key in ["content", "refusal"] {
            if let Some(text) = delta.get(key).and_then(Value::as_str).filter(|t| !t.is_empty()) {
                self.count(text.len())?;
                self.content = true;
                self.text.push_str(text);
                send(RawEvent::TextDelta(text.to_owned())).await?;
            }
        }
        for call in delta.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
            let name = call.pointer("/function/name").and_then(Value::as_str).map_or(0, str::len);
            let arguments = call.pointer("/function/arguments").and_then(Value::as_str).map_or(0, str::len);
            self.count(name + arguments)?;
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
        // Every call but the last one the stream began is complete: started now (eager).
        let complete = self.calls.len().saturating_sub(1);
        self.launch(sink, complete).await?;
        if let Some(finish) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish = Some(reason(finish));
        }
        Ok(())
    }

    /// Starts the calls in index order up to (excluding) the `upto`th, when the turn has tools.
    async fn launch(&mut self, sink: &EventSink, upto: usize) -> Result<(), RuntimeError> {
        let Some(started) = self.started.as_mut() else { return Ok(()) };
        for (index, call) in self.calls.iter().skip(self.launched).take(upto.saturating_sub(self.launched)) {
            let id = if call.id.is_empty() { format!("call_{index}") } else { call.id.clone() };
            started.start(sink, id, call.name.clone(), call.arguments.clone()).await?;
        }
        self.launched = self.launched.max(upto);
        Ok(())
    }

    /// Ends the step: its tool calls (started, with tools), usage, the step's end. What
    /// follows: the finish reason, the step's text, and its calls when it has any to run.
    pub(super) async fn end(mut self, sink: &EventSink) -> Result<(String, String, Option<StepCalls>), RuntimeError> {
        let mut events = Vec::new();
        if self.started.is_some() {
            self.launch(sink, self.calls.len()).await?;
        } else {
            for (index, call) in std::mem::take(&mut self.calls) {
                let input = serde_json::from_str(&call.arguments).unwrap_or(Value::String(call.arguments));
                let id = if call.id.is_empty() { format!("call_{index}") } else { call.id };
                events.push(RawEvent::ToolCall { id, name: call.name, input });
            }
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
        for e in events {
            sink.send(e).await.map_err(|_| RuntimeError::turn("the turn went away", ErrorCode::Runtime))?;
        }
        let reason = self.finish.unwrap_or_else(|| "stop".to_owned());
        Ok((reason, self.text, self.started.filter(|c| !c.is_empty())))
    }
}
