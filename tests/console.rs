//! The web console at `/`: served from the binary, public as assets (the data behind it is
//! not), and driven in a real browser. The browser half runs `tests/console/drive.mjs` with
//! playwright-core (`$DISPATCH_TEST_PLAYWRIGHT`, the package's folder) and Chromium
//! (`$DISPATCH_TEST_CHROMIUM`, else `chromium` on the PATH); without them it says so and
//! passes, unless `DISPATCH_REQUIRE_BROWSER` is set (as `.ci/run` does, after installing both).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use dispatch_gateway::config::{CommandCredential, Credential, Dialect, ScriptedCredential};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

fn console_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("console")
}

#[tokio::test]
async fn the_console_is_served_from_the_binary_and_only_its_assets_are_public() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.api_keys = vec!["k1".into()];
    let server = TestServer::start(config).await;

    let page = server.client.get(server.url("/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert_eq!(page.headers()["content-type"], "text/html; charset=utf-8");
    let policy = page.headers()["content-security-policy"].to_str().unwrap().to_owned();
    assert!(policy.contains("script-src 'self'") && policy.contains("frame-ancestors 'none'"), "{policy}");
    let html = page.text().await.unwrap();
    assert_eq!(html, std::fs::read_to_string(console_dir().join("index.html")).unwrap());

    // Every file of console/ is served as it is in the repository, with its media type; every
    // module a module imports is one of them.
    for entry in std::fs::read_dir(console_dir()).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name == "index.html" {
            continue;
        }
        let r = server.client.get(server.url(&format!("/console/{name}"))).send().await.unwrap();
        assert_eq!(r.status(), 200, "{name} is not served");
        let media = if name.ends_with(".css") { "text/css; charset=utf-8" } else { "text/javascript; charset=utf-8" };
        assert_eq!(r.headers()["content-type"], media, "{name}");
        assert_eq!(r.headers()["x-content-type-options"], "nosniff");
        let text = r.text().await.unwrap();
        assert_eq!(text, std::fs::read_to_string(console_dir().join(&name)).unwrap());
        for import in text.lines().filter_map(|l| l.split(" from \"./").nth(1)) {
            let file = import.split('"').next().unwrap();
            assert!(console_dir().join(file).is_file(), "{name} imports {file}, which console/ lacks");
        }
    }
    for module in html.split("src=\"/console/").skip(1).chain(html.split("href=\"/console/").skip(1)) {
        let file = module.split('"').next().unwrap();
        assert!(console_dir().join(file).is_file(), "index.html names {file}");
    }
    let (status, body) = server.get("/console/nope.js").await;
    assert_eq!((status, body["error"].is_string()), (404, true), "{body}");
    let (status, body) = server.get("/console/..%2FCargo.toml").await;
    assert_eq!((status, body["error"].is_string()), (404, true), "{body}");
    // The assets are public; what they show is not.
    let (status, _) = server.get("/conversations").await;
    assert_eq!(status, 401);
}

/// A WebSocket handshake with `Origin`; the status it gets (101 when it opened).
async fn open_with_origin(server: &TestServer, origin: &str) -> u16 {
    let mut request = format!("ws://{}/ws", server.addr).into_client_request().unwrap();
    request.headers_mut().insert("origin", origin.parse().unwrap());
    match tokio_tungstenite::connect_async(request).await {
        Ok((_, response)) => response.status().as_u16(),
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => response.status().as_u16(),
        Err(e) => panic!("handshake failed: {e}"),
    }
}

