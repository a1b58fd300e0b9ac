//! Turn control and the WebSocket protocol: status, close, last, sticky model, throughput,
//! keep-alives, chat.send / chat.subscribe / chat.queue and status broadcasts.

mod common;

use common::*;
use serde_json::{Value, json};

fn script() -> Value {
    json!({"rules": [
        {"match": "stall", "pace": 0, "steps": [{"text": "partial", "stallMs": 600000}]},
        {"match": "tools", "pace": 0, "steps": [
            {"text": "Looking.", "toolCalls": [{"id": "k", "name": "find", "result": "it"}],
             "usage": {"inputTokens": 10, "outputTokens": 30}},
            {"text": "Found ", "usage": {"inputTokens": 20, "outputTokens": 12}},
        ]},
    ]})
}

async fn server(dir: &std::path::Path, tweak: impl FnOnce(&mut dispatch_gateway::Config)) -> TestServer {
    let mut config = test_config(dir);
    config.scripted_script = Some(write_script(dir, script()));
    tweak(&mut config);
    TestServer::start(config).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_close_and_last() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), |_| {}).await;
    let (status, body) = server.get("/conversations/nobody/status").await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(
        server.get("/conversations/nobody/last").await,
        (200, json!({"conversationId": "nobody", "content": ""}))
    );

    let events = server.chat("c-last", "tools please").await;
    let turn_id = events[0]["turnId"].clone();
    assert_eq!(
        server.get("/conversations/c-last/last").await,
        (200, json!({"conversationId": "c-last", "content": "Found ", "turnId": turn_id}))
    );

    // /last waits for a running turn; a wait that ends first is 409.
    let stream = server.chat_stream(json!({"conversationId": "c-last", "message": "stall"})).await;
    let (status, body) = server.get("/conversations/c-last/last?timeoutMs=50").await;
    assert_eq!(status, 409, "{body}");
    let waiter = {
        let client = server.client.clone();
        let url = server.url("/conversations/c-last/last?timeoutMs=60000");
        tokio::spawn(async move { read_json(client.get(url).send().await.unwrap()).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (_, closed) = server.post("/conversations/c-last/close", json!({})).await;
    assert_eq!(closed, json!({"conversationId": "c-last", "abortedTurn": true}));
    let (status, last) = waiter.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(last["content"], "partial");
    assert_ne!(last["turnId"], turn_id);
    let events = stream.collect().await;
    assert_eq!(events[events.len() - 2]["reason"], "aborted");
    assert_eq!(
        server.get("/conversations/c-last/status").await,
        (200, json!({"conversationId": "c-last", "isActive": false, "status": "closed"}))
    );
    // Closing is idempotent and fine for unknown ids; a new turn reopens the conversation.
    assert_eq!(server.post("/conversations/c-last/close", json!({})).await.1["abortedTurn"], false);
    assert_eq!(server.post("/conversations/ghost/close", json!({})).await.0, 200);
    server.chat("c-last", "hello again").await;
    assert_eq!(server.get("/conversations/c-last/status").await.1["status"], "idle");

    for bad in ["?timeoutMs=-1", "?timeoutMs=abc", "?timeoutMs=300001"] {
        let (status, body) = server.get(&format!("/conversations/c-last/last{bad}")).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
}

#[tokio::test]
async fn sticky_model() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), |_| {}).await;
    assert_eq!(server.get("/conversations/m1/model").await, (200, json!({"conversationId": "m1", "model": null})));
    assert_eq!(
        server.put("/conversations/m1/model", json!({"model": "demo/scripted"})).await,
        (200, json!({"conversationId": "m1", "model": "demo/scripted"}))
    );
    assert_eq!(server.get("/conversations/m1/model").await.1["model"], "demo/scripted");
    let (_, list) = server.get("/conversations?q=m1").await;
    assert_eq!(list["conversations"][0]["model"], "demo/scripted");
    assert_eq!(server.put("/conversations/m1/model", json!({"model": null})).await.1["model"], Value::Null);
    for bad in [json!({}), json!({"model": 4}), json!({"model": "nope/x"})] {
        let (status, body) = server.put("/conversations/m1/model", bad.clone()).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    // The sticky model is the one a turn runs on when the request names none.
    server.put("/conversations/m1/model", json!({"model": "demo/scripted"})).await;
    let events = server.chat("m1", "hi").await;
    assert_eq!(events.last().unwrap()["type"], "turn-sealed");
}

#[tokio::test]
async fn throughput_sums_sealed_turns_per_model() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), |_| {}).await;
    for i in 0..3 {
        server.chat(&format!("tp-{i}"), "tools please").await;
    }
    let mut out_tokens = 0;
    let mut gen_ms = 0;
    for i in 0..3 {
        let (_, m) = server.get(&format!("/conversations/tp-{i}/metrics")).await;
        out_tokens += m["turns"][0]["usage"]["outputTokens"].as_i64().unwrap();
        gen_ms +=
            m["turns"][0]["steps"].as_array().unwrap().iter().map(|s| s["genTotalMs"].as_i64().unwrap()).sum::<i64>();
    }
    assert_eq!(out_tokens, 3 * 42);
    for query in ["", "?period=day", "?period=week", "?period=month"] {
        let (status, body) = server.get(&format!("/metrics/throughput{query}")).await;
        assert_eq!(status, 200, "{query}: {body}");
        let model = &body["models"][0];
        assert_eq!(model["model"], "demo/scripted");
        assert_eq!(model["turns"], 3);
        assert_eq!(model["totalOutputTokens"], out_tokens);
        assert_eq!(model["totalGenMs"], gen_ms);
        let expected = if gen_ms > 0 { out_tokens as f64 * 1000.0 / gen_ms as f64 } else { 0.0 };
        assert!((model["tokensPerSecond"].as_f64().unwrap() - expected).abs() < 1e-6);
        assert!(body["end"].as_i64().unwrap() > body["start"].as_i64().unwrap());
    }
    let (_, week) = server.get("/metrics/throughput?period=week&date=2020-01-01").await;
    // 2020-01-01 is a Wednesday: its ISO week starts Monday 2019-12-30 (day 18,260).
    assert_eq!(week["start"], 18_260_i64 * 86_400_000);
    assert_eq!(week["end"], 18_267_i64 * 86_400_000);
    assert_eq!(week["models"], json!([]));
    let (_, month) = server.get("/metrics/throughput?period=month&date=2024-02").await;
    assert_eq!(month["date"], "2024-02");
    assert_eq!(month["end"].as_i64().unwrap() - month["start"].as_i64().unwrap(), 29 * 86_400_000);
    for bad in ["?period=year", "?date=2026-02-30", "?date=2026-11", "?period=month&date=26-11", "?date=yesterday"] {
        let (status, body) = server.get(&format!("/metrics/throughput{bad}")).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
}

