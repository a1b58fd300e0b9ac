//! The `openai` runtime against a fake upstream on a real socket: no network.

mod common;

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
    // Completions rejects a call without its `tool` message (spec 9.2).
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
async fn the_trimming_estimate_is_calibrated_by_the_last_requests_prompt_tokens() {
    set_key();
    // The upstream counts about three times the estimate (four bytes a token): a 400-byte
    // request estimated as 104 tokens was 300.
    let upstream = FakeUpstream::start(vec![
        Reply::Stream(vec![delta(json!({"content": "a".repeat(40)})), finish("stop"), usage(300, 60)]),
        Reply::Stream(vec![delta(json!({"content": "ok"})), finish("stop")]),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway_with(dir.path(), &upstream, |c| {
        c.context_window = Some(1000);
        c.params.max_tokens = Some(100);
    })
    .await;
    turn(&server, "cal", &"q".repeat(400)).await;
    let (_, metrics) = server.get("/conversations/cal/metrics").await;
    assert_eq!(metrics["turns"][0]["contextSize"], 360);
    // 118 + 304 estimated tokens fit 900 as they are, but not at three real tokens each.
    let new = "n".repeat(1200);
    turn(&server, "cal", &new).await;
    assert_eq!(
        upstream.requests()[1].body["messages"],
        json!([{"role": "user", "content": new}]),
        "the first turn was left out"
    );
}

/// The `Counted` model's context window in the tests below, with `max_tokens` 100 and answers
/// of 300 bytes: a message is 79 estimated tokens and 158 counted.
const WINDOW: u64 = 1200;

/// The `Counted` model's reply to one request.
fn counted(says_count: bool) -> Reply {
    Reply::Counted { window: WINDOW, answer: "a".repeat(300), says_count }
}

/// The `n`th question of a conversation: 300 bytes, numbered.
fn question(n: u32) -> String {
    format!("{n:03}{}", "q".repeat(297))
}

/// A gateway in front of the `Counted` model, with its context window configured.
async fn counted_gateway(dir: &std::path::Path) -> (FakeUpstream, TestServer) {
    let upstream = FakeUpstream::start(Vec::new()).await;
    let server = gateway_with(dir, &upstream, |c| {
        c.context_window = Some(WINDOW);
        c.params.max_tokens = Some(100);
    })
    .await;
    (upstream, server)
}

/// Turns `turns` of `conversation` on the `Counted` model, each of which must end `stop`.
async fn counted_turns(
    server: &TestServer,
    upstream: &FakeUpstream,
    conversation: &str,
    turns: std::ops::RangeInclusive<u32>,
) {
    for n in turns {
        upstream.push(counted(true));
        let events = turn(server, conversation, &question(n)).await;
        assert_eq!(events[events.len() - 2]["reason"], "stop", "turn {n}: {events:?}");
    }
}

/// Once older turns are left out, the last turn's `contextSize` counts only what was kept:
/// the calibration must come from the request the estimate was made for, or the trimming
/// keeps too much and the upstream refuses the conversation a few turns on.
#[tokio::test]
async fn a_long_conversation_keeps_fitting_the_context_window_once_older_turns_are_left_out() {
    set_key();
    let dir = tempfile::tempdir().unwrap();
    let (upstream, server) = counted_gateway(dir.path()).await;
    counted_turns(&server, &upstream, "long", 1..=12).await;
    // 1100 counted tokens of room keep
    // the new message and the two turns before it (790), not a third (1106).
    let last = &upstream.requests()[11].body["messages"];
    assert_eq!(last.as_array().unwrap().len(), 5, "{last}");
    assert!(last[0]["content"].as_str().unwrap().starts_with("010"), "{last}");
    assert!(counted_tokens(last) + 100 <= WINDOW);
}

/// A turn reads the log from its end only as far back as the context window needs: the
/// oldest chunk, made unreadable, is never read once the conversation outgrew the window,
/// and the request is the one trimming the whole log would make.
#[tokio::test]
async fn a_trimmed_request_reads_only_the_tail_of_a_long_conversation() {
    set_key();
    let dir = tempfile::tempdir().unwrap();
    let (upstream, server) = counted_gateway(dir.path()).await;
    // 40 turns: 80 chunks, more than the first tail read's 64.
    counted_turns(&server, &upstream, "tail", 1..=40).await;
    let db = dir.path().join("gateway.db");
    let conn = rusqlite::Connection::open(&db).unwrap();
    let changed = conn
        .execute(r#"UPDATE chunks SET chunk = '{"not":"a chunk"}' WHERE conversation_id = 'tail' AND seq = 1"#, ())
        .unwrap();
    assert_eq!(changed, 1);
    counted_turns(&server, &upstream, "tail", 41..=41).await;
    let sent = &upstream.requests()[40].body["messages"];
    assert_eq!(sent.as_array().unwrap().len(), 5, "{sent}");
    assert!(sent[0]["content"].as_str().unwrap().starts_with("039"), "{sent}");
    // A conversation that fits is read whole, so the same damage in it is a storage error.
    upstream.push(counted(true));
    turn(&server, "short", "hi").await;
    conn.execute(r#"UPDATE chunks SET chunk = '{"not":"a chunk"}' WHERE conversation_id = 'short' AND seq = 1"#, ())
        .unwrap();
    let events = turn(&server, "short", "again").await;
    turn_error(&events, "storage", "could not be read");
}

/// Without a `context_window` a request is still bounded by `--max-runtime-request-bytes`:
/// the oldest turns are left out past it, and the log is read from its end only as far back
/// as that needs (the oldest chunk, made unreadable, is never read), however long it grew.
#[tokio::test]
async fn without_a_context_window_the_request_size_bound_trims_and_reads_only_the_tail() {
    set_key();
    let upstream = FakeUpstream::start(Vec::new()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_with(dir.path(), &upstream, |c| c.context_window = None);
    // 2000 bytes are 500 estimated tokens; each 300-byte message is 79: the new message and
    // the two turns before it (395), not a third (553).
    config.max_runtime_request_bytes = 2000;
    let server = TestServer::start(config).await;
    let answer = || Reply::Stream(vec![delta(json!({"content": "a".repeat(300)})), finish("stop")]);
    for n in 1..=40 {
        upstream.push(answer());
        turn(&server, "bounded", &question(n)).await;
    }
    let conn = rusqlite::Connection::open(dir.path().join("gateway.db")).unwrap();
    let changed = conn
        .execute(r#"UPDATE chunks SET chunk = '{"not":"a chunk"}' WHERE conversation_id = 'bounded' AND seq = 1"#, ())
        .unwrap();
    assert_eq!(changed, 1);
    upstream.push(answer());
    let events = turn(&server, "bounded", &question(41)).await;
    assert_eq!(events[events.len() - 2]["reason"], "stop", "{events:?}");
    let sent = &upstream.requests()[40].body["messages"];
    assert_eq!(sent.as_array().unwrap().len(), 5, "{sent}");
    assert!(sent[0]["content"].as_str().unwrap().starts_with("039"), "{sent}");
    assert_eq!(sent[4]["content"], question(41));
}

/// An upstream that refuses a request as too long for its context is asked again within the
/// turn with older turns left out, as if tokens were as dear as it says it counted (or twice
/// the last guess when it does not say): a conversation whose calibration is unknown or wrong
/// does not fail turn after turn. A message that cannot fit alone still fails.
#[tokio::test]
async fn a_request_refused_as_too_long_is_trimmed_again_within_the_turn() {
    set_key();
    for says_count in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (upstream, server) = counted_gateway(dir.path()).await;
        // Ten turns from an upstream that reports no usage: nothing calibrates the estimate.
        for n in 1..=10 {
            upstream.push(Reply::Stream(vec![delta(json!({"content": "a".repeat(300)})), finish("stop")]));
            turn(&server, "refit", &question(n)).await;
        }
        // At one real token an estimated one, 13 messages (1027 estimated tokens) fit 1100,
        // but the model counts twice as many: refused, then sent again with 5.
        upstream.push(counted(says_count));
        let events = turn(&server, "refit", &question(11)).await;
        assert_eq!(events[events.len() - 2]["reason"], "stop", "says_count {says_count}: {events:?}");
        let requests = upstream.requests();
        assert_eq!(requests.len(), 12, "says_count {says_count}: one refused request, one taken");
        assert_eq!(requests[10].body["messages"].as_array().unwrap().len(), 13);
        assert_eq!(requests[11].body["messages"].as_array().unwrap().len(), 5);
        // The next turn starts calibrated: one request.
        upstream.push(counted(says_count));
        let events = turn(&server, "refit", &question(12)).await;
        assert_eq!(events[events.len() - 2]["reason"], "stop");
        assert_eq!(upstream.requests().len(), 13);
        // A message longer than the window alone: sent alone and refused, with nothing more to
        // leave out, the turn fails without another try.
        upstream.push(counted(says_count));
        let events = turn(&server, "refit", &"x".repeat(3000)).await;
        turn_error(&events, "context_length", "does not fit the model's context");
        let tries = upstream.requests().len() - 13;
        assert_eq!(upstream.requests().last().unwrap().body["messages"].as_array().unwrap().len(), 1);
        assert_eq!(tries, 1, "says_count {says_count}");
    }
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

/// The real binary, its credentials and proxies from the environment (as an operator sets them).
fn child_gateway(dir: &std::path::Path, env: &[(&str, String)]) -> ChildGateway {
    let args: Vec<std::ffi::OsString> = vec!["--database".into(), dir.join("gateway.db").into()];
    let mut env: Vec<(&str, String)> = env.to_vec();
    env.push(("DISPATCH_TEST_UPSTREAM_KEY", "sk-test".into()));
    let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    ChildGateway::spawn_with_env(&args, &pairs)
}

/// An `openai` credential `name` for `base_url`, as environment variables.
fn credential_env(name: &'static str, base_url: &str) -> Vec<(&'static str, String)> {
    let key = |field: &str| -> &'static str { format!("DISPATCH_CREDENTIALS__{name}__{field}").leak() };
    vec![
        (key("KIND"), "openai".into()),
        (key("BASE_URL"), base_url.into()),
        (key("MODELS"), r#"["m1"]"#.into()),
        (key("API_KEY_ENV"), "DISPATCH_TEST_UPSTREAM_KEY".into()),
    ]
}

async fn chat_on(gateway: &ChildGateway, conversation: &str, model: &str) -> Vec<Value> {
    gateway.chat_stream(json!({"conversationId": conversation, "message": "hi", "model": model})).await.collect().await
}

fn text(events: &[Value]) -> String {
    events.iter().filter(|e| e["type"] == "text-delta").map(|e| e["delta"].as_str().unwrap()).collect()
}

/// An HTTP proxy on a real socket. It records the first request head of each connection; a
/// plain request goes on to `upstream` as it came; a CONNECT is answered 200 and the tunnel's
/// TLS ended here with the certificate of the host it names, the plaintext going on to
/// `upstream`.
struct TestProxy {
    addr: std::net::SocketAddr,
    heads: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl TestProxy {
    async fn start(
        upstream: std::net::SocketAddr,
        hosts: BTreeMap<String, std::sync::Arc<rustls::ServerConfig>>,
    ) -> TestProxy {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (kept, hosts) = (heads.clone(), std::sync::Arc::new(hosts));
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (heads, hosts) = (kept.clone(), hosts.clone());
                tokio::spawn(async move {
                    let Some((buf, end)) = common::upstream::read_head(&mut socket).await else { return };
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    heads.lock().unwrap().push(head.clone());
                    let mut server = tokio::net::TcpStream::connect(upstream).await.unwrap();
                    if let Some(target) = head.strip_prefix("CONNECT ") {
                        let host = target.split(':').next().unwrap();
                        let Some(config) = hosts.get(host) else { return };
                        socket.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await.unwrap();
                        // The gateway ends the handshake when it rejects the certificate.
                        let Ok(mut tls) = tokio_rustls::TlsAcceptor::from(config.clone()).accept(socket).await else {
                            return;
                        };
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
                    } else {
                        server.write_all(&buf).await.unwrap();
                        let _ = tokio::io::copy_bidirectional(&mut socket, &mut server).await;
                    }
                });
            }
        });
        TestProxy { addr, heads }
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

/// A TLS server's configuration: this certificate and its key.
fn tls_server(cert: &rcgen::Certificate, key: &rcgen::KeyPair) -> std::sync::Arc<rustls::ServerConfig> {
    let key = rustls::pki_types::PrivatePkcs8KeyDer::from(key.serialize_der());
    let config =
        rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key.into())
            .unwrap();
    std::sync::Arc::new(config)
}

/// A test certificate authority, its certificate written to `ca.pem` in `dir` (for
/// `SSL_CERT_FILE`).
fn test_ca(dir: &std::path::Path) -> (TestCa, std::path::PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(rcgen::DnType::CommonName, "dispatch test CA");
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    (TestCa(ca), ca_file)
}

struct TestCa(rcgen::CertifiedIssuer<'static, rcgen::KeyPair>);

impl TestCa {
    /// A TLS server's configuration with a certificate for `host` this authority signed.
    fn server(&self, host: &str) -> std::sync::Arc<rustls::ServerConfig> {
        let (params, key) = server_params(host);
        tls_server(&params.signed_by(&key, &self.0).unwrap(), &key)
    }
}

/// A server certificate's parameters for `host`, and its key.
fn server_params(host: &str) -> (rcgen::CertificateParams, rcgen::KeyPair) {
    let mut params = rcgen::CertificateParams::new(vec![host.to_owned()]).unwrap();
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    (params, rcgen::KeyPair::generate().unwrap())
}

/// A TLS server on a real socket in front of `upstream`: each connection's TLS ends here (with
/// `config`'s certificate) and its plaintext goes on to `upstream`.
async fn tls_front(
    upstream: std::net::SocketAddr,
    config: std::sync::Arc<rustls::ServerConfig>,
) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let acceptor = tokio_rustls::TlsAcceptor::from(config.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(socket).await else { return };
                let mut server = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
            });
        }
    });
    addr
}

/// An HTTPS upstream goes through `HTTPS_PROXY`'s CONNECT tunnel, with the proxy's credentials,
/// and its certificate is checked against the roots (here `SSL_CERT_FILE`'s test CA): a host
/// whose certificate no root signed is never sent the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_is_reached_through_a_connect_tunnel_and_its_certificate_checked() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, ca_file) = test_ca(dir.path());
    let trusted = ca.server("upstream.test");
    let (params, key) = server_params("rogue.test");
    let rogue = tls_server(&params.self_signed(&key).unwrap(), &key);

    let upstream =
        FakeUpstream::start(vec![Reply::Stream(vec![delta(json!({"content": "through the tunnel"})), finish("stop")])])
            .await;
    let hosts = BTreeMap::from([("upstream.test".to_owned(), trusted), ("rogue.test".to_owned(), rogue)]);
    let proxy = TestProxy::start(upstream.addr, hosts).await;
    let mut env = vec![
        ("HTTPS_PROXY", format!("http://tunnel:s3cret@{}", proxy.addr)),
        ("SSL_CERT_FILE", ca_file.to_string_lossy().into_owned()),
    ];
    env.extend(credential_env("UP", "https://upstream.test/v1"));
    env.extend(credential_env("ROGUE", "https://rogue.test/v1"));
    let gateway = child_gateway(dir.path(), &env);

    let events = chat_on(&gateway, "c1", "up/m1").await;
    assert_eq!(text(&events), "through the tunnel", "{events:?}");
    assert_eq!(events.last().unwrap()["type"], "turn-sealed");
    let head = proxy.heads()[0].to_lowercase();
    assert!(head.starts_with("connect upstream.test:443 http/1.1\r\n"), "{head}");
    // base64("tunnel:s3cret")
    assert!(head.contains("proxy-authorization: basic dhvubmvsonmzy3jlda==\r\n"), "{head}");
    let requests = upstream.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].authorization.as_deref(), Some("Bearer sk-test"));

    let events = chat_on(&gateway, "c2", "rogue/m1").await;
    turn_error(&events, "unavailable", "certificate");
    assert!(proxy.heads().iter().any(|h| h.starts_with("CONNECT rogue.test:443 ")));
    assert_eq!(upstream.requests().len(), 1, "the request never went out");
    gateway.terminate();
}

