//! Property tests: history parameters against a real server, chunk assembly, wire decoding.

mod common;

use common::*;
use dispatch_gateway::store::NewChunk;
use dispatch_gateway::turn::ChunkAssembler;
use dispatch_gateway::wire::*;
use proptest::prelude::*;
use serde_json::{Value, json};

fn param() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        Just(None),
        (0u64..15).prop_map(|n| Some(n.to_string())),
        (-5i64..0).prop_map(|n| Some(n.to_string())),
        any::<f32>().prop_map(|f| Some(f.to_string())),
        "[ -~]{0,6}".prop_map(Some),
        "\\PC{0,4}".prop_map(Some),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, .. ProptestConfig::default() })]

    #[test]
    fn history_parameters_are_answered_200_or_400_never_anything_else(
        since in param(), before in param(), limit in param(),
    ) {
        static SERVER: std::sync::OnceLock<(tokio::runtime::Runtime, TestServer, tempfile::TempDir)> = std::sync::OnceLock::new();
        let (rt, server, _) = SERVER.get_or_init(|| {
            let rt = tokio::runtime::Runtime::new().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let server = rt.block_on(async {
                let server = TestServer::start(test_config(dir.path())).await;
                for i in 0..3 {
                    server.chat("p", &format!("m{i}")).await;
                }
                server
            });
            (rt, server, dir)
        });
        let mut query: Vec<(&str, String)> = Vec::new();
        for (name, value) in [("sinceSeq", &since), ("beforeSeq", &before), ("limit", &limit)] {
            if let Some(v) = value {
                query.push((name, v.clone()));
            }
        }
        let (status, body) = rt.block_on(async {
            let encoded: String = form_urlencoded::Serializer::new(String::new()).extend_pairs(&query).finish();
            let r = server.client.get(server.url(&format!("/conversations/p?{encoded}"))).send().await.unwrap();
            read_json(r).await
        });
        let parse = |v: &Option<String>, min: u64| v.as_ref().map(|s| s.parse::<u64>().ok().filter(|n| *n >= min));
        let (s, b, l) = (parse(&since, 0), parse(&before, 1), parse(&limit, 1));
        if [s, b, l].iter().any(|p| matches!(p, Some(None))) {
            prop_assert_eq!(status, 400, "{:?}", body);
            let error = body["error"].as_str().unwrap();
            prop_assert!(["sinceSeq", "beforeSeq", "limit"].iter().any(|n| error.contains(n)), "{}", error);
        } else {
            prop_assert_eq!(status, 200, "{:?}", body);
            let (s, b, l) = (s.flatten().unwrap_or(0), b.flatten().unwrap_or(u64::MAX), l.flatten());
            let mut expected: Vec<u64> = (1..=9).filter(|q| *q > s && *q < b).collect();
            if let Some(l) = l {
                let skip = expected.len().saturating_sub(l as usize);
                expected.drain(..skip);
            }
            let got: Vec<u64> = body["chunks"].as_array().unwrap().iter().map(|c| c["seq"].as_u64().unwrap()).collect();
            prop_assert_eq!(&got, &expected);
            prop_assert_eq!(body["latestSeq"].as_u64().unwrap(), expected.last().copied().unwrap_or(s));
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Text(String),
    Reasoning(String),
    Call,
    Result,
    EndStep,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => "\\PC{1,5}".prop_map(Op::Text),
        2 => "\\PC{1,5}".prop_map(Op::Reasoning),
        1 => Just(Op::Call),
        1 => Just(Op::Result),
        1 => Just(Op::EndStep),
    ]
}

fn text_of(c: &NewChunk) -> Option<(&'static str, &str)> {
    match &c.chunk {
        Chunk::Text(t) => Some(("text", &t.text)),
        Chunk::Thinking(t) => Some(("thinking", &t.text)),
        _ => None,
    }
}

