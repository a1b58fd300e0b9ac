//! The tool calls of one step of the agent loop (docs/tools.md): each started as soon as its
//! arguments are complete in the stream, at most `max_parallel_tools` of a turn at once,
//! identical ones run once; their progress streamed as `tool-output`; their results handed
//! back in call order once the step has ended.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::super::{EventSink, RawEvent, RuntimeError};
use crate::tools::{Outcome, TurnTools, capped};
use crate::wire::{ErrorCode, OutputStream};

/// The most bytes of one progress line a watcher gets.
const MOST_PROGRESS: usize = 64 * 1024;

/// Progress lines waiting to be sent, per call.
const PROGRESS_QUEUE: usize = 64;

/// What a turn's calls share: its tools, its places, its stop.
#[derive(Clone)]
pub(super) struct Toolkit {
    pub tools: Arc<TurnTools>,
    pub places: Arc<Semaphore>,
    /// Calls one step may run (`max_tool_calls`): the rest are answered with an error result,
    /// so that a prompt cannot make one step run (and the next request carry) hundreds.
    pub max_calls: usize,
    /// Fires when the turn is stopped or ends: calls in flight are cancelled.
    pub cancel: CancellationToken,
}

/// One call of the step.
pub(super) struct Call {
    pub id: String,
    pub name: String,
    /// The arguments as they go back up: the parsed JSON written again, or, when the model
    /// wrote no valid JSON, that text as a JSON string, as the history rebuild sends it. Never
    /// the raw text: an upstream that parses arguments (llama-server) refuses a whole request
    /// that carries a cut call's `{"message":`.
    pub arguments: String,
    result: Pending,
}

enum Pending {
    Running(JoinHandle<(Outcome, u64)>),
    /// Identical to the call at this index: its result is that one's.
    SameAs(usize),
    /// Not run: past the step's `max_tool_calls`.
    Refused,
}

/// The step's calls, started as they complete.
pub(super) struct StepCalls {
    kit: Toolkit,
    calls: Vec<Call>,
    /// The index of the first call of each (name, arguments).
    firsts: HashMap<(String, String), usize>,
}

impl StepCalls {
    pub fn new(kit: Toolkit) -> StepCalls {
        StepCalls { kit, calls: Vec::new(), firsts: HashMap::new() }
    }

    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Announces a call whose arguments are complete (`tool-call`) and starts it.
    pub async fn start(
        &mut self,
        sink: &EventSink,
        id: String,
        name: String,
        arguments: String,
    ) -> Result<(), RuntimeError> {
        let input: Value = serde_json::from_str(&arguments).unwrap_or(Value::String(arguments));
        send(sink, RawEvent::ToolCall { id: id.clone(), name: name.clone(), input: input.clone() }).await?;
        // Same name, same arguments (as JSON, so spacing aside): run once.
        let arguments = input.to_string();
        let key = (name.clone(), arguments.clone());
        let result = match self.firsts.get(&key) {
            Some(first) => Pending::SameAs(*first),
            None if self.firsts.len() >= self.kit.max_calls => Pending::Refused,
            None => {
                self.firsts.insert(key, self.calls.len());
                Pending::Running(self.spawn(sink, id.clone(), name.clone(), input))
            }
        };
        self.calls.push(Call { id, name, arguments, result });
        Ok(())
    }

    fn spawn(&self, sink: &EventSink, id: String, name: String, input: Value) -> JoinHandle<(Outcome, u64)> {
        let kit = self.kit.clone();
        let sink = sink.clone();
        tokio::spawn(async move {
            let aborted = || (Outcome { content: "Aborted".into(), is_error: true }, 0);
            let _place = tokio::select! {
                place = kit.places.clone().acquire_owned() => match place {
                    Ok(place) => place,
                    Err(_) => return aborted(),
                },
                _ = kit.cancel.cancelled() => return aborted(),
            };
            let (progress, mut lines) = mpsc::channel::<String>(PROGRESS_QUEUE);
            let forward = {
                let (sink, id) = (sink.clone(), id.clone());
                tokio::spawn(async move {
                    while let Some(line) = lines.recv().await {
                        let data = capped(line, MOST_PROGRESS);
                        let output = RawEvent::ToolOutput { id: id.clone(), data, stream: OutputStream::Stdout };
                        if sink.send(output).await.is_err() {
                            return;
                        }
                    }
                })
            };
            let started = Instant::now();
            let outcome = kit.tools.call(&name, &input, progress, &kit.cancel).await;
            let took = started.elapsed().as_millis() as u64;
            // Every progress line of the call goes out before its result.
            let _ = forward.await;
            (outcome, took)
        })
    }

    /// Waits for every call and sends their results in call order (`tool-result`, each with
    /// its own duration); the messages that answer them for the next request: the assistant's
    /// (`content` and `tool_calls`) and one `tool` message per call.
    pub async fn finish(self, sink: &EventSink, content: String) -> Result<Vec<Value>, RuntimeError> {
        let mut outcomes: Vec<(Outcome, u64)> = Vec::with_capacity(self.calls.len());
        let mut messages = Vec::with_capacity(self.calls.len() + 1);
        let tool_calls: Vec<Value> = self
            .calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect();
        let content = if content.is_empty() { Value::Null } else { json!(content) };
        messages.push(json!({"role": "assistant", "content": content, "tool_calls": tool_calls}));
        for call in self.calls {
            let (outcome, took) = match call.result {
                Pending::Running(task) => task.await.unwrap_or_else(|_| {
                    (Outcome { content: "the call failed inside the gateway".into(), is_error: true }, 0)
                }),
                Pending::SameAs(first) => (outcomes[first].0.clone(), 0),
                Pending::Refused => {
                    let why = format!(
                        "not run: the step asked for more than {} tool calls (the credential's max_tool_calls); ask for fewer at a time",
                        self.kit.max_calls
                    );
                    (Outcome { content: why, is_error: true }, 0)
                }
            };
            send(
                sink,
                RawEvent::ToolResult {
                    id: call.id.clone(),
                    name: call.name.clone(),
                    content: outcome.content.clone(),
                    is_error: outcome.is_error,
                    duration_ms: Some(took),
                },
            )
            .await?;
            messages.push(json!({"role": "tool", "tool_call_id": call.id, "content": outcome.content}));
            outcomes.push((outcome, took));
        }
        Ok(messages)
    }
}

async fn send(sink: &EventSink, event: RawEvent) -> Result<(), RuntimeError> {
    sink.send(event).await.map_err(|_| RuntimeError::turn("the turn went away", ErrorCode::Runtime))
}
