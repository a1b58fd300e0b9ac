//! The turn's event handling as a pure step function: a raw runtime event (and the time) in,
//! effects out, in order: events to publish, points where the chunks assembled so far are
//! written, the runtime's session id. `run.rs` is the driver that carries them out; the
//! property test in this file drives whole turns through it.

use std::collections::HashMap;
use std::time::Instant;

use super::assembly::ChunkAssembler;
use super::tally::{OpenStep, TurnTally};
use crate::runtime::RawEvent;
use crate::wire::*;

/// Bytes of tool results that wait for the step's next write at most: past it they are written
/// at once (a step of many large results would otherwise hold them all until its end).
const PERSIST_RESULTS: usize = 1024 * 1024;

/// How a turn ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum End {
    Finished(String),
    Failed { message: String, code: Option<ErrorCode> },
    Aborted,
}

/// A tool's result as the runtime reported it.
struct ToolResult {
    id: String,
    name: String,
    content: String,
    is_error: bool,
    duration_ms: Option<u64>,
}

impl End {
    /// `done.reason`.
    pub(super) fn reason(&self) -> String {
        match self {
            End::Finished(reason) => reason.clone(),
            End::Failed { .. } => "error".to_owned(),
            End::Aborted => "aborted".to_owned(),
        }
    }
}

/// What handling an event asks of the driver.
#[derive(Debug)]
pub(super) enum Effect {
    Publish(AgentEvent),
    /// Write the chunks assembled so far (a step closed, or a steering message came).
    Persist,
    /// Remember the runtime's session, to resume it on the next turn.
    SessionId(String),
}

/// A turn's state between raw events.
pub(super) struct TurnSteps {
    conversation_id: String,
    turn_id: String,
    pub(super) tally: TurnTally,
    pub(super) assembler: ChunkAssembler,
    step: Option<OpenStep>,
    /// When the last step boundary happened: the start of a step that opens implicitly.
    boundary: Instant,
    /// Which step each tool call came from, for its result.
    call_steps: HashMap<String, String>,
    /// Tool calls no result has answered yet (id and name), oldest first: a stopped turn
    /// answers them `Aborted`.
    unanswered: Vec<(String, String)>,
    /// Something of the runtime's output has been published: no more retries.
    pub(super) published_content: bool,
    /// The open step produced something (a delta, a tool call, usage): a failed turn whose
    /// step produced nothing leaves no step behind.
    step_content: bool,
    /// The runtime's last calibration, written with the seal.
    pub(super) tokens_per_estimate: Option<f64>,
    /// What each unanswered tool call streamed (`tool-output`), kept for its result's chunk so
    /// that a reopened turn shows it as the live one did: at most `max_output` bytes over the
    /// whole turn (`output_kept` so far), however many calls stream.
    outputs: HashMap<String, String>,
    max_output: usize,
    output_kept: usize,
    /// The prompt's estimated tokens (four bytes a token, as the runtimes' estimator).
    prompt_tokens: u64,
}

impl TurnSteps {
    pub(super) fn new(conversation_id: &str, turn_id: &str, now: Instant, max_output: usize) -> TurnSteps {
        TurnSteps {
            conversation_id: conversation_id.to_owned(),
            turn_id: turn_id.to_owned(),
            tally: TurnTally::new(now),
            assembler: ChunkAssembler::default(),
            step: None,
            boundary: now,
            call_steps: HashMap::new(),
            unanswered: Vec::new(),
            published_content: false,
            step_content: false,
            tokens_per_estimate: None,
            outputs: HashMap::new(),
            max_output,
            output_kept: 0,
            prompt_tokens: 0,
        }
    }

    /// A tool call: in the open step, remembered until its result comes.
    fn tool_call(
        &mut self,
        conversation_id: String,
        turn_id: String,
        id: String,
        name: String,
        input: serde_json::Value,
        out: &mut Vec<Effect>,
    ) {
        let step_id = self.open_step().step_id.clone();
        self.open_step().streamed(name.len() + input.to_string().len());
        self.call_steps.insert(id.clone(), step_id.clone());
        self.unanswered.push((id.clone(), name.clone()));
        self.assembler.tool_call(ToolCallChunk {
            tool_call_id: id.clone(),
            tool_name: name.clone(),
            input: input.clone(),
            step_id: Some(step_id.clone()),
        });
        out.push(Effect::Publish(AgentEvent::ToolCall(TurnToolCallEvent {
            conversation_id,
            turn_id,
            step_id,
            tool_call_id: id,
            tool_name: name,
            input,
        })));
    }

