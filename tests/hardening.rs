//! The gateway as an attacker meets it, on raw sockets: keys on every upgrade, empty keys,
//! foreign origins, subscription and queue caps, frames that never finish, h2c, slow bodies,
//! hostile WebSocket lengths and close codes, the WebSocket after a kept-alive request, error
//! bodies on every hand-written path, and failed reads that must end a turn or a stream.

mod common;

use std::time::Duration;

use common::raw::{exchange, json_body};
use common::*;
use dispatch_gateway::{Config, Gateway};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

fn upgrade(path: &str, extra: &str) -> Vec<u8> {
    format!(
        "GET {path} HTTP/1.1\r\nhost: localhost\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-version: 13\r\nsec-websocket-key: {KEY}\r\n{extra}\r\n"
    )
    .into_bytes()
}

/// A client frame with `first` byte (FIN, opcode) and a masked payload.
fn frame(first: u8, payload: &[u8]) -> Vec<u8> {
    dispatch_testkit::client_frame(first, payload, [1, 2, 3, 4])
}

/// Reads server frames until a close frame; its code (None: closed without one, or none in it).
async fn close_code(socket: &mut TcpStream, mut buf: Vec<u8>) -> Option<u16> {
    loop {
        while let Some(frame) = dispatch_testkit::server_frame(&buf) {
            if frame.opcode() == 0x8 {
                return frame.payload.get(..2).map(|code| u16::from_be_bytes([code[0], code[1]]));
            }
            let taken = frame.len;
            buf.drain(..taken);
        }
        let mut chunk = [0u8; 8192];
        match tokio::time::timeout(Duration::from_secs(15), socket.read(&mut chunk))
            .await
            .expect("the server acts in time")
        {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Opens a raw WebSocket on `addr` and returns the socket and what followed the 101.
async fn raw_ws(addr: std::net::SocketAddr, path: &str, extra: &str) -> (TcpStream, Vec<u8>) {
    let mut socket = TcpStream::connect(addr).await.unwrap();
    let raw = exchange(&mut socket, &upgrade(path, extra)).await;
    assert_eq!(raw.status, 101, "{}", raw.head);
    (socket, raw.rest)
}

#[tokio::test]
async fn every_upgrade_needs_a_key_on_either_listener() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.api_keys = vec!["k1".into()];
    config.ws_listen = Some("127.0.0.1:0".parse().unwrap());
    let server = TestServer::start(config).await;
    let ws_addr = server.ws_addr.unwrap();
    for addr in [server.addr, ws_addr] {
        for path in ["/health", "/ready", "/openapi.json", "/openapi.json?x=1", "/ws", "/"] {
            let mut socket = TcpStream::connect(addr).await.unwrap();
            let raw = exchange(&mut socket, &upgrade(path, "")).await;
            assert_eq!(raw.status, 401, "{path} on {addr} upgraded without a key");
            assert!(json_body(&mut socket, &raw).await["error"].is_string());
        }
    }
    // With the key it opens, on a public path of the WebSocket listener too.
    let (mut socket, _) = raw_ws(ws_addr, "/health?access_token=k1", "").await;
    drop(socket.write_all(&frame(0x88, &[0x03, 0xe8])).await);
    // The plain public routes stay public.
    assert_eq!(server.client.get(server.url("/health")).send().await.unwrap().status(), 200);
}

#[tokio::test]
async fn an_empty_key_is_refused_at_start_and_no_key_means_auth_off() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("k.db").display().to_string();
    let args = |keys: &str| -> Vec<std::ffi::OsString> {
        ["dispatch-gateway", "--database", &db, "--api-keys", keys].iter().map(Into::into).collect()
    };
    for keys in ["k,", ",", ",k"] {
        let config = Config::load_from(args(keys), Vec::new()).unwrap();
        let error = Gateway::build(config).await.err().expect("an empty key stops the start");
        assert!(error.to_string().contains("empty key"), "{error}");
    }
    // Through the environment, as a deployment sets it: a comma alone is two empty keys.
    let run = |value: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"))
            .args(["--listen", "127.0.0.1:0", "--database", &db])
            .env("DISPATCH_API_KEYS", value)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let refused = run(",").wait_with_output().unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("empty key"), "{refused:?}");
    // An empty value (a compose file's unset variable) is no keys: auth off, said in the log.
    let mut open = run("");
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(open.stdout.take().unwrap()), &mut first).unwrap();
    let _ = open.kill();
    let _ = open.wait();
    assert!(first.contains("auth is off"), "{first}");
    // No keys at all: the log says auth is off.
    let child = ChildGateway::spawn(&["--database".into(), dir.path().join("c.db").into()]);
    let said = child
        .logs
        .lock()
        .unwrap()
        .iter()
        .any(|l| l["fields"]["message"] == "auth is off: no API keys or token keys are configured");
    assert!(said, "the start logs that auth is off");
    assert!(child.terminate().success());
}

