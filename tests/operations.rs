//! Operating the gateway: the OpenAPI document, API keys, CORS, limits, metrics, readiness.

mod common;

use std::time::Duration;

use common::raw::{exchange, get_kept_alive, read_until};
use common::*;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn the_served_document_is_the_one_in_the_repository() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let r = server.client.get(server.url("/openapi.json")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    let served = r.text().await.unwrap();
    let kept = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json")).unwrap();
    assert!(served == kept, "the served document is not openapi/openapi.json");
    let doc: Value = serde_json::from_str(&served).unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    // OpenAPI 3.1 requires a description on every response; the key check's 401 is on every
    // route but the public ones, a storage failure's 500 on every route that reads or writes.
    for (path, operations) in doc["paths"].as_object().unwrap() {
        for (method, operation) in operations.as_object().unwrap() {
            let responses = operation["responses"].as_object().unwrap();
            for (status, response) in responses {
                assert!(response["description"].is_string(), "{method} {path} {status}: no description");
            }
            let public = ["/health", "/ready", "/openapi.json", "/", "/console/{asset}"].contains(&path.as_str());
            // Signing in and out need no credential; who is signed in answers 401 for nobody.
            if path != "/auth/session" {
                assert_eq!(responses.contains_key("401"), !public, "{method} {path}: 401");
            }
        }
    }
    for (method, path) in [("delete", "/conversations/{id}"), ("get", "/conversations/{id}/metrics"), ("post", "/chat")]
    {
        let error = &doc["paths"][path][method]["responses"]["500"];
        assert_eq!(
            error["content"]["application/json"]["schema"]["$ref"], "#/components/schemas/ErrorBody",
            "{method} {path}"
        );
    }
    let events = &doc["components"]["schemas"]["AgentEvent"];
    assert_eq!(events["discriminator"]["propertyName"], "type");
    assert_eq!(events["oneOf"].as_array().unwrap().len(), 13);
    assert_eq!(events["discriminator"]["mapping"]["turn-sealed"], "#/components/schemas/TurnSealedEvent");
    let paths: Vec<&str> = doc["paths"].as_object().unwrap().keys().map(String::as_str).collect();
    for route in [
        "/health",
        "/ready",
        "/metrics",
        "/openapi.json",
        "/chat",
        "/models",
        "/conversations",
        "/conversations/{id}",
        "/conversations/{id}/metrics",
        "/conversations/{id}/status",
        "/conversations/{id}/last",
        "/conversations/{id}/stop",
        "/conversations/{id}/close",
        "/conversations/{id}/queue",
        "/conversations/{id}/title",
        "/conversations/{id}/model",
        "/conversations/{id}/messages",
        "/conversations/{id}/session",
        "/conversations/{id}/events",
        "/metrics/throughput",
        "/ws",
    ] {
        assert!(paths.contains(&route), "{route} is documented");
    }
}

/// A request to every route, and whether it is public.
fn every_route() -> Vec<(&'static str, &'static str, bool)> {
    vec![
        ("GET", "/health", true),
        ("GET", "/ready", true),
        ("GET", "/openapi.json", true),
        ("GET", "/metrics", false),
        ("GET", "/models", false),
        ("POST", "/chat", false),
        ("GET", "/conversations", false),
        ("POST", "/conversations", false),
        ("GET", "/conversations/a", false),
        ("DELETE", "/conversations/a", false),
        ("GET", "/conversations/a/metrics", false),
        ("GET", "/conversations/a/status", false),
        ("GET", "/conversations/a/last", false),
        ("POST", "/conversations/a/stop", false),
        ("POST", "/conversations/a/close", false),
        ("POST", "/conversations/a/queue", false),
        ("PUT", "/conversations/a/title", false),
        ("GET", "/conversations/a/model", false),
        ("PUT", "/conversations/a/model", false),
        ("DELETE", "/conversations/a/session", false),
        ("POST", "/conversations/a/messages", false),
        ("GET", "/conversations/a/events?until=sealed", false),
        ("GET", "/metrics/throughput", false),
        ("GET", "/ws", false),
        ("GET", "/no/such/route", false),
    ]
}

