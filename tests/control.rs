//! Turn control and the WebSocket protocol: status, close, last, sticky model, throughput,
//! keep-alives, chat.send / chat.subscribe / chat.queue and status broadcasts.

mod common;

use common::*;
use serde_json::{Value, json};

fn script() -> Value {
    json!({"rules": [
        {"match": "stall", "pace": 0, "steps": [{"text": "partial", "stallMs": 600000}]},
        {"match": "pause", "pace": 0, "steps": [{"text": "a moment", "stallMs": 1000}]},
        {"match": "tools", "pace": 0, "steps": [
            {"text": "Looking.", "toolCalls": [{"id": "k", "name": "find", "result": "it"}],
             "usage": {"inputTokens": 10, "outputTokens": 30}},
            {"text": "Found ", "usage": {"inputTokens": 20, "outputTokens": 12}},
        ]},
        {"match": "timed", "pace": 0, "steps": [
            {"toolCalls": [{"id": "t", "name": "grep", "output": "line 1\n", "result": "1 match", "durationMs": 4}]},
            {"text": "One.", "usage": {"inputTokens": 5, "outputTokens": 2}},
        ]},
        {"match": "broken", "pace": 0, "steps": [{"text": "half"}], "error": {"message": "gone away"}},
        {"match": "lengthy", "pace": 0, "steps": [{"text": "half"}], "error": {"message": "e".repeat(100_000)}},
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

/// What a reopened turn shows comes from the log: why each turn ended and where it starts (in
/// its metrics), a stopped turn's unknown usage marked rather than passed off as zero, a tool's
/// output and duration with its result, and a failed last turn in the list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reopened_turn_has_its_end_its_tools_and_no_made_up_usage() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), |_| {}).await;
    server.chat("reopened", "timed grep").await;
    let stream = server.chat_stream(json!({"conversationId": "reopened", "message": "stall"})).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(server.post("/conversations/reopened/stop", json!({})).await.1["abortedTurn"], true);
    let done = stream.collect().await.into_iter().find(|e| e["type"] == "done").unwrap();
    assert_eq!((done["reason"].as_str(), done.get("usage")), (Some("aborted"), None), "{done}");

    let history = server.history("reopened").await;
    let user_seqs: Vec<&Value> = history.iter().filter(|c| c["role"] == "user").map(|c| &c["seq"]).collect();
    let result = history.iter().find(|c| c["chunk"]["type"] == "tool-result").unwrap();
    assert_eq!(result["chunk"]["durationMs"], 4, "{result}");
    assert_eq!(result["chunk"]["output"], "line 1\n", "{result}");

    let (_, metrics) = server.get("/conversations/reopened/metrics").await;
    let turns = metrics["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 2);
    assert_eq!((&turns[0]["reason"], &turns[0]["firstSeq"]), (&json!("stop"), user_seqs[0]));
    assert_eq!(turns[0].get("usageReported"), None, "reported usage is not marked: {}", turns[0]);
    assert_eq!((&turns[1]["reason"], &turns[1]["firstSeq"]), (&json!("aborted"), user_seqs[1]));
    assert_eq!(turns[1]["usageReported"], false, "{}", turns[1]);
    assert_eq!(turns[1]["steps"][0]["usageReported"], false, "{}", turns[1]);

    let listed = |id: &'static str| {
        let server = &server;
        async move {
            let (_, list) = server.get(&format!("/conversations?q={id}")).await;
            list["conversations"][0].get("lastReason").cloned()
        }
    };
    assert_eq!(listed("reopened").await, Some(json!("aborted")));
    server.chat("broken-last", "broken").await;
    assert_eq!(listed("broken-last").await, Some(json!("error")));
    let (_, created) = server.post("/conversations", json!({"id": "no-turn-yet"})).await;
    assert_eq!(created.get("lastReason"), None);
    assert_eq!(listed("no-turn-yet").await, None);
}

/// `GET /metrics/series`: each model's turns by hour, with their failures, stops, error rate,
/// time-to-first-token quantiles and output rate; a bucket a period cannot take is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn series_count_each_models_turns_by_hour_with_their_first_token_quantiles() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), |_| {}).await;
    server.chat("sr-0", "tools please").await;
    server.chat("sr-1", "tools please").await;
    server.chat("sr-2", "broken").await;
    let stream = server.chat_stream(json!({"conversationId": "sr-3", "message": "stall"})).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(server.post("/conversations/sr-3/stop", json!({})).await.1["abortedTurn"], true);
    stream.collect().await;
    let mut slowest = 0;
    for i in 0..4 {
        let (_, m) = server.get(&format!("/conversations/sr-{i}/metrics")).await;
        slowest = slowest.max(m["turns"][0]["steps"][0]["ttftMs"].as_i64().expect("a first token"));
    }

    let (status, body) = server.get("/metrics/series").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!((&body["bucket"], &body["bucketMs"]), (&json!("hour"), &json!(3_600_000)));
    let model = &body["models"][0];
    assert_eq!(model["model"], "demo/scripted", "{body}");
    let points = model["points"].as_array().unwrap();
    let sum = |key: &str| points.iter().map(|p| p[key].as_i64().unwrap()).sum::<i64>();
    assert_eq!((sum("turns"), sum("failed"), sum("aborted")), (4, 1, 1), "{body}");
    for p in points {
        let rate = p["failed"].as_f64().unwrap() / p["turns"].as_f64().unwrap();
        assert!((p["errorRate"].as_f64().unwrap() - rate).abs() < 1e-9, "{p}");
        assert_eq!(p["at"].as_i64().unwrap() % 3_600_000, 0, "{p}");
        // The quantiles lie in the class of the slowest first token, or below it.
        let bound = [25, 50, 100, 250, 500, 1_000, 2_000, 4_000].into_iter().find(|b| *b >= slowest).unwrap() as f64;
        let (p50, p95) = (p["ttftP50Ms"].as_f64().unwrap(), p["ttftP95Ms"].as_f64().unwrap());
        assert!(0.0 < p50 && p50 <= p95 && p95 <= bound, "{p} (slowest {slowest} ms)");
    }
    // The output rate over the day agrees with /metrics/throughput's.
    let (_, throughput) = server.get("/metrics/throughput").await;
    if let [point] = &points[..] {
        let day = &throughput["models"][0];
        match day["totalGenMs"].as_i64().unwrap() {
            // Steps faster than a millisecond: no time to divide by, no rate.
            0 => assert_eq!(point.get("outputTokensPerSecond"), None, "{point}"),
            _ => {
                let rate = day["tokensPerSecond"].as_f64().unwrap();
                assert!((point["outputTokensPerSecond"].as_f64().unwrap() - rate).abs() < 1e-6, "{point} vs {day}");
            }
        }
    }
    let (_, month) = server.get("/metrics/series?period=month").await;
    assert_eq!(
        (&month["bucket"], month["models"][0]["points"][0]["at"].as_i64().unwrap() % 86_400_000),
        (&json!("day"), 0)
    );
    for bad in ["?bucket=minute", "?period=month&bucket=hour", "?period=year"] {
        let (status, body) = server.get(&format!("/metrics/series{bad}")).await;
        assert_eq!((status, body["error"].is_string()), (400, true), "{bad}: {body}");
    }

    // The failed turn is the recent errors' one, with the error its log keeps.
    let (status, recent) = server.get("/metrics/errors").await;
    assert_eq!(status, 200, "{recent}");
    let failed_turn = server.get("/conversations/sr-2/metrics").await.1["turns"][0]["turnId"].clone();
    assert_eq!(recent["errors"].as_array().unwrap().len(), 1, "{recent}");
    let error = &recent["errors"][0];
    assert_eq!(
        (&error["conversationId"], &error["turnId"], &error["model"], &error["message"]),
        (&json!("sr-2"), &failed_turn, &json!("demo/scripted"), &json!("gone away")),
        "{recent}"
    );
    for bad in ["?limit=0", "?limit=101", "?limit=x"] {
        let (status, body) = server.get(&format!("/metrics/errors{bad}")).await;
        assert_eq!((status, body["error"].is_string()), (400, true), "{bad}: {body}");
    }
}

/// An error longer than a listing reads (an agent program's may be megabytes) is listed as too
/// long, not read whole into the answer; the conversation's history keeps it whole.
#[tokio::test]
async fn a_recent_error_too_long_to_list_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), |_| {}).await;
    server.chat("lengthy", "lengthy").await;
    let (status, recent) = server.get("/metrics/errors").await;
    assert_eq!(status, 200);
    let message = recent["errors"][0]["message"].as_str().unwrap();
    assert!(message.starts_with("(an error too long to list"), "{}", &message[..message.len().min(200)]);
    let history = server.history("lengthy").await;
    let kept = history.iter().find(|c| c["chunk"]["type"] == "error").unwrap();
    assert_eq!(kept["chunk"]["message"].as_str().unwrap().len(), 100_000);
}