#[tokio::test]
async fn a_foreign_origin_gets_no_websocket() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.cors_origins = vec!["http://good.example".into()];
    let server = TestServer::start(config).await;
    let mut socket = TcpStream::connect(server.addr).await.unwrap();
    let raw = exchange(&mut socket, &upgrade("/ws", "origin: http://evil.example\r\n")).await;
    assert_eq!(raw.status, 403);
    assert!(json_body(&mut socket, &raw).await["error"].as_str().unwrap().contains("origin"));
    raw_ws(server.addr, "/ws", "origin: http://good.example\r\n").await;
    // No Origin: not a browser, allowed.
    raw_ws(server.addr, "/ws", "").await;
}

#[tokio::test]
async fn a_session_follows_at_most_its_cap_of_conversations() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_ws_subscriptions = 3;
    let server = TestServer::start(config).await;
    let mut ws = server.ws().await;
    assert_eq!(ws.next().await.unwrap()["type"], "catalog");
    for id in ["c1", "c2", "c3", "c3", "c4"] {
        ws.send(json!({"type": "chat.subscribe", "conversationId": id})).await;
    }
    let error = ws.next().await.unwrap();
    assert_eq!(error["type"], "chat.error", "{error}");
    assert_eq!(error["conversationId"], "c4");
    assert!(error["message"].as_str().unwrap().contains('3'), "{error}");
    // A send to a fourth conversation is refused before its turn starts.
    ws.send(json!({"type": "chat.send", "conversationId": "c5", "message": "hi"})).await;
    assert_eq!(ws.next().await.unwrap()["type"], "chat.error");
    assert_eq!(server.get("/conversations/c5/status").await.0, 404, "no turn started");
    // Unsubscribing makes room; turns in two followed conversations arrive whole, each.
    ws.send(json!({"type": "chat.unsubscribe", "conversationId": "c1"})).await;
    ws.send(json!({"type": "chat.send", "conversationId": "c4", "message": "four"})).await;
    let (events, other) = ws.deltas_until_sealed("c4").await;
    assert_eq!(events.first().unwrap()["type"], "user-message");
    assert!(other.iter().all(|m| m["type"] != "chat.error"), "{other:?}");
    let expected = server.chat("c2", "two").await;
    let (events, _) = ws.deltas_until_sealed("c2").await;
    assert_eq!(events, expected, "the followed conversation's turn, as a chat stream saw it");
    // c1 was left: its turn reaches the socket no more.
    server.chat("c1", "one").await;
    server.chat("c3", "three").await;
    let (events, other) = ws.deltas_until_sealed("c3").await;
    assert_eq!(events.last().unwrap()["type"], "turn-sealed");
    let c1: Vec<_> = other.iter().filter(|m| m["type"] == "chat.delta").collect();
    assert!(c1.is_empty(), "deltas of an unsubscribed conversation: {c1:?}");
}

/// A test configuration whose turns for the message "slow" say "waiting" and then stall.
fn slow_turns(dir: &std::path::Path, stall_ms: u64) -> Config {
    let mut config = test_config(dir);
    let script = json!({"rules": [{"match": "slow", "steps": [{"text": "waiting", "stallMs": stall_ms}]}]});
    config.scripted_script = Some(write_script(dir, script));
    config
}