#[tokio::test]
async fn api_keys_guard_every_route_but_the_public_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.api_keys = vec!["key-one".into(), "key-two".into()];
    let server = TestServer::start(config).await;
    let request = |method: &str, path: &str| {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        server.client.request(method, server.url(path)).timeout(Duration::from_secs(5))
    };
    for (method, path, public) in every_route() {
        let none = request(method, path).send().await.unwrap();
        let wrong = request(method, path).bearer_auth("key-three").send().await.unwrap();
        let sep = if path.contains('?') { '&' } else { '?' };
        let wrong_query = request(method, &format!("{path}{sep}access_token=key-on")).send().await.unwrap();
        for (i, r) in [none, wrong, wrong_query].into_iter().enumerate() {
            if public {
                assert_eq!(r.status(), 200, "{method} {path} is public");
            } else {
                assert_eq!(r.status(), 401, "{method} {path} without a valid key");
                // No credential: a plain challenge; a wrong one: `invalid_token` (RFC 6750).
                let challenge = if i == 0 { "Bearer" } else { "Bearer error=\"invalid_token\"" };
                assert_eq!(r.headers()["www-authenticate"], challenge, "{method} {path}");
                let (_, body) = read_json(r).await;
                let error = body["error"].as_str().unwrap();
                assert!(error.contains("API key or a token") || error.contains("not valid"), "{error}");
            }
        }
        // A valid key, by header or by query, gets past the gate (whatever the route says then).
        let by_header = request(method, path).bearer_auth("key-two").send().await.unwrap();
        let by_query = request(method, &format!("{path}{sep}access_token=key-one")).send().await.unwrap();
        for r in [by_header, by_query] {
            assert_ne!(r.status(), 401, "{method} {path} with a valid key");
        }
    }
    // A WebSocket client passes its key in the query.
    let url = format!("ws://{}/ws?access_token=key-one", server.addr);
    assert!(tokio_tungstenite::connect_async(url).await.is_ok());
    let url = format!("ws://{}/ws", server.addr);
    assert!(tokio_tungstenite::connect_async(url).await.is_err());
}

#[tokio::test]
async fn cors_answers_preflights_and_exposes_the_conversation_id() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    // By default a page on this machine (a web client's dev server) is let in, on any port.
    let preflight = server
        .client
        .request(reqwest::Method::OPTIONS, server.url("/chat"))
        .header("origin", "http://localhost:5173")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "content-type, authorization, last-event-id, idempotency-key")
        .send()
        .await
        .unwrap();
    assert_eq!(preflight.status(), 200);
    assert_eq!(preflight.headers()["access-control-allow-origin"], "http://localhost:5173");
    let methods = preflight.headers()["access-control-allow-methods"].to_str().unwrap().to_lowercase();
    for m in ["get", "post", "put", "delete", "options"] {
        assert!(methods.contains(m), "{methods}");
    }
    let r = server
        .client
        .post(server.url("/chat"))
        .header("origin", "http://localhost:5173")
        .json(&json!({"message": "hi"}))
        .send()
        .await
        .unwrap();
    let exposed = r.headers()["access-control-expose-headers"].to_str().unwrap().to_lowercase();
    assert!(exposed.contains("x-conversation-id") && exposed.contains("retry-after"), "{exposed}");
    EventStream::new(r).collect().await;

    // With an allow-list, other origins get no CORS headers.
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.cors_origins = vec!["http://allowed.example".into()];
    let server = TestServer::start(config).await;
    let allowed =
        server.client.get(server.url("/health")).header("origin", "http://allowed.example").send().await.unwrap();
    assert_eq!(allowed.headers()["access-control-allow-origin"], "http://allowed.example");
    let other = server.client.get(server.url("/health")).header("origin", "http://evil.example").send().await.unwrap();
    assert!(other.headers().get("access-control-allow-origin").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_streams_slow_headers_and_websocket_frames() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_streams = 2;
    config.header_read_timeout_secs = 1;
    config.max_body_bytes = 64 * 1024;
    let server = TestServer::start(config).await;

    // Two streams fit; the third is 503 on every transport; closing one makes room.
    let first = server.events("cap", "", &[]).await;
    let _second = server.events("cap", "", &[("accept", "application/x-ndjson")]).await;
    let (status, body) = server.get("/conversations/cap/events").await;
    assert_eq!(status, 503, "{body}");
    let (status, _) = server.post("/chat", json!({"message": "hi"})).await;
    assert_eq!(status, 503);
    assert!(tokio_tungstenite::connect_async(format!("ws://{}/ws", server.addr)).await.is_err());
    let (_, metrics) = read_json(server.client.get(server.url("/metrics")).send().await.unwrap()).await;
    let metrics = metrics.as_str().unwrap().to_owned();
    assert!(metrics.contains("dispatch_open_streams{transport=\"sse\"} 1"), "{metrics}");
    assert!(metrics.contains("dispatch_open_streams{transport=\"ndjson\"} 1"), "{metrics}");
    drop(first);
    let mut ok = false;
    for _ in 0..100 {
        if server.client.get(server.url("/conversations/cap/events")).send().await.unwrap().status() == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ok, "a closed stream frees its place");

    // A client that never finishes its request head is disconnected.
    let mut slow = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n").await.unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(30), slow.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "the slow client was not disconnected");
    assert!(!String::from_utf8_lossy(&buf).contains("200 OK"));

    // A request body past the limit is 413.
    let (status, body) = server.post("/conversations", json!({"title": "x".repeat(70 * 1024)})).await;
    assert_eq!(status, 413, "{body}");
}