#[tokio::test]
async fn the_consoles_own_origin_may_open_a_websocket_and_learns_of_new_conversations() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.cors_origins = vec!["https://app.example".into()];
    let server = TestServer::start(config).await;
    // The page's own origin (the gateway's address) opens a session whatever the CORS list
    // says; another site's page does not.
    assert_eq!(open_with_origin(&server, &format!("http://{}", server.addr)).await, 101);
    assert_eq!(open_with_origin(&server, "https://app.example").await, 101);
    assert_eq!(open_with_origin(&server, "https://evil.example").await, 403);
    assert_eq!(open_with_origin(&server, &format!("http://{}.evil.example", server.addr.ip())).await, 403);

    // A conversation created without a turn is announced like one that goes idle, so a list
    // that follows status changes shows it.
    let mut ws = server.ws().await;
    assert_eq!(ws.next().await.unwrap()["type"], "catalog");
    let (status, _) = server.post("/conversations", json!({"id": "made-here"})).await;
    assert_eq!(status, 201);
    let m = tokio::time::timeout(Duration::from_secs(5), ws.next()).await.unwrap().unwrap();
    assert_eq!(m, json!({"type": "conversation.statusChanged", "conversationId": "made-here", "status": "idle"}));
}

/// The scripted answers the browser drives: a tool-call turn, paced turns to reload, drop and
/// stop in the middle of.
fn script(dir: &std::path::Path) -> PathBuf {
    let words = |n: usize| (1..=n).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    write_script(
        dir,
        json!({"rules": [
            {"match": "tools", "pace": 0, "steps": [
                {"reasoning": "Two files to read.", "text": "Reading both.", "toolCalls": [
                    {"id": "call_a", "name": "read", "input": {"path": "a.txt"}, "output": "reading a", "result": "alpha", "durationMs": 3},
                    {"id": "call_b", "name": "read", "input": {"path": "b.txt"}, "result": "no such file", "isError": true}
                ], "usage": {"inputTokens": 50, "outputTokens": 12}},
                {"text": "One file read, one missing.", "usage": {"inputTokens": 80, "outputTokens": 7}}
            ]},
            {"match": "paced", "pace": 15, "steps": [{"text": words(60)}]},
            {"match": "dropped", "pace": 10, "steps": [{"text": words(80)}]},
            {"match": "endless", "pace": 20, "steps": [{"text": "token ", "repeat": 100000}]},
            {"match": "broken", "pace": 0, "steps": [{"text": "half an answer"}],
             "error": {"message": "the upstream went away", "code": "upstream"}}
        ]}),
    )
}

