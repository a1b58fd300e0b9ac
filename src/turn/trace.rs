//! A turn's spans: the turn, each runtime attempt, each step, each tool call, and the seal,
//! each with the conversation and turn ids. The turn's span is also the one its log lines run
//! in; with `--otlp-endpoint` (the `otlp` feature) they are exported over OTLP (src/otlp.rs).
//! Their target is this module's, enabled at `info` (the log's default level; the exporter
//! keeps it enabled whatever `RUST_LOG` says).
//!
//! Spans are driven by the turn's events rather than by scopes: a step opens with the
//! runtime's `StepStart` (or its first output when a runtime marks no start) and closes with the
//! turn's `step-complete`; a tool call opens with its call and closes with its result.

use std::collections::HashMap;

use tracing::Span;
use tracing::field::Empty;

use crate::runtime::RawEvent;
use crate::wire::AgentEvent;

/// The target of the turn's spans (this module's path).
pub const TARGET: &str = module_path!();

pub(super) struct TurnTrace {
    turn: Span,
    attempt: Option<Span>,
    step: Option<Span>,
    /// Calls not answered yet, by id.
    tools: HashMap<String, Span>,
}

macro_rules! child {
    ($parent:expr, $turn:expr, $name:literal $(, $($field:tt)*)?) => {
        tracing::info_span!(
            parent: $parent,
            $name,
            conversation.id = $turn.conversation_id,
            turn.id = $turn.turn_id
            $(, $($field)*)?
        )
    };
}

/// The ids every span carries, read back from the turn's span.
struct Ids<'a> {
    conversation_id: &'a str,
    turn_id: &'a str,
}

impl TurnTrace {
    pub(super) fn new(conversation_id: &str, turn_id: &str, model: &str) -> TurnTrace {
        let turn = tracing::info_span!(
            parent: None,
            "turn",
            conversation.id = conversation_id,
            turn.id = turn_id,
            model = model,
            reason = Empty,
        );
        TurnTrace { turn, attempt: None, step: None, tools: HashMap::new() }
    }

    /// The turn's span, for the task that runs it (its log lines run in it).
    pub(super) fn span(&self) -> Span {
        self.turn.clone()
    }

    /// A runtime attempt begins (the first, or a retry): the one before it has ended.
    pub(super) fn attempt(&mut self, ids: (&str, &str), attempt: u32) {
        self.step = None;
        self.tools.clear();
        let ids = Ids { conversation_id: ids.0, turn_id: ids.1 };
        self.attempt = Some(child!(&self.turn, ids, "runtime attempt", attempt = attempt));
    }

    /// What a raw event opens or closes.
    pub(super) fn raw(&mut self, ids: (&str, &str), event: &RawEvent) {
        let ids = Ids { conversation_id: ids.0, turn_id: ids.1 };
        match event {
            RawEvent::StepStart => {
                self.step = None;
                self.open_step(&ids);
            }
            RawEvent::TextDelta(_) | RawEvent::ReasoningDelta(_) | RawEvent::Usage(_) if self.step.is_none() => {
                self.open_step(&ids)
            }
            RawEvent::ToolCall { id, name, .. } => {
                if self.step.is_none() {
                    self.open_step(&ids);
                }
                let parent = self.step.as_ref().unwrap_or(&self.turn);
                let span = child!(
                    parent,
                    ids,
                    "tool call",
                    tool.name = name.as_str(),
                    tool.call_id = id.as_str(),
                    tool.error = Empty
                );
                self.tools.insert(id.clone(), span);
            }
            RawEvent::ToolResult { id, is_error, .. } => {
                if let Some(span) = self.tools.remove(id) {
                    span.record("tool.error", is_error);
                }
            }
            _ => {}
        }
    }

    /// What a published event closes: `step-complete` ends the step's span.
    pub(super) fn published(&mut self, event: &AgentEvent) {
        if let AgentEvent::StepComplete(complete) = event
            && let Some(step) = self.step.take()
        {
            step.record("step.id", complete.step_id.as_str());
            if let Some(ttft) = complete.ttft_ms {
                step.record("step.ttft_ms", ttft);
            }
        }
    }

    fn open_step(&mut self, ids: &Ids) {
        let parent = self.attempt.as_ref().unwrap_or(&self.turn);
        self.step = Some(child!(parent, ids, "step", step.id = Empty, step.ttft_ms = Empty));
    }

    /// The seal's span; the turn's span says why it ended. Calls still open end here.
    pub(super) fn seal(&mut self, ids: (&str, &str), reason: &str) -> Span {
        self.tools.clear();
        self.step = None;
        self.attempt = None;
        self.turn.record("reason", reason);
        let ids = Ids { conversation_id: ids.0, turn_id: ids.1 };
        child!(&self.turn, ids, "seal")
    }
}