/// A plain-HTTP upstream goes through `HTTP_PROXY`, the request in absolute form with the
/// proxy's credentials, unless `NO_PROXY` names its host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_upstream_is_asked_through_the_proxy_unless_no_proxy_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let reply = || Reply::Stream(vec![delta(json!({"content": "hello"})), finish("stop")]);
    let upstream = FakeUpstream::start(vec![reply(), reply()]).await;
    let proxy = TestProxy::start(upstream.addr, BTreeMap::new()).await;
    let mut env = vec![
        ("HTTP_PROXY", format!("http://someone:pw@{}", proxy.addr)),
        ("NO_PROXY", "localhost,127.0.0.1".to_owned()),
    ];
    // Only the proxy knows the first host.
    env.extend(credential_env("VIA", "http://upstream.test/v1"));
    env.extend(credential_env("DIRECT", &upstream.base_url()));
    let gateway = child_gateway(dir.path(), &env);

    let events = chat_on(&gateway, "c1", "via/m1").await;
    assert_eq!(text(&events), "hello", "{events:?}");
    let heads = proxy.heads();
    assert_eq!(heads.len(), 1);
    let head = heads[0].to_lowercase();
    assert!(head.starts_with("post http://upstream.test/v1/chat/completions http/1.1\r\n"), "{head}");
    // base64("someone:pw")
    assert!(head.contains("proxy-authorization: basic c29tzw9uztpwdw==\r\n"), "{head}");

    let events = chat_on(&gateway, "c2", "direct/m1").await;
    assert_eq!(text(&events), "hello", "{events:?}");
    assert_eq!(proxy.heads().len(), 1, "NO_PROXY's host was asked directly");
    assert_eq!(upstream.requests().len(), 2);
    gateway.terminate();
}