proptest! {
    #[test]
    fn assembly_keeps_every_byte_and_merges_exactly_the_runs(ops in proptest::collection::vec(op(), 0..60)) {
        let mut a = ChunkAssembler::default();
        let (mut texts, mut thoughts) = (String::new(), String::new());
        for op in &ops {
            match op {
                Op::Text(t) => { a.text(t); texts.push_str(t); }
                Op::Reasoning(t) => { a.reasoning(t); thoughts.push_str(t); }
                Op::Call => a.tool_call(ToolCallChunk { tool_call_id: "c".into(), tool_name: "t".into(), input: json!({}), step_id: None }),
                Op::Result => a.tool_result(ToolResultChunk { tool_call_id: "c".into(), tool_name: "t".into(), content: String::new(), is_error: false, step_id: None, duration_ms: None, output: None }),
                Op::EndStep => a.end_step(),
            }
        }
        let chunks = a.take();
        let joined = |kind: &str| chunks.iter().filter_map(text_of).filter(|(k, _)| *k == kind).map(|(_, t)| t).collect::<String>();
        prop_assert_eq!(joined("text"), texts);
        prop_assert_eq!(joined("thinking"), thoughts);
        // A run of one kind is one chunk: two text-like chunks of the same kind are never
        // neighbours within one message.
        for pair in chunks.windows(2) {
            if let (Some((k1, _)), Some((k2, _))) = (text_of(&pair[0]), text_of(&pair[1])) {
                prop_assert!(k1 != k2 || pair[1].new_message, "{:?}", pair);
            }
        }
        // Messages never start with a continuation, and every tool result is its own message.
        prop_assert!(chunks.first().is_none_or(|c| c.new_message));
        prop_assert!(chunks.iter().filter(|c| matches!(c.chunk, Chunk::ToolResult(_))).all(|c| c.new_message && c.role == Role::Tool));
    }

    #[test]
    fn decoding_arbitrary_json_never_panics(value in arb_json()) {
        let _ = serde_json::from_value::<AgentEvent>(value.clone());
        let _ = serde_json::from_value::<Chunk>(value.clone());
        let _ = serde_json::from_value::<StoredChunk>(value);
    }

    #[test]
    fn events_round_trip(event in arb_event()) {
        let text = serde_json::to_string(&event).unwrap();
        // Absent optionals are omitted, never null.
        let value: Value = serde_json::from_str(&text).unwrap();
        prop_assert!(value.as_object().unwrap().iter().all(|(k, v)| !v.is_null() || k == "input"));
        let back: AgentEvent = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(back, event);
    }
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        prop_oneof![
            Just("type".to_owned()),
            Just("text-delta".to_owned()),
            Just("done".to_owned()),
            Just("tool-call".to_owned()),
            "\\PC{0,8}"
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("type".to_owned()),
                    Just("conversationId".to_owned()),
                    Just("turnId".to_owned()),
                    Just("delta".to_owned()),
                    Just("usage".to_owned()),
                    Just("reason".to_owned()),
                    "[a-zA-Z]{1,8}"
                ],
                inner,
                0..6,
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn arb_usage() -> impl Strategy<Value = Usage> {
    (any::<u32>(), any::<u32>(), proptest::option::of(any::<u32>()), proptest::option::of(any::<u32>())).prop_map(
        |(i, o, r, w)| Usage {
            input_tokens: i.into(),
            output_tokens: o.into(),
            cache_read_tokens: r.map(Into::into),
            cache_write_tokens: w.map(Into::into),
        },
    )
}

fn arb_event() -> impl Strategy<Value = AgentEvent> {
    let s = || "\\PC{0,12}";
    prop_oneof![
        (s(), s(), s()).prop_map(|(c, t, d)| AgentEvent::TextDelta(TurnTextDeltaEvent {
            conversation_id: c,
            turn_id: t,
            delta: d
        })),
        (s(), s(), s()).prop_map(|(c, t, x)| AgentEvent::UserMessage(TurnInputEvent {
            conversation_id: c,
            turn_id: t,
            text: x
        })),
        (s(), s(), proptest::option::of(s()), arb_usage()).prop_map(|(c, t, st, u)| AgentEvent::Usage(
            TurnUsageEvent { conversation_id: c, turn_id: t, step_id: st, usage: u }
        )),
        (
            s(),
            s(),
            s(),
            proptest::option::of(any::<u32>()),
            proptest::option::of(arb_usage()),
            proptest::option::of(any::<u32>())
        )
            .prop_map(|(c, t, r, d, u, x)| {
                AgentEvent::Done(TurnDoneEvent {
                    conversation_id: c,
                    turn_id: t,
                    reason: r,
                    duration_ms: d.map(Into::into),
                    usage: u,
                    context_size: x.map(Into::into),
                })
            }),
        (s(), s(), s(), s(), s(), arb_json()).prop_map(|(c, t, st, id, n, input)| AgentEvent::ToolCall(
            TurnToolCallEvent { conversation_id: c, turn_id: t, step_id: st, tool_call_id: id, tool_name: n, input }
        )),
        (s(), s(), s(), proptest::option::of(s())).prop_map(|(c, t, m, code)| AgentEvent::Error(TurnErrorEvent {
            conversation_id: c,
            turn_id: t,
            message: m,
            code: code.map(|c| dispatch_gateway::wire::ErrorCode::parse(&c))
        })),
        (s(), s()).prop_map(|(c, t)| AgentEvent::TurnSealed(TurnSealedEvent { conversation_id: c, turn_id: t })),
    ]
}
