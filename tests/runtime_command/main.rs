//! The `command` runtime against fake agent programs through real pipes.

#[path = "../common/mod.rs"]
mod common;
mod faults;
mod processes;
mod tools;
mod transcripts;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::*;
use dispatch_gateway::config::{CommandCredential, Config, Credential, Dialect, ScriptedCredential};
use serde_json::{Value, json};

/// The fake agent: one Python program whose behaviour each prompt picks. It appends a line to
/// `starts.log` each time it starts, so tests can count (re)starts.
const AGENT: &str = r#"
import json, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "starts.log"), "a") as f:
    f.write(os.environ.get("DISPATCH_SESSION_ID", "-") + "\n")
with open(os.path.join(here, "pids.log"), "a") as f:
    f.write(str(os.getpid()) + "\n")
session = os.environ.get("DISPATCH_SESSION_ID")
# A session it begins is named after its start: sess-1 for the first process, sess-2 ...
with open(os.path.join(here, "starts.log")) as f:
    new_session = "sess-%d" % len(f.readlines())

def emit(**e):
    sys.stdout.write(json.dumps(e) + "\n")
    sys.stdout.flush()

for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("type") == "interrupt":
        continue
    text = msg["text"]
    given = msg.get("sessionId")
    print("agent got a turn", file=sys.stderr, flush=True)
    if text.startswith("echo"):
        if session is None:
            session = new_session
            emit(type="session", id=session)
        emit(type="step_start")
        emit(type="text", delta="echo: ")
        emit(type="text", delta=text + f" (session={given})")
        emit(type="usage", usage={"inputTokens": 7, "outputTokens": 2})
        emit(type="step_end")
        emit(type="done", reason="stop")
    elif text.startswith("tools"):
        emit(type="step_start")
        emit(type="reasoning", delta="need a tool")
        emit(type="tool_call", id="t1", name="ls", input={"path": "/"})
        emit(type="tool_output", id="t1", data="bin etc", stream="stdout")
        emit(type="usage", usage={"inputTokens": 10, "outputTokens": 4})
        emit(type="step_end")
        emit(type="tool_result", id="t1", name="ls", content="bin etc", isError=False, durationMs=2)
        emit(type="step_start")
        emit(type="text", delta="There are two.")
        emit(type="usage", usage={"inputTokens": 20, "outputTokens": 3})
        emit(type="step_end")
        emit(type="done", reason="stop")
    elif text.startswith("stall"):
        emit(type="text", delta="thinking slowly")
        for line in sys.stdin:
            if json.loads(line).get("type") == "interrupt":
                emit(type="done", reason="aborted")
                break
    elif text.startswith("odd session"):
        emit(type="session", id="s\nx" if "newline" in text else "s" * 300)
        emit(type="text", delta="odd")
        emit(type="done", reason="stop")
    elif text.startswith("crash"):
        emit(type="text", delta="about to crash")
        sys.exit(3)
    elif text.startswith("garbage"):
        print("this is not json", flush=True)
    elif text.startswith("endless"):
        while True:
            sys.stdout.write("x" * 65536)
            sys.stdout.flush()
    elif text.startswith("loud"):
        # Three stderr lines past the limit (more than a pipe holds), then an answer.
        for _ in range(3):
            sys.stderr.write("e" * 200000 + "\n")
        sys.stderr.flush()
        emit(type="text", delta="still here")
        emit(type="done", reason="stop")
    elif text.startswith("where"):
        emit(type="text", delta=os.getcwd() + " " + os.environ["DISPATCH_MODEL"])
        emit(type="done", reason="stop")
    elif text.startswith("unknown"):
        emit(type="something_new", x=1)
        emit(type="text", delta="fine")
        emit(type="done", reason="stop")

# The end of its input: what it keeps is written, taking a moment (as a transcript is).
time.sleep(0.3)
with open(os.path.join(here, "goodbyes.log"), "a") as f:
    f.write(str(os.getpid()) + "\n")