    /// A tool's result: it closes the step that called it, and is kept once enough are held.
    fn tool_result(
        &mut self,
        (conversation_id, turn_id): (String, String),
        result: ToolResult,
        now: Instant,
        out: &mut Vec<Effect>,
    ) {
        let ToolResult { id, name, content, is_error, duration_ms } = result;
        self.close_step(now, out);
        let step_id = self.call_steps.get(&id).cloned().unwrap_or_else(|| self.last_step_id());
        if let Some(at) = self.unanswered.iter().position(|(call, _)| *call == id) {
            self.unanswered.remove(at);
        }
        self.assembler.tool_result(ToolResultChunk {
            tool_call_id: id.clone(),
            tool_name: name.clone(),
            content: content.clone(),
            is_error,
            step_id: Some(step_id.clone()),
            duration_ms,
            output: self.outputs.remove(&id),
        });
        out.push(Effect::Publish(AgentEvent::ToolResult(TurnToolResultEvent {
            conversation_id,
            turn_id,
            step_id,
            tool_call_id: id,
            tool_name: name,
            content,
            is_error,
            duration_ms,
        })));
        if self.assembler.pending_results() >= PERSIST_RESULTS {
            out.push(Effect::Persist);
        }
        self.boundary = now;
    }

    /// Keeps a call's streamed output while the turn's `max_output` bytes last (cut at a
    /// character), and only for a call that was made and not answered: a runtime cannot grow
    /// the map with made-up ids, nor hold a budget per call by making many calls.
    fn keep_output(&mut self, id: &str, data: &str) {
        if !self.unanswered.iter().any(|(call, _)| call == id) {
            return;
        }
        let mut end = self.max_output.saturating_sub(self.output_kept).min(data.len());
        while !data.is_char_boundary(end) {
            end -= 1;
        }
        if end > 0 {
            self.outputs.entry(id.to_owned()).or_default().push_str(&data[..end]);
            self.output_kept += end;
        }
    }

    /// Usage: counted in the open step (one opened at the last boundary when none was).
    fn usage(&mut self, conversation_id: String, turn_id: String, usage: crate::wire::Usage, out: &mut Vec<Effect>) {
        if self.step.is_none() && self.tally.step_count() == 0 {
            self.step = Some(self.new_step(self.boundary));
        }
        let step_id = match &self.step {
            Some(s) => s.step_id.clone(),
            None => self.last_step_id(),
        };
        self.tally.add_usage(self.step.as_mut(), &usage);
        let event = TurnUsageEvent { conversation_id, turn_id, step_id: Some(step_id), usage };
        out.push(Effect::Publish(AgentEvent::Usage(event)));
    }

    fn ids(&self) -> (String, String) {
        (self.conversation_id.clone(), self.turn_id.clone())
    }