#[tokio::test]
async fn the_queue_is_capped_by_count_and_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = slow_turns(dir.path(), 3000);
    config.max_queued_messages = 3;
    config.max_queued_bytes = 1000;
    let server = TestServer::start(config).await;
    let (status, _) = server.post("/conversations/q/messages", json!({"message": "slow"})).await;
    assert_eq!(status, 202);
    for n in 1..=3 {
        let (status, body) = server.post("/conversations/q/queue", json!({"text": format!("m{n}")})).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["queue"].as_array().unwrap().len(), n);
    }
    let (status, body) = server.post("/conversations/q/queue", json!({"text": "m4"})).await;
    assert_eq!(status, 409, "{body}");
    assert!(body["error"].as_str().unwrap().contains("max-queued-messages"));
    server.post("/conversations/q/stop", json!({})).await;
    server.get("/conversations/q/last").await;

    let (status, _) = server.post("/conversations/b/messages", json!({"message": "slow"})).await;
    assert_eq!(status, 202);
    let (status, _) = server.post("/conversations/b/queue", json!({"text": "x".repeat(600)})).await;
    assert_eq!(status, 200);
    let (status, body) = server.post("/conversations/b/queue", json!({"text": "y".repeat(600)})).await;
    assert_eq!(status, 413, "{body}");
    assert!(body["error"].as_str().unwrap().contains("max-queued-bytes"));
    // Over the WebSocket the same cap answers chat.error.
    let mut ws = server.ws().await;
    ws.next().await.unwrap();
    ws.send(json!({"type": "chat.queue", "conversationId": "b", "text": "z".repeat(600)})).await;
    let error = loop {
        let m = ws.next().await.unwrap();
        if m["type"] == "chat.error" {
            break m;
        }
    };
    assert!(error["message"].as_str().unwrap().contains("max-queued-bytes"), "{error}");
    server.post("/conversations/b/stop", json!({})).await;
}

/// Turns at once are capped (--max-turns): past it a new turn is 503 on every way of starting
/// one, nothing of it is written, and a place frees when a turn seals.
#[tokio::test]
async fn turns_at_once_are_capped() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = slow_turns(dir.path(), 30_000);
    config.max_turns = 2;
    let server = TestServer::start(config).await;
    for id in ["a", "b"] {
        let (status, body) = server.post(&format!("/conversations/{id}/messages"), json!({"message": "slow"})).await;
        assert_eq!(status, 202, "{body}");
    }
    let full = |body: &Value| body["error"].as_str().is_some_and(|e| e.contains("max-turns"));
    let (status, body) = server.post("/conversations/c/messages", json!({"message": "slow"})).await;
    assert!(status == 503 && full(&body), "{status} {body}");
    let (status, body) = server.post("/conversations/c/queue", json!({"text": "slow"})).await;
    assert!(status == 503 && full(&body), "{status} {body}");
    let response = server.client.post(server.url("/chat")).json(&json!({"conversationId": "c", "message": "hi"}));
    let response = response.send().await.unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "5", "a place frees as a turn ends: try again later");
    assert!(full(&response.json().await.unwrap()));
    let mut ws = server.ws().await;
    ws.next().await.unwrap();
    ws.send(json!({"type": "chat.send", "conversationId": "c", "message": "hi"})).await;
    let error = loop {
        let m = ws.next().await.unwrap();
        if m["type"] == "chat.error" {
            break m;
        }
    };
    assert!(full(&json!({"error": error["message"]})), "{error}");
    assert_eq!(server.get("/conversations/c/status").await.0, 404, "nothing of c was written");
    assert_eq!(metric(&server.metrics().await, "dispatch_turns_running"), 2.0);

    // A turn that ends frees its place.
    server.post("/conversations/a/stop", json!({})).await;
    server.get("/conversations/a/last").await;
    let (status, body) = server.post("/conversations/c/messages", json!({"message": "hi"})).await;
    assert_eq!(status, 202, "{body}");
    server.post("/conversations/b/stop", json!({})).await;
}

/// A `/last` waiting for a running turn holds its connection as a stream does, and counts as
/// one under --max-streams: the waits cannot grow past the cap either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_the_last_answer_counts_as_a_stream() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = slow_turns(dir.path(), 30_000);
    config.max_streams = 1;
    let server = TestServer::start(config).await;
    assert_eq!(server.post("/conversations/a/messages", json!({"message": "slow"})).await.0, 202);
    let waiting = {
        let api = Api::new(server.addr.to_string());
        tokio::spawn(async move { api.get("/conversations/a/last?timeoutMs=60000").await })
    };
    let last_open = "dispatch_open_streams{transport=\"last\"} 1";
    assert!(eventually(200, || async { server.metrics().await.contains(last_open) }).await);
    let (status, body) = server.get("/conversations/a/last?timeoutMs=60000").await;
    assert_eq!(status, 503, "{body}");
    assert!(body["error"].as_str().unwrap().contains("streams"), "{body}");
    let events = server.client.get(server.url("/conversations/a/events")).send().await.unwrap();
    assert_eq!(events.status(), 503, "the wait holds the one place");
    assert_eq!(events.headers()["retry-after"], "5");
    server.post("/conversations/a/stop", json!({})).await;
    let (status, body) = waiting.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(server.metrics().await.contains("dispatch_open_streams{transport=\"last\"} 0"));
    // With no turn running, /last answers at once and holds nothing.
    assert_eq!(server.get("/conversations/a/last").await.0, 200);
}

