//! The `command` runtime against fake agent programs through real pipes.

mod common;

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

/// An agent works only inside its credential's folders (spec 8.1): a request or a
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_agent_is_interrupted_by_stop() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let server = gateway(dir.path(), &script, Dialect::Ndjson).await;
    let mut stream = server.chat_stream(json!({"conversationId": "c1", "message": "stall"})).await;
    loop {
        if stream.next_event().await.unwrap()["type"] == "text-delta" {
            break;
        }
    }
    server.post("/conversations/c1/stop", json!({})).await;
    let rest = stream.collect().await;
    assert_eq!(rest[rest.len() - 2]["reason"], "aborted");
    assert_eq!(server.history("c1").await[1]["chunk"]["text"], "thinking slowly");
    // The agent answered the interrupt and stays up for the next turn.
    let next = turn(&server, "c1", "echo after").await;
    assert_eq!(next[next.len() - 2]["reason"], "stop");
    assert_eq!(starts(dir.path()).len(), 1);
}

#[tokio::test]
async fn a_crash_mid_turn_is_an_error_and_the_next_turn_restarts_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let server = gateway(dir.path(), &script, Dialect::Ndjson).await;
    let events = turn(&server, "c1", "crash now").await;
    let n = events.len();
    assert_eq!(types(&events[n - 3..]), vec!["error", "done", "turn-sealed"]);
    assert_eq!(events[n - 3]["code"], "agent-exit");
    assert_eq!(events[n - 2]["reason"], "error");
    assert_eq!(server.history("c1").await[1]["chunk"]["text"], "about to crash");
    let next = turn(&server, "c1", "echo again").await;
    assert_eq!(next[next.len() - 2]["reason"], "stop");
    assert_eq!(starts(dir.path()).len(), 2, "restarted once");
}

#[tokio::test]
async fn a_garbage_line_is_a_clear_error_and_unknown_lines_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let server = gateway(dir.path(), &script, Dialect::Ndjson).await;
    let events = turn(&server, "c1", "garbage").await;
    turn_error(&events, "agent-protocol", "this is not json");
    let events = turn(&server, "c1", "unknown lines").await;
    assert_eq!(
        types(&events),
        vec!["user-message", "turn-start", "text-delta", "step-complete", "done", "turn-sealed"]
    );
    assert_eq!(server.get("/health").await.0, 200);
}

#[tokio::test]
async fn a_line_past_the_limit_ends_the_turn_and_the_process_and_stderr_never_stalls_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let mut config = config_with(dir.path(), &script, Dialect::Ndjson, 600);
    config.max_runtime_line_bytes = 64 * 1024;
    let server = TestServer::start(config).await;
    // Output that never ends a line: the turn ends instead of the gateway's buffer growing
    // (without the bound it would never end: the guard makes that a failure, not a hang).
    let events = tokio::time::timeout(std::time::Duration::from_secs(120), turn(&server, "c1", "endless"))
        .await
        .expect("the turn of an endless line ends");
    turn_error(&events, "agent-protocol", "longer than 65536 bytes");
    // The process was stopped: the next turn starts another.
    let events = turn(&server, "c1", "echo again").await;
    assert!(events.iter().any(|e| e["type"] == "text-delta"), "{events:?}");
    assert_eq!(starts(dir.path()).len(), 2);
    // Stderr lines past the limit are left out, and still read: the agent answers.
    let events = turn(&server, "c1", "loud").await;
    let text: Vec<&Value> = events.iter().filter(|e| e["type"] == "text-delta").collect();
    assert_eq!(text.len(), 1, "{events:?}");
    assert_eq!(text[0]["delta"], "still here");
}