/// `GET /conversations` pages with `nextCursor` and counts with `count=true`; a made-up cursor
/// or count is a 400 that says why.
#[tokio::test]
async fn the_list_reads_in_pages_and_refuses_a_made_up_cursor() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), |_| {}).await;
    for i in 0..5 {
        assert_eq!(server.post("/conversations", json!({"id": format!("paged-{i}")})).await.0, 201);
    }
    let (mut ids, mut query) = (Vec::new(), "limit=2&count=true".to_owned());
    loop {
        let (status, page) = server.get(&format!("/conversations?{query}")).await;
        assert_eq!(status, 200, "{page}");
        assert_eq!(page["total"], 5, "{page}");
        ids.extend(page["conversations"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap().to_owned()));
        match page["nextCursor"].as_str() {
            // A cursor is a time and an id: characters a query takes as they are.
            Some(cursor) => query = format!("limit=2&count=true&cursor={cursor}"),
            None => break,
        }
    }
    let mut sorted = ids.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!((ids.len(), sorted.len()), (5, 5), "each once: {ids:?}");
    let (_, plain) = server.get("/conversations").await;
    assert_eq!((plain.get("total"), plain.get("nextCursor")), (None, None), "{plain}");
    for bad in ["cursor=nope", "cursor=12:", "cursor=x:paged-1", "cursor=1:%20bad", "count=yes"] {
        let (status, body) = server.get(&format!("/conversations?{bad}")).await;
        assert_eq!((status, body["error"].is_string()), (400, true), "{bad}: {body}");
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

/// A masked client frame (a server that ignored the mask would read garbage).
fn client_frame(first: u8, payload: &[u8]) -> Vec<u8> {
    dispatch_testkit::client_frame(first, payload, [0x37, 0xfa, 0x21, 0x3d])
}

/// Sends a WebSocket handshake on a fresh connection; the response head, and the socket.
async fn handshake(server: &TestServer, version: &str) -> (String, tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let request = format!(
        "GET /ws HTTP/1.1\r\nhost: localhost\r\nupgrade: websocket\r\nconnection: keep-alive, Upgrade\r\n\
         sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: {version}\r\n\r\n"
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8];
        socket.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    (String::from_utf8(head).unwrap().to_lowercase(), socket)
}

/// The next server frame: its first byte and payload (server frames are never masked).
async fn server_frame(socket: &mut tokio::net::TcpStream) -> (u8, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let mut header = [0u8; 2];
    socket.read_exact(&mut header).await.unwrap();
    assert_eq!(header[1] & 0x80, 0, "a server frame is not masked");
    let len = match header[1] & 0x7f {
        126 => socket.read_u16().await.unwrap() as usize,
        127 => socket.read_u64().await.unwrap() as usize,
        n => n as usize,
    };
    let mut payload = vec![0u8; len];
    socket.read_exact(&mut payload).await.unwrap();
    (header[0], payload)
}

/// The next text frame's JSON, skipping status changes.
async fn next_json(socket: &mut tokio::net::TcpStream) -> Value {
    let (first, payload) = next_frame(socket).await;
    assert_eq!(first, 0x81, "a final text frame");
    serde_json::from_slice(&payload).unwrap()
}

/// The next frame that is not a `conversation.statusChanged`: those may come at any point
/// after a turn starts or seals.
async fn next_frame(socket: &mut tokio::net::TcpStream) -> (u8, Vec<u8>) {
    loop {
        let (first, payload) = server_frame(socket).await;
        let status = first == 0x81
            && serde_json::from_slice::<Value>(&payload).is_ok_and(|m| m["type"] == "conversation.statusChanged");
        if !status {
            return (first, payload);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_frames_on_the_wire() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), |_| {}).await;

    // The handshake of RFC 6455's example key; the session opens with the catalog.
    let (head, mut socket) = handshake(&server, "13").await;
    assert!(head.starts_with("http/1.1 101 switching protocols\r\n"), "{head}");
    assert!(head.contains("\r\nsec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo=\r\n"), "{head}");
    assert!(head.contains("\r\nupgrade: websocket\r\n") && head.contains("\r\nconnection: upgrade\r\n"), "{head}");
    assert_eq!(next_json(&mut socket).await, json!({"type": "catalog", "catalog": []}));

    // A ping is answered with its payload; an op in two fragments with a ping between them is
    // one op.
    socket.write_all(&client_frame(0x89, b"abc")).await.unwrap();
    assert_eq!(server_frame(&mut socket).await, (0x8A, b"abc".to_vec()));
    let op = json!({"type": "chat.send", "conversationId": "frames", "message": "tools"}).to_string();
    let (a, b) = op.as_bytes().split_at(10);
    let mut bytes = client_frame(0x01, a);
    bytes.extend(client_frame(0x89, b"x"));
    bytes.extend(client_frame(0x80, b));
    socket.write_all(&bytes).await.unwrap();
    assert_eq!(server_frame(&mut socket).await, (0x8A, b"x".to_vec()));
    let mut events = Vec::new();
    while events.last().is_none_or(|e: &Value| e["type"] != "turn-sealed") {
        let m = next_json(&mut socket).await;
        assert_eq!(m["type"], "chat.delta", "{m}");
        events.push(m["event"].clone());
    }
    assert_eq!(events[0]["type"], "user-message");
    assert_eq!(events[0]["text"], "tools");
    // A long op (a 16-bit length) that is not JSON gets its error.
    socket.write_all(&client_frame(0x81, &[b'{'; 300])).await.unwrap();
    assert_eq!(next_json(&mut socket).await, json!({"type": "error", "message": "Invalid JSON"}));

    // An unmasked frame is a protocol error: close 1002, then the connection ends.
    socket.write_all(&[0x81, 0x02, b'h', b'i']).await.unwrap();
    assert_eq!(next_frame(&mut socket).await, (0x88, 1002u16.to_be_bytes().to_vec()));
    let mut rest = Vec::new();
    socket.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty(), "{rest:?}");

    // A close is answered with the same code.
    let (_, mut socket) = handshake(&server, "13").await;
    next_json(&mut socket).await;
    socket.write_all(&client_frame(0x88, &1000u16.to_be_bytes())).await.unwrap();
    assert_eq!(next_frame(&mut socket).await, (0x88, 1000u16.to_be_bytes().to_vec()));
    socket.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty(), "{rest:?}");

    // A text message that is not UTF-8: close 1007.
    let (_, mut socket) = handshake(&server, "13").await;
    next_json(&mut socket).await;
    socket.write_all(&client_frame(0x81, &[0xc3, 0x28])).await.unwrap();
    assert_eq!(next_frame(&mut socket).await, (0x88, 1007u16.to_be_bytes().to_vec()));

    // A handshake of another version is refused with a JSON error.
    let (head, mut socket) = handshake(&server, "8").await;
    assert!(head.starts_with("http/1.1 400 "), "{head}");
    let length: usize = head.split("content-length: ").nth(1).unwrap().split("\r\n").next().unwrap().parse().unwrap();
    let mut body = vec![0u8; length];
    socket.read_exact(&mut body).await.unwrap();
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert!(body["error"].as_str().unwrap().contains("Sec-WebSocket-Version"), "{body}");
    assert_eq!(server.get("/health").await.0, 200);
}