#[tokio::test]
async fn an_oversized_websocket_frame_closes_the_socket() {
    use futures_util::SinkExt;
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_body_bytes = 16 * 1024;
    let server = TestServer::start(config).await;
    let mut ws = server.ws().await;
    ws.next().await.unwrap();
    let big = json!({"type": "chat.send", "message": "x".repeat(64 * 1024)}).to_string();
    let _ = ws.socket.send(tokio_tungstenite::tungstenite::Message::text(big)).await;
    assert_eq!(ws.close_code().await, Some(1009), "closed as too big");
    assert_eq!(ws.next().await, None, "the socket is closed");
    // The gateway is fine.
    assert_eq!(server.get("/health").await.0, 200);
}

#[tokio::test]
async fn a_graceful_stop_closes_websockets_as_going_away() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let mut ws = server.ws().await;
    assert_eq!(ws.next().await.unwrap()["type"], "catalog");
    ws.send(json!({"type": "chat.subscribe", "conversationId": "away"})).await;
    let (_, code) = tokio::join!(server.stop(), ws.close_code());
    assert_eq!(code, Some(1001));
}

#[tokio::test]
async fn metrics_move_when_turns_run_and_ready_answers() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.scripted_script = Some(write_script(
        dir.path(),
        json!({"rules": [{"match": "fail", "steps": [{"text": "x"}], "error": {"message": "no", "code": "upstream"}}]}),
    ));
    let server = TestServer::start(config).await;
    assert_eq!(server.get("/ready").await, (200, json!({"ready": true})));
    let read = || async {
        let r = server.client.get(server.url("/metrics")).send().await.unwrap();
        assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
        r.text().await.unwrap()
    };
    let before = read().await;
    let mut watcher = server.ndjson("m", "?until=sealed").await;
    let events = server.chat("m", "hello").await;
    while watcher.next_event().await.is_some() {}
    let failing = server.chat("m", "fail now").await;
    let after = read().await;
    for (name, delta) in [
        ("dispatch_turns_started_total", 2.0),
        ("dispatch_turns_sealed_total", 2.0),
        ("dispatch_turns_failed_total", 1.0),
        ("dispatch_turns_running", 0.0),
    ] {
        assert_eq!(metric(&after, name) - metric(&before, name), delta, "{name}");
    }
    assert_eq!(
        metric(&after, "dispatch_events_emitted_total") - metric(&before, "dispatch_events_emitted_total"),
        (events.len() + failing.len()) as f64
    );
    // The /chat stream and the watcher both got the first turn.
    assert!(metric(&after, "dispatch_events_delivered_total") >= 2.0 * events.len() as f64);
    assert!(
        metric(&after, "dispatch_sqlite_write_seconds_count") > metric(&before, "dispatch_sqlite_write_seconds_count")
    );
    assert!(after.contains("dispatch_runtime_errors_total{kind=\"upstream\"} 1"), "{after}");
    assert!(after.contains("dispatch_sqlite_write_seconds_bucket{le=\"+Inf\"}"));
    assert!(!after.contains("dispatch_bus_"), "no bus, no bus metrics: {after}");
}

#[tokio::test]
async fn draining_refuses_new_turns_and_is_not_ready() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    server.state.turns.abort_all();
    let (status, body) = server.get("/ready").await;
    assert_eq!((status, body), (503, json!({"error": "shutting down"})));
    for path in ["/chat", "/conversations/x/messages", "/conversations/x/queue"] {
        let (status, body) = server.post(path, json!({"message": "hi", "text": "hi"})).await;
        assert_eq!(status, 503, "{path}: {body}");
    }
    assert_eq!(server.history("x").await, Vec::<Value>::new());
}

