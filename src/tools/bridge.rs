//! The gateway's own MCP endpoint for agent programs (Claude Code, programs of the gateway's
//! dialect): they get the configured servers through it, never the servers' commands.
//!
//! Why a bridge: handed a server's command, an agent starts it itself, with its own
//! environment (the gateway's, secrets included), and sees every tool the server lists, so the
//! operator's `tools` allow-list would bind only the `openai` loop. Through the bridge an agent
//! gets exactly what that loop gets: the servers run as the gateway's children in a clean
//! environment, `tools/list` answers the allow-list, `tools/call` refuses anything else, and a
//! url server's token stays in the gateway.
//!
//! It listens on an ephemeral loopback port, started at the first agent that needs it, and
//! speaks MCP's Streamable HTTP as a stateless server answering JSON (each POST one JSON-RPC
//! message, its answer one JSON document; no session, no server-sent stream). Each agent
//! process gets a [`Pass`]: a random token (in its environment, never its arguments) that
//! names its conversation, folder and servers, and is withdrawn when the process ends. A
//! request without a live token, or with an `Origin` (a browser's, not an agent's), is refused.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use http::{Method, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{SEPARATOR, Toolbox};

/// The variable that carries an agent's token: its MCP configuration names it as
/// `${DISPATCH_MCP_TOKEN}`, which Claude Code expands from its environment.
pub const TOKEN_VARIABLE: &str = "DISPATCH_MCP_TOKEN";

/// The largest request an agent may send (a call's arguments): the SDK's own bound on a
/// server's message.
const MOST_REQUEST: usize = 16 * 1024 * 1024;

/// The protocol versions this endpoint speaks, newest first: a client asking for another gets
/// the newest, as the protocol says.
const VERSIONS: [&str; 3] = ["2025-06-18", "2025-03-26", "2024-11-05"];

/// What a pass lets its agent reach.
struct Grant {
    conversation: String,
    folder: Option<PathBuf>,
    servers: Vec<String>,
}

pub(super) struct Bridge {
    addr: SocketAddr,
    grants: Mutex<HashMap<String, Arc<Grant>>>,
}

/// An agent process's way in: its MCP configuration and token. Dropping it (the process
/// ended) withdraws the token.
pub struct Pass {
    token: String,
    config: Value,
    bridge: Arc<Bridge>,
}

impl Pass {
    /// `{"mcpServers": {name: {"type": "http", "url": ..., "headers": ...}}}`, as Claude Code's
    /// `--mcp-config` reads it; the token goes as `${DISPATCH_MCP_TOKEN}`.
    pub fn config(&self) -> &Value {
        &self.config
    }

    /// The token, for the agent's environment as [`TOKEN_VARIABLE`].
    pub fn token(&self) -> &str {
        &self.token
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        self.bridge.grants.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.token);
    }
}