#[tokio::test]
async fn past_max_processes_the_longest_idle_process_is_stopped_and_none_is_while_in_a_turn() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let mut config = config_with(dir.path(), &script, Dialect::Ndjson, 600);
    let Some(Credential::Command(credential)) = config.credentials.get_mut("agent") else { unreachable!() };
    credential.max_processes = 2;
    let server = TestServer::start(config).await;
    let pids = || -> Vec<String> {
        std::fs::read_to_string(dir.path().join("pids.log")).unwrap().lines().map(str::to_owned).collect()
    };
    turn(&server, "c1", "echo one").await;
    turn(&server, "c2", "echo two").await;
    turn(&server, "c1", "echo one again").await;
    // A third conversation: c2's process has been idle longest (c1 answered since).
    let events = turn(&server, "c3", "echo three").await;
    assert_eq!(events[events.len() - 2]["reason"], "stop", "{events:?}");
    let started = pids();
    assert_eq!(started.len(), 3);
    assert!(alive(&started[0]) && !alive(&started[1]) && alive(&started[2]), "{started:?}");
    // Both processes in a turn: a fourth conversation's turn fails, and stops neither.
    let mut stalls = Vec::new();
    for conversation in ["c1", "c3"] {
        let mut stream = server.chat_stream(json!({"conversationId": conversation, "message": "stall"})).await;
        while stream.next_event().await.unwrap()["type"] != "text-delta" {}
        stalls.push(stream);
    }
    let events = turn(&server, "c4", "echo four").await;
    turn_error(&events, "agent-busy", "max_processes");
    assert_eq!(pids().len(), 3);
    for conversation in ["c1", "c3"] {
        server.post(&format!("/conversations/{conversation}/stop"), json!({})).await;
    }
    for stream in stalls {
        let rest = stream.collect().await;
        assert_eq!(rest[rest.len() - 2]["reason"], "aborted");
    }
    // Idle again: the next new conversation gets a place.
    let events = turn(&server, "c4", "echo four again").await;
    assert_eq!(events[events.len() - 2]["reason"], "stop", "{events:?}");
}

#[tokio::test]
async fn a_write_that_breaks_part_way_is_ambiguous_and_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "short.py", SHORT_READER);
    let server = gateway(dir.path(), &script, Dialect::Ndjson).await;
    // Far more than a pipe holds (and under the 1 MiB body limit): the agent reads 10 bytes and
    // exits while the gateway is still writing.
    let body = json!({"conversationId": "c1", "message": "x".repeat(600 * 1024), "model": "agent/fake"});
    let r = server.client.post(server.url("/chat")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let events = EventStream::new(r).collect().await;
    let error = events.iter().find(|e| e["type"] == "error").unwrap();
    assert_eq!(error["code"], "ambiguous", "{error}");
    assert_eq!(starts(dir.path()).len(), 1, "never retried");
}

#[tokio::test]
async fn a_recorded_claude_transcript_maps_to_the_exact_event_list() {
    let transcript = [
        json!({"type": "system", "subtype": "init", "session_id": "claude-sess", "model": "sonnet", "tools": []}),
        json!({"type": "assistant", "message": {"id": "m1", "role": "assistant", "content": [
            {"type": "thinking", "thinking": "List the files."},
            {"type": "text", "text": "I'll look."},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}
        ], "usage": {"input_tokens": 100, "output_tokens": 20, "cache_read_input_tokens": 50, "cache_creation_input_tokens": 10}}}),
        json!({"type": "user", "message": {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt\nb.txt", "is_error": false}
        ]}}),
        json!({"type": "system", "subtype": "compact_boundary"}),
        json!({"type": "stream_event", "event": {"type": "ping"}}),
        json!({"type": "assistant", "message": {"id": "m2", "role": "assistant", "content": [
            {"type": "text", "text": "Two files."}
        ], "usage": {"input_tokens": 130, "output_tokens": 5}}}),
        json!({"type": "result", "subtype": "success", "is_error": false, "result": "Two files.", "session_id": "claude-sess",
               "usage": {"input_tokens": 230, "output_tokens": 25}, "some_new_field": true}),
    ];
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = transcript.iter().map(|l| l.to_string()).collect();
    let script = agent(
        dir.path(),
        "claude.py",
        &format!(
            r#"
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "starts.log"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
LINES = {lines:?}
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("type") != "user":
        continue
    assert msg["message"]["content"][0]["text"] == "list files"
    for out in LINES:
        print(out, flush=True)
"#
        ),
    );
    let server = gateway(dir.path(), &script, Dialect::ClaudeStreamJson).await;
    let events = turn(&server, "cc", "list files").await;
    let turn_id = events[0]["turnId"].as_str().unwrap().to_owned();
    let (s0, s1) = (format!("{turn_id}#0"), format!("{turn_id}#1"));
    let mut stripped = events.clone();
    for e in &mut stripped {
        let o = e.as_object_mut().unwrap();
        for k in ["conversationId", "turnId", "ttftMs", "decodeMs", "genTotalMs", "durationMs"] {
            o.remove(k);
        }
    }
    assert_eq!(
        stripped,
        vec![
            json!({"type": "user-message", "text": "list files"}),
            json!({"type": "turn-start"}),
            json!({"type": "reasoning-delta", "delta": "List the files."}),
            json!({"type": "text-delta", "delta": "I'll look."}),
            json!({"type": "tool-call", "stepId": s0, "toolCallId": "toolu_1", "toolName": "Bash", "input": {"command": "ls"}}),
            json!({"type": "usage", "stepId": s0, "usage": {"inputTokens": 160, "outputTokens": 20, "cacheReadTokens": 50, "cacheWriteTokens": 10}}),
            json!({"type": "step-complete", "stepId": s0}),
            json!({"type": "tool-result", "stepId": s0, "toolCallId": "toolu_1", "toolName": "Bash", "content": "a.txt\nb.txt", "isError": false}),
            json!({"type": "text-delta", "delta": "Two files."}),
            json!({"type": "usage", "stepId": s1, "usage": {"inputTokens": 130, "outputTokens": 5}}),
            json!({"type": "step-complete", "stepId": s1}),
            json!({"type": "done", "reason": "stop", "usage": {"inputTokens": 290, "outputTokens": 25, "cacheReadTokens": 50, "cacheWriteTokens": 10}, "contextSize": 135}),
            json!({"type": "turn-sealed"}),
        ]
    );
    // Launched in stream-json mode with its model and token streaming; the session was stored
    // for `--resume`. (Input counts the cache: Anthropic's `input_tokens` leaves it out.)
    let launch = &starts(dir.path())[0];
    assert!(launch.contains("--input-format stream-json --output-format stream-json"), "{launch}");
    assert!(launch.contains("--model fake"), "{launch}");
    assert!(launch.contains("--include-partial-messages"), "{launch}");
    let server = server.restart().await;
    turn(&server, "cc", "list files").await;
    assert!(starts(dir.path())[1].contains("--resume=claude-sess"), "{:?}", starts(dir.path()));
}