/// An `https://` proxy is spoken to over TLS, its certificate checked against the roots (here
/// `SSL_CERT_FILE`'s test CA): a plain-HTTP upstream is asked through it in absolute form, an
/// HTTPS one through a CONNECT tunnel inside that TLS, both with the proxy's credentials; a
/// proxy whose certificate no root signed fails the turn `unavailable`, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_proxy_is_spoken_to_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, ca_file) = test_ca(dir.path());
    let reply = || Reply::Stream(vec![delta(json!({"content": "over tls"})), finish("stop")]);
    let upstream = FakeUpstream::start(vec![reply(), reply()]).await;
    let hosts = BTreeMap::from([("upstream.test".to_owned(), ca.server("upstream.test"))]);
    let proxy = TestProxy::start(upstream.addr, hosts).await;
    // The proxy's own TLS ends in front of it.
    let front = tls_front(proxy.addr, ca.server("localhost")).await.port();
    let (params, key) = server_params("localhost");
    let rogue = tls_front(proxy.addr, tls_server(&params.self_signed(&key).unwrap(), &key)).await.port();
    let gateway_through = |front: u16, name: &str| {
        let mut env = vec![
            ("HTTPS_PROXY", format!("https://tunnel:s3cret@localhost:{front}")),
            ("HTTP_PROXY", format!("https://someone:pw@localhost:{front}")),
            ("SSL_CERT_FILE", ca_file.to_string_lossy().into_owned()),
        ];
        env.extend(credential_env("PLAIN", "http://upstream.test/v1"));
        env.extend(credential_env("TLS", "https://upstream.test/v1"));
        child_gateway(&dir.path().join(name), &env)
    };
    let gateway = gateway_through(front, "a");
    for (conversation, model) in [("c1", "plain/m1"), ("c2", "tls/m1")] {
        let events = chat_on(&gateway, conversation, model).await;
        assert_eq!(text(&events), "over tls", "{model}: {events:?}");
    }
    let heads: Vec<String> = proxy.heads().iter().map(|h| h.to_lowercase()).collect();
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert!(heads[0].starts_with("post http://upstream.test/v1/chat/completions http/1.1\r\n"), "{}", heads[0]);
    // base64("someone:pw"), base64("tunnel:s3cret")
    assert!(heads[0].contains("proxy-authorization: basic c29tzw9uztpwdw==\r\n"), "{}", heads[0]);
    assert!(heads[1].starts_with("connect upstream.test:443 http/1.1\r\n"), "{}", heads[1]);
    assert!(heads[1].contains("proxy-authorization: basic dhvubmvsonmzy3jlda==\r\n"), "{}", heads[1]);

    let untrusted = gateway_through(rogue, "b");
    for (conversation, model) in [("c3", "plain/m1"), ("c4", "tls/m1")] {
        let events = chat_on(&untrusted, conversation, model).await;
        let error = turn_error(&events, "unavailable", &format!("the proxy https://localhost:{rogue}/: "));
        assert!(error["message"].as_str().unwrap().contains("certificate"), "{error}");
    }
    assert_eq!(proxy.heads().len(), 2, "nothing was asked through the untrusted proxy");
    gateway.terminate();
    untrusted.terminate();
}

