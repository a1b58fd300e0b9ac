//! Chunk assembly: how a turn's events become log chunks. Pure, no I/O.
//!
//! Consecutive text deltas of a step merge into one `text` chunk and consecutive reasoning
//! deltas into one `thinking` chunk; alternation starts a new chunk. A step's assistant chunks
//! form one message; each tool result is a message of its own (role `tool`), as chat APIs
//! expect; a turn-level error is an assistant message of its own.

use crate::store::NewChunk;
use crate::wire::{Chunk, ErrorChunk, ErrorCode, Role, TextChunk, ThinkingChunk, ToolCallChunk, ToolResultChunk};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    None,
    Text,
    Thinking,
}

#[derive(Debug)]
pub struct ChunkAssembler {
    pending: Vec<NewChunk>,
    /// Bytes of tool results in `pending`.
    results: usize,
    run: Run,
    /// An assistant message is open in this step: the next assistant chunk continues it.
    in_message: bool,
}

impl Default for ChunkAssembler {
    fn default() -> Self {
        ChunkAssembler { pending: Vec::new(), results: 0, run: Run::None, in_message: false }
    }
}

impl ChunkAssembler {
    pub fn text(&mut self, delta: &str) {
        self.delta(delta, Run::Text);
    }

    pub fn reasoning(&mut self, delta: &str) {
        self.delta(delta, Run::Thinking);
    }

    fn delta(&mut self, delta: &str, kind: Run) {
        if self.run == kind
            && let Some(last) = self.pending.last_mut()
        {
            match &mut last.chunk {
                Chunk::Text(TextChunk { text }) | Chunk::Thinking(ThinkingChunk { text }) => {
                    text.push_str(delta);
                    return;
                }
                _ => {}
            }
        }
        let text = delta.to_owned();
        let chunk = match kind {
            Run::Thinking => Chunk::Thinking(ThinkingChunk { text }),
            _ => Chunk::Text(TextChunk { text }),
        };
        self.assistant(chunk);
        self.run = kind;
    }

    pub fn tool_call(&mut self, call: ToolCallChunk) {
        self.assistant(Chunk::ToolCall(call));
    }

    pub fn tool_result(&mut self, result: ToolResultChunk) {
        self.results += result.content.len();
        self.pending.push(NewChunk { role: Role::Tool, chunk: Chunk::ToolResult(result), new_message: true });
        self.run = Run::None;
        self.in_message = false;
    }

    /// A user message that reached the runtime mid-turn (steering): a message of its own.
    pub fn user(&mut self, text: &str) {
        self.pending.push(NewChunk {
            role: Role::User,
            chunk: Chunk::Text(TextChunk { text: text.to_owned() }),
            new_message: true,
        });
        self.run = Run::None;
        self.in_message = false;
    }

    pub fn error(&mut self, message: &str, code: Option<ErrorCode>) {
        self.in_message = false;
        self.assistant(Chunk::Error(ErrorChunk { message: message.to_owned(), code }));
        self.in_message = false;
    }

    /// A step ended: its text runs end and the next step's content is a new message.
    pub fn end_step(&mut self) {
        self.run = Run::None;
        self.in_message = false;
    }

    /// Hands out what is ready to be written, in order.
    pub fn take(&mut self) -> Vec<NewChunk> {
        self.run = Run::None;
        self.results = 0;
        std::mem::take(&mut self.pending)
    }

    /// Bytes of tool results waiting to be written: each is a message of its own, so they may
    /// be written as they come, and a step's results of MiBs are not held until its end.
    pub fn pending_results(&self) -> usize {
        self.results
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn assistant(&mut self, chunk: Chunk) {
        self.pending.push(NewChunk { role: Role::Assistant, chunk, new_message: !self.in_message });
        self.run = Run::None;
        self.in_message = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn summary(chunks: &[NewChunk]) -> Vec<(Role, bool, Chunk)> {
        chunks.iter().map(|c| (c.role, c.new_message, c.chunk.clone())).collect()
    }

    #[test]
    fn runs_merge_and_alternation_splits() {
        let mut a = ChunkAssembler::default();
        a.reasoning("think ");
        a.reasoning("more");
        a.text("Hel");
        a.text("lo");
        a.reasoning("again");
        a.tool_call(ToolCallChunk {
            tool_call_id: "c1".into(),
            tool_name: "t".into(),
            input: json!({}),
            step_id: Some("s#0".into()),
        });
        a.end_step();
        a.tool_result(ToolResultChunk {
            tool_call_id: "c1".into(),
            tool_name: "t".into(),
            content: "ok".into(),
            is_error: false,
            step_id: Some("s#0".into()),
            duration_ms: None,
            output: None,
        });
        a.text("next step");
        let got = summary(&a.take());
        let thinking = |t: &str| Chunk::Thinking(ThinkingChunk { text: t.into() });
        let text = |t: &str| Chunk::Text(TextChunk { text: t.into() });
        assert_eq!(got[0], (Role::Assistant, true, thinking("think more")));
        assert_eq!(got[1], (Role::Assistant, false, text("Hello")));
        assert_eq!(got[2], (Role::Assistant, false, thinking("again")));
        assert!(matches!(got[3], (Role::Assistant, false, Chunk::ToolCall(_))));
        assert!(matches!(got[4], (Role::Tool, true, Chunk::ToolResult(_))));
        assert_eq!(got[5], (Role::Assistant, true, text("next step")));
        assert_eq!(got.len(), 6);
        assert!(!a.has_pending());
    }

    #[test]
    fn a_new_step_starts_a_new_text_chunk() {
        let mut a = ChunkAssembler::default();
        a.text("one");
        a.end_step();
        a.text("two");
        a.error("boom", Some(ErrorCode::Other("x".into())));
        let got = summary(&a.take());
        assert_eq!(got.len(), 3);
        assert_eq!(got[1], (Role::Assistant, true, Chunk::Text(TextChunk { text: "two".into() })));
        assert_eq!(
            got[2],
            (
                Role::Assistant,
                true,
                Chunk::Error(ErrorChunk { message: "boom".into(), code: Some(ErrorCode::Other("x".into())) })
            )
        );
    }
}
