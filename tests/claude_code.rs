//! The real Claude Code CLI (npm `@anthropic-ai/claude-code`) behind the `command` runtime,
//! offline: its API base URL points at a mock of the Anthropic Messages API on loopback
//! (`tests/fixtures/mock_anthropic.py`). The CLI is found as `$DISPATCH_TEST_CLAUDE`, else
//! `claude` on the PATH; without it the test says so and passes, unless
//! `DISPATCH_REQUIRE_CLAUDE` is set (as `.ci/run` does, after installing it).

mod common;

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::PathBuf;

use common::*;
use dispatch_gateway::config::{CommandCredential, Credential, Dialect};
use serde_json::{Value, json};

/// The mock API, on an ephemeral port; killed when dropped.
struct MockApi {
    child: std::process::Child,
    port: u16,
}

impl MockApi {
    fn start(dir: &std::path::Path) -> MockApi {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mock_anthropic.py");
        let mut child = std::process::Command::new("python3")
            .arg(script)
            .current_dir(dir)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 runs the mock API");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        MockApi { child, port: line.trim().parse().expect("the mock prints its port") }
    }
}

impl Drop for MockApi {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last streamed Messages request the mock API was sent.
fn last_streamed(dir: &tempfile::TempDir) -> Value {
    let requests = std::fs::read_to_string(dir.path().join("requests.jsonl")).unwrap();
    requests
        .lines()
        .rev()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|r| r["path"].as_str().unwrap().starts_with("/v1/messages") && r["body"]["stream"] == true)
        .expect("a streamed request")
}

