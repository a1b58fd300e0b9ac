//! The `scripted` runtime: deterministic replies with no model behind them.
//!
//! With no script it answers every prompt with a short reasoning part and a reply of a few
//! sentences, streamed word by word at `pace` tokens per second, with synthetic usage. A
//! script file (JSON, see `docs/scripted-runtime.md`) can describe exact steps per prompt: tool
//! calls with results, errors, stalls and long outputs.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::timer::Timer;
use super::{EventSink, RawEvent, Runtime, RuntimeError, RuntimeFuture, TurnRequest};
use crate::wire::{ErrorCode, OutputStream, Usage};

/// A script: the first rule whose `match` is contained in the prompt answers it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Script {
    /// Shared with the turns that play them (a rule may hold MiBs of tool results).
    pub rules: Vec<Arc<Rule>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rule {
    /// A substring of the prompt; a rule without one matches every prompt.
    #[serde(rename = "match")]
    pub pattern: Option<String>,
    /// Tokens per second for this rule's deltas (0 = as fast as possible).
    pub pace: Option<f64>,
    pub steps: Vec<StepScript>,
    /// `done.reason` when the steps run out (default `stop`).
    pub finish: Option<String>,
    /// Ends the turn with this error after the steps instead of finishing.
    pub error: Option<ScriptedError>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StepScript {
    pub reasoning: Option<String>,
    pub text: Option<String>,
    /// Streams `text` this many times (long outputs for tests and benchmarks).
    pub repeat: Option<u32>,
    #[serde(default)]
    pub tool_calls: Vec<ToolScript>,
    /// The step's usage; synthetic when absent.
    pub usage: Option<Usage>,
    /// Waits this long after the step's text before ending the step.
    pub stall_ms: Option<u64>,
    /// Prefixes every text delta with the wall-clock time it was sent, in unix microseconds
    /// and a colon (`1795996840524672:word `), so a client can measure delivery latency.
    #[serde(default)]
    pub stamp: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolScript {
    pub id: Option<String>,
    pub name: String,
    #[serde(default = "empty_object")]
    pub input: Value,
    /// Streamed as `tool-output` on stdout before the step ends.
    pub output: Option<String>,
    #[serde(default)]
    pub result: String,
    #[serde(default)]
    pub is_error: bool,
    /// The tool's reported execution time.
    pub duration_ms: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScriptedError {
    pub message: String,
    pub code: Option<String>,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

impl Script {
    pub fn load(path: &Path) -> Result<Script, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read script {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("script {} is invalid: {e}", path.display()))
    }
}

pub struct ScriptedRuntime {
    pace: f64,
    reasoning: bool,
    script: Script,
}

impl ScriptedRuntime {
    /// `pace` in tokens per second (0 = as fast as possible); `reasoning` adds a reasoning part
    /// to the default reply.
    pub fn new(pace: f64, reasoning: bool, script: Script) -> ScriptedRuntime {
        ScriptedRuntime { pace, reasoning, script }
    }

    fn plan(&self, prompt: &str) -> Arc<Rule> {
        if let Some(rule) = self.script.rules.iter().find(|r| r.pattern.as_deref().is_none_or(|p| prompt.contains(p))) {
            return rule.clone();
        }
        let words = prompt.split_whitespace().count();
        Arc::new(Rule {
            pattern: None,
            pace: None,
            steps: vec![StepScript {
                reasoning: self
                    .reasoning
                    .then(|| format!("The prompt has {words} words. Nothing to look up: answer with the demo reply.")),
                text: Some(format!(
                    "You said: \"{prompt}\". This is the scripted runtime of dispatch-gateway. \
                     It streams a fixed reply in small pieces so that you can watch a turn without a model. \
                     Every turn it streams is logged, measured and sealed like a real one. \
                     Configure an OpenAI-compatible endpoint or an agent program to get real answers."
                )),
                ..StepScript::default()
            }],
            finish: None,
            error: None,
        })
    }
}

/// Splits text into word-sized deltas (each word keeps the whitespace that follows it), so the
/// deltas concatenate back to the exact text.
pub fn split_tokens(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut in_space = false;
    for (i, c) in text.char_indices() {
        let space = c.is_whitespace();
        if in_space && !space {
            out.push(&text[start..i]);
            start = i;
        }
        in_space = space;
    }
    if start < text.len() {
        out.push(&text[start..]);
    }
    out
}

/// Paces deltas at a fixed rate from a start instant, so sleeping does not drift.
struct Pacer {
    interval: Option<Duration>,
    next: Instant,
    /// The kernel's timer, so that deltas come `interval` apart to the microsecond rather than
    /// to tokio's millisecond (`timer.rs`); tokio's where there is none, and in unit tests,
    /// which pace on tokio's paused clock.
    timer: Option<Timer>,
}

impl Pacer {
    fn new(tokens_per_second: f64) -> Pacer {
        let interval = (tokens_per_second > 0.0).then(|| Duration::from_secs_f64(1.0 / tokens_per_second));
        let timer = interval.filter(|_| !cfg!(test)).and_then(|_| Timer::new().ok());
        Pacer { interval, next: Instant::now(), timer }
    }

    /// Paces from now on: after a stall (or a step's tool calls) the next delta comes one
    /// interval later, not at once with every delta the stall held up.
    fn restart(&mut self) {
        self.next = Instant::now();
    }

    async fn tick(&mut self, cancel: &CancellationToken) -> Result<(), Stop> {
        if let Some(interval) = self.interval {
            self.next += interval;
            let (next, timer) = (self.next, self.timer.as_ref());
            let sleep = async move {
                match timer {
                    Some(timer) if timer.sleep_until(next).await.is_ok() => {}
                    _ => tokio::time::sleep_until(next).await,
                }
            };
            tokio::select! {
                _ = sleep => {}
                _ = cancel.cancelled() => return Err(Stop),
            }
        }
        Ok(())
    }
}

/// The turn was cancelled or its consumer went away: stop quietly.
struct Stop;

async fn send(sink: &EventSink, event: RawEvent) -> Result<(), Stop> {
    sink.send(event).await.map_err(|_| Stop)
}

async fn stream_text(
    sink: &EventSink,
    pacer: &mut Pacer,
    cancel: &CancellationToken,
    text: &str,
    reasoning: bool,
    mut stamp: Option<&mut u64>,
) -> Result<u64, Stop> {
    let mut count = 0;
    for token in split_tokens(text) {
        pacer.tick(cancel).await?;
        let delta = match stamp.as_deref_mut() {
            Some(n) => {
                let micros =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros());
                *n += 1;
                format!("{micros}:{}:{token}", *n - 1)
            }
            None => token.to_owned(),
        };
        send(sink, if reasoning { RawEvent::ReasoningDelta(delta) } else { RawEvent::TextDelta(delta) }).await?;
        count += 1;
    }
    Ok(count)
}

async fn play(
    rule: Arc<Rule>,
    default_pace: f64,
    req: TurnRequest,
    sink: EventSink,
    cancel: CancellationToken,
) -> Result<(), Stop> {
    let mut pacer = Pacer::new(rule.pace.unwrap_or(default_pace));
    // Synthetic context: a notional system prompt plus the prompt, growing with each step.
    let mut context = 32 + (req.prompt.len() as u64).div_ceil(4);
    for (k, step) in rule.steps.iter().enumerate() {
        // Steering is taken at step boundaries: the model sees it in this step's prompt.
        let mut noted = Vec::new();
        if k > 0 {
            for message in req.inbox.drain() {
                context += (message.text.len() as u64).div_ceil(4);
                noted.push(message.text.clone());
                send(&sink, RawEvent::UserInput(message.text)).await?;
            }
        }
        send(&sink, RawEvent::StepStart).await?;
        pacer.restart();
        let mut output = 0;
        if !noted.is_empty() {
            let ack = format!("Noted: {}. ", noted.join("; "));
            output += stream_text(&sink, &mut pacer, &cancel, &ack, false, None).await?;
        }
        if let Some(reasoning) = &step.reasoning {
            output += stream_text(&sink, &mut pacer, &cancel, reasoning, true, None).await?;
        }
        if let Some(text) = &step.text {
            let mut stamped = 0;
            for _ in 0..step.repeat.unwrap_or(1) {
                let stamp = step.stamp.then_some(&mut stamped);
                output += stream_text(&sink, &mut pacer, &cancel, text, false, stamp).await?;
            }
        }
        let call_id = |i: usize, t: &ToolScript| t.id.clone().unwrap_or_else(|| format!("call_{k}_{i}"));
        for (i, tool) in step.tool_calls.iter().enumerate() {
            let input = tool.input.clone();
            send(&sink, RawEvent::ToolCall { id: call_id(i, tool), name: tool.name.clone(), input }).await?;
            output += 8;
        }
        for (i, tool) in step.tool_calls.iter().enumerate() {
            if let Some(data) = &tool.output {
                let (id, data) = (call_id(i, tool), data.clone());
                send(&sink, RawEvent::ToolOutput { id, data, stream: OutputStream::Stdout }).await?;
            }
        }
        if let Some(ms) = step.stall_ms {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
                _ = cancel.cancelled() => return Err(Stop),
            }
        }
        let usage = step.usage.unwrap_or(Usage { input_tokens: context, output_tokens: output, ..Usage::default() });
        send(&sink, RawEvent::Usage(usage)).await?;
        send(&sink, RawEvent::StepEnd).await?;
        context = usage.input_tokens + usage.output_tokens;
        for (i, tool) in step.tool_calls.iter().enumerate() {
            send(
                &sink,
                RawEvent::ToolResult {
                    id: call_id(i, tool),
                    name: tool.name.clone(),
                    content: tool.result.clone(),
                    is_error: tool.is_error,
                    duration_ms: Some(tool.duration_ms.unwrap_or(0)),
                },
            )
            .await?;
            context += (tool.result.len() as u64).div_ceil(4);
        }
    }
    let terminal = match &rule.error {
        Some(e) => RawEvent::Error { message: e.message.clone(), code: e.code.as_deref().map(ErrorCode::parse) },
        None => RawEvent::Finish { reason: rule.finish.clone().unwrap_or_else(|| "stop".to_owned()) },
    };
    send(&sink, terminal).await
}

impl Runtime for ScriptedRuntime {
    fn run_turn(&self, request: TurnRequest, sink: EventSink, cancel: CancellationToken) -> RuntimeFuture {
        let rule = self.plan(&request.prompt);
        let pace = self.pace;
        Box::pin(async move {
            // A stop (cancellation, or nobody listening any more) is not an error of the runtime.
            let _ = play(rule, pace, request, sink, cancel).await;
            Ok::<(), RuntimeError>(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// When each text delta of a turn played from `rule` was sent, relative to the turn's
    /// start, on tokio's paused clock (so the figures are the pacer's own, not the machine's).
    async fn delta_times(rule: serde_json::Value) -> Vec<Duration> {
        let rule: Rule = serde_json::from_value(rule).unwrap();
        let request = TurnRequest {
            conversation_id: "c".into(),
            turn_id: "t".into(),
            model: "scripted".into(),
            prompt: "p".into(),
            cwd: None,
            reasoning_effort: None,
            history: None,
            session_id: None,
            previous_turn_id: None,
            tokens_per_estimate: None,
            inbox: Default::default(),
        };
        let (sink, mut events) = crate::runtime::event_queue(1024, 1 << 20);
        let start = Instant::now();
        tokio::spawn(async move { play(Arc::new(rule), 0.0, request, sink, CancellationToken::new()).await.ok() });
        let mut at = Vec::new();
        while let Some(event) = events.recv().await {
            if matches!(event, RawEvent::TextDelta(_)) {
                at.push(start.elapsed());
            }
        }
        at
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_stall_the_next_step_is_paced_again_instead_of_sent_at_once() {
        let rule = serde_json::json!({"pace": 200, "steps": [
            {"text": "first", "stallMs": 100},
            {"text": "one two three four five six seven eight"},
        ]});
        let ms = |n: u64| Duration::from_millis(n);
        // 5 ms a delta; the second step starts after the 100 ms stall and keeps the pace.
        let expected: Vec<Duration> = std::iter::once(ms(5)).chain((1..=8).map(|i| ms(105 + 5 * i))).collect();
        assert_eq!(delta_times(rule).await, expected);
    }

    #[test]
    fn tokens_concatenate_to_the_text() {
        for text in ["", "one", "one two  three ", "  lead", "héllo wörld\nnext"] {
            assert_eq!(split_tokens(text).concat(), text);
        }
        assert_eq!(split_tokens("a b c"), vec!["a ", "b ", "c"]);
    }
}