/// Messages being assembled count in the gateway's reading budget (`--max-reading-bytes`,
/// shared with request bodies): sessions that would hold more than it between them are closed
/// 1013 (try again later) while their frames are still arriving; whole small messages go on.
#[tokio::test]
async fn messages_being_assembled_count_in_the_reading_budget() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_reading_bytes = 256 * 1024;
    config.max_body_bytes = 1024 * 1024;
    let server = TestServer::start(config).await;
    // Two sessions each send most of a 200 KB frame: the first fits, the second does not.
    let announced = frame(0x81, &vec![b'a'; 200_000]);
    let (mut first, first_rest) = raw_ws(server.addr, "/ws", "").await;
    first.write_all(&announced[..150_000]).await.unwrap();
    let held = || async { server.state.reading.in_use() >= 140_000 };
    assert!(eventually(200, held).await, "the first session's frame takes room");
    let (mut second, rest) = raw_ws(server.addr, "/ws", "").await;
    second.write_all(&announced[..150_000]).await.unwrap();
    assert_eq!(close_code(&mut second, rest).await, Some(1013));
    // The first finishes its message (an op the session answers) and its room is given back.
    first.write_all(&announced[150_000..]).await.unwrap();
    let (mut third, rest) = raw_ws(server.addr, "/ws", "").await;
    third.write_all(&announced[..150_000]).await.unwrap();
    third.write_all(&announced[150_000..]).await.unwrap();
    third.write_all(&frame(0x88, &[0x03, 0xe8])).await.unwrap();
    assert_eq!(close_code(&mut third, rest).await, Some(1000), "room was given back");
    drop(first_rest);
}

#[tokio::test]
async fn a_frame_or_message_that_never_finishes_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.ws_message_timeout_secs = 1;
    let server = TestServer::start(config).await;
    // A frame announcing 60,000 bytes, of which 10 come.
    let (mut socket, rest) = raw_ws(server.addr, "/ws", "").await;
    let announced = frame(0x81, &vec![b'a'; 60_000]);
    socket.write_all(&announced[..18]).await.unwrap();
    assert_eq!(close_code(&mut socket, rest).await, Some(1008));
    // A fragmented message whose last fragment never comes (pings meanwhile do not help).
    let (mut socket, rest) = raw_ws(server.addr, "/ws", "").await;
    socket.write_all(&frame(0x01, b"{\"type\":")).await.unwrap();
    for _ in 0..3 {
        let _ = socket.write_all(&frame(0x89, b"p")).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(close_code(&mut socket, rest).await, Some(1008));
    // Whole messages sent slowly, one by one, are fine.
    let (mut socket, mut rest) = raw_ws(server.addr, "/ws", "").await;
    for _ in 0..3 {
        socket.write_all(&frame(0x89, b"p")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    socket.write_all(&frame(0x88, &[0x03, 0xe8])).await.unwrap();
    let mut chunk = [0u8; 4096];
    let n = socket.read(&mut chunk).await.unwrap();
    rest.extend_from_slice(&chunk[..n]);
    assert_eq!(close_code(&mut socket, rest).await, Some(1000));
}

#[tokio::test]
async fn cleartext_http2_is_not_spoken() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let mut socket = TcpStream::connect(server.addr).await.unwrap();
    let raw = exchange(&mut socket, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0").await;
    assert_eq!(raw.status, 400);
    assert!(json_body(&mut socket, &raw).await["error"].is_string());
    assert!(closed_by_peer(&mut socket, Duration::from_secs(5)).await);
    // After a request served as HTTP/1.1, the preface is not HTTP/2 either.
    let mut socket = TcpStream::connect(server.addr).await.unwrap();
    let raw = exchange(&mut socket, b"POST /conversations HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}").await;
    assert_eq!(raw.status, 201);
    socket.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    let mut seen = raw.rest;
    let mut chunk = [0u8; 4096];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(5), socket.read(&mut chunk)).await {
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&chunk[..n]);
    }
    let seen = String::from_utf8_lossy(&seen);
    assert!(!seen.contains("HTTP/2"), "{seen}");
    // An `Upgrade: h2c` request is served as HTTP/1.1, not switched.
    let mut socket = TcpStream::connect(server.addr).await.unwrap();
    let raw = exchange(
        &mut socket,
        b"GET /health HTTP/1.1\r\nhost: localhost\r\nconnection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAAP__\r\n\r\n",
    )
    .await;
    assert_eq!(raw.status, 200, "{}", raw.head);
}