/// The JSON messages of the server frames in `bytes` (whole frames only).
fn frames_in(mut bytes: &[u8]) -> Vec<Value> {
    let mut messages = Vec::new();
    while let Some(frame) = dispatch_testkit::server_frame(bytes) {
        messages.push(serde_json::from_slice(frame.payload).unwrap());
        bytes = &bytes[frame.len..];
    }
    messages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_changes_wait_out_the_flush_window_and_go_out_together() {
    use tokio::io::AsyncReadExt;
    let dir = tempfile::tempdir().unwrap();
    // One watcher of a turn in flight opens a window of two seconds.
    let server = server(dir.path(), |c| {
        c.flush_sweeps = u32::MAX;
        c.flush_max_ms = 2_000;
    })
    .await;
    let (_, mut observer) = handshake(&server, "13").await;
    assert_eq!(next_json(&mut observer).await["type"], "catalog");
    let mut watcher = server.sse("held", "").await;
    let (status, body) = server.post("/conversations/held/messages", json!({"message": "stall"})).await;
    assert_eq!(status, 202, "{body}");
    // The watcher reads the turn (the window opens), and the observer hears it start.
    while watcher.next().await.unwrap().json()["type"] != "turn-start" {}
    let m = frame_json(&mut observer).await;
    assert_eq!((m["conversationId"].as_str(), m["status"].as_str()), (Some("held"), Some("active")), "{m}");

    // Three turns start within the window: their status changes reach the observer in one
    // write, in the order they happened. (Written as they come, the first would wake the read
    // already waiting for it, alone.)
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        let n = observer.read(&mut buf).await.unwrap();
        buf.truncate(n);
        (observer, buf)
    });
    for id in ["s1", "s2", "s3"] {
        let (status, body) = server.post(&format!("/conversations/{id}/messages"), json!({"message": "stall"})).await;
        assert_eq!(status, 202, "{body}");
    }
    let (mut observer, buf) = tokio::time::timeout(std::time::Duration::from_secs(10), reader).await.unwrap().unwrap();
    let statuses: Vec<(String, String)> = frames_in(&buf)
        .iter()
        .map(|m| {
            assert_eq!(m["type"], "conversation.statusChanged", "{m}");
            (m["conversationId"].as_str().unwrap().to_owned(), m["status"].as_str().unwrap().to_owned())
        })
        .collect();
    let active = |id: &str| (id.to_owned(), "active".to_owned());
    assert_eq!(statuses, vec![active("s1"), active("s2"), active("s3")]);

    // The stops end every turn, and the observer hears each go idle (held or not, none is lost).
    drop(watcher);
    for id in ["held", "s1", "s2", "s3"] {
        server.post(&format!("/conversations/{id}/stop"), json!({})).await;
    }
    let mut idle = Vec::new();
    while idle.len() < 4 {
        let m = tokio::time::timeout(std::time::Duration::from_secs(10), frame_json(&mut observer)).await.unwrap();
        if m["status"] == "idle" {
            idle.push(m["conversationId"].as_str().unwrap().to_owned());
        }
    }
    idle.sort();
    assert_eq!(idle, ["held", "s1", "s2", "s3"]);
}