/// A proxy that is not there fails the turn `unavailable`, naming the proxy (not the upstream,
/// which was never asked), for a plain-HTTP upstream and for a tunnel alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_cannot_be_reached_fails_the_turn_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut env = vec![
        ("HTTP_PROXY", format!("http://someone:pw@{nobody}")),
        ("HTTPS_PROXY", format!("http://someone:pw@{nobody}")),
    ];
    env.extend(credential_env("PLAIN", "http://upstream.test/v1"));
    env.extend(credential_env("TLS", "https://upstream.test/v1"));
    let gateway = child_gateway(dir.path(), &env);
    for (conversation, model) in [("c1", "plain/m1"), ("c2", "tls/m1")] {
        let events = chat_on(&gateway, conversation, model).await;
        let error = turn_error(&events, "unavailable", &format!("the proxy http://{nobody}/: "));
        assert!(error["message"].as_str().unwrap().contains("refused"), "{error}");
    }
    gateway.terminate();
}

/// A proxy that takes the connection and never answers (a CONNECT tunnel, a SOCKS5 handshake)
/// is given up within the credential's connect timeout: the turn fails `unavailable` naming
/// the proxy, not later as an upstream that took the request and went quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_never_answers_is_given_up_within_the_connect_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let mut env = vec![
        ("HTTPS_PROXY", format!("http://{silent}")),
        ("HTTP_PROXY", format!("socks5h://{silent}")),
        ("DISPATCH_CREDENTIALS__TLS__CONNECT_TIMEOUT_SECS", "1".to_owned()),
        ("DISPATCH_CREDENTIALS__SOCKS__CONNECT_TIMEOUT_SECS", "1".to_owned()),
        // Past the connect timeout and its retries (about 5 s): an idle timeout ends it otherwise.
        ("DISPATCH_CREDENTIALS__TLS__IDLE_TIMEOUT_SECS", "30".to_owned()),
        ("DISPATCH_CREDENTIALS__SOCKS__IDLE_TIMEOUT_SECS", "30".to_owned()),
    ];
    env.extend(credential_env("TLS", "https://upstream.test/v1"));
    env.extend(credential_env("SOCKS", "http://upstream.test/v1"));
    let gateway = child_gateway(dir.path(), &env);
    for (conversation, model, scheme) in [("c1", "tls/m1", "http"), ("c2", "socks/m1", "socks5h")] {
        let events = chat_on(&gateway, conversation, model).await;
        let error = turn_error(&events, "unavailable", &format!("the proxy {scheme}://{silent}/: "));
        assert!(error["message"].as_str().unwrap().contains("no way through within 1 s"), "{error}");
    }
    gateway.terminate();
}

