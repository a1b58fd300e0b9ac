//! The `openai` runtime against a fake upstream on a real socket: no network.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::upstream::{FakeUpstream, Reply};
use common::*;
use dispatch_gateway::config::{Credential, OpenAiCredential};
use serde_json::{Value, json};

fn delta(d: Value) -> Value {
    json!({"choices": [{"index": 0, "delta": d, "finish_reason": null}]})
}

fn finish(reason: &str) -> Value {
    json!({"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})
}

fn usage(prompt: u64, completion: u64) -> Value {
    json!({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})
}

async fn gateway(dir: &std::path::Path, upstream: &FakeUpstream) -> TestServer {
    let mut config = test_config(dir);
    let mut headers = BTreeMap::new();
    headers.insert("X-Title".to_owned(), "dispatch".to_owned());
    config.credentials.insert(
        "up".into(),
        Credential::Openai(OpenAiCredential {
            base_url: upstream.base_url(),
            api_key_env: Some("DISPATCH_TEST_UPSTREAM_KEY".into()),
            models: vec!["m1".into()],
            headers,
            connect_timeout_secs: 5,
            idle_timeout_secs: 30,
            system_prompt: None,
            context_window: Some(8192),
        }),
    );
    TestServer::start(config).await
}

fn set_key() {
    // SAFETY: every test of this file sets the same value; nothing reads it concurrently in a
    // way that could observe a torn write.
    unsafe { std::env::set_var("DISPATCH_TEST_UPSTREAM_KEY", "sk-test") };
}

fn strip(events: &[Value]) -> Vec<Value> {
    events
        .iter()
        .map(|e| {
            let mut e = e.as_object().unwrap().clone();
            for k in ["conversationId", "turnId", "stepId", "ttftMs", "decodeMs", "genTotalMs", "durationMs"] {
                e.remove(k);
            }
            Value::Object(e)
        })
        .collect()
}

#[tokio::test]
async fn a_stream_with_reasoning_and_usage_maps_onto_the_wire() {
    set_key();
    let upstream = FakeUpstream::start(vec![Reply::Stream(vec![
        delta(json!({"role": "assistant", "reasoning_content": "Let me think."})),
        delta(json!({"reasoning": " Done."})),
        delta(json!({"content": "Hello"})),
        delta(json!({"content": " world"})),
        finish("stop"),
        json!({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}}),
    ])])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let events = server
        .chat_stream(json!({"conversationId": "o1", "message": "hi", "model": "up/m1", "reasoningEffort": "low"}))
        .await
        .collect()
        .await;
    assert_eq!(
        strip(&events),
        vec![
            json!({"type": "user-message", "text": "hi"}),
            json!({"type": "turn-start"}),
            json!({"type": "reasoning-delta", "delta": "Let me think."}),
            json!({"type": "reasoning-delta", "delta": " Done."}),
            json!({"type": "text-delta", "delta": "Hello"}),
            json!({"type": "text-delta", "delta": " world"}),
            json!({"type": "usage", "usage": {"inputTokens": 12, "outputTokens": 5, "cacheReadTokens": 4}}),
            json!({"type": "step-complete"}),
            json!({"type": "done", "reason": "stop", "usage": {"inputTokens": 12, "outputTokens": 5, "cacheReadTokens": 4}, "contextSize": 17}),
            json!({"type": "turn-sealed"}),
        ]
    );
    let requests = upstream.requests();
    assert_eq!(requests.len(), 1);
    let body = &requests[0].body;
    assert_eq!(body["model"], "m1");
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"], json!({"include_usage": true}));
    assert_eq!(body["reasoning_effort"], "low");
    assert_eq!(body["messages"], json!([{"role": "user", "content": "hi"}]));
    assert_eq!(requests[0].authorization.as_deref(), Some("Bearer sk-test"));
    assert!(requests[0].headers.contains(&("x-title".to_owned(), "dispatch".to_owned())));
    let (_, models) = server.get("/models").await;
    assert_eq!(models["modelInfo"]["up/m1"]["contextWindow"], 8192);
}

#[tokio::test]
async fn a_429_is_retried_and_the_wire_sees_one_clean_turn() {
    set_key();
    let upstream = FakeUpstream::start(vec![
        Reply::Status(429),
        Reply::Status(503),
        Reply::Stream(vec![delta(json!({"content": "ok"})), finish("stop"), usage(3, 1)]),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let events =
        server.chat_stream(json!({"conversationId": "o2", "message": "hi", "model": "up/m1"})).await.collect().await;
    assert_eq!(
        types(&events),
        vec!["user-message", "turn-start", "text-delta", "usage", "step-complete", "done", "turn-sealed"]
    );
    assert_eq!(events[5]["reason"], "stop");
    assert_eq!(upstream.requests().len(), 3);
    let metrics = server.metrics().await;
    assert!(metrics.contains("dispatch_runtime_errors_total{kind=\"retried\"} 2"), "{metrics}");
}

#[tokio::test]
async fn a_failure_after_content_ends_the_turn_and_is_not_retried() {
    set_key();
    let upstream = FakeUpstream::start(vec![
        Reply::Broken(vec![delta(json!({"content": "partial"}))]),
        Reply::Stream(vec![delta(json!({"content": "partial"})), json!({"error": {"message": "model overloaded"}})]),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    for (conversation, expected) in [("o3", "stream"), ("o4", "model overloaded")] {
        let events = server
            .chat_stream(json!({"conversationId": conversation, "message": "hi", "model": "up/m1"}))
            .await
            .collect()
            .await;
        let n = events.len();
        assert_eq!(types(&events[n - 4..]), vec!["step-complete", "error", "done", "turn-sealed"], "{events:?}");
        assert!(events[n - 3]["message"].as_str().unwrap().contains(expected), "{}", events[n - 3]);
        assert_eq!(events[n - 3]["code"], "upstream");
        assert_eq!(events[n - 2]["reason"], "error");
        let history = server.history(conversation).await;
        assert_eq!(history[1]["chunk"], json!({"type": "text", "text": "partial"}));
        assert_eq!(history[2]["chunk"]["type"], "error");
    }
    assert_eq!(upstream.requests().len(), 2, "one request per turn: no retry after content");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_closes_a_stalled_upstream_connection_at_once() {
    set_key();
    let upstream = FakeUpstream::start(vec![Reply::Stall(vec![delta(json!({"content": "partial"}))])]).await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let mut stream = server.chat_stream(json!({"conversationId": "o5", "message": "hi", "model": "up/m1"})).await;
    loop {
        if stream.next_event().await.unwrap()["type"] == "text-delta" {
            break;
        }
    }
    assert_eq!(upstream.disconnects(), 0, "the upstream is stalled, the client still there");
    let (_, stopped) = server.post("/conversations/o5/stop", json!({})).await;
    assert_eq!(stopped["abortedTurn"], true);
    // The fake upstream never sends another byte: it sees the disconnect only if the gateway
    // closes the connection itself.
    tokio::time::timeout(Duration::from_secs(20), upstream.wait_disconnect())
        .await
        .expect("the upstream saw the disconnect");
    let rest = stream.collect().await;
    assert_eq!(rest[rest.len() - 2]["reason"], "aborted");
    assert_eq!(server.history("o5").await[1]["chunk"]["text"], "partial");
}

#[tokio::test]
async fn the_history_sent_upstream_is_the_log() {
    set_key();
    let upstream = FakeUpstream::start(vec![
        Reply::Stream(vec![
            delta(json!({"content": "Let me look."})),
            delta(json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{\"q\":"}}]})),
            delta(json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"rust\"}"}}]})),
            finish("tool_calls"),
        ]),
        Reply::Stream(vec![delta(json!({"content": "Second answer"})), finish("stop")]),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let first =
        server.chat_stream(json!({"conversationId": "o6", "message": "first", "model": "up/m1"})).await.collect().await;
    let call = first.iter().find(|e| e["type"] == "tool-call").unwrap();
    assert_eq!((call["toolName"].clone(), call["input"].clone()), (json!("search"), json!({"q": "rust"})));
    assert_eq!(first[first.len() - 2]["reason"], "tool-calls");
    server.chat_stream(json!({"conversationId": "o6", "message": "second", "model": "up/m1"})).await.collect().await;

    let log = server.history("o6").await;
    let sent = &upstream.requests()[1].body["messages"];
    // The log: user, assistant text + tool call (one message), user. A tool call no result
    // answered is left out (Chat Completions rejects one without its `tool` message).
    assert_eq!(log.len(), 5);
    assert_eq!(log[2]["chunk"]["type"], "tool-call");
    assert_eq!(
        sent,
        &json!([
            {"role": "user", "content": log[0]["chunk"]["text"]},
            {"role": "assistant", "content": log[1]["chunk"]["text"]},
            {"role": "user", "content": log[3]["chunk"]["text"]},
        ])
    );
}