fn text_of(events: &[Value]) -> String {
    events.iter().filter(|e| e["type"] == "text-delta").map(|e| e["delta"].as_str().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_claude_code_cli_streams_runs_tools_with_leave_follows_the_model_and_effort_and_reports_errors() {
    let install = "npm install @anthropic-ai/claude-code";
    let Some(claude) = program("DISPATCH_TEST_CLAUDE", "claude", "DISPATCH_REQUIRE_CLAUDE", install) else { return };
    let dir = tempfile::tempdir().unwrap();
    let api = MockApi::start(dir.path());
    let home = dir.path().join("home");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let mut env = BTreeMap::new();
    for (k, v) in [
        ("ANTHROPIC_BASE_URL", format!("http://127.0.0.1:{}", api.port)),
        ("ANTHROPIC_API_KEY", "sk-ant-test".to_owned()),
        ("HOME", home.display().to_string()),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".to_owned()),
        ("DISABLE_AUTOUPDATER", "1".to_owned()),
    ] {
        env.insert(k.to_owned(), v);
    }
    let mut config = test_config(dir.path());
    // `guarded` is the same CLI with nobody to allow its tools.
    for (name, unattended) in [("claude", true), ("guarded", false)] {
        let credential = CommandCredential {
            program: claude.display().to_string(),
            args: Vec::new(),
            dialect: Dialect::ClaudeStreamJson,
            models: vec!["sonnet".into(), "opus".into()],
            cwd: Some(work.clone()),
            cwd_roots: vec![dir.path().to_owned()],
            env: env.clone(),
            idle_timeout_secs: 600,
            unattended,
            max_processes: 32,
            grace_secs: 3,
            mcp: Vec::new(),
        };
        config.credentials.insert(name.into(), Credential::Command(credential));
    }
    let server = TestServer::start(config).await;

    // Tokens stream one by one; the thinking comes first; one model call is one step.
    let events = server.chat("cc", "please think about rust").await;
    let reasoning: String =
        events.iter().filter(|e| e["type"] == "reasoning-delta").map(|e| e["delta"].as_str().unwrap()).collect();
    assert_eq!(reasoning, "Let me think.", "{events:?}");
    assert_eq!(text_of(&events), "Answer to: please think about rust ");
    let deltas = events.iter().filter(|e| e["type"] == "text-delta").count();
    assert_eq!(deltas, 6, "word by word, as the API streamed them: {events:?}");
    assert_eq!(events.iter().filter(|e| e["type"] == "step-complete").count(), 1, "{events:?}");
    let done = events.iter().find(|e| e["type"] == "done").unwrap();
    assert_eq!(done["reason"], "stop");
    // message_start: 12 input, 100 cache reads, 20 cache writes; message_delta: 9 output.
    assert_eq!(done["usage"]["inputTokens"], 132, "{done}");
    assert_eq!(done["usage"]["outputTokens"], 9, "{done}");
    assert_eq!(done["usage"]["cacheReadTokens"], 100);
    assert_eq!(done["contextSize"], 141, "the whole context, cache included");

    // A tool that needs leave, with nobody to give it: refused, and the model is told so.
    let made = work.join("tool-ran.txt");
    let request = json!({"conversationId": "denied", "message": "use a tool please", "model": "guarded/sonnet"});
    let events: Vec<Value> = server.chat_stream(request).await.collect().await;
    let result = events.iter().find(|e| e["type"] == "tool-result").unwrap_or_else(|| panic!("a result: {events:?}"));
    assert_eq!(result["isError"], true, "{result}");
    assert!(!made.exists(), "the tool did not run: {events:?}");
    // Unattended: the CLI asks the gateway's leave, which allows it; the tool runs and its
    // result goes back to the model; a step per model call.
    let events = server.chat("tools", "use a tool please").await;
    let call = events.iter().find(|e| e["type"] == "tool-call").unwrap_or_else(|| panic!("a tool call: {events:?}"));
    assert_eq!(call["toolName"], "Bash", "{call}");
    assert_eq!(call["input"]["command"], "touch tool-ran.txt && echo tool-ran", "{call}");
    let result = events.iter().find(|e| e["type"] == "tool-result").expect("a tool result");
    assert_eq!((&result["toolCallId"], &result["isError"]), (&call["toolCallId"], &json!(false)), "{result}");
    assert!(result["content"].as_str().unwrap().contains("tool-ran"), "{result}");
    assert!(made.exists(), "the tool ran in the conversation's folder");
    assert_eq!(text_of(&events), "The tool said: tool-ran ");
    assert_eq!(events.iter().filter(|e| e["type"] == "step-complete").count(), 2, "{events:?}");
    assert_eq!(events.iter().find(|e| e["type"] == "done").unwrap()["reason"], "stop");

    // A stop while a tool runs (`sleep 30 && touch late.txt`): the CLI is interrupted, the
    // tool with it, and the conversation goes on.
    let tool_running = || {
        std::fs::read_dir("/proc").unwrap().flatten().any(|p| {
            std::fs::read(p.path().join("cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains("late.txt"))
        })
    };
    let mut stream = server.chat_stream(json!({"conversationId": "tools", "message": "a slow tool please"})).await;
    let mut done = Value::Null;
    while let Some(event) = stream.next_event().await {
        if event["type"] == "tool-call" {
            assert!(eventually(200, || async { tool_running() }).await, "the tool runs");
            server.post("/conversations/tools/stop", json!({})).await;
        }
        if event["type"] == "done" {
            done = event;
        }
    }
    assert_eq!(done["reason"], "aborted", "{done}");
    assert!(eventually(100, || async { !tool_running() }).await, "the interrupted tool is not left running");
    assert_eq!(text_of(&server.chat("tools", "and now?").await), "Answer to: and now? ");

    // The same process takes the next turn.
    let events = server.chat("cc", "hello again").await;
    assert_eq!(text_of(&events), "Answer to: hello again ");

    // An API error ends the turn with its reason.
    let events = server.chat("cc", "please fail").await;
    let error = events.iter().find(|e| e["type"] == "error").expect("an error event");
    assert!(error["message"].as_str().unwrap().contains("mock refused the request"), "{error}");
    assert_eq!(events[events.len() - 2]["reason"], "error");

    // A stop mid-stream keeps the text streamed so far.
    let mut stream = server.chat_stream(json!({"conversationId": "cc", "message": "slow story please"})).await;
    let mut seen = 0;
    while let Some(event) = stream.next_event().await {
        if event["type"] == "text-delta" {
            seen += 1;
            if seen == 2 {
                server.post("/conversations/cc/stop", json!({})).await;
            }
        }
        if event["type"] == "done" {
            assert_eq!(event["reason"], "aborted");
        }
    }
    let history = server.history("cc").await;
    let last_text = history.iter().rev().find(|c| c["role"] == "assistant" && c["chunk"]["type"] == "text").unwrap();
    assert!(last_text["chunk"]["text"].as_str().unwrap().starts_with("Answer to:"), "{last_text}");
    // And the conversation goes on after the interrupt.
    let events = server.chat("cc", "after the stop").await;
    assert_eq!(text_of(&events), "Answer to: after the stop ");

    // Another model for the conversation (Claude Code takes it as an argument): its next turn
    // runs on it, in the same session (the API is sent the earlier turns, the last one too:
    // the old process was let write it before it went).
    assert_eq!(server.put("/conversations/cc/model", json!({"model": "claude/opus"})).await.0, 200);
    let events = server.chat("cc", "on opus now").await;
    assert_eq!(text_of(&events), "Answer to: on opus now ", "{events:?}");
    let last = last_streamed(&dir);
    let model = last["body"]["model"].as_str().unwrap();
    assert!(model.contains("opus"), "the turn ran on {model}");
    let body = last["body"].to_string();
    assert!(body.contains("hello again") && body.contains("after the stop"), "the session goes on: {body}");

    // The conversation's reasoning effort is Claude Code's effort.
    assert_eq!(server.put("/conversations/cc/reasoning-effort", json!({"reasoningEffort": "low"})).await.0, 200);
    assert_eq!(text_of(&server.chat("cc", "briefly").await), "Answer to: briefly ");
    let last = last_streamed(&dir);
    assert_eq!(last["body"]["output_config"]["effort"], "low", "{last}");
    assert!(last["body"].to_string().contains("on opus now"), "the session goes on: {last}");

    // Another folder: a process there cannot find the session, and the turn says why; the
    // folder set back, the session goes on.
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    assert_eq!(server.put("/conversations/cc/cwd", json!({"cwd": elsewhere})).await.0, 200);
    let events = server.chat("cc", "from elsewhere").await;
    turn_error(&events, "error_during_execution", "keeps a session under the folder it started in");
    assert_eq!(server.put("/conversations/cc/cwd", json!({"cwd": work})).await.0, 200);
    assert_eq!(text_of(&server.chat("cc", "back home").await), "Answer to: back home ");
    assert!(last_streamed(&dir)["body"].to_string().contains("briefly"), "the session goes on");

    // A session forgotten: the next turn begins a new one (the API is sent that turn alone,
    // not what the running process held), and the turns after go on in it; so in another
    // folder, where the old one could not be resumed.
    assert_eq!(server.delete("/conversations/cc/session").await.0, 204);
    assert_eq!(text_of(&server.chat("cc", "a new start").await), "Answer to: a new start ");
    let body = last_streamed(&dir)["body"].to_string();
    assert!(body.contains("a new start") && !body.contains("back home"), "a new session: {body}");
    assert_eq!(text_of(&server.chat("cc", "and on").await), "Answer to: and on ");
    assert!(last_streamed(&dir)["body"].to_string().contains("a new start"), "the new session goes on");
    assert_eq!(server.put("/conversations/cc/cwd", json!({"cwd": elsewhere})).await.0, 200);
    assert_eq!(server.delete("/conversations/cc/session").await.0, 204);
    assert_eq!(text_of(&server.chat("cc", "in the new folder").await), "Answer to: in the new folder ");
    let body = last_streamed(&dir)["body"].to_string();
    assert!(body.contains("in the new folder") && !body.contains("a new start"), "a new session there: {body}");
    server.stop().await;
}

/// A `command` credential with `mcp` hands the gateway's MCP servers to Claude Code through the
/// gateway's own MCP endpoint: the real CLI calls a tool of the configured server (the test's
/// Python server over stdio, made with the `mcp` package); a tool outside the server's `tools`
/// is neither offered to the model nor callable; the server and the agent see none of the
/// gateway's environment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_gets_only_the_allowed_tools_and_none_of_the_gateways_environment() {
    let install = "npm install @anthropic-ai/claude-code";
    let Some(claude) = program("DISPATCH_TEST_CLAUDE", "claude", "DISPATCH_REQUIRE_CLAUDE", install) else { return };
    let Some(python) = std::env::var_os("DISPATCH_TEST_MCP_PYTHON") else {
        assert!(std::env::var_os("DISPATCH_REQUIRE_MCP").is_none(), "a Python with `mcp` is required");
        eprintln!("skipped: set DISPATCH_TEST_MCP_PYTHON (.ci/run installs it)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let api = MockApi::start(dir.path());
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let env: BTreeMap<String, String> = [
        ("ANTHROPIC_BASE_URL", format!("http://127.0.0.1:{}", api.port)),
        ("ANTHROPIC_API_KEY", "sk-ant-test".to_owned()),
        ("HOME", home.display().to_string()),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".to_owned()),
        ("DISABLE_AUTOUPDATER", "1".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let mut config = test_config(dir.path());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/tools/server.py");
    let server =
        json!({"command": python.to_string_lossy(), "args": [script, "stdio"], "tools": ["shout", "environment"]});
    // A secret of the gateway's own, as an upstream key would be.
    // SAFETY: set before the gateway starts; no other thread of this test reads the environment.
    unsafe { std::env::set_var("DISPATCH_TEST_GATEWAY_SECRET", "gateway-only-4c1d") };
    config.mcp.insert("py".into(), serde_json::from_value(server).unwrap());
    let credential = CommandCredential {
        program: claude.display().to_string(),
        args: Vec::new(),
        dialect: Dialect::ClaudeStreamJson,
        models: vec!["sonnet".into()],
        cwd: Some(dir.path().to_owned()),
        cwd_roots: vec![dir.path().to_owned()],
        env,
        idle_timeout_secs: 600,
        unattended: true,
        max_processes: 4,
        grace_secs: 3,
        mcp: vec!["py".into()],
    };
    config.credentials.insert("claude".into(), Credential::Command(credential));
    let server = TestServer::start(config).await;
    let events = server.chat("mcp", "use the mcp tool please").await;
    let call = events.iter().find(|e| e["type"] == "tool-call").unwrap_or_else(|| panic!("a tool call: {events:?}"));
    assert_eq!(call["toolName"], "mcp__py__shout", "{call}");
    let result = events.iter().find(|e| e["type"] == "tool-result").unwrap_or_else(|| panic!("a result: {events:?}"));
    assert_eq!(result["isError"], false, "{result}");
    assert!(result["content"].as_str().unwrap().contains("FROM CLAUDE"), "the server ran the call: {result}");
    assert!(text_of(&events).contains("FROM CLAUDE"), "the model read it: {events:?}");

    // The model was offered the allowed tools of the server, and no other.
    let offered: Vec<String> = last_streamed(&dir)["body"]["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["name"].as_str().filter(|n| n.starts_with("mcp__")).map(str::to_owned))
        .collect();
    assert_eq!(offered, ["mcp__py__environment", "mcp__py__shout"], "only the allow-list");

    // A tool outside the list, asked for anyway: not run.
    let events = server.chat("forbidden", "use the forbidden mcp tool").await;
    let result = events.iter().find(|e| e["type"] == "tool-result").unwrap_or_else(|| panic!("a result: {events:?}"));
    assert_eq!(result["isError"], true, "{result}");
    assert!(!result["content"].as_str().unwrap().contains("slept"), "the server never ran it: {result}");

    // The server's environment: the basics, nothing of the gateway's.
    let events = server.chat("environment", "show the environment mcp tool").await;
    let result = events.iter().find(|e| e["type"] == "tool-result").unwrap_or_else(|| panic!("a result: {events:?}"));
    let environment = result["content"].as_str().unwrap();
    assert!(environment.contains("PATH="), "the server printed its environment: {result}");
    for secret in ["gateway-only-4c1d", "DISPATCH_TEST_GATEWAY_SECRET", "sk-ant-test", "DISPATCH_REQUIRE"] {
        assert!(!environment.contains(secret), "{secret} reached the server: {environment}");
    }

    // The agent's own environment (its Bash tool runs `env`): its credential's `env`, nothing
    // of the gateway's.
    let events = server.chat("agent-env", "printenv tool").await;
    let result = events.iter().find(|e| e["type"] == "tool-result").unwrap_or_else(|| panic!("a result: {events:?}"));
    let environment = result["content"].as_str().unwrap();
    assert!(environment.contains("ANTHROPIC_BASE_URL="), "the agent printed its environment: {result}");
    for secret in ["gateway-only-4c1d", "DISPATCH_TEST_GATEWAY_SECRET", "DISPATCH_REQUIRE"] {
        assert!(!environment.contains(secret), "{secret} reached the agent: {environment}");
    }
    server.stop().await;
}