/// A SOCKS5 proxy (Debian's microsocks, asking for a user and password, its connections out
/// made from 127.0.0.2) in `ALL_PROXY`: plain and HTTPS upstreams (TLS end to end, checked for
/// the upstream's name) are reached through it whether the proxy resolves the host
/// (`socks5h://`: it is sent the name) or the gateway does (`socks5://`: the address); wrong
/// credentials, or no proxy there, fail the turn `unavailable`, naming the proxy and never its
/// password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_is_reached_through_a_socks5_proxy() {
    let install = "apt-get install microsocks";
    let Some(microsocks) = program("DISPATCH_TEST_MICROSOCKS", "microsocks", "DISPATCH_REQUIRE_MICROSOCKS", install)
    else {
        return;
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    // It logs each connection's target as the client named it.
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut proxy = std::process::Command::new(microsocks)
        .args(["-i", "127.0.0.1", "-p", &port, "-u", "socks", "-P", "s3cret", "-b", "127.0.0.2"])
        .stdout(std::process::Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .expect("microsocks starts");
    let up = eventually(100, || async { tokio::net::TcpStream::connect(format!("127.0.0.1:{port}")).await.is_ok() });
    assert!(up.await, "microsocks listens");

    let reply = || Reply::Stream(vec![delta(json!({"content": "through socks"})), finish("stop")]);
    let upstream = FakeUpstream::start((0..4).map(|_| reply()).collect()).await;
    // HTTPS as well: TLS runs end to end through the tunnel, checked for the upstream's name
    // (`SSL_CERT_FILE`'s test CA signed a certificate for `localhost`).
    let dir = tempfile::tempdir().unwrap();
    let (ca, ca_file) = test_ca(dir.path());
    let tls_port = tls_front(upstream.addr, ca.server("localhost")).await.port();
    // A name, not an address: the socks5h proxy resolves it.
    let plain_url = format!("http://localhost:{}/v1", upstream.addr.port());
    let tls_url = format!("https://localhost:{tls_port}/v1");
    let through = |scheme: &str, password: &str, name: &str| {
        let mut env = vec![
            ("ALL_PROXY", format!("{scheme}://socks:{password}@127.0.0.1:{port}")),
            ("SSL_CERT_FILE", ca_file.to_string_lossy().into_owned()),
        ];
        env.extend(credential_env("UP", &plain_url));
        env.extend(credential_env("TLS", &tls_url));
        child_gateway(&dir.path().join(name), &env)
    };
    let remote_dns = through("socks5h", "s3cret", "a");
    let local_dns = through("socks5", "s3cret", "b");
    for (gateway, conversation) in [(&remote_dns, "c1"), (&local_dns, "c2")] {
        for model in ["up/m1", "tls/m1"] {
            let events = chat_on(gateway, conversation, model).await;
            assert_eq!(text(&events), "through socks", "{model}: {events:?}");
        }
    }
    // The plain requests came from the proxy (the TLS ones from the test's TLS front).
    let peers: Vec<_> = upstream.requests().iter().map(|r| r.peer.unwrap().ip().to_string()).collect();
    assert_eq!(peers.iter().filter(|p| *p == "127.0.0.2").count(), 2, "{peers:?}");
    let targets: Vec<String> = std::fs::read_to_string(log.path())
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once("connected to ").map(|(_, target)| target.to_owned()))
        .collect();
    let (plain, tls) = (upstream.addr.port(), tls_port);
    let expected = [
        format!("localhost:{plain}"),
        format!("localhost:{tls}"),
        format!("127.0.0.1:{plain}"),
        format!("127.0.0.1:{tls}"),
    ];
    assert_eq!(targets, expected, "socks5h sent the name, socks5 the address the gateway resolved");

    let refused = through("socks5h", "wrong", "c");
    let error = turn_error(&chat_on(&refused, "c3", "up/m1").await, "unavailable", "credentials not accepted").clone();
    let _ = proxy.kill();
    let _ = proxy.wait();
    let gone = turn_error(&chat_on(&remote_dns, "c4", "up/m1").await, "unavailable", "refused").clone();
    for error in [error, gone] {
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(&format!("the proxy socks5h://127.0.0.1:{port}/")), "{message}");
        assert!(!message.contains("s3cret") && !message.contains("wrong"), "{message}");
    }
    assert_eq!(upstream.requests().len(), 4, "no request went out without the proxy");
    for gateway in [remote_dns, local_dns, refused] {
        gateway.terminate();
    }
}

