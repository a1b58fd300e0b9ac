//! Descriptors and connections: the open-file limit, running out, the connection cap and the
//! place a WebSocket session keeps.

use super::*;

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
