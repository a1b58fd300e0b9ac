//! What the reference web client relies on, against the real server: history that never
//! overlaps the live replay, the side-panel routes and the settings a turn takes from them, a
//! request's model that sticks, and reads that still work right after a shutdown's last seal.
//! (The scripted pace after a stall, which the client's demo relies on, is a unit test of the
//! scripted runtime on a paused clock.)

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use dispatch_gateway::config::{CommandCredential, Credential, Dialect, ScriptedCredential};
use serde_json::{Value, json};

/// Chunks of a history read and its `latestSeq`.
async fn read(server: &TestServer, id: &str, query: &str) -> (Vec<Value>, u64) {
    let (status, body) = server.get(&format!("/conversations/{id}{query}")).await;
    assert_eq!(status, 200, "{body}");
    (body["chunks"].as_array().unwrap().clone(), body["latestSeq"].as_u64().unwrap())
}

fn seqs(chunks: &[Value]) -> Vec<u64> {
    chunks.iter().map(|c| c["seq"].as_u64().unwrap()).collect()
}

/// A two-step tool-call turn whose second step stalls, so a read can land mid-turn.
fn tool_script(dir: &std::path::Path) -> std::path::PathBuf {
    write_script(
        dir,
        json!({"rules": [
            {"match": "tools", "pace": 0, "steps": [
                {"text": "Looking.", "toolCalls": [{"id": "call_a", "name": "ls", "input": {}, "result": "a b"}]},
                {"text": "Found two.", "stallMs": 1500}
            ]}
        ]}),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_shows_sealed_turns_only_and_never_overlaps_the_replay() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.scripted_script = Some(tool_script(dir.path()));
    // Reads in pages of 2 chunks: a page's end is the horizon of the read's start.
    config.history_page_chunks = 2;
    let server = TestServer::start(config).await;
    server.chat("h", "hello").await;
    let (sealed, sealed_latest) = read(&server, "h", "").await;
    assert!(!sealed.is_empty());
    assert_eq!(sealed_latest, *seqs(&sealed).last().unwrap());

    // A turn past its first step (the tool call and its result are committed).
    let mut stream = server.chat_stream(json!({"conversationId": "h", "message": "tools please"})).await;
    loop {
        let event = stream.next_event().await.unwrap();
        if event["type"] == "step-complete" && event["stepId"].as_str().unwrap().ends_with("#0") {
            break;
        }
    }
    assert!(
        eventually(100, || async { read(&server, "h", "?include=inflight").await.0.len() >= sealed.len() + 3 }).await,
        "the first step's chunks are committed"
    );
    // At the same moment: a watcher joins and a history read is made.
    let mut joiner = server.sse("h", "").await;
    let (now, latest) = read(&server, "h", "").await;
    assert_eq!(now, sealed, "a read mid-turn shows exactly the sealed turns");
    assert_eq!(latest, sealed_latest, "latestSeq follows the sealed horizon");
    for window in ["?limit=2", "?sinceSeq=1", "?beforeSeq=1000"] {
        let (chunks, _) = read(&server, "h", window).await;
        assert!(seqs(&chunks).iter().all(|s| *s <= sealed_latest), "{window}: {chunks:?}");
    }
    let (inflight, inflight_latest) = read(&server, "h", "?include=inflight").await;
    assert!(inflight_latest > sealed_latest);
    let new: Vec<&Value> = inflight.iter().filter(|c| c["seq"].as_u64().unwrap() > sealed_latest).collect();
    assert_eq!(new[0]["role"], "user", "{new:?}");
    assert!(new.iter().any(|c| c["chunk"]["type"] == "tool-call"), "{new:?}");
    // A stale cursor's resync names the sealed horizon too.
    let mut stale = server.sse("h", "?lastEventId=gone:1").await;
    let resync = stale.next().await.unwrap();
    assert_eq!(resync.event.as_deref(), Some("resync"));
    assert_eq!(resync.json()["latestSeq"], sealed_latest);

    // The joiner's replay holds the in-flight turn from its user message; with the history
    // read, each chunk of the log is there once: the history has none of this turn.
    let replay = joiner.until_sealed().await;
    let events: Vec<Value> = replay.iter().map(|m| m.json()).collect();
    assert_eq!(events[0]["type"], "user-message");
    assert_eq!(events.iter().filter(|e| e["type"] == "tool-call").count(), 1);
    assert!(now.iter().all(|c| c["chunk"]["text"] != "tools please"), "the prompt is not in both: {now:?}");

    // The moment a watcher has turn-sealed, the whole turn is history.
    let (after, after_latest) = read(&server, "h", "").await;
    assert_eq!(after, inflight_at_seal(&server).await);
    assert!(after_latest > inflight_latest);
    let calls: Vec<&Value> = after.iter().filter(|c| c["chunk"]["type"] == "tool-call").collect();
    assert_eq!(calls.len(), 1, "the tool call once: {after:?}");
    assert_eq!(after.last().unwrap()["chunk"]["text"], "Found two.");
    assert_eq!(seqs(&after), (1..=after_latest).collect::<Vec<_>>(), "gap-free");
    drop(stream);
}

/// With nothing in flight, the opt-in read and the default one agree.
async fn inflight_at_seal(server: &TestServer) -> Vec<Value> {
    read(server, "h", "?include=inflight").await.0
}

#[tokio::test]
async fn the_history_parameter_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let (status, body) = server.get("/conversations/x?include=everything").await;
    assert_eq!(status, 400);
    assert!(body["error"].as_str().unwrap().contains("include"));
    assert_eq!(read(&server, "unknown", "?include=inflight").await, (vec![], 0));
}