"#;

/// Reads a little of its input, then leaves: a large prompt's write breaks part-way.
const SHORT_READER: &str = r#"
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "starts.log"), "a") as f:
    f.write("-\n")
sys.stdin.buffer.read(10)
os._exit(0)
"#;

fn agent(dir: &Path, name: &str, source: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, source).unwrap();
    path
}

async fn gateway(dir: &Path, script: &Path, dialect: Dialect) -> TestServer {
    gateway_with(dir, script, dialect, 600).await
}

async fn gateway_with(dir: &Path, script: &Path, dialect: Dialect, idle_timeout_secs: u64) -> TestServer {
    TestServer::start(config_with(dir, script, dialect, idle_timeout_secs)).await
}

fn config_with(dir: &Path, script: &Path, dialect: Dialect, idle_timeout_secs: u64) -> Config {
    let mut config = test_config(dir);
    config.credentials.insert(
        "agent".into(),
        Credential::Command(CommandCredential {
            program: "python3".into(),
            args: vec!["-u".into(), script.display().to_string()],
            dialect,
            models: vec!["fake".into(), "other".into()],
            cwd: None,
            cwd_roots: vec![std::env::current_dir().unwrap(), dir.to_owned()],
            env: BTreeMap::new(),
            idle_timeout_secs,
            unattended: false,
            max_processes: 32,
            grace_secs: 3,
            mcp: Vec::new(),
        }),
    );
    config
}

fn starts(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("starts.log")).unwrap_or_default().lines().map(str::to_owned).collect()
}

async fn turn(server: &TestServer, conversation: &str, message: &str) -> Vec<Value> {
    server.chat_stream(json!({"conversationId": conversation, "message": message})).await.collect().await
}

#[tokio::test]
async fn echo_and_the_session_id_is_stored_and_passed_back() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let server = gateway(dir.path(), &script, Dialect::Ndjson).await;
    let first = turn(&server, "c1", "echo one").await;
    assert_eq!(
        types(&first),
        vec!["user-message", "turn-start", "text-delta", "text-delta", "usage", "step-complete", "done", "turn-sealed"]
    );
    assert_eq!(first[3]["delta"], "echo one (session=None)");
    let second = turn(&server, "c1", "echo two").await;
    assert_eq!(second[3]["delta"], "echo two (session=sess-1)", "the stored session comes back");
    assert_eq!(starts(dir.path()), vec!["-"], "one resident process served both turns");

    // After a restart of the gateway the process is new, and it resumes the stored session.
    let server = server.restart().await;
    let third = turn(&server, "c1", "echo three").await;
    assert_eq!(third[3]["delta"], "echo three (session=sess-1)");
    assert_eq!(starts(dir.path()), vec!["-", "sess-1"]);
    // Another conversation gets its own process.
    turn(&server, "c2", "echo x").await;
    assert_eq!(starts(dir.path()).len(), 3);
    // /models says an agent program reads all three of a conversation's settings.
    let (_, models) = server.get("/models").await;
    let name = models["models"][0].as_str().unwrap();
    assert_eq!(models["modelInfo"][name]["settings"], json!(["cwd", "reasoningEffort", "session"]), "{models}");
}