/// The idle timeout runs between the upstream's bytes: an upstream that keeps a queued request
/// open with keep-alive comments (which the event parser swallows) is waited for, past the
/// timeout, and once it falls silent the turn ends after it.
#[tokio::test]
async fn keep_alive_comments_hold_the_idle_timeout_off_and_silence_does_not() {
    set_key();
    let pause = Duration::from_millis(400);
    let comments = |n: usize| (0..n).map(|_| (pause, ": PROCESSING\n\n".to_owned())).collect::<Vec<_>>();
    let data = |payload: Value| (Duration::ZERO, format!("data: {payload}\n\n"));
    let head = (Duration::ZERO, "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n".to_owned());
    // Six comments 0.4 s apart: 2.4 s with no event, under a timeout of 1 s.
    let mut queued = vec![head.clone()];
    queued.extend(comments(6));
    queued.extend([
        data(delta(json!({"content": "late"}))),
        data(finish("stop")),
        (Duration::ZERO, "data: [DONE]\n\n".into()),
    ]);
    // Content, comments, then nothing at all.
    let mut silent = vec![head, data(delta(json!({"content": "partial"})))];
    silent.extend(comments(3));
    let upstream = FakeUpstream::start(vec![Reply::Drip(queued), Reply::Drip(silent)]).await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway_with(dir.path(), &upstream, |c| c.idle_timeout_secs = 1).await;

    let events = turn(&server, "keep", "hi").await;
    assert_eq!(
        events.iter().find(|e| e["type"] == "text-delta").map(|e| &e["delta"]),
        Some(&json!("late")),
        "{events:?}"
    );
    assert_eq!(events[events.len() - 2]["reason"], "stop", "{events:?}");

    let events = turn(&server, "keep", "again").await;
    let error = events.iter().find(|e| e["type"] == "error").expect("the silence ended the turn");
    assert_eq!(error["code"], "upstream", "{error}");
    assert!(error["message"].as_str().unwrap().contains("the upstream sent nothing for 1s"), "{error}");
    assert_eq!(server.history("keep").await.last().unwrap()["chunk"]["type"], "error");
    assert_eq!(upstream.requests().len(), 2, "one request per turn");
}