/// Tells what the agent process saw: its folder and the effort it was asked for.
const SETTINGS_AGENT: &str = r#"
import json, os, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("type") == "interrupt":
        continue
    def emit(**e):
        sys.stdout.write(json.dumps(e) + "\n")
        sys.stdout.flush()
    emit(type="step_start")
    emit(type="text", delta=json.dumps({"cwd": os.getcwd(), "effort": msg.get("reasoningEffort")}))
    emit(type="step_end")
    emit(type="done", reason="stop")
"#;

#[tokio::test]
async fn side_panel_routes_persist_settings_that_turns_use() {
    let dir = tempfile::tempdir().unwrap();
    let agent = dir.path().join("agent.py");
    std::fs::write(&agent, SETTINGS_AGENT).unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let mut config = test_config(dir.path());
    config.credentials.insert(
        "agent".into(),
        Credential::Command(CommandCredential {
            program: "python3".into(),
            args: vec!["-u".into(), agent.display().to_string()],
            dialect: Dialect::Ndjson,
            models: vec!["fake".into()],
            cwd: None,
            cwd_roots: vec![std::env::current_dir().unwrap(), dir.path().to_owned()],
            env: BTreeMap::new(),
            idle_timeout_secs: 600,
            unattended: false,
            max_processes: 32,
            grace_secs: 3,
            mcp: Vec::new(),
        }),
    );
    let server = TestServer::start(config).await;
    // Unseen ids answer null, never 404.
    assert_eq!(server.get("/conversations/p/cwd").await, (200, json!({"conversationId": "p", "cwd": null})));
    assert_eq!(
        server.get("/conversations/p/reasoning-effort").await,
        (200, json!({"conversationId": "p", "reasoningEffort": null}))
    );
    assert_eq!(
        server.get("/conversations/p/lsp").await,
        (200, json!({"conversationId": "p", "cwd": null, "servers": []}))
    );
    // No setting: the agent runs in the gateway's folder and is told the default effort.
    let seen = |events: &[Value]| -> Value {
        let text: String =
            events.iter().filter(|e| e["type"] == "text-delta").map(|e| e["delta"].as_str().unwrap()).collect();
        serde_json::from_str(&text).unwrap()
    };
    let first = seen(&server.chat("p", "hi").await);
    assert_eq!(first["effort"], "high");
    assert_eq!(first["cwd"], std::env::current_dir().unwrap().display().to_string());

    let cwd = work.display().to_string();
    assert_eq!(
        server.put("/conversations/q/cwd", json!({"cwd": cwd})).await,
        (200, json!({"conversationId": "q", "cwd": cwd}))
    );
    let (status, body) = server.put("/conversations/q/reasoning-effort", json!({"reasoningEffort": "max"})).await;
    assert_eq!((status, &body["reasoningEffort"]), (200, &json!("max")));
    for bad in [json!({"reasoningEffort": "extreme"}), json!({"reasoningEffort": 3}), json!({})] {
        let (status, body) = server.put("/conversations/q/reasoning-effort", bad).await;
        assert_eq!(status, 400, "{body}");
    }
    assert_eq!(server.get("/conversations/q/cwd").await.1["cwd"], cwd);
    assert_eq!(server.get("/conversations/q/reasoning-effort").await.1["reasoningEffort"], "max");
    assert_eq!(server.get("/conversations/q/lsp").await.1["cwd"], cwd);
    let persisted = seen(&server.chat("q", "hi").await);
    assert_eq!(persisted, json!({"cwd": cwd, "effort": "max"}));
    // The request's own value wins over the persisted one.
    let events = server
        .chat_stream(json!({"conversationId": "q", "message": "hi", "reasoningEffort": "low"}))
        .await
        .collect()
        .await;
    assert_eq!(seen(&events)["effort"], "low");
    let (status, _) = server.post("/chat", json!({"message": "hi", "reasoningEffort": "huge"})).await;
    assert_eq!(status, 400);
    // Cleared with null.
    assert_eq!(
        server.put("/conversations/q/reasoning-effort", json!({"reasoningEffort": null})).await.1["reasoningEffort"],
        Value::Null
    );
}