/// The next frame's JSON, status changes included.
async fn frame_json(socket: &mut tokio::net::TcpStream) -> Value {
    serde_json::from_slice(&server_frame(socket).await.1).unwrap()
}

/// Messages queued too late for a turn start the next one straight from it: the conversation is
/// never free in between, so no session is told it is idle (and nobody who read `/status`
/// idle is then refused a turn, 409, because the queued turn took it). The status changes a
/// session hears: active, active (the queued turn), idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_turn_follows_its_turn_without_an_idle_between() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), |_| {}).await;
    let mut ws = server.ws().await;
    ws.send(json!({"type": "chat.subscribe", "conversationId": "handover"})).await;
    let (status, _) = server.post("/conversations/handover/messages", json!({"message": "pause"})).await;
    assert_eq!(status, 202);
    let (status, body) = server.post("/conversations/handover/queue", json!({"text": "and then"})).await;
    assert_eq!(status, 200, "{body}");
    let mut heard = Vec::new();
    while heard.len() < 3 {
        let m = ws.next().await.expect("the session stays open");
        if m["type"] == "conversation.statusChanged" && m["conversationId"] == "handover" {
            heard.push(m["status"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(heard, ["active", "active", "idle"], "no idle between the turn and the queued one");
    let history = server.history("handover").await;
    let users: Vec<&Value> = history.iter().filter(|c| c["role"] == "user").map(|c| &c["chunk"]["text"]).collect();
    assert_eq!(users, [&json!("pause"), &json!("and then")], "the queued message ran as the next turn");
}