fn alive(pid: &str) -> bool {
    // A killed child may linger as a zombie until reaped; count only live states.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "))
}

#[tokio::test]
async fn an_idle_process_is_stopped_and_shutdown_stops_them_all() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let server = gateway_with(dir.path(), &script, Dialect::Ndjson, 1).await;
    turn(&server, "c1", "echo one").await;
    let pids = std::fs::read_to_string(dir.path().join("pids.log")).unwrap();
    let first = pids.lines().next().unwrap().to_owned();
    assert!(alive(&first));
    assert!(eventually(100, || async { !alive(&first) }).await, "the idle process was not stopped");
    let goodbyes = || std::fs::read_to_string(dir.path().join("goodbyes.log")).unwrap_or_default();
    assert_eq!(goodbyes(), format!("{first}\n"), "stopped at the end of its input, not killed");
    // Its place is given back once it is reaped, a moment after it exits.
    let processes = || async { metric(&server.metrics().await, "dispatch_agent_processes{credential=\"agent\"}") };
    assert!(eventually(100, || async { processes().await == 0.0 }).await, "no process runs");
    turn(&server, "c1", "echo two").await;
    assert_eq!(starts(dir.path()).len(), 2, "the next turn started a new process");

    turn(&server, "c2", "echo three").await;
    let pids: Vec<String> =
        std::fs::read_to_string(dir.path().join("pids.log")).unwrap().lines().map(str::to_owned).collect();
    assert!(alive(pids.last().unwrap()), "the new conversation's process runs");
    server.stop().await;
    assert!(pids.iter().all(|p| !alive(p)), "shutdown stops every agent process");
    assert_eq!(goodbyes().lines().count(), 3, "each let write what it keeps: {pids:?}");
}