/// An upstream nobody listens on never took the request: the turn retries it with backoff,
/// then ends `unavailable`, saying it cannot reach it. An upstream that answers the stream with
/// an event that is not JSON (a proxy's page, say) ends the turn `upstream`, not retried.
#[tokio::test]
async fn an_unreachable_upstream_is_retried_then_unavailable_and_an_event_that_is_not_json_ends_the_turn() {
    set_key();
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let page = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
        data: <html>upstream busy</html>\n\n";
    let upstream = FakeUpstream::start(vec![Reply::Raw(page.into())]).await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let events = turn(&server, "page", "hi").await;
    turn_error(&events, "upstream", "the upstream sent an event that is not JSON");
    assert_eq!(upstream.requests().len(), 1, "not retried");

    let other = tempfile::tempdir().unwrap();
    // The listener is gone: connecting to its port is refused.
    let server = gateway_with(other.path(), &upstream, |c| c.base_url = format!("http://{nobody}/v1")).await;
    let events = turn(&server, "gone", "hi").await;
    turn_error(&events, "unavailable", "cannot reach the upstream");
    let metrics = server.metrics().await;
    assert_eq!(metric(&metrics, "dispatch_runtime_errors_total{kind=\"retried\"}"), 3.0, "{metrics}");
    assert_eq!(server.history("gone").await.last().unwrap()["chunk"]["type"], "error");
}

