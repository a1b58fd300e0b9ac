//! Golden JSON for every wire type: the exact string out, and the same value back in.

use dispatch_gateway::wire::*;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

fn golden<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(value: T, expected: &str) {
    assert_eq!(serde_json::to_string(&value).unwrap(), expected);
    let back: T = serde_json::from_str(expected).unwrap();
    assert_eq!(back, value);
}

fn ids() -> (String, String) {
    ("c1".to_owned(), "t1".to_owned())
}

fn usage() -> Usage {
    Usage { input_tokens: 10, output_tokens: 5, cache_read_tokens: None, cache_write_tokens: None }
}

#[test]
fn every_agent_event_variant() {
    let (c, t) = ids();
    let cases: Vec<(AgentEvent, &str)> = vec![
        (
            AgentEvent::Status(StatusEvent { conversation_id: c.clone(), status: "running".into() }),
            r#"{"type":"status","conversationId":"c1","status":"running"}"#,
        ),
        (
            AgentEvent::TurnStart(TurnStartEvent { conversation_id: c.clone(), turn_id: t.clone() }),
            r#"{"type":"turn-start","conversationId":"c1","turnId":"t1"}"#,
        ),
        (
            AgentEvent::UserMessage(TurnInputEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                text: "hi".into(),
            }),
            r#"{"type":"user-message","conversationId":"c1","turnId":"t1","text":"hi"}"#,
        ),
        (
            AgentEvent::TextDelta(TurnTextDeltaEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                delta: "He".into(),
            }),
            r#"{"type":"text-delta","conversationId":"c1","turnId":"t1","delta":"He"}"#,
        ),
        (
            AgentEvent::ReasoningDelta(TurnReasoningDeltaEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                delta: "hm".into(),
            }),
            r#"{"type":"reasoning-delta","conversationId":"c1","turnId":"t1","delta":"hm"}"#,
        ),
        (
            AgentEvent::ToolCall(TurnToolCallEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                step_id: "t1#0".into(),
                tool_call_id: "k".into(),
                tool_name: "ls".into(),
                input: json!({"path": "/"}),
            }),
            r#"{"type":"tool-call","conversationId":"c1","turnId":"t1","stepId":"t1#0","toolCallId":"k","toolName":"ls","input":{"path":"/"}}"#,
        ),
        (
            AgentEvent::ToolResult(TurnToolResultEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                step_id: "t1#0".into(),
                tool_call_id: "k".into(),
                tool_name: "ls".into(),
                content: "a b".into(),
                is_error: false,
                duration_ms: None,
            }),
            r#"{"type":"tool-result","conversationId":"c1","turnId":"t1","stepId":"t1#0","toolCallId":"k","toolName":"ls","content":"a b","isError":false}"#,
        ),
        (
            AgentEvent::ToolResult(TurnToolResultEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                step_id: "t1#0".into(),
                tool_call_id: "k".into(),
                tool_name: "ls".into(),
                content: "denied".into(),
                is_error: true,
                duration_ms: Some(12),
            }),
            r#"{"type":"tool-result","conversationId":"c1","turnId":"t1","stepId":"t1#0","toolCallId":"k","toolName":"ls","content":"denied","isError":true,"durationMs":12}"#,
        ),
        (
            AgentEvent::ToolOutput(TurnToolOutputEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                tool_call_id: "k".into(),
                data: "out".into(),
                stream: OutputStream::Stderr,
            }),
            r#"{"type":"tool-output","conversationId":"c1","turnId":"t1","toolCallId":"k","data":"out","stream":"stderr"}"#,
        ),
        (
            AgentEvent::Usage(TurnUsageEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                step_id: None,
                usage: usage(),
            }),
            r#"{"type":"usage","conversationId":"c1","turnId":"t1","usage":{"inputTokens":10,"outputTokens":5}}"#,
        ),
        (
            AgentEvent::Usage(TurnUsageEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                step_id: Some("t1#1".into()),
                usage: Usage { cache_read_tokens: Some(3), cache_write_tokens: Some(4), ..usage() },
            }),
            r#"{"type":"usage","conversationId":"c1","turnId":"t1","stepId":"t1#1","usage":{"inputTokens":10,"outputTokens":5,"cacheReadTokens":3,"cacheWriteTokens":4}}"#,
        ),
        (
            AgentEvent::StepComplete(TurnStepCompleteEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                step_id: "t1#0".into(),
                ttft_ms: Some(5),
                decode_ms: Some(7),
                gen_total_ms: Some(12),
            }),
            r#"{"type":"step-complete","conversationId":"c1","turnId":"t1","stepId":"t1#0","ttftMs":5,"decodeMs":7,"genTotalMs":12}"#,
        ),
        (
            AgentEvent::StepComplete(TurnStepCompleteEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                step_id: "t1#0".into(),
                ttft_ms: None,
                decode_ms: None,
                gen_total_ms: None,
            }),
            r#"{"type":"step-complete","conversationId":"c1","turnId":"t1","stepId":"t1#0"}"#,
        ),
        (
            AgentEvent::Error(TurnErrorEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                message: "bad".into(),
                code: None,
            }),
            r#"{"type":"error","conversationId":"c1","turnId":"t1","message":"bad"}"#,
        ),
        (
            AgentEvent::Error(TurnErrorEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                message: "bad".into(),
                code: Some(ErrorCode::Other("x".into())),
            }),
            r#"{"type":"error","conversationId":"c1","turnId":"t1","message":"bad","code":"x"}"#,
        ),
        (
            AgentEvent::Done(TurnDoneEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                reason: "stop".into(),
                duration_ms: None,
                usage: None,
                context_size: None,
            }),
            r#"{"type":"done","conversationId":"c1","turnId":"t1","reason":"stop"}"#,
        ),
        (
            AgentEvent::Done(TurnDoneEvent {
                conversation_id: c.clone(),
                turn_id: t.clone(),
                reason: "tool-calls".into(),
                duration_ms: Some(40),
                usage: Some(usage()),
                context_size: Some(15),
            }),
            r#"{"type":"done","conversationId":"c1","turnId":"t1","reason":"tool-calls","durationMs":40,"usage":{"inputTokens":10,"outputTokens":5},"contextSize":15}"#,
        ),
        (
            AgentEvent::TurnSealed(TurnSealedEvent { conversation_id: c.clone(), turn_id: t.clone() }),
            r#"{"type":"turn-sealed","conversationId":"c1","turnId":"t1"}"#,
        ),
    ];
    let mut kinds: Vec<&str> = cases.iter().map(|(e, _)| e.type_name()).collect();
    kinds.dedup();
    assert_eq!(kinds.len(), 13, "all 13 variants are covered");
    for (event, expected) in cases {
        golden(event, expected);
    }
}

