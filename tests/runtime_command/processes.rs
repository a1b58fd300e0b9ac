//! Processes over time: idle stops, turns the agent starts itself, grace, missed turns, bad
//! session ids, deleted conversations.

use super::*;

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