/// A 200 that is not an event stream (a server that ignored `stream: true`, a proxy's 200 with
/// an error or a login page) ends the turn `upstream` saying what came, its first bytes
/// included, and is not retried: the upstream took the request.
#[tokio::test]
async fn a_200_that_is_not_an_event_stream_says_what_came_and_is_not_retried() {
    set_key();
    let json_error = r#"{"error":{"message":"quota exceeded for this key"}}"#;
    let page = "<html><body>Sign in to continue</body></html>";
    let upstream =
        FakeUpstream::start(vec![raw("200 OK", "", json_error), html("200 OK", "text/html; charset=utf-8", page)])
            .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let events = turn(&server, "json", "hi").await;
    let error = turn_error(&events, "upstream", "application/json, not an event stream");
    assert!(error["message"].as_str().unwrap().contains("quota exceeded for this key"), "{error}");
    assert_eq!(upstream.requests().len(), 1, "not retried");
    let events = turn(&server, "html", "hi").await;
    let error = turn_error(&events, "upstream", "text/html; charset=utf-8, not an event stream");
    assert!(error["message"].as_str().unwrap().contains("Sign in to continue"), "{error}");
    assert_eq!(upstream.requests().len(), 2, "not retried");
}

/// A proxy's HTML error page in front of the upstream ends the turn saying the page's title,
/// not its markup (what the console and the reference client show the user).
#[tokio::test]
async fn an_html_error_page_is_said_by_its_title_not_its_markup() {
    set_key();
    let page = "<html>\r\n<head><title>403 Forbidden</title></head>\r\n<body>\r\n<center><h1>403 Forbidden</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";
    let upstream = FakeUpstream::start(vec![html("403 Forbidden", "text/html", page)]).await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let events = turn(&server, "proxied", "hi").await;
    let error = turn_error(&events, "upstream", "the upstream answered 403 Forbidden: an HTML page: 403 Forbidden");
    assert!(!error["message"].as_str().unwrap().contains('<'), "{error}");
    let history = server.history("proxied").await;
    assert!(!history.last().unwrap()["chunk"]["message"].as_str().unwrap().contains('<'), "{history:?}");
}
