//! Safe defaults (docs/security.md): a gateway started with no configuration cannot be driven by a web
//! page it did not let in, on any path. The browser half (`tests/safety/drive.mjs`) attacks it
//! from real Chromium pages; the rest sends what such pages send over raw sockets, on both the
//! gateway's own HTTP/1.1 path and hyper's (a chunked body).

mod common;

use std::time::Duration;

use common::raw::exchange;
use common::*;
use serde_json::{Value, json};
use tokio::net::TcpStream;

/// A raw request and the status it gets.
async fn status_of(server: &TestServer, request: &str) -> (u16, String) {
    let mut socket = TcpStream::connect(server.addr).await.unwrap();
    let raw = exchange(&mut socket, request.as_bytes()).await;
    (raw.status, raw.head.clone())
}

/// A foreign `Host` (a name re-bound to this machine) is refused before routing, on every
/// path; loopback names, any port, are served.
#[tokio::test]
async fn a_default_gateway_answers_to_loopback_names_only() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    for host in ["evil.example", "evil.example:24203", "127.0.0.1.nip.example", "localhost.evil.example"] {
        for request in [
            format!("GET /conversations HTTP/1.1\r\nhost: {host}\r\n\r\n"),
            format!("GET /conversations/x/events HTTP/1.1\r\nhost: {host}\r\n\r\n"),
            format!(
                "POST /chat HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: 17\r\n\r\n{{\"message\":\"hi\"}}"
            ),
            // hyper's path (a chunked body).
            format!(
                "POST /chat HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n11\r\n{{\"message\":\"hi\"}}\r\n0\r\n\r\n"
            ),
            format!(
                "GET /ws HTTP/1.1\r\nhost: {host}\r\nupgrade: websocket\r\nconnection: upgrade\r\nsec-websocket-version: 13\r\n\
                 sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\norigin: http://{host}\r\n\r\n"
            ),
        ] {
            let (status, head) = status_of(&server, &request).await;
            assert_eq!(status, 421, "{request:?}: {head}");
        }
    }
    let (status, body) =
        read_json(server.client.get(server.url("/conversations")).header("host", "evil.example").send().await.unwrap())
            .await;
    assert_eq!(status, 421);
    assert!(body["error"].as_str().unwrap().contains("host"), "{body}");
    for host in ["localhost", "localhost:1", "127.0.0.1:24203", "[::1]:80"] {
        let (status, head) = status_of(&server, &format!("GET /health HTTP/1.1\r\nhost: {host}\r\n\r\n")).await;
        assert_eq!(status, 200, "{host}: {head}");
    }
    assert_eq!(server.get("/conversations").await.1["conversations"], json!([]), "nothing was started");
}