#[tokio::test]
async fn a_slow_body_is_cut_on_streaming_routes_too() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.request_timeout_secs = 1;
    let server = TestServer::start(config).await;
    for head in [
        "POST /chat HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"mess",
        // A body the gateway reads itself, on a route that is not streaming: 408, not the
        // handler's 503 for a request that ran out of time.
        "PUT /conversations/s/title HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"tit",
        "GET /ws HTTP/1.1\r\nhost: localhost\r\nupgrade: websocket\r\nconnection: upgrade\r\ncontent-length: 50\r\n\r\nab",
        "GET /conversations/s/events HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 50\r\n\r\nab",
    ] {
        let mut socket = TcpStream::connect(server.addr).await.unwrap();
        let raw = exchange(&mut socket, head.as_bytes()).await;
        assert_eq!(raw.status, 408, "{head:?}: {}", raw.head);
        assert!(json_body(&mut socket, &raw).await["error"].as_str().unwrap().contains("in time"));
        assert!(closed_by_peer(&mut socket, Duration::from_secs(5)).await, "{head:?}");
    }
    // A client that leaves part way through a body gets nothing, and the gateway goes on.
    let mut socket = TcpStream::connect(server.addr).await.unwrap();
    socket.write_all(b"PUT /conversations/s/title HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{").await.unwrap();
    socket.shutdown().await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), socket.read_to_end(&mut answer)).await.unwrap().unwrap();
    assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
    let (status, _) = server.get("/conversations?q=s").await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn hostile_lengths_and_close_codes_get_protocol_errors() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    // A fragment, then a continuation declaring a length near 2^64 (the old sum wrapped).
    let mut huge = frame(0x01, b"a");
    huge.extend_from_slice(&[0x80, 0x80 | 127]);
    huge.extend_from_slice(&(u64::MAX - 1).to_be_bytes());
    huge.extend_from_slice(&[0, 0, 0, 0]);
    // A length with the top bit set, alone, and one just under the limit's wrap.
    let mut top = vec![0x81, 0x80 | 127];
    top.extend_from_slice(&(1u64 << 63).to_be_bytes());
    top.extend_from_slice(&[0, 0, 0, 0]);
    let mut big = vec![0x81, 0x80 | 127];
    big.extend_from_slice(&(u64::MAX >> 1).to_be_bytes());
    big.extend_from_slice(&[0, 0, 0, 0]);
    for (bytes, expected) in [(huge, [1002, 1009]), (top, [1002, 1002]), (big, [1009, 1009])] {
        let (mut socket, rest) = raw_ws(server.addr, "/ws", "").await;
        socket.write_all(&bytes).await.unwrap();
        let code = close_code(&mut socket, rest).await;
        assert!(code.is_some_and(|c| expected.contains(&c)), "{code:?} for {bytes:02x?}");
    }
    for code in [0u16, 999, 1004, 1005, 1006, 1015, 1016, 2999, 5000] {
        let (mut socket, rest) = raw_ws(server.addr, "/ws", "").await;
        socket.write_all(&frame(0x88, &code.to_be_bytes())).await.unwrap();
        assert_eq!(close_code(&mut socket, rest).await, Some(1002), "close code {code}");
    }
    for code in [1000u16, 1001, 3000, 4999] {
        let (mut socket, rest) = raw_ws(server.addr, "/ws", "").await;
        socket.write_all(&frame(0x88, &code.to_be_bytes())).await.unwrap();
        assert_eq!(close_code(&mut socket, rest).await, Some(code), "close code {code} is echoed");
    }
    assert_eq!(server.get("/health").await.0, 200, "the gateway is up");
}