#[tokio::test]
async fn idle_streams_get_keep_alives() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), |c| c.keepalive_secs = 1).await;
    let mut ndjson = server.ndjson("quiet", "").await;
    assert_eq!(ndjson.next_line().await.as_deref(), Some(""));
    let mut sse = server.events("quiet", "", &[]).await;
    let chunk = sse.chunk().await.unwrap().unwrap();
    assert_eq!(&chunk[..], b": keep-alive\n\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_ops() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), |c| c.ws_listen = Some("127.0.0.1:0".parse().unwrap())).await;
    let mut ws = server.ws().await;
    assert_eq!(ws.next().await.unwrap(), json!({"type": "catalog", "catalog": []}));
    let mut observer = server.ws().await;
    observer.next().await.unwrap();

    ws.send_raw("{not json").await;
    assert_eq!(ws.next().await.unwrap(), json!({"type": "error", "message": "Invalid JSON"}));
    // Surface ops, unknown ops and subscribing to an unknown conversation are not errors.
    ws.send(json!({"type": "subscribe", "surface": "x"})).await;
    ws.send(json!({"type": "whatever"})).await;
    ws.send(json!({"type": "chat.subscribe", "conversationId": "nobody-yet"})).await;
    ws.send(json!({"type": "chat.send", "conversationId": "ws-1", "message": "stall"})).await;
    let mut first = ws.next().await.unwrap();
    while first["type"] == "conversation.statusChanged" {
        first = ws.next().await.unwrap();
    }
    assert_eq!(first["type"], "chat.delta", "{first}");
    assert_eq!(first["event"]["type"], "user-message");
    ws.send(json!({"type": "chat.send", "conversationId": "ws-1", "message": "again"})).await;
    let mut errors = Vec::new();
    while errors.is_empty() {
        let m = ws.next().await.unwrap();
        if m["type"] == "chat.error" {
            errors.push(m);
        }
    }
    assert_eq!(
        errors[0],
        json!({"type": "chat.error", "conversationId": "ws-1", "message": "a turn is already generating for this conversation"})
    );
    ws.send(json!({"type": "chat.send", "conversationId": "ws-2", "message": ""})).await;
    loop {
        let m = ws.next().await.unwrap();
        if m["type"] == "chat.error" {
            assert_eq!(m["conversationId"], "ws-2");
            assert!(m["message"].as_str().unwrap().contains("message"));
            break;
        }
    }
    server.post("/conversations/ws-1/stop", json!({})).await;
    let (events, _) = ws.deltas_until_sealed("ws-1").await;
    assert_eq!(events.last().unwrap()["type"], "turn-sealed");

    // Every connection hears status changes, subscribed or not.
    let mut statuses = Vec::new();
    while statuses.len() < 2 {
        let m = observer.next().await.unwrap();
        assert_eq!(m["type"], "conversation.statusChanged", "{m}");
        statuses.push((m["conversationId"].clone(), m["status"].clone()));
    }
    assert_eq!(statuses, vec![(json!("ws-1"), json!("active")), (json!("ws-1"), json!("idle"))]);

    // The extra listener upgrades on any path.
    let ws_addr = server.ws_addr.unwrap();
    let (mut other, _) = tokio_tungstenite::connect_async(format!("ws://{ws_addr}/")).await.unwrap();
    let mut other_client = WsClient { socket: other };
    assert_eq!(other_client.next().await.unwrap()["type"], "catalog");
    other_client.send(json!({"type": "chat.queue", "conversationId": "ws-3", "text": "tools"})).await;
    let (events, _) = other_client.deltas_until_sealed("ws-3").await;
    assert_eq!(events[0]["text"], "tools");
    other = other_client.socket;
    drop(other);
}
