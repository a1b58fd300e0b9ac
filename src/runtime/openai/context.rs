//! The conversation as Chat Completions messages, fitted to the model's context window: the
//! log mapped to messages, their estimated size, the trimming, the read of the log's tail that
//! trimming needs, and what an upstream's refusal says it counted.

use serde_json::{Value, json};

use super::super::HistoryChunk;
use crate::wire::{Chunk, ErrorCode, Role};

/// The conversation as Chat Completions messages, always one a strict chat template takes
/// (alternating user and assistant turns):
/// - a message per log message; thinking and error chunks stay home, and each tool result is
///   a `tool` message; a tool call no later result answered (the gateway stopped during it)
///   goes up answered `Aborted`, after the results of its message's other calls (the API
///   rejects a call without its answer);
/// - an assistant message that had only reasoning is kept, with empty content;
/// - the message of a turn the upstream refused as too long for the context is left out;
/// - consecutive user messages (a turn that failed or was stopped before any answer, then the
///   next one) are merged into one, and so are consecutive assistant messages.
fn messages(history: &[HistoryChunk], system_prompt: Option<&str>) -> Vec<Value> {
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
    // `Aborted` answers of the last assistant message's unanswered calls: they go up once its
    // other calls' results have.
    let mut aborted: Vec<Value> = Vec::new();
    let mut i = 0;
    while i < history.len() {
        let id = history[i].message_id;
        let role = history[i].role;
        let start = i;
        let group: Vec<&HistoryChunk> = history[i..].iter().take_while(|c| c.message_id == id).collect();
        i += group.len();
        if role != Role::Tool {
            out.append(&mut aborted);
        }
        let text: String = group
            .iter()
            .filter_map(|c| match &c.chunk {
                Chunk::Text(t) => Some(t.text.as_str()),
                Chunk::System(s) => Some(s.text.as_str()),
                _ => None,
            })
            .collect();
        let too_long =
            group.iter().any(|c| matches!(&c.chunk, Chunk::Error(e) if e.code == Some(ErrorCode::ContextLength)));
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
                        Chunk::ToolCall(call) => {
                            if !answered {
                                aborted.push(
                                    json!({"role": "tool", "tool_call_id": call.tool_call_id, "content": "Aborted"}),
                                );
                            }
                            Some(json!({
                                "id": call.tool_call_id,
                                "type": "function",
                                "function": {"name": call.tool_name, "arguments": call.input.to_string()},
                            }))
                        }
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
    out.append(&mut aborted);
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
pub(super) fn estimated_tokens(message: &Value) -> u64 {
    let text =
        message["content"].as_str().map_or(0, str::len) + message.get("tool_calls").map_or(0, |c| c.to_string().len());
    (text as u64).div_ceil(4) + 4
}

/// This turn's earlier steps (assistant calls, tool results, steering) as a request of at most
/// `bound` tokens carries them: within three quarters of it (the new prompt and some history
/// need room too). While they are over that, the oldest tool result, then the oldest call's
/// arguments and text, is replaced by a line saying what was left out, so that a loop that
/// calls many tools or reads large results cannot grow its requests without bound. Also
/// returns how many messages were shortened.
pub(super) fn fitting_steps(added: &[Value], bound: u64) -> (std::borrow::Cow<'_, [Value]>, usize) {
    let budget = bound / 4 * 3;
    let mut total: u64 = added.iter().map(estimated_tokens).sum();
    if total <= budget {
        return (std::borrow::Cow::Borrowed(added), 0);
    }
    let mut steps = added.to_vec();
    let mut shortened = 0;
    // Results first (they are most of a loop's bytes), then what the model wrote.
    for role in ["tool", "assistant"] {
        for message in steps.iter_mut().filter(|m| m["role"] == role) {
            if total <= budget {
                return (std::borrow::Cow::Owned(steps), shortened);
            }
            let before = estimated_tokens(message);
            let bytes = message["content"].as_str().map_or(0, str::len)
                + message.get("tool_calls").map_or(0, |c| c.to_string().len());
            let note = format!(
                "[{bytes} bytes left out of this request: the turn's tool calls and results passed its size bound]"
            );
            // A short message would only grow.
            if bytes <= note.len() * 2 {
                continue;
            }
            message["content"] = Value::String(note);
            for call in message.get_mut("tool_calls").and_then(Value::as_array_mut).into_iter().flatten() {
                call["function"]["arguments"] = Value::String("{}".into());
            }
            total = total - before + estimated_tokens(message);
            shortened += 1;
        }
    }
    (std::borrow::Cow::Owned(steps), shortened)
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
/// `from..=to`): the oldest turns left out until the estimate fits `budget`, reading from the
/// log's end only as far back as that needs. Once a read's
/// tail has a turn left out, nothing older could be kept (an older message only adds to every
/// longer tail), so the log before it is never read: docs/upstreams.md has the argument.
/// Also returns how many messages of the read tail were left out.
pub(super) async fn fitting_messages<F, Fut, E>(
    len: u64,
    mut read: F,
    system_prompt: Option<&str>,
    budget: u64,
) -> Result<(Vec<Value>, usize), E>
where
    F: FnMut(u64, u64) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<HistoryChunk>, E>>,
{
    let keep = usize::from(system_prompt.is_some());
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
pub(super) fn context_exceeded(body: &str) -> bool {
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

/// How many tokens the upstream says the refused request's messages were, where its error
/// says: llama.cpp's `n_prompt_tokens`, or the number in OpenAI's, vLLM's and their kin's
/// wordings ("(N in the messages", "N tokens in the messages", "N input tokens", "your
/// messages resulted in N", "request (N tokens)").
pub(super) fn prompt_tokens_counted(body: &str) -> Option<u64> {
    if let Ok(error) = serde_json::from_str::<Value>(body)
        && let Some(n) = error.pointer("/error/n_prompt_tokens").and_then(Value::as_u64)
    {
        return Some(n);
    }
    let text = body.to_ascii_lowercase();
    let before = [" in the messages", " tokens in the messages", " input tokens"].into_iter().find_map(|marker| {
        text.match_indices(marker).find_map(|(at, _)| {
            let digits = text[..at].bytes().rev().take_while(u8::is_ascii_digit).count();
            text[at - digits..at].parse().ok()
        })
    });
    before.or_else(|| {
        ["resulted in ", "request ("].into_iter().find_map(|marker| {
            text.match_indices(marker).find_map(|(at, _)| {
                let rest = &text[at + marker.len()..];
                rest[..rest.bytes().take_while(u8::is_ascii_digit).count()].parse().ok()
            })
        })
    })
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
                duration_ms: None,
                output: None,
            })
        };
        let assistant_chunk = prop_oneof![
            4 => (0usize..120).prop_map(move |n| Chunk::Text(TextChunk { text: text(n) })),
            1 => (0usize..40).prop_map(move |n| Chunk::Thinking(ThinkingChunk { text: text(n) })),
            2 => (0u8..6).prop_map(call),
            1 => prop_oneof![Just(Some(ErrorCode::ContextLength)), Just(None)]
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
    /// goes up answered `Aborted` even when a later turn's call of the same id was answered.
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
            duration_ms: None,
            output: None,
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
        assert_eq!(sent[1]["tool_calls"][0]["function"]["arguments"], "{\"n\":1}", "{sent:?}");
        assert_eq!(sent[2], json!({"role": "tool", "tool_call_id": "call_0", "content": "Aborted"}));
        assert_eq!(sent[4]["tool_calls"][0]["function"]["arguments"], "{\"n\":2}");
        assert_eq!(sent[5]["content"], "r");
        assert_eq!(sent.len(), 7);
    }

    /// The wordings servers refuse a too long request in, and the counts they carry.
    #[test]
    fn a_refusal_says_how_many_tokens_the_messages_were() {
        let said = [
            (
                r#"{"error":{"code":400,"message":"request (4476 tokens) exceeds the available context size (4096 tokens)","type":"exceed_context_size_error","n_prompt_tokens":4476,"n_ctx":4096}}"#,
                Some(4476),
            ),
            ("request (4476 tokens) exceeds the available context size (4096 tokens)", Some(4476)),
            (
                "This model's maximum context length is 32768 tokens. However, you requested 33348 tokens (32836 in the messages, 512 in the completion). Please reduce the length of the messages or completion.",
                Some(32836),
            ),
            (
                "This model's maximum context length is 32768 tokens. However, you requested 32818 tokens in the messages, Please reduce the length of the messages.",
                Some(32818),
            ),
            (
                "This model's maximum context length is 32768 tokens. However, your request has 40354 input tokens. Please reduce the length of the input messages.",
                Some(40354),
            ),
            (
                "This model's maximum context length is 128000 tokens. However, your messages resulted in 150000 tokens.",
                Some(150000),
            ),
            ("This model's maximum context length is 1200 tokens. Please reduce the length of the messages.", None),
            (r#"{"error":{"message":"context_length_exceeded"}}"#, None),
            // Hostile or odd: a count past u64, a marker with no number or at the very start,
            // a negative or fractional n_prompt_tokens, text that is not UTF-8-clean JSON.
            ("you requested 99999999999999999999999 tokens in the messages", None),
            (" in the messages (no number before it)", None),
            ("your messages resulted in tokens", None),
            (r#"{"error":{"n_prompt_tokens":-5,"message":"x"}}"#, None),
            (r#"{"error":{"n_prompt_tokens":1.5,"message":"x (7 in the messages"}}"#, Some(7)),
            ("\u{0}\u{ffff} request (12 tokens) exceeds", Some(12)),
        ];
        for (body, count) in said {
            assert_eq!(prompt_tokens_counted(body), count, "{body}");
        }
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
            let (tail, _) = fitting_messages(len, read, prompt, budget).now_or_never().unwrap().unwrap();
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
                    duration_ms: None,
                    output: None,
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