impl std::fmt::Debug for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pass").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Bridge {
    /// Listens on an ephemeral loopback port and serves until `closing` fires.
    pub(super) fn start(
        toolbox: Weak<Toolbox>,
        tasks: &TaskTracker,
        closing: CancellationToken,
    ) -> std::io::Result<Arc<Bridge>> {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let bridge = Arc::new(Bridge { addr, grants: Mutex::default() });
        let served = bridge.clone();
        let connections = tasks.clone();
        tasks.spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(accepted) => accepted,
                        Err(e) => {
                            tracing::warn!(error = %e, "the MCP bridge could not accept a connection");
                            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                    _ = closing.cancelled() => return,
                };
                let (bridge, toolbox, closing) = (served.clone(), toolbox.clone(), closing.clone());
                connections.spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        let (bridge, toolbox) = (bridge.clone(), toolbox.clone());
                        async move { Ok::<_, std::convert::Infallible>(bridge.answer(request, &toolbox).await) }
                    });
                    let connection =
                        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
                    tokio::select! {
                        _ = connection => {}
                        _ = closing.cancelled() => {}
                    }
                });
            }
        });
        tracing::debug!(%addr, "the MCP bridge for agent programs listens");
        Ok(bridge)
    }

    /// A pass for an agent of `conversation` working in `folder`, reaching `servers`.
    pub(super) fn pass(self: &Arc<Self>, servers: &[String], conversation: &str, folder: Option<PathBuf>) -> Pass {
        let token = random_token();
        let mut entries = serde_json::Map::new();
        for server in servers {
            let url = format!("http://{}/mcp/{server}", self.addr);
            let headers = json!({"Authorization": format!("Bearer ${{{TOKEN_VARIABLE}}}")});
            entries.insert(server.clone(), json!({"type": "http", "url": url, "headers": headers}));
        }
        let grant = Grant { conversation: conversation.to_owned(), folder, servers: servers.to_vec() };
        self.grants.lock().unwrap_or_else(|p| p.into_inner()).insert(token.clone(), Arc::new(grant));
        Pass { token, config: json!({"mcpServers": entries}), bridge: self.clone() }
    }

    async fn answer(
        &self,
        request: hyper::Request<hyper::body::Incoming>,
        toolbox: &Weak<Toolbox>,
    ) -> hyper::Response<Full<Bytes>> {
        // An agent sends no Origin; a page that found the port does.
        if request.headers().contains_key(header::ORIGIN) {
            return refusal(StatusCode::FORBIDDEN, "the MCP bridge is for agent programs, not web pages");
        }
        let token = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        let grant = self.grants.lock().unwrap_or_else(|p| p.into_inner()).get(token).cloned();
        let Some(grant) = grant else {
            return refusal(StatusCode::UNAUTHORIZED, "no valid token: the agent's pass is missing or withdrawn");
        };
        let server = request.uri().path().strip_prefix("/mcp/").unwrap_or_default().to_owned();
        if !grant.servers.contains(&server) {
            return refusal(StatusCode::NOT_FOUND, "no such MCP server for this agent");
        }
        if request.method() != Method::POST {
            // No server-sent stream: the protocol lets a server answer GET with 405.
            return refusal(StatusCode::METHOD_NOT_ALLOWED, "POST one JSON-RPC message");
        }
        let body = match Limited::new(request.into_body(), MOST_REQUEST).collect().await {
            Ok(body) => body.to_bytes(),
            Err(_) => return refusal(StatusCode::PAYLOAD_TOO_LARGE, "a request of at most 16 MiB"),
        };
        let Ok(message) = serde_json::from_slice::<Value>(&body) else {
            return rpc(json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": "not JSON"}}));
        };
        // A notification (no id) or a response to nothing it asked: accepted, nothing to say.
        let Some(id) = message.get("id").cloned().filter(|_| message.get("method").is_some()) else {
            return hyper::Response::builder().status(StatusCode::ACCEPTED).body(Full::default()).expect("a response");
        };
        let Some(toolbox) = toolbox.upgrade() else {
            return refusal(StatusCode::SERVICE_UNAVAILABLE, "the gateway is shutting down");
        };
        let params = message.get("params").cloned().unwrap_or(Value::Null);
        let outcome = match message["method"].as_str().unwrap_or_default() {
            "initialize" => Ok(initialized(&params)),
            "ping" => Ok(json!({})),
            "tools/list" => Ok(json!({"tools": list(&toolbox, &grant, &server).await})),
            "tools/call" => call(&toolbox, &grant, &server, &params).await,
            other => Err((-32601, format!("no method `{other}` here: this endpoint serves tools"))),
        };
        rpc(match outcome {
            Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
            Err((code, message)) => json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}),
        })
    }
}

fn initialized(params: &Value) -> Value {
    let asked = params.get("protocolVersion").and_then(Value::as_str);
    let version = VERSIONS.iter().find(|v| Some(**v) == asked).unwrap_or(&VERSIONS[0]);
    json!({
        "protocolVersion": version,
        "capabilities": {"tools": {}},
        "serverInfo": {"name": "dispatch-gateway", "version": env!("CARGO_PKG_VERSION")},
    })
}

/// The server's tools as the `openai` loop lists them (allow-list applied), by their own names.
async fn list(toolbox: &Arc<Toolbox>, grant: &Grant, server: &str) -> Vec<Value> {
    let tools = toolbox.for_turn(&[server.to_owned()], &grant.conversation, grant.folder.as_deref()).await;
    tools
        .listed()
        .map(|(name, description, schema)| {
            let name = name.strip_prefix(server).and_then(|n| n.strip_prefix(SEPARATOR)).unwrap_or(name);
            let mut tool = json!({"name": name, "inputSchema": schema});
            if let Some(description) = description {
                tool["description"] = json!(description);
            }
            tool
        })
        .collect()
}

/// A call, run as the `openai` loop runs one: a tool outside the allow-list is no tool.
async fn call(toolbox: &Arc<Toolbox>, grant: &Grant, server: &str, params: &Value) -> Result<Value, (i64, String)> {
    let Some(name) = params.get("name").and_then(Value::as_str) else {
        return Err((-32602, "tools/call needs a `name`".into()));
    };
    let tools = toolbox.for_turn(&[server.to_owned()], &grant.conversation, grant.folder.as_deref()).await;
    let arguments = params.get("arguments").cloned().unwrap_or(Value::Null);
    // Progress goes nowhere: the agent reports its calls itself.
    let (progress, _) = tokio::sync::mpsc::channel(1);
    let cancel = CancellationToken::new();
    let _cancel = cancel.clone().drop_guard();
    let outcome = tools.call(&format!("{server}{SEPARATOR}{name}"), &arguments, progress, &cancel).await;
    Ok(json!({"content": [{"type": "text", "text": outcome.content}], "isError": outcome.is_error}))
}

fn rpc(body: Value) -> hyper::Response<Full<Bytes>> {
    hyper::Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("a response")
}

fn refusal(status: StatusCode, why: &str) -> hyper::Response<Full<Bytes>> {
    let mut response = rpc(json!({"error": why}));
    *response.status_mut() = status;
    response
}

/// 32 random bytes as hex: a token nobody guesses.
fn random_token() -> String {
    let mut bytes = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes).expect("the system's random numbers");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
