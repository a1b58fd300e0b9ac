//! The `openai` runtime against a fake upstream on a real socket: no network.

#[path = "../common/mod.rs"]
mod common;
mod proxies;
mod trimming;
mod upstream_errors;

use std::collections::BTreeMap;
use std::time::Duration;

use common::upstream::{FakeUpstream, Reply, counted_tokens};
use common::*;
use dispatch_gateway::config::{Config, Credential, OpenAiCredential};
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
    gateway_with(dir, upstream, |_| {}).await
}

async fn gateway_with(
    dir: &std::path::Path,
    upstream: &FakeUpstream,
    adjust: impl FnOnce(&mut OpenAiCredential),
) -> TestServer {
    TestServer::start(config_with(dir, upstream, adjust)).await
}

fn config_with(dir: &std::path::Path, upstream: &FakeUpstream, adjust: impl FnOnce(&mut OpenAiCredential)) -> Config {
    let mut config = test_config(dir);
    let mut headers = BTreeMap::new();
    headers.insert("X-Title".to_owned(), "dispatch".to_owned());
    let mut credential = OpenAiCredential {
        base_url: upstream.base_url(),
        api_key_env: Some("DISPATCH_TEST_UPSTREAM_KEY".into()),
        models: vec!["m1".into()],
        headers,
        connect_timeout_secs: 5,
        idle_timeout_secs: 30,
        system_prompt: None,
        context_window: Some(8192),
        params: Default::default(),
        model_params: Default::default(),
        mcp: Vec::new(),
        max_steps: 32,
        max_parallel_tools: 4,
        max_tool_calls: 16,
    };
    adjust(&mut credential);
    config.credentials.insert("up".into(), Credential::Openai(credential));
    config
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
    // It reads the effort (sent above), not a folder (it has no MCP servers) nor a session.
    assert_eq!(models["modelInfo"]["up/m1"]["settings"], json!(["reasoningEffort"]), "{models}");
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
        // Some servers put the error's text in place of the object.
        Reply::Stream(vec![delta(json!({"content": "partial"})), json!({"error": "worker crashed"})]),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    for (conversation, expected) in [("o3", "stream"), ("o4", "model overloaded"), ("o5", "worker crashed")] {
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
    assert_eq!(upstream.requests().len(), 3, "one request per turn: no retry after content");
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
    // answered (no server runs this credential's tools) goes up answered `Aborted`: Chat
    // Completions rejects a call without its `tool` message (docs/tools.md).
    assert_eq!(log.len(), 5);
    assert_eq!(log[2]["chunk"]["type"], "tool-call");
    assert_eq!(
        sent,
        &json!([
            {"role": "user", "content": log[0]["chunk"]["text"]},
            {"role": "assistant", "content": log[1]["chunk"]["text"], "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{\"q\":\"rust\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Aborted"},
            {"role": "user", "content": log[3]["chunk"]["text"]},
        ])
    );
}

/// Sends one turn and returns its events.
async fn turn(server: &TestServer, conversation: &str, message: &str) -> Vec<Value> {
    server
        .chat_stream(json!({"conversationId": conversation, "message": message, "model": "up/m1"}))
        .await
        .collect()
        .await
}

/// A page of `kind` (an HTML media type) with `status`.
fn html(status: &str, kind: &str, page: &str) -> Reply {
    Reply::Raw(format!(
        "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
        page.len()
    ))
}

fn raw(status: &str, headers: &str, body: &str) -> Reply {
    Reply::Raw(format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{headers}\r\n{body}",
        body.len()
    ))
}

/// A redirect is not followed: the turn ends with the status and where it points.
#[tokio::test]
async fn a_redirect_ends_the_turn_saying_where_it_points() {
    set_key();
    let dir = tempfile::tempdir().unwrap();
    let location = "https://elsewhere.test/v1/chat/completions";
    let upstream =
        FakeUpstream::start(vec![raw("308 Permanent Redirect", &format!("location: {location}\r\n"), "")]).await;
    let server = gateway(dir.path(), &upstream).await;
    let events = turn(&server, "c1", "hi").await;
    let error = turn_error(&events, "upstream", &format!("base_url moved to {location}"));
    assert!(error["message"].as_str().unwrap().contains("308"), "{error}");
    assert_eq!(upstream.requests().len(), 1);
}