/// An agent program (the gateway's NDJSON protocol) that answers every turn with one word and
/// stays up between turns.
fn echo_agent(dir: &std::path::Path) -> CommandCredential {
    let program = dir.join("echo_agent.py");
    let source = r#"
import json, sys
for line in sys.stdin:
    if json.loads(line).get("type") == "user":
        for event in ({"type": "text", "delta": "echo"}, {"type": "done", "reason": "stop"}):
            print(json.dumps(event), flush=True)
"#;
    std::fs::write(&program, source).unwrap();
    CommandCredential {
        program: "python3".into(),
        args: vec!["-u".into(), program.display().to_string()],
        dialect: Dialect::Ndjson,
        models: vec!["echo".into()],
        cwd: None,
        cwd_roots: Vec::new(),
        env: Default::default(),
        idle_timeout_secs: 600,
        unattended: false,
        max_processes: 4,
        grace_secs: 3,
        mcp: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_a_real_browser() {
    let Some((chromium, playwright)) = browser() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut open = test_config(&dir.path().join("open"));
    std::fs::create_dir_all(dir.path().join("open")).unwrap();
    // The scripted models, and an agent program whose process the Gateway view counts.
    let scripted = ScriptedCredential {
        models: vec!["scripted".into()],
        pace: None,
        reasoning: None,
        script: Some(script(dir.path())),
    };
    open.credentials.insert("demo".into(), Credential::Scripted(scripted));
    open.credentials.insert("agent".into(), Credential::Command(echo_agent(dir.path())));
    open.default_model = Some("demo/scripted".into());
    // MCP servers for the Gateway view's tools: one that is ready, one that cannot start.
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/tools/tiny_server.py");
    for (name, server) in [
        ("tiny", json!({"command": "python3", "args": [tiny], "scope": "shared"})),
        ("gone", json!({"command": "/nonexistent/mcp-server", "scope": "shared"})),
    ] {
        open.mcp.insert(name.into(), serde_json::from_value(server).unwrap());
    }
    let open = TestServer::start(open).await;
    // More conversations than the list's first page, older than every other: the list shows
    // how many there are and loads the rest.
    for i in 0..230 {
        let (status, _) = open.post("/conversations", json!({"id": format!("bulk-{i:03}")})).await;
        assert_eq!(status, 201);
    }
    let events = open.chat_stream(json!({"conversationId": "agent-run", "message": "hi", "model": "agent/echo"})).await;
    assert_eq!(types(&events.collect().await).last(), Some(&"turn-sealed"));
    std::fs::create_dir_all(dir.path().join("locked")).unwrap();
    let mut locked = test_config(&dir.path().join("locked"));
    locked.api_keys = vec!["console-key".into()];
    let secret = dir.path().join("jwt-secret");
    std::fs::write(&secret, "a-secret-of-at-least-thirty-two-bytes!!").unwrap();
    locked.jwt_secret_file = Some(secret);
    let locked = TestServer::start(locked).await;
    let claims = json!({"sub": "alice", "exp": jsonwebtoken::get_current_timestamp() + 3600});
    let alice = jsonwebtoken::encode(
        &jsonwebtoken::Header::default(),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(b"a-secret-of-at-least-thirty-two-bytes!!").unwrap(),
    )
    .unwrap();
    let mine = locked
        .client
        .post(locked.url("/conversations"))
        .bearer_auth(&alice)
        .json(&json!({"id": "alices-own", "title": "Alice's own"}))
        .send()
        .await
        .unwrap();
    assert_eq!(mine.status(), 201);

    // A conversation whose last turn failed, for the list's mark.
    let failed = open.chat("failed-last", "broken please").await;
    assert_eq!(failed.iter().find(|e| e["type"] == "done").unwrap()["reason"], "error");

    // A conversation of 500 sealed turns, for the plots' readability and their point count.
    for i in 0..500 {
        open.chat("many-turns", &format!("question {i}")).await;
    }
    let (_, title) = open.put("/conversations/many-turns/title", json!({"title": "Five hundred turns"})).await;
    assert_eq!(title["title"], "Five hundred turns");
    let created = locked
        .client
        .post(locked.url("/conversations"))
        .bearer_auth("console-key")
        .json(&json!({"id": "behind-a-key", "title": "Behind a key"}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);

    let shots = std::env::var_os("DISPATCH_CONSOLE_SHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots"));
    std::fs::create_dir_all(&shots).unwrap();
    let driver = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/console/drive.mjs");
    let mut child = tokio::process::Command::new("node")
        .arg(driver)
        .env("PLAYWRIGHT", &playwright)
        .env("CHROMIUM", &chromium)
        .env("OPEN_URL", open.url(""))
        .env("LOCKED_URL", locked.url(""))
        .env("API_KEY", "console-key")
        .env("ALICE_TOKEN", &alice)
        .env("SHOTS", &shots)
        .kill_on_drop(true)
        .spawn()
        .expect("node runs the browser driver");
    let status =
        tokio::time::timeout(Duration::from_secs(300), child.wait()).await.expect("the driver finishes").unwrap();
    assert!(status.success(), "the browser driver failed ({status}); its output says where");
    for shot in [
        "list",
        "streaming",
        "live-turn",
        "tool-calls",
        "aborted",
        "key-prompt",
        "signed-in-user",
        "plots",
        "plots-500",
        "throughput",
        "over-time",
        "gateway",
        "narrow",
        "dark",
    ] {
        assert!(shots.join(format!("{shot}.png")).is_file(), "no screenshot {shot}.png");
    }
    let metrics: Value = open.get("/conversations/many-turns/metrics").await.1;
    assert_eq!(metrics["turns"].as_array().unwrap().len(), 500);
}