/// A process is started for a model and a folder: a turn on another model or in another
/// folder gets a new process, there, resuming the session; a folder that is not there is the
/// turn's error, saying so.
#[tokio::test]
async fn another_model_or_folder_starts_a_new_process_that_resumes_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let server = gateway(dir.path(), &script, Dialect::Ndjson).await;
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let here = std::env::current_dir().unwrap();
    let whereabouts = |events: &[Value]| events.iter().find(|e| e["type"] == "text-delta").unwrap()["delta"].clone();
    turn(&server, "c", "echo one").await;
    assert_eq!(whereabouts(&turn(&server, "c", "where").await), format!("{} fake", here.display()));
    assert_eq!(starts(dir.path()), vec!["-"]);

    assert_eq!(server.put("/conversations/c/cwd", json!({"cwd": elsewhere})).await.0, 200);
    assert_eq!(whereabouts(&turn(&server, "c", "where").await), format!("{} fake", elsewhere.display()));
    assert_eq!(starts(dir.path()), vec!["-", "sess-1"], "a new process, resuming the session");
    let goodbyes = std::fs::read_to_string(dir.path().join("goodbyes.log")).unwrap_or_default();
    assert_eq!(goodbyes.lines().count(), 1, "the old process was let finish what it keeps, not killed");
    assert_eq!(server.put("/conversations/c/model", json!({"model": "agent/other"})).await.0, 200);
    assert_eq!(whereabouts(&turn(&server, "c", "where").await), format!("{} other", elsewhere.display()));
    assert_eq!(whereabouts(&turn(&server, "c", "where").await), format!("{} other", elsewhere.display()));
    assert_eq!(starts(dir.path()), vec!["-", "sess-1", "sess-1"], "the same model and folder keep the process");
    let metrics = server.metrics().await;
    assert_eq!(metric(&metrics, "dispatch_agent_processes{credential=\"agent\"}"), 1.0, "{metrics}");
    assert_eq!(metric(&metrics, "dispatch_agent_starts_total{credential=\"agent\"}"), 3.0, "{metrics}");

    // A folder that is not there is refused as one outside the roots, naming the value asked
    // for only; so is one that went away after it was set, when a turn would start there.
    let gone = dir.path().join("gone").display().to_string();
    let (status, body) = server.put("/conversations/c/cwd", json!({"cwd": gone})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(
        body["error"],
        format!("`cwd` {gone:?} is not a folder the agent may work in (the credential's cwd_roots)")
    );
    std::fs::create_dir(&gone).unwrap();
    assert_eq!(server.put("/conversations/c/cwd", json!({"cwd": gone})).await.0, 200);
    std::fs::remove_dir(&gone).unwrap();
    let (status, body) = server.post("/conversations/c/messages", json!({"message": "where"})).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("is not a folder the agent may work in"), "{body}");
}

/// An agent works only inside its credential's folders (docs/security.md): a request or a
/// conversation that names another place (the root, `..`, a symlink out of the root) is
/// refused with 400 before anything starts, and the answer says nothing of the host's folders.
#[tokio::test]
async fn an_agent_works_only_inside_its_credentials_folders() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let mut config = config_with(dir.path(), &script, Dialect::Ndjson, 600);
    let root = dir.path().join("root");
    std::fs::create_dir_all(root.join("project")).unwrap();
    std::os::unix::fs::symlink(dir.path(), root.join("escape")).unwrap();
    if let Some(Credential::Command(agent)) = config.credentials.get_mut("agent") {
        agent.cwd_roots = vec![root.clone()];
    }
    let server = TestServer::start(config).await;
    for (i, refused) in
        ["/", "/root", "../../..", "..", "escape", "escape/..", "/etc/cron.d", "missing"].iter().enumerate()
    {
        let (status, body) = server.put("/conversations/c/cwd", json!({"cwd": refused})).await;
        assert_eq!(status, 400, "PUT cwd {refused}: {body}");
        let error = body["error"].as_str().unwrap();
        assert!(!error.contains(&dir.path().display().to_string()), "no host path: {error}");
        let id = format!("r{i}");
        let (status, body) =
            server.post("/chat", json!({"conversationId": id, "message": "where", "cwd": refused})).await;
        assert_eq!(status, 400, "POST /chat cwd {refused}: {body}");
        assert_eq!(server.get(&format!("/conversations/{id}")).await.1["chunks"], json!([]), "nothing started");
    }
    // Inside the root, relative to it or absolute, the agent works there.
    let whereabouts = |events: &[Value]| events.iter().find(|e| e["type"] == "text-delta").unwrap()["delta"].clone();
    assert_eq!(server.put("/conversations/c/cwd", json!({"cwd": "project"})).await.0, 200);
    let project = root.join("project").canonicalize().unwrap();
    assert_eq!(whereabouts(&turn(&server, "c", "where").await), format!("{} fake", project.display()));
    let events: Vec<Value> = server
        .chat_stream(json!({"conversationId": "d", "message": "where", "cwd": root.display().to_string()}))
        .await
        .collect()
        .await;
    assert_eq!(whereabouts(&events), format!("{} fake", root.canonicalize().unwrap().display()));
}