/// An error response whose body never ends: what is read of it is bounded
/// (`--max-runtime-line-bytes`), and the turn ends instead of waiting for the rest.
#[tokio::test]
async fn an_error_body_that_never_ends_is_read_only_up_to_the_limit() {
    set_key();
    let dir = tempfile::tempdir().unwrap();
    let body = "x".repeat(200 * 1024);
    let head = "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 1000000000\r\n\r\n";
    let upstream = FakeUpstream::start(vec![Reply::Drip(vec![(Duration::ZERO, format!("{head}{body}"))])]).await;
    // An idle timeout past the guard below: only the bound can end the read in time.
    let mut config = config_with(dir.path(), &upstream, |c| c.idle_timeout_secs = 600);
    config.max_runtime_line_bytes = 64 * 1024;
    let server = TestServer::start(config).await;
    // Without the bound the turn would wait for the rest of a gigabyte: the guard makes that
    // a failure, not a hang.
    let events = tokio::time::timeout(Duration::from_secs(60), turn(&server, "c1", "hi"))
        .await
        .expect("the turn ends without the whole body");
    turn_error(&events, "upstream", "400 Bad Request: xxx");
}

/// Roles of a request's messages, the system prompt aside.
fn roles(request: &Value) -> Vec<String> {
    request["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap().to_owned())
        .filter(|r| r != "system")
        .collect()
}

#[tokio::test]
async fn failed_stopped_and_thinking_only_turns_keep_the_history_alternating() {
    set_key();
    let upstream = FakeUpstream::start(vec![
        raw("400 Bad Request", "", r#"{"error":{"message":"bad sampler"}}"#),
        Reply::Stream(vec![delta(json!({"reasoning_content": "hmm"})), finish("stop")]),
        Reply::Stall(vec![]),
        Reply::Stream(vec![delta(json!({"content": "fine"})), finish("stop")]),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let failed = turn(&server, "alt", "one").await;
    assert_eq!(failed[failed.len() - 2]["reason"], "error");
    turn(&server, "alt", "two").await;
    // A turn stopped before the upstream said anything.
    let mut stopped = server.chat_stream(json!({"conversationId": "alt", "message": "three", "model": "up/m1"})).await;
    assert!(eventually(100, || async { upstream.requests().len() == 3 }).await);
    server.post("/conversations/alt/stop", json!({})).await;
    while stopped.next_event().await.is_some() {}
    turn(&server, "alt", "four").await;
    let last = &upstream.requests()[3].body;
    assert_eq!(
        last["messages"],
        json!([
            {"role": "user", "content": "one\n\ntwo"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "three\n\nfour"},
        ])
    );
    // The failed attempt left no empty step in the metrics.
    let (_, metrics) = server.get("/conversations/alt/metrics").await;
    assert_eq!(metrics["turns"][0]["steps"], json!([]), "{metrics}");
}

#[tokio::test]
async fn a_message_over_the_context_ends_its_turn_and_spares_the_next_ones() {
    set_key();
    let too_long = r#"{"error":{"message":"This model's maximum context length is 4096 tokens","code":"context_length_exceeded"}}"#;
    let ok = || Reply::Stream(vec![delta(json!({"content": "ok"})), finish("stop"), usage(10, 1)]);
    let upstream = FakeUpstream::start(vec![ok(), raw("400 Bad Request", "", too_long), ok()]).await;
    let dir = tempfile::tempdir().unwrap();
    // No window configured: the upstream is the judge.
    let server = gateway_with(dir.path(), &upstream, |c| c.context_window = None).await;
    turn(&server, "ctx", "hello").await;
    let events = turn(&server, "ctx", &"long ".repeat(5000)).await;
    let error = events.iter().find(|e| e["type"] == "error").unwrap();
    assert_eq!(error["code"], "context_length", "{error}");
    assert!(error["message"].as_str().unwrap().contains("context"), "{error}");
    turn(&server, "ctx", "short again").await;
    let sent = &upstream.requests()[2].body["messages"];
    assert_eq!(
        sent,
        &json!([
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "short again"},
        ]),
        "the message that did not fit is left out"
    );
}

#[tokio::test]
async fn with_a_context_window_the_oldest_turns_are_left_out_to_fit() {
    set_key();
    let upstream = FakeUpstream::start(Vec::new()).await;
    for _ in 0..6 {
        upstream.push(Reply::Stream(vec![delta(json!({"content": "a".repeat(400)})), finish("stop")]));
    }
    let dir = tempfile::tempdir().unwrap();
    let server = gateway_with(dir.path(), &upstream, |c| {
        c.context_window = Some(800);
        c.system_prompt = Some("be brief".into());
        c.params.max_tokens = Some(100);
    })
    .await;
    for n in 0..6 {
        turn(&server, "win", &format!("question {n} {}", "q".repeat(400))).await;
    }
    let last = &upstream.requests()[5].body;
    let messages = last["messages"].as_array().unwrap();
    assert_eq!(messages[0], json!({"role": "system", "content": "be brief"}), "the system prompt stays");
    assert!(messages.last().unwrap()["content"].as_str().unwrap().starts_with("question 5"), "the new message stays");
    let bytes: usize = messages.iter().map(|m| m["content"].as_str().unwrap().len()).sum();
    assert!(bytes / 4 + messages.len() * 4 <= 700, "fits 800 tokens less the 100 reserved: {bytes} bytes");
    assert!(messages.len() < 12, "older turns were left out: {}", messages.len());
    assert_eq!(messages[1]["role"], "user", "a turn is left out whole: {messages:?}");
    let roles = roles(last);
    assert!(roles.windows(2).all(|w| w[0] != w[1]), "{roles:?}");
}

#[tokio::test]
async fn request_parameters_come_from_the_credential_and_the_model() {
    set_key();
    let upstream =
        FakeUpstream::start(vec![Reply::Stream(vec![delta(json!({"content": "ok"})), finish("stop")])]).await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway_with(dir.path(), &upstream, |c| {
        c.params = dispatch_gateway::config::RequestParams {
            max_tokens: Some(64),
            temperature: Some(0.5),
            top_p: None,
            stop: Some(vec!["END".into()]),
            extra_body: Some(json!({"top_k": 40, "seed": 1}).as_object().unwrap().clone()),
            include_usage: Some(false),
        };
        c.model_params.insert(
            "m1".into(),
            dispatch_gateway::config::RequestParams {
                temperature: Some(0.1),
                extra_body: Some(json!({"min_p": 0.05, "seed": 2}).as_object().unwrap().clone()),
                ..Default::default()
            },
        );
    })
    .await;
    turn(&server, "params", "hi").await;
    let body = &upstream.requests()[0].body;
    assert_eq!(body["max_tokens"], 64);
    assert_eq!(body["temperature"], 0.1, "the model's over the credential's");
    assert_eq!(body["stop"], json!(["END"]));
    assert_eq!(
        (body["top_k"].clone(), body["min_p"].clone(), body["seed"].clone()),
        (json!(40), json!(0.05), json!(2))
    );
    assert!(body.get("top_p").is_none());
    assert!(body.get("stream_options").is_none(), "include_usage = false sends no stream_options");
    // A model_params entry for a model the credential does not list stops the start.
    let mut config = test_config(dir.path());
    config.credentials.insert(
        "x".into(),
        Credential::Openai(OpenAiCredential {
            base_url: upstream.base_url(),
            api_key_env: None,
            models: vec!["a".into()],
            headers: BTreeMap::new(),
            connect_timeout_secs: 5,
            idle_timeout_secs: 5,
            system_prompt: None,
            context_window: None,
            params: Default::default(),
            model_params: [("b".to_owned(), Default::default())].into_iter().collect(),
            mcp: Vec::new(),
            max_steps: 32,
            max_parallel_tools: 4,
            max_tool_calls: 16,
        }),
    );
    config.database = dispatch_gateway::config::Database::Sqlite(dir.path().join("other.db"));
    assert!(dispatch_gateway::Gateway::build(config).await.is_err());
}

#[tokio::test]
async fn no_answer_after_the_request_is_ambiguous_and_a_retry_after_is_waited_for() {
    set_key();
    let upstream = FakeUpstream::start(vec![
        Reply::Silent,
        raw("429 Too Many Requests", "retry-after: 1\r\n", r#"{"error":{"message":"slow down"}}"#),
        Reply::Stream(vec![delta(json!({"content": "ok"})), finish("stop")]),
        raw("429 Too Many Requests", "retry-after: 600\r\n", r#"{"error":{"message":"come back later"}}"#),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway_with(dir.path(), &upstream, |c| c.idle_timeout_secs = 1).await;
    let events = turn(&server, "adm", "hi").await;
    let error = events.iter().find(|e| e["type"] == "error").unwrap();
    assert_eq!(error["code"], "ambiguous", "sent, never answered: not retried ({error})");
    assert_eq!(upstream.requests().len(), 1);

    let events = turn(&server, "adm", "again").await;
    assert_eq!(events[events.len() - 2]["reason"], "stop");
    let requests = upstream.requests();
    assert_eq!(requests.len(), 3);
    assert!(requests[2].at - requests[1].at >= Duration::from_millis(950), "Retry-After: 1 was honoured");

    let events = turn(&server, "adm", "later").await;
    let error = events.iter().find(|e| e["type"] == "error").unwrap();
    assert_eq!(error["code"], "rate_limited", "beyond the retry budget: {error}");
    assert_eq!(upstream.requests().len(), 4, "not retried");
}

#[tokio::test]
async fn deltas_refusals_and_multi_line_events_map_once() {
    set_key();
    let multi_line = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
        data: {\"choices\":[{\"index\":0,\r\ndata: \"delta\":{\"content\":\"split\"}}]}\r\n\r\n\
        : a comment\n\n\
        data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
    let upstream = FakeUpstream::start(vec![
        Reply::Stream(vec![
            delta(json!({"reasoning_content": "once", "reasoning": "once"})),
            delta(json!({"refusal": "I can't help with that."})),
            finish("stop"),
        ]),
        Reply::Raw(multi_line.into()),
        Reply::Broken(vec![delta(json!({"content": "cut"}))]),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let events = turn(&server, "map", "hi").await;
    let reasoning: Vec<&Value> = events.iter().filter(|e| e["type"] == "reasoning-delta").collect();
    assert_eq!(reasoning.len(), 1, "{events:?}");
    let text: Vec<&Value> = events.iter().filter(|e| e["type"] == "text-delta").collect();
    assert_eq!(text[0]["delta"], "I can't help with that.");
    let events = turn(&server, "map", "split").await;
    assert_eq!(events.iter().find(|e| e["type"] == "text-delta").unwrap()["delta"], "split");
    let events = turn(&server, "map", "cut").await;
    let error = events.iter().find(|e| e["type"] == "error").unwrap();
    assert!(error["message"].as_str().unwrap().contains("the upstream closed the stream"), "{error}");
    // done.reason is kept with the turn's row.
    let db = dir.path().join("gateway.db");
    let conn = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let reasons: Vec<String> = conn
        .prepare("SELECT reason FROM turns WHERE conversation_id = 'map' ORDER BY ordinal")
        .unwrap()
        .query_map((), |row| row.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(reasons, ["stop", "stop", "error"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_counts_only_the_time_of_steps_that_produced_tokens() {
    set_key();
    let upstream = FakeUpstream::start(vec![
        Reply::Stall(vec![]),
        Reply::Stream(vec![delta(json!({"content": "ok"})), finish("stop"), usage(3, 5)]),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let mut stalled = server.chat_stream(json!({"conversationId": "tp", "message": "stall", "model": "up/m1"})).await;
    assert!(eventually(100, || async { upstream.requests().len() == 1 }).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.post("/conversations/tp/stop", json!({})).await;
    while stalled.next_event().await.is_some() {}
    turn(&server, "tp", "go").await;
    let (_, metrics) = server.get("/conversations/tp/metrics").await;
    let aborted = metrics["turns"][0]["steps"][0]["genTotalMs"].as_u64().unwrap();
    assert!(aborted >= 250, "the aborted step took its time: {metrics}");
    let counted = metrics["turns"][1]["steps"][0]["genTotalMs"].as_u64().unwrap();
    let (_, throughput) = server.get("/metrics/throughput?period=day").await;
    let model = &throughput["models"][0];
    assert_eq!(model["totalOutputTokens"], 5);
    assert_eq!(model["totalGenMs"].as_u64().unwrap(), counted, "only the step with output counts: {throughput}");
}

#[tokio::test]
async fn an_event_past_the_limit_ends_the_turn_and_the_next_one_streams() {
    set_key();
    let huge = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: {}\n\n",
        "x".repeat(200_000)
    );
    let upstream = FakeUpstream::start(vec![
        Reply::Raw(huge),
        Reply::Stream(vec![delta(json!({"content": "fits"})), finish("stop")]),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_with(dir.path(), &upstream, |_| {});
    config.max_runtime_line_bytes = 64 * 1024;
    let server = TestServer::start(config).await;
    let events = turn(&server, "big", "hi").await;
    turn_error(&events, "upstream", "an event longer than 65536 bytes");
    let events = turn(&server, "big", "again").await;
    assert_eq!(events.iter().find(|e| e["type"] == "text-delta").unwrap()["delta"], "fits");
}

/// A user's turn stopped before the upstream's last event (where it reports usage) is charged
/// what the gateway sent, the conversation's history included (the estimate that trims
/// context), and what it streamed; a turn that reported usage is charged that.
#[tokio::test]
async fn a_stopped_turn_is_charged_the_request_it_sent() {
    set_key();
    let upstream = FakeUpstream::start(vec![
        Reply::Stream(vec![delta(json!({"content": "ok"})), finish("stop"), usage(3000, 1)]),
        Reply::Stall(vec![delta(json!({"content": "x".repeat(400)}))]),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_with(dir.path(), &upstream, |_| {});
    let secret = "a-secret-of-at-least-thirty-two-bytes!!";
    std::fs::write(dir.path().join("secret"), secret).unwrap();
    config.jwt_secret_file = Some(dir.path().join("secret"));
    config.quotas.tokens_per_day = Some(1_000_000);
    let server = TestServer::start(config).await;
    let claims = json!({"sub": "alice", "exp": jsonwebtoken::get_current_timestamp() + 3600});
    let key = jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap();
    let alice = jsonwebtoken::encode(&jsonwebtoken::Header::default(), &claims, &key).unwrap();
    let chat = |message: String| {
        server
            .client
            .post(server.url("/chat"))
            .bearer_auth(&alice)
            .json(&json!({"conversationId": "c", "message": message}))
    };
    // 10,000 bytes of prompt: the next turn's request carries them as history.
    EventStream::new(chat("word ".repeat(2000)).send().await.unwrap()).collect().await;
    let reported = server.state.store.tokens_since("alice", 0).await.unwrap();
    assert_eq!(reported, 3001, "the usage the upstream reported");
    let mut events = EventStream::new(chat("go on".into()).send().await.unwrap());
    while let Some(event) = events.next_event().await {
        if event["type"] == "text-delta" {
            break;
        }
    }
    let r = server.client.post(server.url("/conversations/c/stop")).bearer_auth(&alice).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let rest = events.collect().await;
    assert!(rest.iter().any(|e| e["type"] == "done" && e["reason"] == "aborted"), "{rest:?}");
    let stopped = server.state.store.tokens_since("alice", 0).await.unwrap() - reported;
    // ~2,500 tokens of history and prompt, 100 of output: not the 2-word prompt alone, not 0.
    assert!((2_600..3_000).contains(&stopped), "the stopped turn was charged {stopped}");
}
