//! What /metrics, /ready and the logs say while turns run and requests fail.

use std::collections::BTreeMap;

use super::*;

/// A gateway whose scripted model fails a prompt that says "fail" (code `upstream`).
async fn failing_server(dir: &std::path::Path) -> TestServer {
    let mut config = test_config(dir);
    config.scripted_script = Some(write_script(
        dir,
        json!({"rules": [{"match": "fail", "steps": [{"text": "x"}], "error": {"message": "no", "code": "upstream"}}]}),
    ));
    TestServer::start(config).await
}

#[tokio::test]
async fn metrics_move_when_turns_run_and_ready_answers() {
    let dir = tempfile::tempdir().unwrap();
    let server = failing_server(dir.path()).await;
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

/// A Python with the official Prometheus client (`prometheus_client`), whose parser reads the
/// exposition as Prometheus does: `DISPATCH_TEST_PROMETHEUS_PYTHON`. Without it the test says
/// so and passes, unless `DISPATCH_REQUIRE_PROMETHEUS` is set.
fn prometheus_python() -> Option<String> {
    let python = std::env::var("DISPATCH_TEST_PROMETHEUS_PYTHON").ok().filter(|p| !p.is_empty());
    if python.is_none() {
        assert!(std::env::var_os("DISPATCH_REQUIRE_PROMETHEUS").is_none(), "prometheus_client is required");
        eprintln!("skipped: DISPATCH_TEST_PROMETHEUS_PYTHON names no Python with prometheus_client");
    }
    python
}

/// Every sample of the exposition as the Prometheus client's parser reads it: name, labels,
/// value. The parser refuses what Prometheus would (a malformed line, a bad escape).
fn parsed(python: &str, text: &str) -> Vec<(String, BTreeMap<String, String>, f64)> {
    use std::io::Write;
    const PARSE: &str = "import json, sys
from prometheus_client.parser import text_string_to_metric_families
print(json.dumps([[s.name, s.labels, s.value] for f in text_string_to_metric_families(sys.stdin.read()) for s in f.samples]))";
    let mut child = std::process::Command::new(python)
        .args(["-c", PARSE])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the parser refused the exposition: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Turns are counted by model and credential: by outcome, failures by error code (a code an
/// agent program made up counts as `other`, so no client makes new series), tokens in and
/// out, and each step's time to first token and decode time as histograms, all read back by
/// the Prometheus client's own parser.
#[tokio::test]
async fn turns_are_counted_by_model_with_bounded_labels() {
    let Some(python) = prometheus_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.scripted_script = Some(write_script(
        dir.path(),
        json!({"rules": [
            {"match": "upstream", "steps": [{"text": "x", "usage": {"inputTokens": 1, "outputTokens": 1}}],
             "error": {"message": "no", "code": "upstream"}},
            {"match": "odd", "steps": [{"text": "x", "usage": {"inputTokens": 1, "outputTokens": 1}}],
             "error": {"message": "no", "code": "made-up-by-the-agent"}},
            {"steps": [{"text": "hello there", "usage": {"inputTokens": 7, "outputTokens": 3}}]}
        ]}),
    ));
    let server = TestServer::start(config).await;
    for (conversation, message) in [("a", "hi"), ("a", "hi again"), ("b", "upstream please"), ("c", "odd one")] {
        server.chat(conversation, message).await;
    }
    let samples = parsed(&python, &server.metrics().await);
    let value = |name: &str, labels: &[(&str, &str)]| -> Vec<f64> {
        samples
            .iter()
            .filter(|(n, l, _)| n == name && labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v)))
            .map(|(_, _, v)| *v)
            .collect()
    };
    let model = [("model", "demo/scripted"), ("credential", "demo")];
    let with = |extra: (&'static str, &'static str)| {
        let mut labels = model.to_vec();
        labels.push(extra);
        labels
    };
    assert_eq!(value("dispatch_model_turns_total", &with(("outcome", "finished"))), [2.0]);
    assert_eq!(value("dispatch_model_turns_total", &with(("outcome", "failed"))), [2.0]);
    assert_eq!(value("dispatch_model_turns_total", &with(("outcome", "aborted"))), [0.0]);
    assert_eq!(value("dispatch_model_errors_total", &with(("code", "upstream"))), [1.0]);
    assert_eq!(value("dispatch_model_errors_total", &with(("code", "other"))), [1.0]);
    assert!(
        !samples.iter().any(|(_, labels, _)| labels.values().any(|v| v.contains("made-up"))),
        "a runtime's own code makes no series"
    );
    assert_eq!(value("dispatch_model_tokens_total", &with(("direction", "input"))), [7.0 + 7.0 + 1.0 + 1.0]);
    assert_eq!(value("dispatch_model_tokens_total", &with(("direction", "output"))), [3.0 + 3.0 + 1.0 + 1.0]);
    // Every step with text had a first token and a decode: four steps.
    assert_eq!(value("dispatch_model_ttft_seconds_count", &model), [4.0]);
    assert_eq!(value("dispatch_model_decode_seconds_count", &model), [4.0]);
    assert_eq!(value("dispatch_model_ttft_seconds_bucket", &with(("le", "+Inf"))), [4.0]);
    assert_eq!(value("dispatch_runtime_errors_total", &[("kind", "other")]), [1.0]);
}

/// The Grafana dashboard of docker/ graphs only series the gateway exposes (its queries name
/// metrics as the exposition spells them, a histogram's by its `_bucket` series), through the
/// data source the compose file provisions beside it.
#[tokio::test]
async fn the_dashboard_graphs_series_the_gateway_exposes() {
    let read = |path: &str| std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let dashboard: Value = serde_json::from_str(&read("docker/grafana/dispatch.json")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let server = failing_server(dir.path()).await;
    server.chat("m", "hello").await;
    server.chat("m", "fail now").await;
    let text = server.metrics().await;
    // Every series name: a family's samples (a histogram's `_bucket`, `_sum` and `_count`).
    let exposed: Vec<&str> =
        text.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
    let datasources = read("docker/grafana/datasources.yaml");
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        let uid = panel["datasource"]["uid"].as_str().unwrap();
        assert!(datasources.contains(&format!("uid: {uid}")), "{}: data source {uid}", panel["title"]);
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            queries += 1;
            let names =
                expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| w.starts_with("dispatch_"));
            for name in names {
                assert!(exposed.contains(&name), "{}: {name} is not a series of /metrics", panel["title"]);
            }
        }
    }
    assert!(queries >= 10, "the dashboard has its panels");
    let compose = read("docker/compose.yaml");
    for file in ["datasources.yaml", "dashboards.yaml", "dispatch.json"] {
        assert!(compose.contains(&format!("./grafana/{file}:")), "compose mounts docker/grafana/{file}");
    }
}