/// A Claude Code stand-in that runs a turn of its own between the gateway's: after the first
/// answer it prints a background task's turn, whose result comes only once the next turn has
/// been submitted; the third answer has a subagent's line in it.
const SELF_STARTING: &str = r#"
import json, sys
n = 0
def out(**v):
    print(json.dumps(v), flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("type") != "user":
        continue
    n += 1
    text = msg["message"]["content"][0]["text"]
    if n == 2:
        out(type="result", subtype="success", is_error=False, result="background done", origin={"kind": "task-notification"})
    if n == 3:
        out(type="assistant", parent_tool_use_id="toolu_x", message={"id": "sub", "content": [{"type": "text", "text": "subagent chatter"}]})
    out(type="assistant", message={"id": f"m{n}", "content": [{"type": "text", "text": "answer to " + text}], "usage": {"input_tokens": 5, "output_tokens": 2}})
    out(type="result", subtype="success", is_error=False, result="answer to " + text, session_id="s")
    if n == 1:
        out(type="assistant", message={"id": "bg", "content": [{"type": "text", "text": "background done"}]})
"#;

#[tokio::test]
async fn a_turn_the_agent_starts_itself_is_not_answered_as_the_users() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "self_starting.py", SELF_STARTING);
    let server = gateway(dir.path(), &script, Dialect::ClaudeStreamJson).await;
    let text = |events: &[Value]| -> String {
        events.iter().filter(|e| e["type"] == "text-delta").map(|e| e["delta"].as_str().unwrap()).collect()
    };
    assert_eq!(text(&turn(&server, "bg", "one").await), "answer to one");
    // The background turn's line is printed by now; its result comes with the next turn.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(text(&turn(&server, "bg", "two").await), "answer to two");
    assert_eq!(text(&turn(&server, "bg", "three").await), "answer to three", "subagent lines stay out");
}

/// Answers every turn, starts a helper of its own, and stays after the end of its input.
const STUBBORN: &str = r#"
import json, os, subprocess, sys, time
here = os.path.dirname(os.path.abspath(__file__))
helper = subprocess.Popen(["sleep", "1000"])
with open(os.path.join(here, "stubborn.pids"), "a") as f:
    f.write(f"{os.getpid()} {helper.pid}\n")
for line in sys.stdin:
    if json.loads(line).get("type") == "user":
        print(json.dumps({"type": "text", "delta": "here"}), flush=True)
        print(json.dumps({"type": "done", "reason": "stop"}), flush=True)
while True:
    time.sleep(1)
"#;

/// A process told to stop that does not exit at the end of its input is killed after the
/// grace, with what it started; the turn that needed a new process gets one.
#[tokio::test]
async fn an_agent_that_stays_after_the_end_of_its_input_is_killed_with_its_group() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "stubborn.py", STUBBORN);
    let server = gateway(dir.path(), &script, Dialect::Ndjson).await;
    turn(&server, "s", "first").await;
    let pids = || std::fs::read_to_string(dir.path().join("stubborn.pids")).unwrap();
    let first: Vec<String> = pids().split_whitespace().map(str::to_owned).collect();
    assert!(first.iter().all(|p| alive(p)), "{first:?}");
    // Another model: the first process is told to stop, stays, and is killed.
    let events = server.chat_stream(json!({"conversationId": "s", "message": "second", "model": "agent/other"})).await;
    let events: Vec<Value> = events.collect().await;
    assert_eq!(events.iter().find(|e| e["type"] == "text-delta").unwrap()["delta"], "here");
    // The helper dies of the group's kill a moment after it is sent.
    let gone = eventually(100, || async { first.iter().all(|p| !alive(p)) }).await;
    assert!(gone, "the process and its helper are gone: {first:?}");
    assert_eq!(pids().lines().count(), 2, "a new process took the turn");
}

/// An agent that takes two seconds after the end of its input to write what it keeps.
const SLOW_GOODBYE: &str = r#"
import json, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
for line in sys.stdin:
    if json.loads(line).get("type") == "user":
        for event in ({"type": "text", "delta": "hi"}, {"type": "done", "reason": "stop"}):
            print(json.dumps(event), flush=True)
time.sleep(2)
with open(os.path.join(here, "kept.log"), "a") as f:
    f.write("kept\n")
"#;

/// The time a stopped agent has to exit is its credential's `grace_secs`: one that needs two
/// seconds to write what it keeps does so with ten, and is killed before it could with none.
#[tokio::test]
async fn a_stopped_agent_has_its_credentials_grace() {
    for (grace, kept) in [(10, true), (0, false)] {
        let dir = tempfile::tempdir().unwrap();
        let script = agent(dir.path(), "slow.py", SLOW_GOODBYE);
        let mut config = config_with(dir.path(), &script, Dialect::Ndjson, 600);
        if let Some(Credential::Command(c)) = config.credentials.get_mut("agent") {
            c.grace_secs = grace;
        }
        let server = TestServer::start(config).await;
        turn(&server, "g", "first").await;
        // Another model: the first process is stopped (and waited for) before the next starts.
        let events =
            server.chat_stream(json!({"conversationId": "g", "message": "second", "model": "agent/other"})).await;
        assert_eq!(types(&events.collect().await).last(), Some(&"turn-sealed"));
        assert_eq!(dir.path().join("kept.log").exists(), kept, "grace_secs = {grace}");
    }
}

