//! An agent that stalls, crashes, prints garbage or overlong lines, or breaks its input.

use super::*;

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
