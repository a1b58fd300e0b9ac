//! Tools for every model (docs/tools.md): real MCP servers from the registries (the reference
//! `server-everything` and `server-filesystem` from npm, a server made with the `mcp` package
//! from PyPI over Streamable HTTP and stdio), a fake OpenAI upstream that asks for the calls,
//! and the gateway running the agent loop between them.
//!
//! `.ci/run` installs the servers and sets `DISPATCH_TEST_MCP_BIN` (npm's `.bin` folder) and
//! `DISPATCH_TEST_MCP_PYTHON` (a Python with `mcp`); without them the tests are skipped, unless
//! `DISPATCH_REQUIRE_MCP` is set.

mod bounds;
#[path = "../common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::upstream::{FakeUpstream, Reply};
use common::{TestServer, eventually, test_config, types};
use dispatch_gateway::Config;
use dispatch_gateway::config::{Credential, McpScope, McpServer, OpenAiCredential};
use serde_json::{Value, json};

/// npm's `.bin` folder with the reference servers, and a Python with `mcp`.
fn servers() -> Option<(PathBuf, PathBuf)> {
    let bin = std::env::var_os("DISPATCH_TEST_MCP_BIN").map(PathBuf::from);
    let python = std::env::var_os("DISPATCH_TEST_MCP_PYTHON").map(PathBuf::from);
    match (bin, python) {
        (Some(bin), Some(python)) => Some((bin, python)),
        _ => {
            assert!(std::env::var_os("DISPATCH_REQUIRE_MCP").is_none(), "the MCP servers are required");
            eprintln!("skipped: set DISPATCH_TEST_MCP_BIN and DISPATCH_TEST_MCP_PYTHON (.ci/run installs them)");
            None
        }
    }
}

fn script() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tools/server.py").to_string_lossy().into_owned()
}

fn stdio(command: impl Into<String>, args: &[&str], scope: McpScope) -> McpServer {
    let scope = if scope == McpScope::Shared { "shared" } else { "conversation" };
    let server = json!({"command": command.into(), "args": args, "scope": scope, "startup_timeout_secs": 30, "call_timeout_secs": 30});
    serde_json::from_value(server).unwrap()
}

/// The Python server over Streamable HTTP on a free port, behind the token `token`.
struct HttpServer {
    child: tokio::process::Child,
    url: String,
}