    /// Handles one raw event published at `now`; the end, when it is a terminal.
    pub(super) fn handle(&mut self, event: RawEvent, now: Instant, out: &mut Vec<Effect>) -> Option<End> {
        let bookkeeping = matches!(
            event,
            RawEvent::StepStart | RawEvent::SessionId(_) | RawEvent::TokensPerEstimate(_) | RawEvent::RequestSize(_)
        );
        if !bookkeeping {
            self.published_content = true;
        }
        self.step_content |= !bookkeeping && !matches!(event, RawEvent::Error { .. } | RawEvent::Finish { .. });
        let (conversation_id, turn_id) = self.ids();
        match event {
            RawEvent::StepStart => {
                self.close_step(now, out);
                self.step = Some(self.new_step(now));
                self.step_content = false;
            }
            RawEvent::TextDelta(delta) | RawEvent::ReasoningDelta(delta) if delta.is_empty() => {}
            RawEvent::TextDelta(delta) => {
                self.open_step().token(now);
                self.open_step().streamed(delta.len());
                self.assembler.text(&delta);
                out.push(Effect::Publish(AgentEvent::TextDelta(TurnTextDeltaEvent {
                    conversation_id,
                    turn_id,
                    delta,
                })));
            }
            RawEvent::ReasoningDelta(delta) => {
                self.open_step().token(now);
                self.open_step().streamed(delta.len());
                self.assembler.reasoning(&delta);
                let event = TurnReasoningDeltaEvent { conversation_id, turn_id, delta };
                out.push(Effect::Publish(AgentEvent::ReasoningDelta(event)));
            }
            RawEvent::ToolCall { id, name, input } => self.tool_call(conversation_id, turn_id, id, name, input, out),
            RawEvent::ToolOutput { id, data, stream } => {
                self.keep_output(&id, &data);
                out.push(Effect::Publish(AgentEvent::ToolOutput(TurnToolOutputEvent {
                    conversation_id,
                    turn_id,
                    tool_call_id: id,
                    data,
                    stream,
                })));
            }
            RawEvent::ToolResult { id, name, content, is_error, duration_ms } => {
                let ids = (conversation_id, turn_id);
                self.tool_result(ids, ToolResult { id, name, content, is_error, duration_ms }, now, out);
            }
            RawEvent::Usage(usage) => self.usage(conversation_id, turn_id, usage, out),
            RawEvent::StepEnd => self.close_step(now, out),
            RawEvent::Finish { reason } => return Some(End::Finished(reason)),
            RawEvent::Error { message, code } => return Some(End::Failed { message, code }),
            RawEvent::UserInput(text) => {
                self.close_step(now, out);
                self.assembler.user(&text);
                out.push(Effect::Persist);
                self.boundary = now;
            }
            RawEvent::SessionId(id) => out.push(Effect::SessionId(id)),
            RawEvent::TokensPerEstimate(ratio) => self.tokens_per_estimate = Some(ratio),
            RawEvent::RequestSize(tokens) => self.open_step().sent_tokens = tokens,
        }
        None
    }

    /// The turn's prompt: the first step's charge until the runtime reports its request.
    pub(super) fn prompt(&mut self, prompt: &str) {
        self.prompt_tokens = (prompt.len() as u64).div_ceil(4) + 4;
    }

    /// A retry after a failed attempt: the step it opened produced nothing.
    pub(super) fn forget_step(&mut self) {
        self.step = None;
    }

    /// The first half of a turn's end: closes the open step (a failed turn's step that produced
    /// nothing is dropped instead: a request the upstream never answered is no step of the
    /// model's).
    /// A stopped turn's calls still in flight are answered `Aborted` (an error result), so
    /// that every call in the log has its result.
    pub(super) fn close(&mut self, end: &End, now: Instant, out: &mut Vec<Effect>) {
        if matches!(end, End::Failed { .. }) && !self.step_content {
            self.step = None;
        }
        self.close_step(now, out);
        if matches!(end, End::Aborted) {
            for (id, name) in std::mem::take(&mut self.unanswered) {
                let aborted =
                    RawEvent::ToolResult { id, name, content: "Aborted".into(), is_error: true, duration_ms: None };
                self.handle(aborted, now, out);
            }
        }
    }

    /// The second half: `error` (for a failed turn), then `done`. Its duration.
    pub(super) fn end(&mut self, end: &End, now: Instant, out: &mut Vec<Effect>) -> u64 {
        let (conversation_id, turn_id) = self.ids();
        if let End::Failed { message, code } = end {
            self.assembler.error(message, code.clone());
            out.push(Effect::Publish(AgentEvent::Error(TurnErrorEvent {
                conversation_id: conversation_id.clone(),
                turn_id: turn_id.clone(),
                message: message.clone(),
                code: code.clone(),
            })));
        }
        let duration_ms = self.tally.duration_ms(now);
        out.push(Effect::Publish(AgentEvent::Done(TurnDoneEvent {
            conversation_id,
            turn_id,
            reason: end.reason(),
            duration_ms: Some(duration_ms),
            usage: self.tally.usage(),
            context_size: self.tally.context_size(),
        })));
        duration_ms
    }

    fn new_step(&self, started: Instant) -> OpenStep {
        let mut step = OpenStep::new(format!("{}#{}", self.turn_id, self.tally.step_count()), started);
        // Until the runtime says what it sent, the first step is charged the prompt.
        if self.tally.step_count() == 0 {
            step.sent_tokens = self.prompt_tokens;
        }
        step
    }

    fn open_step(&mut self) -> &mut OpenStep {
        if self.step.is_none() {
            self.step = Some(self.new_step(self.boundary));
        }
        self.step.as_mut().expect("just opened")
    }