#[test]
fn every_chunk_and_the_stored_envelope() {
    let cases: Vec<(Chunk, &str)> = vec![
        (Chunk::Text(TextChunk { text: "hi".into() }), r#"{"type":"text","text":"hi"}"#),
        (Chunk::Thinking(ThinkingChunk { text: "hm".into() }), r#"{"type":"thinking","text":"hm"}"#),
        (
            Chunk::ToolCall(ToolCallChunk {
                tool_call_id: "k".into(),
                tool_name: "ls".into(),
                input: json!([1]),
                step_id: None,
            }),
            r#"{"type":"tool-call","toolCallId":"k","toolName":"ls","input":[1]}"#,
        ),
        (
            Chunk::ToolCall(ToolCallChunk {
                tool_call_id: "k".into(),
                tool_name: "ls".into(),
                input: json!(null),
                step_id: Some("t#0".into()),
            }),
            r#"{"type":"tool-call","toolCallId":"k","toolName":"ls","input":null,"stepId":"t#0"}"#,
        ),
        (
            Chunk::ToolResult(ToolResultChunk {
                tool_call_id: "k".into(),
                tool_name: "ls".into(),
                content: "x".into(),
                is_error: false,
                step_id: Some("t#0".into()),
                duration_ms: None,
                output: None,
            }),
            r#"{"type":"tool-result","toolCallId":"k","toolName":"ls","content":"x","isError":false,"stepId":"t#0"}"#,
        ),
        (
            // The gateway's own fields, when it has them (docs/wire-choices.md).
            Chunk::ToolResult(ToolResultChunk {
                tool_call_id: "k".into(),
                tool_name: "ls".into(),
                content: "x".into(),
                is_error: false,
                step_id: None,
                duration_ms: Some(4),
                output: Some("a\n".into()),
            }),
            r#"{"type":"tool-result","toolCallId":"k","toolName":"ls","content":"x","isError":false,"durationMs":4,"output":"a\n"}"#,
        ),
        (Chunk::Error(ErrorChunk { message: "m".into(), code: None }), r#"{"type":"error","message":"m"}"#),
        (
            Chunk::Error(ErrorChunk { message: "m".into(), code: Some(ErrorCode::Interrupted) }),
            r#"{"type":"error","message":"m","code":"interrupted"}"#,
        ),
        (Chunk::System(SystemChunk { text: "s".into() }), r#"{"type":"system","text":"s"}"#),
    ];
    for (chunk, expected) in cases {
        golden(chunk, expected);
    }
    golden(
        StoredChunk { seq: 7, role: Role::Tool, chunk: Chunk::Text(TextChunk { text: "x".into() }) },
        r#"{"seq":7,"role":"tool","chunk":{"type":"text","text":"x"}}"#,
    );
    for (role, s) in
        [(Role::System, "system"), (Role::User, "user"), (Role::Assistant, "assistant"), (Role::Tool, "tool")]
    {
        golden(role, &format!("\"{s}\""));
    }
}

#[test]
fn metrics_and_conversation_meta() {
    golden(
        StepMetrics {
            step_id: "t#0".into(),
            usage: usage(),
            ttft_ms: Some(1),
            decode_ms: Some(2),
            gen_total_ms: Some(3),
            usage_reported: true,
        },
        r#"{"stepId":"t#0","usage":{"inputTokens":10,"outputTokens":5},"ttftMs":1,"decodeMs":2,"genTotalMs":3}"#,
    );
    golden(
        StepMetrics {
            step_id: "t#0".into(),
            usage: usage(),
            ttft_ms: None,
            decode_ms: None,
            gen_total_ms: None,
            usage_reported: true,
        },
        r#"{"stepId":"t#0","usage":{"inputTokens":10,"outputTokens":5}}"#,
    );
    let bare = TurnMetrics {
        turn_id: "t".into(),
        usage: usage(),
        duration_ms: None,
        steps: vec![],
        context_size: None,
        usage_reported: true,
        reason: None,
        first_seq: None,
    };
    golden(bare.clone(), r#"{"turnId":"t","usage":{"inputTokens":10,"outputTokens":5},"steps":[]}"#);
    // The gateway's own fields, when it has them (docs/wire-choices.md).
    golden(
        TurnMetrics {
            usage: Default::default(),
            usage_reported: false,
            reason: Some("aborted".into()),
            first_seq: Some(3),
            ..bare
        },
        r#"{"turnId":"t","usage":{"inputTokens":0,"outputTokens":0},"steps":[],"usageReported":false,"reason":"aborted","firstSeq":3}"#,
    );
    golden(
        TurnMetrics {
            turn_id: "t".into(),
            usage: usage(),
            duration_ms: Some(9),
            steps: vec![StepMetrics {
                step_id: "t#0".into(),
                usage: usage(),
                ttft_ms: None,
                decode_ms: None,
                gen_total_ms: Some(4),
                usage_reported: true,
            }],
            context_size: Some(15),
            usage_reported: true,
            reason: None,
            first_seq: None,
        },
        r#"{"turnId":"t","usage":{"inputTokens":10,"outputTokens":5},"durationMs":9,"steps":[{"stepId":"t#0","usage":{"inputTokens":10,"outputTokens":5},"genTotalMs":4}],"contextSize":15}"#,
    );
    golden(
        ConversationMeta {
            id: "c".into(),
            created_at: 1,
            last_activity_at: 2,
            title: "T".into(),
            status: ConversationStatus::Idle,
            model: None,
            owner: None,
            last_reason: None,
        },
        r#"{"id":"c","createdAt":1,"lastActivityAt":2,"title":"T","status":"idle"}"#,
    );
    golden(
        ConversationMeta {
            id: "c".into(),
            created_at: 1,
            last_activity_at: 2,
            title: "".into(),
            status: ConversationStatus::Closed,
            model: Some("demo/scripted".into()),
            owner: Some("alice".into()),
            last_reason: Some("error".into()),
        },
        r#"{"id":"c","createdAt":1,"lastActivityAt":2,"title":"","status":"closed","model":"demo/scripted","owner":"alice","lastReason":"error"}"#,
    );
}

#[test]
fn unknown_types_and_missing_fields_are_rejected() {
    assert!(serde_json::from_str::<AgentEvent>(r#"{"type":"nope","conversationId":"c","turnId":"t"}"#).is_err());
    assert!(serde_json::from_str::<AgentEvent>(r#"{"type":"done","conversationId":"c","turnId":"t"}"#).is_err());
    assert!(serde_json::from_str::<AgentEvent>(r#"{"conversationId":"c","turnId":"t"}"#).is_err());
    assert!(serde_json::from_str::<Chunk>(r#"{"type":"text"}"#).is_err());
    assert!(serde_json::from_str::<Usage>(r#"{"inputTokens":-1,"outputTokens":0}"#).is_err());
}

/// Every error code of the gateway's own reads back as it was written, and docs/wire-choices.md
/// lists each (its "Error codes" table); a runtime's own code passes through as it came.
#[test]
fn error_codes_read_back_as_written_and_each_of_the_gateways_is_documented() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/wire-choices.md");
    let documented = std::fs::read_to_string(path).unwrap();
    for code in ErrorCode::OWN {
        let spelled = code.as_str();
        assert_eq!(ErrorCode::parse(spelled), code);
        assert_eq!(serde_json::to_string(&code).unwrap(), format!("\"{spelled}\""));
        assert!(documented.contains(&format!("| `{spelled}` |")), "{spelled} is not in docs/wire-choices.md");
    }
    let theirs: ErrorCode = serde_json::from_str("\"error_during_execution\"").unwrap();
    assert_eq!(theirs, ErrorCode::Other("error_during_execution".into()));
    assert_eq!(theirs.as_str(), "error_during_execution");
}
