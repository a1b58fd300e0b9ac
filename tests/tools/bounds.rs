//! The agent loop's bounds (docs/tools.md, "The loop's bounds"): calls per step, the bytes a
//! request carries, the bytes a step streams, and arguments that are not JSON going back up as
//! JSON. The fake upstream refuses a request whose tool call arguments are not JSON, as
//! llama-server does.

use serde_json::{Value, json};

use super::common::upstream::{FakeUpstream, Reply};
use super::common::{self, TestServer};
use super::{asks, config, ready, results, says, script, servers, stdio};
use dispatch_gateway::config::{Credential, McpScope};

/// Five calls in one step with `max_tool_calls = 3`: three run, two are answered with an error
/// result that says why, and the turn goes on.
#[tokio::test]
async fn calls_past_max_tool_calls_are_answered_not_run() {
    let Some((_, python)) = servers() else { return };
    let dir = tempfile::tempdir().unwrap();
    let calls: Vec<(String, String)> =
        (0..5).map(|i| (format!("c{i}"), format!(r#"{{"text": "call {i}"}}"#))).collect();
    let asked: Vec<(&str, &str, &str)> =
        calls.iter().map(|(id, args)| (id.as_str(), "py__shout", args.as_str())).collect();
    let upstream = FakeUpstream::start(vec![asks(&asked), says("Done.")]).await;
    let py = stdio(python.to_string_lossy(), &[&script(), "stdio"], McpScope::Shared);
    let mut config = config(dir.path(), &upstream, vec![("py", py)]);
    if let Some(Credential::Openai(c)) = config.credentials.get_mut("up") {
        c.max_tool_calls = 3;
    }
    let server = TestServer::start(config).await;
    ready(&server, "py").await;
    let events = server.chat("many", "call five").await;
    let got = results(&events);
    assert_eq!(got.len(), 5, "every call is answered: {got:?}");
    for (i, (_, content, is_error)) in got.iter().enumerate().take(3) {
        assert_eq!((content.as_str(), *is_error), (format!("CALL {i}").as_str(), false), "{got:?}");
    }
    for (_, content, is_error) in &got[3..] {
        assert!(*is_error && content.contains("max_tool_calls"), "not run, and why: {got:?}");
    }
    assert_eq!(events.iter().find(|e| e["type"] == "done").unwrap()["reason"], "stop");
    let second = &upstream.requests()[1].body["messages"];
    let answers = second.as_array().unwrap().iter().filter(|m| m["role"] == "tool").count();
    assert_eq!(answers, 5, "each call has its answer upstream: {second}");
    server.stop().await;
}

/// Results larger together than `--max-runtime-request-bytes`: every request stays within the
/// bound, older results replaced by a note that says what was left out, the newest kept.
#[tokio::test]
async fn every_request_of_a_loop_stays_within_the_request_bound() {
    let Some((_, python)) = servers() else { return };
    let dir = tempfile::tempdir().unwrap();
    const BOUND: usize = 64 * 1024;
    let upstream = FakeUpstream::start(vec![
        asks(&[("a", "py__big", r#"{"size": 30000}"#), ("b", "py__big", r#"{"size": 30001}"#)]),
        asks(&[("c", "py__big", r#"{"size": 30002}"#), ("d", "py__big", r#"{"size": 30003}"#)]),
        asks(&[("e", "py__shout", r#"{"text": "last"}"#)]),
        says("Read them all."),
    ])
    .await;
    let py = stdio(python.to_string_lossy(), &[&script(), "stdio"], McpScope::Shared);
    let mut config = config(dir.path(), &upstream, vec![("py", py)]);
    config.max_runtime_request_bytes = BOUND as u64;
    let server = TestServer::start(config).await;
    ready(&server, "py").await;
    let events = server.chat("large", "read the big ones").await;
    assert_eq!(events.iter().find(|e| e["type"] == "done").unwrap()["reason"], "stop", "{:?}", results(&events));
    let requests = upstream.requests();
    assert_eq!(requests.len(), 4);
    for (i, request) in requests.iter().enumerate() {
        let messages = request.body["messages"].to_string().len();
        assert!(messages <= BOUND, "request {i} carries {messages} bytes of messages, over {BOUND}");
    }
    let last = requests[3].body["messages"].as_array().unwrap().clone();
    let tool =
        |id: &str| last.iter().find(|m| m["tool_call_id"] == id).unwrap()["content"].as_str().unwrap().to_owned();
    assert!(tool("a").contains("bytes left out of this request"), "the oldest result is a note: {}", tool("a"));
    assert_eq!(tool("d").len(), 30003, "the newest large result goes up whole");
    assert_eq!(tool("e"), "LAST");
    server.stop().await;
}

/// A step that streams more text than `--max-step-bytes` (each event under the per-event
/// bound), and one whose call's arguments pass it: the turn ends with `upstream`, saying why.
#[tokio::test]
async fn a_step_past_max_step_bytes_ends_the_turn() {
    let dir = tempfile::tempdir().unwrap();
    let kib = "k".repeat(1024);
    let mut text: Vec<Value> =
        (0..100).map(|_| json!({"choices": [{"index": 0, "delta": {"content": kib}}]})).collect();
    text.push(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}));
    let mut arguments = vec![json!({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "big", "type": "function", "function": {"name": "py__shout", "arguments": "{\"text\": \""}}]}}]})];
    for _ in 0..100 {
        arguments.push(json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": kib}}]}}]}));
    }
    let upstream = FakeUpstream::start(vec![Reply::Stream(text), Reply::Stream(arguments)]).await;
    let mut config = config(dir.path(), &upstream, Vec::new());
    config.max_step_bytes = 64 * 1024;
    let server = TestServer::start(config).await;
    let events = server.chat("text", "talk a lot").await;
    common::turn_error(&events, "upstream", "--max-step-bytes");
    let streamed: usize =
        events.iter().filter(|e| e["type"] == "text-delta").map(|e| e["delta"].as_str().unwrap().len()).sum();
    assert!(streamed <= 64 * 1024, "no more than the bound reached watchers: {streamed}");
    let events = server.chat("arguments", "call with a lot").await;
    common::turn_error(&events, "upstream", "--max-step-bytes");
    server.stop().await;
}

/// A call cut mid-arguments (`max_tokens`): answered with an error result, and its arguments
/// go back up as JSON (a string), so an upstream that parses them takes the request and the
/// turn goes on.
#[tokio::test]
async fn a_cut_call_goes_back_up_as_json() {
    let Some((_, python)) = servers() else { return };
    let dir = tempfile::tempdir().unwrap();
    let upstream = FakeUpstream::start(vec![asks(&[("cut", "py__shout", r#"{"text":"#)]), says("Trying again.")]).await;
    let py = stdio(python.to_string_lossy(), &[&script(), "stdio"], McpScope::Shared);
    let server = TestServer::start(config(dir.path(), &upstream, vec![("py", py)])).await;
    ready(&server, "py").await;
    let events = server.chat("cut", "shout").await;
    let got = results(&events);
    assert!(got[0].2 && got[0].1.contains("not a JSON object"), "{got:?}");
    assert_eq!(events.iter().find(|e| e["type"] == "done").unwrap()["reason"], "stop", "{events:?}");
    let second = &upstream.requests()[1].body["messages"];
    let call = second.as_array().unwrap().iter().find_map(|m| m["tool_calls"].get(0)).unwrap();
    assert_eq!(call["function"]["arguments"], json!(r#"{"text":"#).to_string(), "as the history rebuild sends it");
    server.stop().await;
}