    fn last_step_id(&self) -> String {
        format!("{}#{}", self.turn_id, self.tally.step_count().saturating_sub(1))
    }

    /// Ends the open step, if any: `step-complete`, then its chunks are written.
    fn close_step(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let Some(step) = self.step.take() else { return };
        let step_id = step.step_id.clone();
        let timing = self.tally.close_step(step, now);
        self.boundary = now;
        let (conversation_id, turn_id) = self.ids();
        out.push(Effect::Publish(AgentEvent::StepComplete(TurnStepCompleteEvent {
            conversation_id,
            turn_id,
            step_id,
            ttft_ms: timing.ttft_ms,
            decode_ms: timing.decode_ms,
            gen_total_ms: Some(timing.gen_total_ms),
        })));
        self.assembler.end_step();
        out.push(Effect::Persist);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;
    use crate::wire::OutputStream;

    fn raw() -> impl Strategy<Value = RawEvent> {
        prop_oneof![
            Just(RawEvent::StepStart),
            Just(RawEvent::StepEnd),
            "[a-c ]{0,3}".prop_map(RawEvent::TextDelta),
            "[x-z]{0,2}".prop_map(RawEvent::ReasoningDelta),
            (0u8..3).prop_map(|i| RawEvent::ToolCall {
                id: format!("call{i}"),
                name: "t".into(),
                input: serde_json::json!({}),
            }),
            (0u8..3).prop_map(|i| RawEvent::ToolOutput {
                id: format!("call{i}"),
                data: "o".into(),
                stream: OutputStream::Stdout
            }),
            (0u8..4).prop_map(|i| RawEvent::ToolResult {
                id: format!("call{i}"),
                name: "t".into(),
                content: "r".into(),
                is_error: false,
                duration_ms: None,
            }),
            (1u64..50).prop_map(|n| RawEvent::Usage(Usage {
                input_tokens: n,
                output_tokens: n,
                cache_read_tokens: None,
                cache_write_tokens: None
            })),
            Just(RawEvent::UserInput("steer".into())),
            Just(RawEvent::SessionId("s".into())),
            Just(RawEvent::TokensPerEstimate(1.5)),
        ]
    }

    fn end() -> impl Strategy<Value = End> {
        prop_oneof![
            Just(End::Finished("stop".into())),
            Just(End::Failed { message: "boom".into(), code: Some(ErrorCode::Upstream) }),
            Just(End::Aborted),
        ]
    }

    /// Drives a whole turn, each event a millisecond after the last; what it published, and
    /// where the chunks were written (indices into the published events).
    fn drive(events: Vec<RawEvent>, ending: End) -> (Vec<AgentEvent>, TurnSteps, u64) {
        let t0 = Instant::now();
        let mut steps = TurnSteps::new("c", "t", t0, 64);
        let mut out = Vec::new();
        let mut at = t0;
        let mut end = None;
        for event in events {
            at += Duration::from_millis(1);
            if let Some(e) = steps.handle(event, at, &mut out) {
                end = Some(e);
                break;
            }
        }
        let end = end.unwrap_or(ending);
        steps.close(&end, at, &mut out);
        let duration = steps.end(&end, at, &mut out);
        let published = out
            .into_iter()
            .filter_map(|e| match e {
                Effect::Publish(event) => Some(event),
                _ => None,
            })
            .collect();
        (published, steps, duration)
    }

    proptest! {
        #[test]
        fn whole_turns_keep_the_wire_rules(events in proptest::collection::vec(raw(), 0..40), ending in end()) {
            let texts: String = events.iter().filter_map(|e| match e {
                RawEvent::TextDelta(d) => Some(d.as_str()),
                _ => None,
            }).collect();
            let (published, steps, _) = drive(events, ending.clone());
            // `done` ends the turn, once, with the end's reason; `error` comes right before it
            // exactly when the turn failed.
            let dones: Vec<_> = published.iter().filter(|e| matches!(e, AgentEvent::Done(_))).collect();
            prop_assert_eq!(dones.len(), 1);
            let AgentEvent::Done(done) = published.last().unwrap() else { panic!("done is last") };
            prop_assert_eq!(&done.reason, &ending.reason());
            let errors = published.iter().filter(|e| matches!(e, AgentEvent::Error(_))).count();
            prop_assert_eq!(errors, usize::from(matches!(ending, End::Failed { .. })));
            // Steps complete once each, numbered in order, and the tally counts them.
            let completed: Vec<String> = published.iter().filter_map(|e| match e {
                AgentEvent::StepComplete(s) => Some(s.step_id.clone()),
                _ => None,
            }).collect();
            let numbered: Vec<String> = (0..completed.len()).map(|i| format!("t#{i}")).collect();
            prop_assert_eq!(&completed, &numbered);
            prop_assert_eq!(steps.tally.step_count(), completed.len());
            // genTotalMs is ttftMs + decodeMs exactly.
            for e in &published {
                if let AgentEvent::StepComplete(s) = e && let (Some(t), Some(d)) = (s.ttft_ms, s.decode_ms) {
                    prop_assert_eq!(Some(t + d), s.gen_total_ms);
                }
            }
            // A tool call belongs to a step that completes after it; its result names that step.
            let mut call_steps = HashMap::new();
            for (i, e) in published.iter().enumerate() {
                match e {
                    AgentEvent::ToolCall(c) => {
                        let later = published[i..].iter().any(|e| matches!(e, AgentEvent::StepComplete(s) if s.step_id == c.step_id));
                        prop_assert!(later, "the step of {} completes after it", c.tool_call_id);
                        call_steps.insert(c.tool_call_id.clone(), c.step_id.clone());
                    }
                    AgentEvent::ToolResult(r) => if let Some(step) = call_steps.get(&r.tool_call_id) {
                        prop_assert_eq!(step, &r.step_id);
                    },
                    _ => {}
                }
            }
            // The text deltas published are every non-empty one the runtime sent, in order.
            let published_text: String = published.iter().filter_map(|e| match e {
                AgentEvent::TextDelta(d) => Some(d.delta.as_str()),
                _ => None,
            }).collect();
            prop_assert_eq!(published_text, texts);
        }
    }

    /// Tool results are written once they add up to `PERSIST_RESULTS`, not held to the
    /// step's end; small ones wait for it.
    /// The outputs kept with results share one budget for the turn, cut at a character; an
    /// output for a call never made is not kept.
    #[test]
    fn kept_tool_output_is_bounded_for_the_whole_turn() {
        let now = Instant::now();
        let mut steps = TurnSteps::new("c", "t", now, 64);
        let mut out = Vec::new();
        for i in 0..3 {
            let call = RawEvent::ToolCall { id: format!("call{i}"), name: "run".into(), input: serde_json::json!({}) };
            steps.handle(call, now, &mut out);
            let output =
                RawEvent::ToolOutput { id: format!("call{i}"), data: "é".repeat(20), stream: OutputStream::Stdout };
            steps.handle(output, now, &mut out);
        }
        let stray = RawEvent::ToolOutput { id: "made-up".into(), data: "x".into(), stream: OutputStream::Stdout };
        steps.handle(stray, now, &mut out);
        assert_eq!(steps.outputs.get("call0").map(String::len), Some(40));
        assert_eq!(steps.outputs.get("call1").map(String::len), Some(24), "cut at a character, within 64 bytes");
        assert_eq!(steps.outputs.get("call2"), None, "nothing left for the third call");
        assert!(!steps.outputs.contains_key("made-up"));
    }

    #[test]
    fn large_tool_results_are_written_as_they_come() {
        let now = Instant::now();
        let mut steps = TurnSteps::new("c", "t", now, 64);
        let mut out = Vec::new();
        let result = |i: usize, size: usize| RawEvent::ToolResult {
            id: format!("call{i}"),
            name: "read".into(),
            content: "r".repeat(size),
            is_error: false,
            duration_ms: None,
        };
        let persists = |out: &Vec<Effect>| out.iter().filter(|e| matches!(e, Effect::Persist)).count();
        steps.handle(RawEvent::TextDelta("hi".into()), now, &mut out);
        steps.handle(RawEvent::StepEnd, now, &mut out);
        out.clear();
        for i in 0..4 {
            steps.handle(result(i, 100), now, &mut out);
        }
        assert_eq!(persists(&out), 0, "small results wait for the step's next write");
        for i in 0..3 {
            out.clear();
            steps.handle(result(10 + i, 600 * 1024), now, &mut out);
            assert_eq!(persists(&out), usize::from(i % 2 == 1), "result {i}");
            if i % 2 == 1 {
                assert_eq!(steps.assembler.take().len(), 7, "the text, four small results and two large");
            }
        }
    }
}