#[tokio::test]
async fn a_websocket_after_a_kept_alive_request_closes_errors_with_their_codes() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_body_bytes = 1024;
    let server = TestServer::start(config).await;
    let not_utf8 = frame(0x81, &[0xc3, 0x28]);
    let unmasked = vec![0x81, 0x02, b'h', b'i'];
    let too_big = frame(0x81, &[b'a'; 2000]);
    for (bytes, code) in [(not_utf8, 1007), (unmasked, 1002), (too_big, 1009)] {
        let mut socket = TcpStream::connect(server.addr).await.unwrap();
        let raw = exchange(&mut socket, b"GET /models HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
        assert_eq!(raw.status, 200);
        let body = json_body(&mut socket, &raw).await;
        assert!(body["models"].is_array());
        let raw = exchange(&mut socket, &upgrade("/ws", "")).await;
        assert_eq!(raw.status, 101, "{}", raw.head);
        // The same session as any: it opens with the catalog and answers ops.
        socket.write_all(&frame(0x81, br#"{"type":"chat.subscribe","conversationId":"k"}"#)).await.unwrap();
        socket.write_all(&bytes).await.unwrap();
        let mut rest = raw.rest;
        let mut chunk = [0u8; 4096];
        while !String::from_utf8_lossy(&rest).contains("catalog") {
            let n = socket.read(&mut chunk).await.unwrap();
            assert!(n > 0);
            rest.extend_from_slice(&chunk[..n]);
        }
        assert_eq!(close_code(&mut socket, rest).await, Some(code));
    }
}

#[tokio::test]
async fn hand_written_paths_answer_errors_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let many: String = (0..150).map(|i| format!("x-h{i}: v\r\n")).collect();
    let cases: Vec<(Vec<u8>, u16)> = vec![
        (b"GET /ws HTTP/1.1\r\nhost: localhost\r\n\r\n".to_vec(), 400),
        (b"GET /ws HTTP/1.0\r\nupgrade: websocket\r\nconnection: upgrade\r\nsec-websocket-version: 13\r\nsec-websocket-key: a\r\n\r\n".to_vec(), 426),
        (b"GET / HTTP/1.1\r\nho st: x\r\n\r\n".to_vec(), 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03".to_vec(), 400),
        (format!("GET /health HTTP/1.1\r\nhost: localhost\r\nx-pad: {}\r\n\r\n", "p".repeat(70 * 1024)).into_bytes(), 431),
        (format!("GET /health HTTP/1.1\r\nhost: localhost\r\n{many}\r\n").into_bytes(), 431),
        // Framing hyper refuses with an empty 400 (where the body ends is unknown).
        (b"POST /conversations HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}".to_vec(), 400),
        (b"POST /conversations HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: +2\r\n\r\n{}".to_vec(), 400),
        (b"GET /health HTTP/1.1\r\nhost: localhost\r\ntransfer-encoding: gzip\r\n\r\n".to_vec(), 400),
        (b"POST /conversations HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n".to_vec(), 400),
    ];
    for (request, status) in cases {
        let mut socket = TcpStream::connect(server.addr).await.unwrap();
        let raw = exchange(&mut socket, &request).await;
        assert_eq!(raw.status, status, "{:?}", String::from_utf8_lossy(&request[..request.len().min(80)]));
        assert!(json_body(&mut socket, &raw).await["error"].is_string());
    }
    // Version 8 is told the version the gateway speaks.
    let mut socket = TcpStream::connect(server.addr).await.unwrap();
    let v8 =
        String::from_utf8(upgrade("/ws", "")).unwrap().replace("sec-websocket-version: 13", "sec-websocket-version: 8");
    let raw = exchange(&mut socket, v8.as_bytes()).await;
    assert_eq!(raw.status, 400);
    assert!(raw.head.contains("sec-websocket-version: 13"), "{}", raw.head);
    assert!(json_body(&mut socket, &raw).await["error"].is_string());
}

#[tokio::test]
async fn request_heads_are_held_to_the_configured_length_and_header_count() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_head_bytes = 8 * 1024;
    config.max_headers = 10;
    let server = TestServer::start(config).await;
    let head = |pad: usize, extra: usize| {
        let lines: String = (0..extra).map(|i| format!("x-h{i}: v\r\n")).collect();
        format!("GET /health HTTP/1.1\r\nhost: localhost\r\nx-pad: {}\r\n{lines}\r\n", "p".repeat(pad)).into_bytes()
    };
    // A kept-alive request with a body first: what follows on that connection is hyper's,
    // held to the same limits (and answered with hyper's own empty 431).
    let post =
        b"POST /conversations HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    for after_a_body in [false, true] {
        let connect = || async {
            let mut socket = TcpStream::connect(server.addr).await.unwrap();
            if after_a_body {
                let raw = exchange(&mut socket, post).await;
                assert_eq!(raw.status, 201, "{}", raw.head);
                json_body(&mut socket, &raw).await;
            }
            socket
        };
        // Just inside both limits: served, and the connection goes on.
        let mut socket = connect().await;
        let raw = exchange(&mut socket, &head(7 * 1024, 7)).await;
        assert_eq!(raw.status, 200, "after a body: {after_a_body}");
        for (request, why) in [(head(9 * 1024, 0), "longer than 8 KiB"), (head(0, 9), "11 header lines")] {
            let mut socket = connect().await;
            let raw = exchange(&mut socket, &request).await;
            assert_eq!(raw.status, 431, "{why}, after a body: {after_a_body}");
            if !after_a_body {
                assert!(json_body(&mut socket, &raw).await["error"].is_string());
            }
        }
    }
}

