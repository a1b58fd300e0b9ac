//! An agent program of the gateway's dialect with MCP servers: it reaches them only through
//! the gateway's MCP endpoint named in `DISPATCH_MCP_CONFIG`, with its token in
//! `DISPATCH_MCP_TOKEN`, and gets the server's allow-list and nothing of the gateway's
//! environment. The server is the test's Python MCP server (`tests/tools/server.py`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::common::TestServer;
use super::{agent, config_with, turn};
use dispatch_gateway::config::{Credential, Dialect};
use serde_json::{Value, json};

/// Lists the server's tools, calls `shout`, `slow` (not allowed) and `environment` through the
/// endpoint, reads its own environment, and says all of it as one JSON text; a request with a
/// wrong token or an Origin says what it got.
const TOOL_USER: &str = r#"
import json, os, sys, urllib.request, urllib.error

config = json.loads(os.environ["DISPATCH_MCP_CONFIG"])["mcpServers"]["py"]
token = os.environ["DISPATCH_MCP_TOKEN"]

def rpc(method, params, token=token, origin=None, raw=None):
    body = raw if raw is not None else json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).encode()
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
    headers["authorization"] = config["headers"]["Authorization"].replace("${DISPATCH_MCP_TOKEN}", token)
    if origin:
        headers["origin"] = origin
    request = urllib.request.Request(config["url"], data=body, headers=headers)
    try:
        with urllib.request.urlopen(request) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": json.loads(e.read())}

def emit(**e):
    sys.stdout.write(json.dumps(e) + "\n")
    sys.stdout.flush()

for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("type") == "interrupt":
        continue
    said = {
        "config": config,
        "initialize": rpc("initialize", {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}),
        "tools": [t["name"] for t in rpc("tools/list", {})["result"]["tools"]],
        "shout": rpc("tools/call", {"name": "shout", "arguments": {"text": "hi"}})["result"],
        "slow": rpc("tools/call", {"name": "slow", "arguments": {"seconds": 0.1}})["result"],
        "environment": rpc("tools/call", {"name": "environment", "arguments": {}})["result"]["content"][0]["text"],
        "wrong_token": rpc("tools/list", {}, token="0" * 64),
        "origin": rpc("tools/list", {}, origin="http://127.0.0.1:9"),
        "malformed": rpc("", {}, raw=b"{not json"),
        "unknown": rpc("resources/list", {}),
        "too_big": rpc("", {}, raw=b"[" + b" " * (17 * 1024 * 1024) + b"]"),
        "own": sorted(os.environ),
    }
    # Where its pass lets it in, for the test to try once the process is gone.
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pass.json"), "w") as f:
        json.dump({"url": config["url"], "token": token}, f)
    emit(type="step_start")
    emit(type="text", delta=json.dumps(said))
    emit(type="step_end")
    emit(type="done", reason="stop")
"#;

#[tokio::test]
async fn an_agent_program_gets_the_allowed_tools_through_the_gateway_and_no_secrets() {
    let Some(python) = std::env::var_os("DISPATCH_TEST_MCP_PYTHON") else {
        assert!(std::env::var_os("DISPATCH_REQUIRE_MCP").is_none(), "a Python with `mcp` is required");
        eprintln!("skipped: set DISPATCH_TEST_MCP_PYTHON (.ci/run installs it)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let script = agent(dir.path(), "tool_user.py", TOOL_USER);
    let mut config = config_with(dir.path(), &script, Dialect::Ndjson, 600);
    let server_py = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/tools/server.py");
    let py =
        json!({"command": python.to_string_lossy(), "args": [server_py, "stdio"], "tools": ["shout", "environment"]});
    config.mcp.insert("py".into(), serde_json::from_value(py).unwrap());
    if let Some(Credential::Command(c)) = config.credentials.get_mut("agent") {
        c.mcp = vec!["py".into()];
        c.env = BTreeMap::from([("AGENT_SETTING".to_owned(), "given".to_owned())]);
    }
    // A secret of the gateway's own, as an upstream key would be.
    // SAFETY: set before the gateway starts; no other thread of this test reads the environment.
    unsafe { std::env::set_var("DISPATCH_TEST_AGENT_SECRET", "gateway-only-7e2a") };
    let server = TestServer::start(config).await;
    let events = turn(&server, "tools", "go").await;
    let text: String =
        events.iter().filter(|e| e["type"] == "text-delta").map(|e| e["delta"].as_str().unwrap()).collect();
    let said: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("the agent's report: {events:?}"));

    assert_eq!(said["config"]["type"], "http", "the gateway's endpoint, not the server's command: {said}");
    assert!(said["config"]["url"].as_str().unwrap().starts_with("http://127.0.0.1:"), "{said}");
    assert_eq!(said["initialize"]["result"]["capabilities"], json!({"tools": {}}), "{said}");
    assert_eq!(said["tools"], json!(["shout", "environment"]), "only the allow-list, in the server's order");
    assert_eq!(said["shout"]["content"][0]["text"], "HI");
    assert_eq!(said["slow"]["isError"], true, "not callable: {said}");
    assert!(said["slow"]["content"][0]["text"].as_str().unwrap().contains("no tool"), "{said}");
    assert_eq!(said["wrong_token"]["status"], 401, "{said}");
    assert!(said["wrong_token"]["body"]["error"].is_string(), "{said}");
    assert_eq!(said["origin"]["status"], 403, "a page's request: {said}");

    let environment = said["environment"].as_str().unwrap();
    assert!(environment.contains("PATH="), "{environment}");
    let own: Vec<&str> = said["own"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    for (what, text) in [("the server", environment.to_owned()), ("the agent", own.join("\n"))] {
        for secret in ["gateway-only-7e2a", "DISPATCH_TEST_AGENT_SECRET", "DISPATCH_REQUIRE", "CARGO"] {
            assert!(!text.contains(secret), "{secret} reached {what}: {text}");
        }
    }
    assert!(own.contains(&"AGENT_SETTING"), "the credential's env: {own:?}");
    // Hostile requests with a live token: each a clear answer, the endpoint still serving.
    assert_eq!(said["malformed"]["error"]["code"], -32700, "{said}");
    assert_eq!(said["unknown"]["error"]["code"], -32601, "{said}");
    assert_eq!(said["too_big"]["status"], 413, "{said}");
    assert!(said["too_big"]["body"]["error"].is_string(), "{said}");

    // The pass goes with its process: once the conversation (and its agent) is deleted, its
    // token lets nothing in.
    let pass: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("pass.json")).unwrap()).unwrap();
    let list = |token: String| {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"});
        let request = server.client.post(pass["url"].as_str().unwrap()).bearer_auth(token).json(&body);
        async move { request.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(list(pass["token"].as_str().unwrap().to_owned()).await, 200, "live while its process runs");
    let (status, _) = server.delete("/conversations/tools").await;
    assert_eq!(status, 204);
    let mut answered = 0;
    for _ in 0..100 {
        answered = list(pass["token"].as_str().unwrap().to_owned()).await;
        if answered == 401 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(answered, 401, "the token of a process that ended");
    server.stop().await;
}