/// A process kept for a conversation serves its next turn only if it was given the turn
/// before: after a turn on another runtime (or, in a cluster, on another gateway) the
/// conversation went on without it, and a new process resumes the session instead.
#[tokio::test]
async fn a_process_that_missed_a_turn_of_its_conversation_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let mut config = config_with(dir.path(), &script, Dialect::Ndjson, 600);
    let scripted = ScriptedCredential { models: vec!["scripted".into()], pace: None, reasoning: None, script: None };
    config.credentials.insert("demo".into(), Credential::Scripted(scripted));
    let server = TestServer::start(config).await;
    let on = |model: &str, message: &str| json!({"conversationId": "m", "message": message, "model": model});
    let sealed = |events: Vec<Value>| types(&events).last() == Some(&"turn-sealed");
    assert!(sealed(server.chat_stream(on("agent/fake", "echo one")).await.collect().await));
    assert!(sealed(server.chat_stream(on("agent/fake", "echo two")).await.collect().await));
    assert_eq!(starts(dir.path()), vec!["-"], "one process for consecutive turns");
    assert!(sealed(server.chat_stream(on("demo/scripted", "elsewhere")).await.collect().await));
    let events: Vec<Value> = server.chat_stream(on("agent/fake", "echo three")).await.collect().await;
    assert!(events.iter().any(|e| e["delta"] == "echo three (session=sess-1)"), "{events:?}");
    assert_eq!(starts(dir.path()), vec!["-", "sess-1"], "a new process, resuming the session");
    let goodbyes = std::fs::read_to_string(dir.path().join("goodbyes.log")).unwrap_or_default();
    assert_eq!(goodbyes.lines().count(), 1, "the old one was stopped");
}

/// A session id that could not go back to a process (a control character, past 256 bytes) is
/// not kept: its turn ends as usual, the next one resumes nothing, and the process stays.
#[tokio::test]
async fn a_session_id_that_cannot_be_passed_back_is_not_kept() {
    for odd in ["odd session newline", "odd session long"] {
        let dir = tempfile::tempdir().unwrap();
        let script = agent(dir.path(), "agent.py", AGENT);
        let server = gateway(dir.path(), &script, Dialect::Ndjson).await;
        let events = turn(&server, "o", odd).await;
        assert_eq!(events[events.len() - 2]["reason"], "stop", "{odd}: {events:?}");
        let events = turn(&server, "o", "echo one").await;
        assert_eq!(events[3]["delta"], "echo one (session=None)", "{odd}: nothing kept");
        assert_eq!(turn(&server, "o", "echo two").await[3]["delta"], "echo two (session=sess-1)", "{odd}");
        assert_eq!(starts(dir.path()), vec!["-"], "{odd}: one process throughout");
    }
}

/// A deleted conversation's agent process is stopped (as at any stop: its input closed)
/// rather than left idle with the deleted turns; a conversation made again under the id
/// starts a new one, with no session. So also when the deletion comes right before the new
/// turn (the process is checked, not only stopped).
#[tokio::test]
async fn a_deleted_conversations_process_is_stopped_and_not_given_to_one_made_again() {
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "agent.py", AGENT);
    let server = gateway(dir.path(), &script, Dialect::Ndjson).await;
    turn(&server, "d", "echo one").await;
    assert_eq!(turn(&server, "d", "echo two").await[3]["delta"], "echo two (session=sess-1)");
    assert_eq!(server.delete("/conversations/d").await.0, 204);
    let processes = || async { metric(&server.metrics().await, "dispatch_agent_processes{credential=\"agent\"}") };
    assert!(eventually(100, || async { processes().await == 0.0 }).await, "the process was stopped");
    let goodbyes = std::fs::read_to_string(dir.path().join("goodbyes.log")).unwrap_or_default();
    assert_eq!(goodbyes.lines().count(), 1, "let go as at any stop, not killed");
    assert_eq!(turn(&server, "d", "echo again").await[3]["delta"], "echo again (session=None)");
    assert_eq!(starts(dir.path()), vec!["-", "-"], "a new process, resuming nothing");

    // Deleted and made again at once: whichever comes first, the new turn gets a new process.
    assert_eq!(server.delete("/conversations/d").await.0, 204);
    assert_eq!(turn(&server, "d", "echo anew").await[3]["delta"], "echo anew (session=None)");
    assert_eq!(starts(dir.path()).len(), 3);
}