impl HttpServer {
    async fn start(python: &Path, token: &str) -> HttpServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = tokio::process::Command::new(python)
            .args([script(), "http".into(), port.to_string(), token.into()])
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let up = eventually(200, || async move { tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() });
        assert!(up.await, "the Python MCP server did not listen");
        HttpServer { child, url: format!("http://127.0.0.1:{port}/mcp") }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// A config with the credential `up` on `upstream`, using `servers`.
fn config(dir: &Path, upstream: &FakeUpstream, servers: Vec<(&str, McpServer)>) -> Config {
    let mut config = test_config(dir);
    let names = servers.iter().map(|(n, _)| n.to_string()).collect();
    config.mcp = servers.into_iter().map(|(n, s)| (n.to_owned(), s)).collect();
    config.credentials.insert(
        "up".into(),
        Credential::Openai(OpenAiCredential {
            base_url: upstream.base_url(),
            api_key_env: None,
            models: vec!["m".into()],
            headers: Default::default(),
            connect_timeout_secs: 5,
            idle_timeout_secs: 30,
            system_prompt: None,
            context_window: None,
            params: Default::default(),
            model_params: Default::default(),
            mcp: names,
            max_steps: 8,
            max_parallel_tools: 4,
            max_tool_calls: 16,
        }),
    );
    config
}

/// A step whose model asks for `calls` (id, tool, arguments as written), each streamed in
/// pieces as OpenAI streams them.
fn asks(calls: &[(&str, &str, &str)]) -> Reply {
    let mut chunks = vec![json!({"choices": [{"index": 0, "delta": {"content": "Let me look."}}]})];
    for (i, (id, name, arguments)) in calls.iter().enumerate() {
        let (head, tail) = arguments.split_at(arguments.len() / 2);
        chunks.push(json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "id": id, "type": "function", "function": {"name": name, "arguments": head}}]}}]}));
        chunks.push(json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "function": {"arguments": tail}}]}}]}));
    }
    chunks.push(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}));
    chunks.push(json!({"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 10}}));
    Reply::Stream(chunks)
}

fn says(text: &str) -> Reply {
    Reply::Stream(vec![
        json!({"choices": [{"index": 0, "delta": {"content": text}}]}),
        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    ])
}

/// The tool results of a turn's events, by call id.
fn results(events: &[Value]) -> Vec<(String, String, bool)> {
    events
        .iter()
        .filter(|e| e["type"] == "tool-result")
        .map(|e| {
            let content = e["content"].as_str().unwrap_or_default().to_owned();
            (e["toolCallId"].as_str().unwrap().to_owned(), content, e["isError"] == true)
        })
        .collect()
}

async fn ready(server: &TestServer, name: &str) -> Value {
    let mut last = Value::Null;
    for _ in 0..300 {
        let (status, body) = server.get("/tools").await;
        assert_eq!(status, 200);
        last = body["servers"].as_array().unwrap().iter().find(|s| s["name"] == name).cloned().unwrap();
        if last["state"] == "ready" {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{name} never became ready: {last}");
}

/// The steady case: calls to three real servers (stdio shared, stdio per conversation in its
/// folder, Streamable HTTP with a token) in one step, started as their arguments complete;
/// identical calls run once; progress arrives as `tool-output`; results come after
/// `step-complete` in call order; the next request carries them; the next turn's request
/// rebuilds them from the log.
#[tokio::test]
async fn real_servers_tools_run_in_the_agent_loop() {
    let Some((bin, python)) = servers() else { return };
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    std::fs::write(work.join("note.txt"), "the note's words").unwrap();
    let http = HttpServer::start(&python, "s3cret").await;
    // SAFETY: set before the gateway reads it; nothing else in this test reads it.
    unsafe { std::env::set_var("DISPATCH_TEST_PY_MCP_TOKEN", "s3cret") };
    let upstream = FakeUpstream::start(vec![]).await;
    let note = work.canonicalize().unwrap().join("note.txt");
    let read_note = format!(r#"{{"path": "{}"}}"#, note.display());
    upstream.push(asks(&[
        ("a", "every__echo", r#"{"message": "hi"}"#),
        ("b", "every__echo", r#"{"message":"hi"}"#),
        ("c", "fs__read_text_file", &read_note),
        ("d", "py__shout", r#"{"text": "quiet"}"#),
        ("e", "every__trigger-long-running-operation", r#"{"duration": 1, "steps": 3}"#),
        ("f", "roots__get-roots-list", "{}"),
    ]));
    upstream.push(says("All done."));
    upstream.push(says("Again."));
    let everything = stdio(bin.join("mcp-server-everything").to_string_lossy(), &[], McpScope::Shared);
    // The filesystem server learns its folder from the process's own (`.`, the conversation's
    // folder): from the MCP roots alone, a call right after the start can come before the server
    // has read them (it asks for them once initialized). The roots themselves: `roots`.
    let mut fs = stdio(bin.join("mcp-server-filesystem").to_string_lossy(), &["."], McpScope::Conversation);
    fs.cwd_roots = vec![dir.path().to_owned()];
    let mut roots = stdio(bin.join("mcp-server-everything").to_string_lossy(), &[], McpScope::Conversation);
    roots.cwd_roots = vec![dir.path().to_owned()];
    let py = McpServer {
        command: None,
        url: Some(http.url.clone()),
        token_env: Some("DISPATCH_TEST_PY_MCP_TOKEN".into()),
        scope: None,
        ..stdio("", &[], McpScope::Shared)
    };
    let config = config(dir.path(), &upstream, vec![("every", everything), ("fs", fs), ("py", py), ("roots", roots)]);
    let server = TestServer::start(config).await;
    let every = ready(&server, "every").await;
    assert!(every["tools"].as_array().unwrap().iter().any(|t| t["name"] == "every__echo"), "{every}");
    ready(&server, "py").await;

    let events =
        server.chat_stream(json!({"conversationId": "t1", "message": "look", "cwd": "work"})).await.collect().await;
    let kinds: Vec<&str> =
        types(&events).into_iter().filter(|t| !matches!(*t, "text-delta" | "usage" | "tool-output")).collect();
    let calls = ["tool-call"; 6];
    let results_after = ["tool-result"; 6];
    let step_complete = kinds.iter().position(|t| *t == "step-complete").expect("a step");
    assert_eq!(&kinds[step_complete - 6..step_complete], &calls, "{kinds:?}");
    assert_eq!(&kinds[step_complete + 1..step_complete + 7], &results_after, "{kinds:?}");
    let got = results(&events);
    let ids: Vec<&str> = got.iter().map(|(id, _, _)| id.as_str()).collect();
    assert_eq!(ids, ["a", "b", "c", "d", "e", "f"], "results in call order");
    assert!(got[0].1.contains("hi") && !got[0].2, "{got:?}");
    assert_eq!(got[0].1, got[1].1, "an identical call has the first's result");
    assert!(got[2].1.contains("the note's words") && !got[2].2, "the folder's server read the file: {got:?}");
    assert_eq!(got[3], ("d".into(), "QUIET".into(), false));
    assert!(!got[4].2, "{got:?}");
    let folder = format!("file://{}", work.canonicalize().unwrap().display());
    assert!(got[5].1.contains(&folder), "a conversation server's MCP root is its folder: {got:?}");
    let progress: Vec<&Value> =
        events.iter().filter(|e| e["type"] == "tool-output" && e["toolCallId"] == "e").collect();
    assert!(!progress.is_empty(), "the long operation's progress arrives as tool-output: {events:?}");
    let first_step = events.iter().find(|e| e["type"] == "tool-call").unwrap()["stepId"].clone();
    for e in events.iter().filter(|e| e["type"] == "tool-result") {
        assert_eq!(e["stepId"], first_step, "results belong to their calls' step");
        assert!(e["durationMs"].is_u64(), "{e}");
    }
    let done = events.iter().find(|e| e["type"] == "done").unwrap();
    assert_eq!(done["reason"], "stop", "{done}");

    // The second request: the tools, the assistant's calls and their results.
    let requests = upstream.requests();
    assert_eq!(requests.len(), 2, "two steps");
    let names: Vec<&str> =
        requests[0].body["tools"].as_array().unwrap().iter().map(|t| t["function"]["name"].as_str().unwrap()).collect();
    for name in ["every__echo", "fs__read_text_file", "py__shout"] {
        assert!(names.contains(&name), "{name} offered: {names:?}");
    }
    let messages = requests[1].body["messages"].as_array().unwrap();
    let assistant = &messages[messages.len() - 7];
    assert_eq!(assistant["role"], "assistant");
    assert_eq!(assistant["content"], "Let me look.");
    assert_eq!(assistant["tool_calls"].as_array().unwrap().len(), 6);
    let answered: Vec<&str> =
        messages[messages.len() - 6..].iter().map(|m| m["tool_call_id"].as_str().unwrap()).collect();
    assert_eq!(answered, ["a", "b", "c", "d", "e", "f"]);
    assert_eq!(messages[messages.len() - 3]["content"], "QUIET");

    // Identical calls ran once; the servers' counters say so.
    let metrics = server.metrics().await;
    assert!(metrics.contains(r#"dispatch_tool_calls_total{server="every",tool="echo"} 1"#), "{metrics}");
    assert!(metrics.contains(r#"dispatch_tool_calls_total{server="py",tool="shout"} 1"#), "{metrics}");
    assert!(metrics.contains(r#"dispatch_mcp_server_ready{server="fs"} 1"#), "{metrics}");
    let (_, tools) = server.get("/tools").await;
    let fs_view = tools["servers"].as_array().unwrap().iter().find(|s| s["name"] == "fs").unwrap().clone();
    assert_eq!(fs_view["processes"], 1, "{fs_view}");

    // The next turn sends the calls and results up again, rebuilt from the log.
    let again = server.chat("t1", "and again").await;
    assert_eq!(again.iter().find(|e| e["type"] == "done").unwrap()["reason"], "stop");
    let request = &upstream.requests()[2].body;
    let messages = request["messages"].as_array().unwrap();
    let calls = messages.iter().find(|m| m["tool_calls"].is_array()).expect("the calls from the log");
    assert_eq!(calls["tool_calls"].as_array().unwrap().len(), 6, "{messages:?}");
    let tool_messages = messages.iter().filter(|m| m["role"] == "tool").count();
    assert_eq!(tool_messages, 6, "{messages:?}");
    server.stop().await;
}

/// A server that will not start, one that never finishes `initialize`, one that answers
/// garbage, one that crashes mid-call, a call past `call_timeout_secs`, arguments that are not
/// an object and an unknown tool: each an error result that says why, and the turn goes on.
/// The crashed server is started again.
#[tokio::test]
async fn failures_are_results_that_say_why_and_the_turn_goes_on() {
    let Some((_, python)) = servers() else { return };
    let dir = tempfile::tempdir().unwrap();
    let upstream = FakeUpstream::start(vec![]).await;
    upstream.push(asks(&[
        ("a", "gone__x", "{}"),
        ("b", "mute__x", "{}"),
        ("c", "garbage__x", "{}"),
        ("d", "py__slow", r#"{"seconds": 30}"#),
        ("e", "py__shout", "not json"),
        ("f", "nobody__x", "{}"),
    ]));
    upstream.push(asks(&[("g", "py__crash", "{}")]));
    upstream.push(says("Carried on."));
    let python = python.to_string_lossy().into_owned();
    let mut mute = stdio("sleep", &["1000"], McpScope::Shared);
    mute.startup_timeout_secs = 1;
    let mut garbage = stdio("sh", &["-c", "echo '{not json'; echo 'hello there'; sleep 1000"], McpScope::Shared);
    garbage.startup_timeout_secs = 2;
    let mut py = stdio(python.clone(), &[&script(), "stdio"], McpScope::Shared);
    py.call_timeout_secs = 1;
    let servers = vec![
        ("gone", stdio("/nonexistent/mcp-server", &[], McpScope::Shared)),
        ("mute", mute),
        ("garbage", garbage),
        ("py", py),
    ];
    let server = TestServer::start(config(dir.path(), &upstream, servers)).await;
    ready(&server, "py").await;

    let events = server.chat("f1", "try").await;
    let got = results(&events);
    let said = |id: &str| got.iter().find(|(i, _, _)| i == id).unwrap_or_else(|| panic!("no result for {id}: {got:?}"));
    for (id, says) in [
        ("a", "could not be started"),
        ("b", "startup_timeout_secs"),
        ("c", "`garbage` is not available"),
        ("d", "call_timeout_secs"),
        ("e", "not a JSON object"),
        ("f", "there is no tool `nobody__x`"),
        ("g", "went away during the call"),
    ] {
        let (_, content, is_error) = said(id);
        assert!(*is_error, "{id}: {content}");
        assert!(content.contains(says), "{id} says {says:?}: {content}");
    }
    assert_eq!(events.iter().find(|e| e["type"] == "done").unwrap()["reason"], "stop", "the turn went on");
    assert!(events.iter().any(|e| e["type"] == "text-delta" && e["delta"] == "Carried on."));

    let (_, tools) = server.get("/tools").await;
    let state = |name: &str| tools["servers"].as_array().unwrap().iter().find(|s| s["name"] == name).unwrap().clone();
    assert_eq!(state("gone")["state"], "failed");
    assert!(state("gone")["error"].as_str().unwrap().contains("could not be started"), "{tools}");
    // The crashed server comes back, and its tools work again.
    let back = ready(&server, "py").await;
    assert!(back["tools"].as_array().unwrap().iter().any(|t| t["name"] == "py__shout"));
    upstream.push(asks(&[("h", "py__shout", r#"{"text": "back"}"#)]));
    upstream.push(says("ok"));
    let events = server.chat("f1", "again").await;
    assert_eq!(results(&events), [("h".to_owned(), "BACK".to_owned(), false)]);
    let metrics = server.metrics().await;
    assert!(metrics.contains(r#"dispatch_tool_errors_total{server="py",tool="slow"} 1"#), "{metrics}");
    server.stop().await;
}

/// A stop cancels the calls in flight: their results are `Aborted` errors, the turn ends
/// `done{aborted}`, and the history holds every call with its result.
#[tokio::test]
async fn a_stop_cancels_the_calls_in_flight() {
    let Some((_, python)) = servers() else { return };
    let dir = tempfile::tempdir().unwrap();
    let upstream = FakeUpstream::start(vec![asks(&[("s", "py__slow", r#"{"seconds": 60}"#)])]).await;
    let mut py = stdio(python.to_string_lossy(), &[&script(), "stdio"], McpScope::Shared);
    let marker = dir.path().join("cancelled");
    py.env.insert("DISPATCH_TEST_MCP_CANCELLED".into(), marker.to_string_lossy().into_owned());
    let pidfile = dir.path().join("pid");
    py.env.insert("DISPATCH_TEST_MCP_PIDFILE".into(), pidfile.to_string_lossy().into_owned());
    let server = TestServer::start(config(dir.path(), &upstream, vec![("py", py)])).await;
    ready(&server, "py").await;
    let mut stream = server.chat_stream(json!({"conversationId": "s1", "message": "wait"})).await;
    let mut events = Vec::new();
    // The call is running once its progress arrives.
    while let Some(event) = stream.next_event().await {
        let progress = event["type"] == "tool-output";
        events.push(event);
        if progress {
            break;
        }
    }
    let (_, stopped) = server.post("/conversations/s1/stop", json!({})).await;
    assert_eq!(stopped["abortedTurn"], true);
    events.extend(stream.collect().await);
    assert_eq!(results(&events), [("s".to_owned(), "Aborted".to_owned(), true)], "{events:?}");
    assert_eq!(events.iter().find(|e| e["type"] == "done").unwrap()["reason"], "aborted");
    let history = server.history("s1").await;
    let kinds: Vec<&str> = history.iter().map(|c| c["chunk"]["type"].as_str().unwrap()).collect();
    assert!(kinds.contains(&"tool-call") && kinds.contains(&"tool-result"), "{kinds:?}");
    // The server was told (MCP `notifications/cancelled`): its call stopped.
    assert!(eventually(100, || async { marker.exists() }).await, "the server's call was cancelled");
    upstream.push(asks(&[("t", "py__shout", r#"{"text": "next"}"#)]));
    upstream.push(says("ok"));
    let events = server.chat("s1", "next").await;
    assert_eq!(results(&events), [("t".to_owned(), "NEXT".to_owned(), false)]);

    // A server that says its tools changed is listed again.
    upstream.push(asks(&[("g", "py__grow", "{}")]));
    upstream.push(says("ok"));
    server.chat("s1", "grow").await;
    let grown = eventually(100, || async {
        let (_, tools) = server.get("/tools").await;
        tools.to_string().contains("py__grown")
    });
    assert!(grown.await, "tools/list_changed was followed");

    // The gateway's stop stops the server.
    let pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    server.stop().await;
    // SAFETY: kill(2) with signal 0 only asks whether the process exists.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    assert!(!alive, "the MCP server's process is gone after the gateway stopped");
}

/// Messages queued during a call reach the model before its next step (the reference kernel's
/// steering); `max_steps` ends a turn whose model never stops calling; a result past
/// `--max-tool-result-bytes` is cut, saying so.
#[tokio::test]
async fn steering_step_limit_and_result_cap() {
    let Some((_, python)) = servers() else { return };
    let dir = tempfile::tempdir().unwrap();
    let upstream =
        FakeUpstream::start(vec![asks(&[("s", "py__slow", r#"{"seconds": 1.5}"#)]), says("Heard you.")]).await;
    let py = stdio(python.to_string_lossy(), &[&script(), "stdio"], McpScope::Shared);
    let mut config = config(dir.path(), &upstream, vec![("py", py)]);
    config.max_tool_result_bytes = 1000;
    if let Some(Credential::Openai(c)) = config.credentials.get_mut("up") {
        c.max_steps = 2;
    }
    let server = TestServer::start(config).await;
    ready(&server, "py").await;

    let mut stream = server.chat_stream(json!({"conversationId": "q1", "message": "go"})).await;
    let mut events = Vec::new();
    while let Some(event) = stream.next_event().await {
        let calling = event["type"] == "tool-call";
        events.push(event);
        if calling {
            break;
        }
    }
    let (status, _) = server.post("/conversations/q1/queue", json!({"text": "also this"})).await;
    assert_eq!(status, 200);
    events.extend(stream.collect().await);
    let second = &upstream.requests()[1].body["messages"];
    let last = second.as_array().unwrap().last().unwrap();
    assert_eq!(last, &json!({"role": "user", "content": "also this"}), "steering after the results: {second}");
    assert_eq!(events.iter().find(|e| e["type"] == "done").unwrap()["reason"], "stop");

    upstream.push(asks(&[("b", "py__big", r#"{"size": 5000}"#)]));
    upstream.push(asks(&[("c", "py__shout", r#"{"text": "more"}"#)]));
    let events = server.chat("q2", "loop").await;
    let got = results(&events);
    assert!(got[0].1.len() < 1100 && got[0].1.contains("4000 more bytes left out"), "{got:?}");
    common::turn_error(&events, "max-steps", "max_steps");
    assert_eq!(upstream.requests().len(), 4, "two steps, no third");
    server.stop().await;
}

/// Conversation servers: one process per conversation in its folder, at most `max_processes`
/// (the one idle longest makes room), stopped once idle; a folder outside `cwd_roots` is
/// refused before any server starts.
#[tokio::test]
async fn conversation_servers_are_capped_and_stopped_when_idle() {
    let Some((bin, _)) = servers() else { return };
    let dir = tempfile::tempdir().unwrap();
    let upstream = FakeUpstream::start(vec![says("one"), says("two")]).await;
    // The filesystem server learns its folder from the process's own (`.`, the conversation's
    // folder): from the MCP roots alone, a call right after the start can come before the server
    // has read them (it asks for them once initialized). The roots themselves: `roots`.
    let mut fs = stdio(bin.join("mcp-server-filesystem").to_string_lossy(), &["."], McpScope::Conversation);
    fs.cwd_roots = vec![dir.path().to_owned()];
    let mut roots = stdio(bin.join("mcp-server-everything").to_string_lossy(), &[], McpScope::Conversation);
    roots.cwd_roots = vec![dir.path().to_owned()];
    fs.max_processes = 1;
    fs.idle_timeout_secs = 2;
    let server = TestServer::start(config(dir.path(), &upstream, vec![("fs", fs)])).await;
    let processes = || async {
        let (_, tools) = server.get("/tools").await;
        tools["servers"][0]["processes"].as_u64().unwrap()
    };
    server.chat("p1", "hello").await;
    assert_eq!(processes().await, 1);
    server.chat("p2", "hello").await;
    assert_eq!(processes().await, 1, "max_processes 1: the first conversation's stopped");
    let offered = &upstream.requests()[1].body["tools"];
    assert!(offered.as_array().is_some_and(|t| !t.is_empty()), "the second conversation got its own: {offered}");
    assert!(eventually(100, || async { processes().await == 0 }).await, "stopped once idle");
    let (status, body) = server.post("/chat", json!({"conversationId": "p3", "message": "x", "cwd": "/"})).await;
    assert_eq!(status, 400, "{body}");
    server.stop().await;
}

/// The wire order for a loop turn ("The loop, on the wire" in docs/tools.md), exactly, as the reference web client reads it:
/// a step's batched calls share its `stepId` (live and in the log), their results follow its
/// `step-complete` in call order, and the next step has the next `stepId`.
#[tokio::test]
async fn a_loop_turn_has_the_wire_order_a_client_groups_by_step() {
    let Some((_, python)) = servers() else { return };
    let dir = tempfile::tempdir().unwrap();
    let upstream = FakeUpstream::start(vec![
        asks(&[("a", "py__shout", r#"{"text": "one"}"#), ("b", "py__shout", r#"{"text": "two"}"#)]),
        says("Done."),
    ])
    .await;
    let py = stdio(python.to_string_lossy(), &[&script(), "stdio"], McpScope::Shared);
    let server = TestServer::start(config(dir.path(), &upstream, vec![("py", py)])).await;
    ready(&server, "py").await;
    let events = server.chat("w1", "shout").await;
    let turn_id = events[0]["turnId"].as_str().unwrap().to_owned();
    let (s0, s1) = (format!("{turn_id}#0"), format!("{turn_id}#1"));
    let stripped: Vec<Value> = events
        .iter()
        .map(|e| {
            let mut e = e.as_object().unwrap().clone();
            assert_eq!(e.remove("conversationId").unwrap(), "w1");
            assert_eq!(e.remove("turnId").unwrap(), turn_id.as_str());
            for timing in ["ttftMs", "decodeMs", "genTotalMs", "durationMs"] {
                if let Some(v) = e.remove(timing) {
                    assert!(v.is_u64(), "{timing}: {v}");
                }
            }
            Value::Object(e)
        })
        .collect();
    let call = |id: &str, text: &str| json!({"type": "tool-call", "stepId": s0, "toolCallId": id, "toolName": "py__shout", "input": {"text": text}});
    let result = |id: &str, text: &str| json!({"type": "tool-result", "stepId": s0, "toolCallId": id, "toolName": "py__shout", "content": text, "isError": false});
    assert_eq!(
        stripped,
        vec![
            json!({"type": "user-message", "text": "shout"}),
            json!({"type": "turn-start"}),
            json!({"type": "text-delta", "delta": "Let me look."}),
            call("a", "one"),
            call("b", "two"),
            json!({"type": "usage", "stepId": s0, "usage": {"inputTokens": 50, "outputTokens": 10}}),
            json!({"type": "step-complete", "stepId": s0}),
            result("a", "ONE"),
            result("b", "TWO"),
            json!({"type": "text-delta", "delta": "Done."}),
            json!({"type": "step-complete", "stepId": s1}),
            json!({"type": "done", "reason": "stop", "usage": {"inputTokens": 50, "outputTokens": 10}, "contextSize": 60}),
            json!({"type": "turn-sealed"}),
        ]
    );
    // Each result keeps how long its call ran (timed here, so only its presence is compared).
    let history: Vec<Value> = server
        .history("w1")
        .await
        .into_iter()
        .map(|mut c| {
            if c["chunk"]["type"] == "tool-result" {
                let ran = c["chunk"].as_object_mut().unwrap().remove("durationMs");
                assert!(ran.is_some_and(|ms| ms.is_u64()), "a stored result's duration: {c}");
            }
            json!([c["role"], c["chunk"]])
        })
        .collect();
    let logged_call = |id: &str, text: &str| json!(["assistant", {"type": "tool-call", "toolCallId": id, "toolName": "py__shout", "input": {"text": text}, "stepId": s0}]);
    let logged_result = |id: &str, text: &str| json!(["tool", {"type": "tool-result", "toolCallId": id, "toolName": "py__shout", "content": text, "isError": false, "stepId": s0}]);
    assert_eq!(
        history,
        vec![
            json!(["user", {"type": "text", "text": "shout"}]),
            json!(["assistant", {"type": "text", "text": "Let me look."}]),
            logged_call("a", "one"),
            logged_call("b", "two"),
            logged_result("a", "ONE"),
            logged_result("b", "TWO"),
            json!(["assistant", {"type": "text", "text": "Done."}]),
        ]
    );
    server.stop().await;
}

/// A call starts as soon as its arguments are complete in the stream, not when the step ends:
/// the first call's progress arrives while the model is still writing the second call.
#[tokio::test]
async fn a_call_starts_while_the_step_still_streams() {
    let Some((_, python)) = servers() else { return };
    let dir = tempfile::tempdir().unwrap();
    let data = |value: Value| format!("data: {value}\n\n");
    let first = [
        data(json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "a", "type": "function", "function": {"name": "py__slow", "arguments": "{\"seconds\": 0.3}"}}]}}]})),
        data(json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 1, "id": "b", "type": "function", "function": {"name": "py__shout", "arguments": "{\"text\":"}}]}}]})),
    ]
    .concat();
    let rest = [
        data(json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "function": {"arguments": " \"x\"}"}}]}}]})),
        data(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})),
        "data: [DONE]\n\n".to_owned(),
    ]
    .concat();
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    let upstream = FakeUpstream::start(vec![
        Reply::Drip(vec![(Duration::ZERO, format!("{head}{first}")), (Duration::from_millis(2000), rest)]),
        says("ok"),
    ])
    .await;
    let py = stdio(python.to_string_lossy(), &[&script(), "stdio"], McpScope::Shared);
    let server = TestServer::start(config(dir.path(), &upstream, vec![("py", py)])).await;
    ready(&server, "py").await;
    let events = server.chat("e1", "eager").await;
    let at = |matches: &dyn Fn(&Value) -> bool| events.iter().position(matches);
    let progress = at(&|e| e["type"] == "tool-output" && e["toolCallId"] == "a").expect("a's progress");
    let second = at(&|e| e["type"] == "tool-call" && e["toolCallId"] == "b").expect("b's call");
    assert!(progress < second, "the first call ran while the second was still being written: {events:?}");
    let got = results(&events);
    assert_eq!(got.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(got[1].1, "X");
    server.stop().await;
}