/// RUST_LOG sets levels per target: the gateway's own debug lines (a request's start and end)
/// appear when its target is at debug, while the default level for everything else is warn.
#[tokio::test]
async fn rust_log_sets_levels_per_target() {
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<std::ffi::OsString> = vec!["--database".into(), dir.path().join("gateway.db").into()];
    let gateway = ChildGateway::spawn_with_env(&args, &[("RUST_LOG", "warn,dispatch_gateway=debug")]);
    let health = reqwest::get(format!("http://{}/health", gateway.addr)).await.unwrap();
    assert_eq!(health.status(), 200);
    let logs = gateway.logs.clone();
    let finished = eventually(100, || {
        let logs = logs.clone();
        async move {
            logs.lock()
                .unwrap()
                .iter()
                .any(|l| l["level"] == "DEBUG" && l["fields"]["message"] == "finished processing request")
        }
    })
    .await;
    assert!(finished, "no debug line for the request: {:?}", logs.lock().unwrap());
    let kept = logs.lock().unwrap().clone();
    for line in &kept {
        let target = line["target"].as_str().unwrap_or_default();
        let level = line["level"].as_str().unwrap_or_default();
        assert!(
            target.starts_with("dispatch_gateway") || matches!(level, "WARN" | "ERROR"),
            "a line below warn from another target: {line}"
        );
    }
    gateway.terminate();

    // A value that does not parse is `info`: the gateway starts and logs its address (which
    // `spawn` waits for), and nothing at debug.
    let args: Vec<std::ffi::OsString> = vec!["--database".into(), dir.path().join("other.db").into()];
    let gateway = ChildGateway::spawn_with_env(&args, &[("RUST_LOG", "=debug,,x=loud=")]);
    reqwest::get(format!("http://{}/health", gateway.addr)).await.unwrap();
    let kept = gateway.logs.lock().unwrap().clone();
    assert!(kept.iter().all(|l| l["level"] != "DEBUG"), "{kept:?}");
    gateway.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_request_is_one_log_line_with_its_id_and_what_went_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gateway.db");
    let args: Vec<std::ffi::OsString> =
        vec!["--database".into(), db.clone().into(), "--sqlite-busy-timeout-ms".into(), "100".into()];
    let gateway = ChildGateway::spawn(&args);
    let base = format!("http://{}", gateway.addr);
    let client = reqwest::Client::new();
    let get = |path: &str, id: &str| client.get(format!("{base}{path}")).header("x-request-id", id).send();

    // Stored metrics that are not JSON: the read fails inside the gateway (500).
    let other = rusqlite::Connection::open(&db).unwrap();
    other.execute("INSERT INTO conversations (id, created_at, last_activity_at) VALUES ('bad', 0, 0)", ()).unwrap();
    other
        .execute(
            "INSERT INTO turns (conversation_id, turn_id, ordinal, model, started_at, sealed_at, metrics)
             VALUES ('bad', 't', 1, 'scripted', 0, 1, '{not json')",
            (),
        )
        .unwrap();
    let r = get("/conversations/bad/metrics", "req-500").await.unwrap();
    assert_eq!(r.status(), 500);
    assert_eq!(read_json(r).await.1, json!({"error": "internal error"}), "the detail is not sent");
    // Another writer holds the lock: a write is refused (503).
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let r = client
        .post(format!("{base}/conversations"))
        .header("x-request-id", "req-503")
        .json(&json!({"id": "locked"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    other.execute_batch("ROLLBACK").unwrap();
    // Requests that succeed write nothing at the default level.
    assert_eq!(get("/conversations/bad?limit=1", "req-200").await.unwrap().status(), 200);

    let line = |id: &str| -> Vec<Value> {
        gateway.logs.lock().unwrap().iter().filter(|l| l.to_string().contains(id)).cloned().collect()
    };
    assert!(eventually(100, || async { line("req-503").len() == 1 }).await, "{:?}", line("req-503"));
    let failed = &line("req-500")[..];
    assert_eq!(failed.len(), 1, "{failed:?}");
    let fields = &failed[0]["fields"];
    assert_eq!(failed[0]["level"], "ERROR");
    assert_eq!(
        (&fields["message"], &fields["id"], &fields["method"], &fields["path"], &fields["status"]),
        (&json!("request failed"), &json!("req-500"), &json!("GET"), &json!("/conversations/bad/metrics"), &json!(500)),
        "{failed:?}"
    );
    assert!(fields["error"].as_str().unwrap().contains("turn metrics"), "{failed:?}");
    let refused = &line("req-503")[0]["fields"];
    assert_eq!(
        (&refused["method"], &refused["path"], &refused["status"]),
        (&json!("POST"), &json!("/conversations"), &json!(503))
    );
    assert!(line("req-200").is_empty());
    gateway.terminate();
}

/// `/metrics` carries the figures every Prometheus client library exports for its process, and
/// they are the gateway process's own, checked against what the kernel says of it: when it
/// started, its file descriptors (one more per open stream) and their limit, its memory, its CPU.
#[tokio::test]
async fn metrics_carry_the_gateway_process_figures() {
    let dir = tempfile::tempdir().unwrap();
    let unix_now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let before_spawn = unix_now();
    let gateway = ChildGateway::spawn(&["--database".into(), dir.path().join("d.db").into()]);
    let after_spawn = unix_now();
    let proc_file = |name: &str| std::fs::read_to_string(format!("/proc/{}/{name}", gateway.child.id())).unwrap();
    let open_fds = || std::fs::read_dir(format!("/proc/{}/fd", gateway.child.id())).unwrap().count() as f64;

    let first = gateway.metrics().await;
    for name in [
        "process_cpu_seconds_total",
        "process_virtual_memory_bytes",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ] {
        assert!(first.contains(&format!("# TYPE {name} ")), "{name} has its type line: {first}");
    }
    let version = format!("\ndispatch_build_info{{version=\"{}\"}} 1\n", env!("CARGO_PKG_VERSION"));
    assert!(first.contains(&version), "{first}");
    // Boot time is in whole seconds: the start is known to a second.
    let started = metric(&first, "process_start_time_seconds");
    assert!(
        started >= before_spawn - 1.5 && started <= after_spawn + 1.5,
        "{started} vs {before_spawn}..{after_spawn}"
    );
    let limit = proc_file("limits").lines().find(|l| l.starts_with("Max open files")).unwrap().to_owned();
    let soft: f64 = limit.split_whitespace().nth(3).unwrap().parse().unwrap();
    assert_eq!(metric(&first, "process_max_fds"), soft, "{limit}");
    let rss_kib: f64 = proc_file("status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    let resident = metric(&first, "process_resident_memory_bytes");
    assert!(resident > rss_kib * 1024.0 / 2.0 && resident < rss_kib * 1024.0 * 2.0, "{resident} vs {rss_kib} KiB");
    assert!(metric(&first, "process_virtual_memory_bytes") >= resident);

    // 50 streams open: 50 more descriptors.
    let fds_before = metric(&first, "process_open_fds");
    assert!((fds_before - open_fds()).abs() <= 3.0, "{fds_before} vs {}", open_fds());
    let mut streams = Vec::new();
    for i in 0..50 {
        streams.push(gateway.sse(&format!("fds-{i}"), "").await);
    }
    let sse_open = "dispatch_open_streams{transport=\"sse\"} 50";
    assert!(eventually(100, || async { gateway.metrics().await.contains(sse_open) }).await);
    let second = gateway.metrics().await;
    let fds = metric(&second, "process_open_fds");
    assert!(fds >= fds_before + 50.0, "{fds_before} then {fds}");
    assert!((fds - open_fds()).abs() <= 3.0, "{fds} vs {}", open_fds());
    let cpu = (metric(&first, "process_cpu_seconds_total"), metric(&second, "process_cpu_seconds_total"));
    // At most every core the whole time since the start.
    let cores = std::thread::available_parallelism().unwrap().get() as f64;
    assert!(cpu.0 > 0.0 && cpu.1 >= cpu.0 && cpu.1 <= cores * (unix_now() - before_spawn), "{cpu:?}");
    drop(streams);
    assert!(gateway.terminate().success());
}

/// `/metrics` counts responses by status code: those the router answers (a 200, a 404, a 401
/// without a key, a 101 upgrade), and those refused before a request reaches it (a head that is
/// not HTTP: 400; a head past the limit: 431).
#[tokio::test]
async fn metrics_count_responses_by_status() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.api_keys = vec!["key-one".into()];
    config.request_timeout_secs = 1;
    let server = TestServer::start(config).await;
    let responses = || async {
        let text = server.client.get(server.url("/metrics")).bearer_auth("key-one").send().await.unwrap();
        let text = text.text().await.unwrap();
        let count = |code: u16| {
            let line = format!("dispatch_http_responses_total{{code=\"{code}\"}} ");
            text.lines().find_map(|l| l.strip_prefix(&line)).map_or(0, |n| n.parse::<u64>().unwrap())
        };
        [200, 101, 400, 401, 404, 408, 431].map(count)
    };
    let before = responses().await;
    for _ in 0..3 {
        assert_eq!(server.client.get(server.url("/conversations")).send().await.unwrap().status(), 401);
    }
    let with_key = |path: &str| server.client.get(server.url(path)).bearer_auth("key-one");
    assert_eq!(with_key("/no/such/route").send().await.unwrap().status(), 404);
    assert_eq!(with_key("/conversations").send().await.unwrap().status(), 200);
    let url = format!("ws://{}/ws?access_token=key-one", server.addr);
    let (socket, _) = tokio_tungstenite::connect_async(url).await.expect("ws connects");
    let mut ws = WsClient { socket };
    assert_eq!(ws.next().await.unwrap()["type"], "catalog");
    // Refused by the gateway's own connection code: a malformed head, one too long, a body
    // that stops short (after --request-timeout-secs); and by the router: no Host.
    for refused in [
        "GET /health HTTP/1.1\r\nbad header line\r\n\r\n".to_owned(),
        format!("GET /{} HTTP/1.1\r\n", "a".repeat(70_000)),
        "POST /conversations HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer key-one\r\ncontent-type: application/json\r\ncontent-length: 10\r\n\r\n{}".to_owned(),
        "GET /health HTTP/1.1\r\nconnection: close\r\n\r\n".to_owned(),
    ] {
        let mut socket = tokio::net::TcpStream::connect(server.addr).await.unwrap();
        let _ = socket.write_all(refused.as_bytes()).await;
        let mut answer = Vec::new();
        let _ = socket.read_to_end(&mut answer).await;
        assert!(answer.starts_with(b"HTTP/1.1 4"), "{}", String::from_utf8_lossy(&answer));
    }
    let after = responses().await;
    // The first read of /metrics is among the 200s of the second.
    let moved: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    assert_eq!(moved, [2, 1, 2, 3, 1, 1, 1], "200, 101, 400, 401, 404, 408, 431");
}

/// A gateway started under a low soft limit on open files (1024 under systemd and most shells)
/// raises it to the hard limit: otherwise `accept` fails near a thousand streams, far below
/// --max-streams. When the hard limit itself leaves no room for --max-streams, the start says so.
#[tokio::test]
async fn the_open_file_limit_is_raised_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let database = |name: &str| -> Vec<std::ffi::OsString> { vec!["--database".into(), dir.path().join(name).into()] };
    let said = |gateway: &ChildGateway, message: &str| {
        gateway
            .logs
            .lock()
            .unwrap()
            .iter()
            .any(|l| l["fields"]["message"].as_str().is_some_and(|m| m.starts_with(message)))
    };
    let too_low = "the open-file limit is below what --max-streams needs";

    // Under the hard limit the tests run with (which only root could raise), --max-streams
    // fits once the soft limit is raised.
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let hard: u32 = line.split_whitespace().nth(4).unwrap().parse().unwrap();
    assert!(hard >= 1024, "{line}");
    let mut args = database("roomy.db");
    args.extend(["--max-streams".into(), (hard - 300).min(10_000).to_string().into()]);
    let roomy = ChildGateway::spawn_with_open_files(256, hard, &args);
    assert_eq!(metric(&roomy.metrics().await, "process_max_fds"), f64::from(hard));
    assert!(said(&roomy, "raised the open-file limit to the hard limit"));
    assert!(!said(&roomy, too_low));
    // Past 256 descriptors: 300 streams open at once (under the soft limit it started with,
    // the last ones would wait unanswered).
    let opened = tokio::time::timeout(Duration::from_secs(30), async {
        let mut streams = Vec::new();
        for i in 0..300 {
            streams.push(roomy.sse(&format!("many-{i}"), "").await);
        }
        streams
    })
    .await
    .expect("300 streams open");
    let all_open = "dispatch_open_streams{transport=\"sse\"} 300";
    assert!(eventually(100, || async { roomy.metrics().await.contains(all_open) }).await);
    drop(opened);
    assert!(roomy.terminate().success());

    // A hard limit of 512 leaves no room for 10,000 streams, but does for 200.
    let cramped = ChildGateway::spawn_with_open_files(256, 512, &database("cramped.db"));
    assert_eq!(metric(&cramped.metrics().await, "process_max_fds"), 512.0);
    assert!(eventually(100, || async { said(&cramped, too_low) }).await, "the start warns");
    assert!(cramped.terminate().success());
    // An agent program it starts gets the limit the gateway started with, not the raised one
    // (a program that sizes a table by it, or uses select(2), runs as it would from a shell).
    let agent = dir.path().join("limits.py");
    std::fs::write(
        &agent,
        "import json, resource, sys\n\
         for line in sys.stdin:\n\
         \x20   soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n\
         \x20   print(json.dumps({'type': 'text', 'delta': f'{soft} {hard}'}), flush=True)\n\
         \x20   print(json.dumps({'type': 'done', 'reason': 'stop'}), flush=True)\n",
    )
    .unwrap();
    let config = dir.path().join("fits.toml");
    let credential = format!(
        "default_model = \"probe/limits\"\n[credentials.probe]\nkind = \"command\"\nprogram = \"python3\"\n\
         args = [{:?}]\ndialect = \"ndjson\"\nmodels = [\"limits\"]\n",
        agent.display().to_string()
    );
    std::fs::write(&config, credential).unwrap();
    let mut args = database("fits.db");
    args.extend(["--max-streams".into(), "200".into(), "--config".into(), config.into()]);
    let fits = ChildGateway::spawn_with_open_files(256, 512, &args);
    assert_eq!(metric(&fits.metrics().await, "process_max_fds"), 512.0);
    assert!(!said(&fits, too_low));
    let events = fits.chat("limits", "what is your limit?").await;
    let said_limit = events.iter().find(|e| e["type"] == "text-delta").unwrap_or_else(|| panic!("{events:?}"));
    assert_eq!(said_limit["delta"], "256 512", "the agent's (soft, hard) limit on open files");
    assert!(fits.terminate().success());
}

/// A gateway out of file descriptors (a hard limit of 64 here) leaves new connections in the
/// listen queue, and says so once, not at every attempt (every 50 ms), then says when it accepts
/// again; the connections that waited are served.
#[tokio::test]
async fn out_of_descriptors_is_logged_when_it_starts_and_ends() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = ChildGateway::spawn_with_open_files(64, 64, &["--database".into(), dir.path().join("d.db").into()]);
    let lines = |message: &str| {
        gateway
            .logs
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l["fields"]["message"].as_str().is_some_and(|m| m.starts_with(message)))
            .count()
    };
    // Connections that send nothing hold a descriptor each until the head's timeout.
    let mut held = Vec::new();
    for _ in 0..80 {
        held.push(tokio::net::TcpStream::connect(&gateway.addr).await.unwrap());
    }
    assert!(eventually(100, || async { lines("accept failed") > 0 }).await, "the gateway runs out");
    // Past many attempts, still one line.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(lines("accept failed"), 1);
    assert_eq!(lines("accepting connections again"), 0);
    // A request queued meanwhile is answered once descriptors are free again.
    let waiting = tokio::spawn({
        let client = gateway.client.clone();
        let url = gateway.url("/health");
        async move { client.get(url).send().await.map(|r| r.status().as_u16()) }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(held);
    assert_eq!(waiting.await.unwrap().unwrap(), 200);
    assert!(eventually(100, || async { lines("accepting connections again") == 1 }).await);
    assert!(gateway.terminate().success());
}

/// Connections are capped (--max-connections): at the cap new ones wait in the listen queue,
/// which is logged when it starts and ends, and a request queued meanwhile is answered once a
/// connection closes. /metrics counts the open connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait_for_a_place() {
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<std::ffi::OsString> = vec![
        "--database".into(),
        dir.path().join("d.db").into(),
        "--max-connections".into(),
        "5".into(),
        "--header-read-timeout-secs".into(),
        "60".into(),
    ];
    let gateway = ChildGateway::spawn(&args);
    let lines = |message: &str| {
        let logs = gateway.logs.lock().unwrap();
        logs.iter().filter(|l| l["fields"]["message"].as_str().is_some_and(|m| m.starts_with(message))).count()
    };
    // Connections that send nothing hold their place until the head's timeout.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(tokio::net::TcpStream::connect(&gateway.addr).await.unwrap());
    }
    // Read over one of them, which keeps its place after the answer (kept alive); a connection
    // counts once the gateway has accepted it, a moment after `connect` returns.
    let mut open = 0.0;
    for _ in 0..100 {
        open = metric(&get_kept_alive(&mut held[0], "/metrics").await, "dispatch_open_connections");
        if open == 4.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(open, 4.0, "the four held");
    // The fifth, answered once so that it holds the last place before the sixth comes.
    held.push(tokio::net::TcpStream::connect(&gateway.addr).await.unwrap());
    assert_eq!(get_kept_alive(&mut held[4], "/health").await, r#"{"ok":true}"#);
    let waiting = tokio::spawn({
        let url = gateway.url("/health");
        async move { reqwest::get(url).await.map(|r| r.status().as_u16()) }
    });
    assert!(eventually(100, || async { lines("at --max-connections") == 1 }).await, "the cap is logged");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the sixth connection waits");
    held.pop();
    assert_eq!(waiting.await.unwrap().unwrap(), 200);
    assert!(eventually(100, || async { lines("accepting connections again") == 1 }).await);
    assert_eq!(lines("at --max-connections"), 1);
    assert!(gateway.terminate().success());
}

/// A WebSocket session keeps its connection's place under --max-connections whichever path
/// served the connection's first requests: one hyper read (a chunked body) and then upgraded
/// holds it until the session ends, as one upgraded on the gateway's own path does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_session_keeps_its_connections_place() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_connections = Some(3);
    let server = TestServer::start(config).await;
    let mut scraper = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let open = |text: &str| metric(text, "dispatch_open_connections");
    for chunked_first in [false, true] {
        let mut session = tokio::net::TcpStream::connect(server.addr).await.unwrap();
        if chunked_first {
            // A body without a length is hyper's to read; the upgrade then comes to hyper too.
            let request = "POST /conversations/w/queue HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
                           transfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n";
            let answer = exchange(&mut session, request.as_bytes()).await;
            assert_eq!(answer.status, 400, "{}", answer.head);
            read_until(&mut session, answer.rest, b"}").await;
        }
        let upgrade = "GET /ws HTTP/1.1\r\nhost: localhost\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
                       sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n";
        let answer = exchange(&mut session, upgrade.as_bytes()).await;
        assert_eq!(answer.status, 101, "{}", answer.head);
        // The session writes its catalog once it has the socket, after the connection's
        // serving gave its place on (or back).
        read_until(&mut session, answer.rest, b"catalog").await;
        assert_eq!(open(&get_kept_alive(&mut scraper, "/metrics").await), 2.0, "chunked first: {chunked_first}");
        drop(session);
        let mut closed = 0.0;
        for _ in 0..100 {
            closed = open(&get_kept_alive(&mut scraper, "/metrics").await);
            if closed == 1.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(closed, 1.0, "the session's end gives the place back");
    }
}

/// `--backup` copies the database while a gateway writes to it: the copy holds every turn
/// sealed before it, and a gateway started on it serves them as the original did (a turn that
/// was running is marked interrupted there, as after a crash). A backup never overwrites a
/// file, and a source that is not a gateway's SQLite database is refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_taken_while_a_turn_runs_restores_what_was_sealed() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gateway.db");
    let database = |db: &std::path::Path| -> Vec<std::ffi::OsString> {
        vec!["--database".into(), db.into(), "--scripted-pace".into(), "200".into()]
    };
    let backup = |from: &std::ffi::OsStr, to: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"))
            .arg("--database")
            .arg(from)
            .arg("--backup")
            .arg(to)
            .output()
            .expect("the binary runs")
    };
    let gateway = ChildGateway::spawn(&database(&db));
    for k in 0..2 {
        assert_eq!(gateway.chat("kept", &format!("turn {k}")).await.last().unwrap()["type"], "turn-sealed");
    }
    let kept = gateway.history("kept").await;
    let mut running = gateway.chat_stream(json!({"conversationId": "running", "message": "a long answer"})).await;
    while running.next_event().await.expect("the turn streams")["type"] != "text-delta" {}

    let copy = dir.path().join("copy.db");
    let made = backup(db.as_os_str(), &copy);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let said: Value = serde_json::from_slice(&made.stdout).expect("a JSON line");
    let bytes = std::fs::read(&copy).unwrap();
    assert_eq!(said, json!({"backup": copy, "bytes": bytes.len()}));

    // Refused, with the reason, leaving nothing behind.
    let not_a_database = dir.path().join("notes.txt");
    std::fs::write(&not_a_database, "not a database").unwrap();
    let other = dir.path().join("other.db");
    for (from, to, reason) in [
        (db.as_os_str(), &copy, "exists: a backup goes to a new file"),
        (dir.path().join("missing.db").as_os_str(), &other, "there is no database at"),
        (not_a_database.as_os_str(), &other, "is not a dispatch-gateway database"),
        ("postgres://gateway@127.0.0.1:1/db".as_ref(), &other, "back up a PostgreSQL one with pg_dump"),
        (db.as_os_str(), &dir.path().join("no/such/folder.db"), "its folder does not exist"),
    ] {
        let refused = backup(from, to);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(1), "{from:?}: {stderr}");
        assert!(stderr.contains(reason), "{from:?}: {stderr}");
    }
    assert_eq!(std::fs::read(&copy).unwrap(), bytes, "the backup is as it was");
    let mut files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    files.retain(|f| !f.to_string_lossy().starts_with("gateway.db"));
    files.sort();
    assert_eq!(files, ["copy.db", "notes.txt"], "no partial copy left");

    // The original goes on: the turn ends there.
    assert_eq!(running.collect().await.last().unwrap()["type"], "turn-sealed");
    let whole = gateway.history("running").await;
    assert!(gateway.terminate().success());

    let restored = ChildGateway::spawn(&database(&copy));
    assert_eq!(restored.history("kept").await, kept);
    let cut = restored.history("running").await;
    assert!(cut.len() < whole.len(), "the copy has the running turn as it was then");
    assert!(
        eventually(100, || async {
            let (_, status) = restored.get("/conversations/running/status").await;
            status["isActive"] == false
        })
        .await,
        "the running turn is ended in the copy"
    );
    let marked = restored.history("running").await;
    assert!(marked.iter().any(|c| c["chunk"]["code"] == "interrupted"), "marked interrupted: {marked:?}");
    assert_eq!(marked[..cut.len()], cut[..], "what the copy held is kept");
}