/// A state change from a page of another origin is refused (403) whatever its form, and a
/// body not typed as JSON is refused (415) whoever sends it, before anything happens; the same
/// requests from a loopback origin (a web client's dev server), or with no `Origin` (a script),
/// work.
#[tokio::test]
async fn pages_of_other_origins_change_nothing_and_bodies_must_be_typed_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    assert_eq!(server.post("/conversations", json!({"id": "victim", "title": "mine"})).await.0, 201);
    let send = |method: &str, path: &str, origin: Option<&str>, kind: Option<&str>, body: &str| {
        let mut head = format!("{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n");
        if let Some(origin) = origin {
            head += &format!("origin: {origin}\r\n");
        }
        if let Some(kind) = kind {
            head += &format!("content-type: {kind}\r\n");
        }
        format!("{head}content-length: {}\r\n\r\n{body}", body.len())
    };
    let json_type = Some("application/json");
    for origin in ["http://evil.example", "null", "http://localhost.evil.example:5173", "https://127.0.0.1.evil:1"] {
        for (method, path, body) in [
            ("POST", "/chat", r#"{"conversationId":"attack","message":"hi","cwd":"/"}"#),
            ("POST", "/conversations", r#"{"id":"attack"}"#),
            ("POST", "/conversations/victim/messages", r#"{"message":"hi"}"#),
            ("POST", "/conversations/victim/stop", ""),
            ("POST", "/conversations/victim/close", ""),
            ("PUT", "/conversations/victim/title", r#"{"title":"owned"}"#),
            ("PUT", "/conversations/victim/cwd", r#"{"cwd":"/"}"#),
            ("DELETE", "/conversations/victim", ""),
        ] {
            for kind in [json_type, Some("text/plain"), None] {
                let (status, head) = status_of(&server, &send(method, path, Some(origin), kind, body)).await;
                assert_eq!(status, 403, "{method} {path} from {origin} as {kind:?}: {head}");
            }
        }
    }
    // A simple request's types, from anyone: refused for the type.
    for kind in [Some("text/plain"), Some("application/x-www-form-urlencoded"), Some("multipart/form-data"), None] {
        let body = r#"{"conversationId":"attack","message":"hi"}"#;
        let (status, head) = status_of(&server, &send("POST", "/chat", None, kind, body)).await;
        assert_eq!(status, 415, "{kind:?}: {head}");
        let (status, head) =
            status_of(&server, &send("POST", "/chat", Some("http://localhost:5173"), kind, body)).await;
        assert_eq!(status, 415, "{kind:?}: {head}");
    }
    assert_eq!(server.history("attack").await, Vec::<Value>::new(), "no turn started");
    let victim = server.get("/conversations/victim/status").await.1;
    assert_eq!(victim["status"], "idle", "{victim}");
    let (_, list) = server.get("/conversations").await;
    assert_eq!(list["conversations"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list["conversations"][0]["title"], "mine");

    // A page of this machine, a `+json` type with a charset, and a bodyless close: all work.
    let body = r#"{"title":"renamed"}"#;
    let (status, head) = status_of(
        &server,
        &send(
            "PUT",
            "/conversations/victim/title",
            Some("http://localhost:5173"),
            Some("application/merge-patch+json; charset=utf-8"),
            body,
        ),
    )
    .await;
    assert_eq!(status, 200, "{head}");
    let (status, head) =
        status_of(&server, &send("POST", "/conversations/victim/close", Some("http://127.0.0.1:8080"), None, "")).await;
    assert_eq!(status, 200, "{head}");
    // The gateway's own page (the console) is of the gateway's origin.
    let own = format!("http://{}", server.addr);
    let (status, head) =
        status_of(&server, &send("POST", "/conversations", Some(&own), json_type, r#"{"id":"mine"}"#)).await;
    assert_eq!(status, 201, "{head}");
}

/// The key is checked from the head, before any byte of the body is read: a keyless client that
/// declares a large body and sends part of it is answered 401 at once (it does not have to send
/// the rest, nor does the gateway hold it), on both paths.
#[tokio::test]
async fn the_key_is_checked_before_the_body_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.api_keys = vec!["the-key".into()];
    config.request_timeout_secs = 30;
    let server = TestServer::start(config).await;
    for head in [
        "POST /chat HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 1048575\r\n\r\n{\"mess",
        "POST /chat HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n100000\r\n{\"mess",
    ] {
        let mut socket = TcpStream::connect(server.addr).await.unwrap();
        socket.write_all(head.as_bytes()).await.unwrap();
        // The answer comes while the body is still owed (well within the body timeout).
        let mut answer = vec![0u8; 4096];
        let n =
            tokio::time::timeout(Duration::from_secs(10), socket.read(&mut answer)).await.expect("answered").unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 401"), "{head:?}: {answer}");
    }
}

/// The bodies the gateway reads at once are capped in total bytes: past `--max-reading-bytes`
/// a request with a body is answered 503 with Retry-After, and once the bodies in flight end,
/// requests are served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_being_read_are_capped_in_total() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_reading_bytes = 3 * 1024 * 1024;
    config.max_body_bytes = 1024 * 1024;
    config.request_timeout_secs = 30;
    let server = TestServer::start(config).await;
    // Three clients each send most of a 1 MiB body and stall: the budget is spent.
    let mut stalled = Vec::new();
    for i in 0..3 {
        let mut socket = TcpStream::connect(server.addr).await.unwrap();
        let body = format!("{{\"id\":\"c{i}\",\"title\":\"");
        let head = format!(
            "POST /conversations HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            1024 * 1024
        );
        socket.write_all(head.as_bytes()).await.unwrap();
        socket.write_all(&vec![b'a'; 512 * 1024]).await.unwrap();
        stalled.push(socket);
    }
    let spent = || async { server.state.reading.in_use() >= 3 * 1024 * 1024 };
    assert!(eventually(200, spent).await, "the three bodies take the budget");
    let r = server.client.post(server.url("/conversations")).json(&json!({"id": "late"})).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let (_, body) = read_json(r).await;
    assert!(body["error"].as_str().unwrap().contains("request bodies"), "{body}");
    // Requests with no body go on meanwhile.
    assert_eq!(server.get("/conversations").await.0, 200);
    // The stalled clients leave: their room is given back.
    for mut socket in stalled {
        socket.shutdown().await.unwrap();
        let mut rest = Vec::new();
        let _ = socket.read_to_end(&mut rest).await;
    }
    assert!(
        eventually(100, || async { server.post("/conversations", json!({"id": "later"})).await.0 == 201 }).await,
        "served again once the bodies ended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_browser_pages_cannot_drive_a_default_gateway() {
    let Some((chromium, playwright)) = browser() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.scripted_script = Some(write_script(
        dir.path(),
        json!({"rules": [{"match": "long", "steps": [{"text": "working", "stallMs": 120000}]}]}),
    ));
    let server = TestServer::start(config).await;
    assert_eq!(server.post("/conversations", json!({"id": "victim", "title": "mine"})).await.0, 201);
    assert_eq!(server.post("/conversations/victim/messages", json!({"message": "long"})).await.0, 202);
    assert_eq!(server.post("/conversations", json!({"id": "own-victim"})).await.0, 201);

    let report = browser_report("safety/drive.mjs", &chromium, &playwright, &[("GATEWAY", &server.url(""))]).await;

    let threw = |v: &Value| v.as_str().is_some_and(|s| s.starts_with("threw"));
    // Another site's page: it reads nothing, its preflighted requests fail, its simple ones
    // are refused unseen, its WebSocket does not open, its form post is refused.
    let foreign = &report["foreign"];
    assert!(threw(&foreign["read"]), "{foreign}");
    assert!(threw(&foreign["chatJson"]), "{foreign}");
    assert_eq!(foreign["websocket"]["opened"], false, "{foreign}");
    assert!(matches!(foreign["form"].as_u64(), Some(403 | 415)), "{foreign}");
    // A re-bound name: same-origin to the page, refused for its host on every request.
    let rebound = &report["rebound"];
    assert_eq!(rebound["read"]["status"], 421, "{rebound}");
    assert!(!rebound["read"]["body"].as_str().unwrap().contains("victim"), "{rebound}");
    assert_eq!(rebound["chatJson"]["status"], 421, "{rebound}");
    assert_eq!(rebound["websocket"]["opened"], false, "{rebound}");
    assert_eq!(rebound["form"], 421, "{rebound}");
    // A page on this machine (a web client's dev server on another port) works as before.
    let own = &report["own"];
    assert_eq!(own["read"]["status"], 200, "{own}");
    assert!(own["read"]["body"].as_str().unwrap().contains("victim"), "{own}");
    assert_eq!(own["chatJson"]["status"], 200, "{own}");
    assert_eq!(own["websocket"]["opened"], true, "{own}");

    // And the gateway: nothing the attacking pages sent started, stopped, renamed or closed.
    for id in ["foreign-json", "foreign-nocors", "rebound-json", "rebound-nocors", "attack-form"] {
        assert_eq!(server.history(id).await, Vec::<Value>::new(), "{id}");
        assert_eq!(server.get(&format!("/conversations/{id}/status")).await.0, 404, "{id}");
    }
    let victim = server.get("/conversations/victim/status").await.1;
    assert_eq!(victim["isActive"], true, "the victim's turn still runs: {victim}");
    let (_, list) = server.get("/conversations").await;
    let titles: Vec<&Value> = list["conversations"].as_array().unwrap().iter().map(|c| &c["title"]).collect();
    assert!(titles.contains(&&json!("mine")), "{list}");
    assert!(!titles.contains(&&json!("owned")), "{list}");
    // The loopback page's own turn did run.
    assert!(!server.history("own-json").await.is_empty());
    // The console at a malformed address says so, with no script error.
    assert_eq!(report["console"]["errors"], json!([]), "{report}");
    server.post("/conversations/victim/stop", json!({})).await;
}

/// Reads what a socket holds until the peer closes (or 10 s of silence).
async fn read_to_close(socket: &mut TcpStream) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut all = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(10), socket.read(&mut chunk)).await {
        if n == 0 {
            break;
        }
        all.extend_from_slice(&chunk[..n]);
    }
    all
}

/// A stream the gateway ends before its turn's end ends visibly (docs/security.md): an NDJSON watcher
/// that fell too far behind (its place in the replay buffer coalesced away) gets an `error`
/// event saying so, and the connection closes without the chunked body's end, so no client or
/// proxy takes the truncated answer for a whole one: on the gateway's own HTTP/1.1 path (a
/// watch) and on hyper's (a `/chat` with a chunked body).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_cut_behind_its_turn_sees_an_error_and_no_end_of_body() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    // Deltas of 1 KB, 8 MB in all: far more than the sockets of a client that stopped reading
    // hold, coalesced in passes of half a MiB.
    config.turn_buffer_bytes = 1024 * 1024;
    let delta = format!("{} ", "x".repeat(1023));
    config.scripted_script = Some(write_script(
        dir.path(),
        json!({"rules": [{"match": "flood", "pace": 0, "steps": [{"text": delta, "repeat": 8000}]}]}),
    ));
    let server = TestServer::start(config).await;
    let stalled = || async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        socket.connect(server.addr).await.unwrap()
    };
    // The watcher (the gateway's own path) and a `/chat` caller (hyper's), neither reading.
    let mut watcher = stalled().await;
    watcher
        .write_all(b"GET /conversations/flood/events?format=ndjson&until=sealed HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut caller = stalled().await;
    let body = r#"{"conversationId":"flood","message":"flood"}"#;
    let request = format!(
        "POST /chat HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    );
    caller.write_all(request.as_bytes()).await.unwrap();
    assert!(
        eventually(300, || async { server.get("/conversations/flood/status").await.1["isActive"] == false }).await,
        "the turn ends"
    );
    for (name, socket) in [("watch", &mut watcher), ("chat", &mut caller)] {
        let raw = read_to_close(socket).await;
        let text = String::from_utf8_lossy(&raw);
        assert!(text.starts_with("HTTP/1.1 200"), "{name}: {}", &text[..text.len().min(300)]);
        assert!(!text.ends_with("0\r\n\r\n"), "{name}: a cut stream has no last chunk");
        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with('{')).collect();
        let last: Value = serde_json::from_str(lines.last().unwrap()).unwrap();
        assert_eq!(last["type"], "error", "{name}: {last}");
        assert_eq!(last["code"], "lagged", "{name}: {last}");
        assert_eq!(last["conversationId"], "flood");
        assert!(!lines.iter().any(|l| l.contains("turn-sealed")), "{name}: it never reached the end");
    }
}