/// Writes a value the store cannot decode into a column, from a connection of its own.
async fn spoil(db: &std::path::Path, sql: &str) {
    rusqlite::Connection::open(db).unwrap().execute(sql, ()).unwrap();
}

/// A paged read that fails is an error status while its answer has not started, and a cut
/// connection (never a document that looks whole) once pages have gone out.
#[tokio::test]
async fn a_metrics_read_that_fails_is_an_error_or_a_cut_never_a_short_document() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.metrics_page_turns = 1;
    let server = TestServer::start(config).await;
    let db = dir.path().join("gateway.db");
    for i in 0..4 {
        server.chat("m", &format!("message {i}")).await;
    }
    let first = "(SELECT min(ordinal) FROM turns WHERE conversation_id = 'm')";
    spoil(&db, &format!("UPDATE turns SET metrics = 'not json' WHERE conversation_id = 'm' AND ordinal = {first}"))
        .await;
    let (status, body) = server.get("/conversations/m/metrics").await;
    assert_eq!(status, 500, "{body}");
    assert!(body["error"].is_string(), "{body}");
    // The first pages are fine and go out; the fourth cannot be read.
    let last = "(SELECT max(ordinal) FROM turns WHERE conversation_id = 'm')";
    spoil(&db, &format!("UPDATE turns SET metrics = (SELECT metrics FROM turns WHERE conversation_id = 'm' AND ordinal = {last}) WHERE conversation_id = 'm' AND ordinal = {first}")).await;
    spoil(&db, &format!("UPDATE turns SET metrics = 'not json' WHERE conversation_id = 'm' AND ordinal = {last}"))
        .await;
    let response = server.client.get(server.url("/conversations/m/metrics")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.content_length().is_none());
    let body = response.bytes().await;
    assert!(body.is_err(), "the connection is cut, not ended: {body:?}");
}

#[tokio::test]
async fn a_failed_read_ends_the_turn_or_the_stream_instead_of_making_up_a_value() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let db = dir.path().join("gateway.db");
    server.chat("s", "first").await;
    // The session id cannot be read: the turn ends `storage` instead of starting fresh.
    spoil(&db, "UPDATE conversations SET session_id = x'00ff' WHERE id = 's'").await;
    let events = server.chat("s", "second").await;
    let error = events.iter().find(|e| e["type"] == "error").expect("an error event");
    assert_eq!(error["code"], "storage", "{error}");
    let n = events.len();
    assert_eq!(events[n - 2]["type"], "done");
    assert_eq!(events[n - 2]["reason"], "error");
    assert_eq!(events[n - 1]["type"], "turn-sealed");
    assert!(!types(&events).contains(&"text-delta"), "the runtime was not asked: {events:?}");

    // A resync whose latestSeq cannot be read ends the SSE stream instead of saying 0.
    server.chat("r", "first").await;
    spoil(&db, "UPDATE conversations SET sealed_seq = x'00' WHERE id = 'r'").await;
    let response = server.events("r", "?lastEventId=gone:3", &[]).await;
    assert_eq!(response.status(), 200);
    let body = tokio::time::timeout(Duration::from_secs(10), response.text()).await.expect("the stream ends");
    assert!(!body.unwrap_or_default().contains("resync"), "a resync with a made-up latestSeq");
}