/// A conversation's session can be forgotten between turns: the next turn gets a new process
/// that starts without one (the old one let go as at any stop) and begins its own, which the
/// turns after resume; while a turn runs it is refused, and an unknown conversation is 404.
#[tokio::test]
async fn a_forgotten_session_is_not_resumed_and_the_next_turn_begins_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let server = gateway(dir.path(), &script, Dialect::Ndjson).await;
    let said = |events: Vec<Value>| {
        events.iter().find(|e| e["type"] == "text-delta" && e["delta"] != "echo: ").unwrap()["delta"].clone()
    };
    turn(&server, "c", "echo one").await;
    assert_eq!(said(turn(&server, "c", "echo two").await), "echo two (session=sess-1)");

    assert_eq!(server.delete("/conversations/c/session").await.0, 204);
    assert_eq!(said(turn(&server, "c", "echo three").await), "echo three (session=None)");
    assert_eq!(starts(dir.path()), vec!["-", "-"], "a new process, resuming nothing");
    let goodbyes = std::fs::read_to_string(dir.path().join("goodbyes.log")).unwrap_or_default();
    assert_eq!(goodbyes.lines().count(), 1, "the old process was let finish what it keeps, not killed");
    assert_eq!(said(turn(&server, "c", "echo four").await), "echo four (session=sess-2)");
    assert_eq!(starts(dir.path()), vec!["-", "-"], "the new session's process goes on");

    let (status, body) = server.delete("/conversations/nobody/session").await;
    assert_eq!((status, body["error"].is_string()), (404, true), "{body}");
    let (status, _) = server.post("/conversations/c/messages", json!({"message": "stall"})).await;
    assert_eq!(status, 202);
    let (status, body) = server.delete("/conversations/c/session").await;
    assert_eq!(status, 409, "{body}");
    assert!(body["error"].as_str().unwrap().contains("turn is running"), "{body}");
    assert_eq!(server.post("/conversations/c/stop", json!({})).await.0, 200);
    let last = server.get("/conversations/c/last?timeoutMs=10000").await.1;
    assert_eq!(last["conversationId"], "c", "{last}");
    assert_eq!(said(turn(&server, "c", "echo five").await), "echo five (session=sess-2)", "refused: kept");
}

#[tokio::test]
async fn multi_step_with_tools() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let server = gateway(dir.path(), &script, Dialect::Ndjson).await;
    let events = turn(&server, "c1", "tools please").await;
    assert_eq!(
        types(&events),
        vec![
            "user-message",
            "turn-start",
            "reasoning-delta",
            "tool-call",
            "tool-output",
            "usage",
            "step-complete",
            "tool-result",
            "text-delta",
            "usage",
            "step-complete",
            "done",
            "turn-sealed"
        ]
    );
    let turn_id = events[0]["turnId"].as_str().unwrap();
    assert_eq!(events[3]["stepId"], format!("{turn_id}#0"));
    assert_eq!(events[7]["stepId"], format!("{turn_id}#0"));
    assert_eq!(events[7]["durationMs"], 2);
    assert_eq!(events[9]["stepId"], format!("{turn_id}#1"));
    assert_eq!(events[11]["contextSize"], 23);
    let (_, metrics) = server.get("/conversations/c1/metrics").await;
    assert_eq!(metrics["turns"][0]["steps"].as_array().unwrap().len(), 2);
}

fn alive(pid: &str) -> bool {
    // A killed child may linger as a zombie until reaped; count only live states.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "))
}