#[tokio::test]
async fn a_model_named_by_a_request_sticks() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    for name in ["a", "b"] {
        config.credentials.insert(
            name.into(),
            Credential::Scripted(ScriptedCredential {
                models: vec!["m".into()],
                pace: Some(0.0),
                reasoning: Some(false),
                script: None,
            }),
        );
    }
    config.default_model = Some("a/m".into());
    let server = TestServer::start(config).await;
    server.chat_stream(json!({"conversationId": "s", "message": "one", "model": "b/m"})).await.collect().await;
    assert_eq!(server.get("/conversations/s/model").await.1["model"], "b/m");
    server.chat("s", "two").await;
    let (_, throughput) = server.get("/metrics/throughput?period=day").await;
    let models: Vec<(&str, u64)> = throughput["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["model"].as_str().unwrap(), m["turns"].as_u64().unwrap()))
        .collect();
    assert_eq!(models, vec![("b/m", 2)], "both turns ran on the request's model");
    // An unknown model is refused and changes nothing.
    let (status, _) = server.post("/chat", json!({"conversationId": "s", "message": "x", "model": "nope/m"})).await;
    assert_eq!(status, 400);
    assert_eq!(server.get("/conversations/s/model").await.1["model"], "b/m");
}

#[tokio::test]
async fn reads_go_on_for_a_grace_after_the_shutdown_seals_the_last_turn() {
    let dir = tempfile::tempdir().unwrap();
    let script = tool_script(dir.path());
    let child = ChildGateway::spawn(&[
        "--database".into(),
        dir.path().join("g.db").into(),
        "--scripted-script".into(),
        script.into(),
    ]);
    let base = format!("http://{}", child.addr);
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{base}/chat"))
        .json(&json!({"conversationId": "g", "message": "tools again"}))
        .send()
        .await
        .unwrap();
    let mut stream = EventStream::new(response);
    while stream.next_event().await.unwrap()["type"] != "step-complete" {}
    let pid = child.child.id().to_string();
    std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let mut last = Value::Null;
    while let Some(event) = stream.next_event().await {
        last = event;
    }
    assert_eq!(last["type"], "turn-sealed");
    // Right after the seal, as the web client does: history, metrics, and /ready says 503.
    let history: Value = client.get(format!("{base}/conversations/g")).send().await.unwrap().json().await.unwrap();
    assert!(history["chunks"].as_array().unwrap().iter().any(|c| c["chunk"]["type"] == "tool-call"), "{history}");
    let metrics: Value =
        client.get(format!("{base}/conversations/g/metrics")).send().await.unwrap().json().await.unwrap();
    assert_eq!(metrics["turns"].as_array().unwrap().len(), 1);
    let ready = client.get(format!("{base}/ready")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let (status, _) =
        read_json(client.post(format!("{base}/chat")).json(&json!({"message": "late"})).send().await.unwrap()).await;
    assert_eq!(status, 503, "no new turn during the grace");
    let logs = child.logs.clone();
    let status = terminate_wait(child);
    assert!(status.success());
    let logs = logs.lock().unwrap();
    let ready_lines: Vec<&Value> = logs.iter().filter(|l| l["fields"]["path"] == "/ready").collect();
    assert!(!ready_lines.is_empty(), "the draining /ready is logged");
    assert!(ready_lines.iter().all(|l| l["level"] == "INFO"), "{ready_lines:?}");
}

/// Waits for a child that was already sent SIGTERM.
fn terminate_wait(mut child: ChildGateway) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.child.try_wait().unwrap() {
            return status;
        }
        assert!(std::time::Instant::now() < deadline, "the gateway did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}
