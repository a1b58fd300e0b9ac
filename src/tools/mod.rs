//! Tools for every model (docs/tools.md): the MCP servers the configuration names, and what a turn
//! needs of them: the tool definitions its model gets and a way to call them.
//!
//! A `shared` server has one client for the gateway, started with it in the background. A
//! `conversation` server has one process per conversation, started in the conversation's
//! folder at its first turn, stopped once idle or when the server's `max_processes` needs room.
//! Tools are named `<server>__<tool>` for the model. Nothing here blocks a turn on a dead
//! server: a server that is not ready gives no tools, and a call to it an error result.

mod bridge;
mod content;
mod server;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use self::bridge::{Pass, TOKEN_VARIABLE};
pub use self::content::{capped, result_text};
use self::server::{Connection, State};
use crate::config::{McpScope, McpServer};

/// Between a server's name and its tool's in the name the model sees.
const SEPARATOR: &str = "__";

/// The longest tool name OpenAI's API takes (`^[a-zA-Z0-9_-]{1,64}$`).
const MOST_NAME: usize = 64;

/// Whether `name` is a tool name the OpenAI API takes.
fn valid_name(name: &str) -> bool {
    (1..=MOST_NAME).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Why a server's configuration stops the start.
pub fn check_server(name: &str, spec: &McpServer) -> Result<(), String> {
    if !valid_name(&format!("{name}{SEPARATOR}x")) {
        return Err(
            "a server name of letters, digits, `_` and `-`, short enough that `<server>__<tool>` fits 64 characters"
                .into(),
        );
    }
    match (&spec.command, &spec.url) {
        (Some(_), Some(_)) => return Err("`command` and `url` are both set: a server is one or the other".into()),
        (None, None) => return Err("set `command` (a stdio server) or `url` (a Streamable HTTP server)".into()),
        (None, Some(url)) if !(url.starts_with("http://") || url.starts_with("https://")) => {
            return Err(format!("`url` {url:?} is not an http:// or https:// URL"));
        }
        (None, Some(_)) if spec.scope() == McpScope::Conversation => {
            return Err("a url server is `shared`: it has no folder to start in".into());
        }
        _ => {}
    }
    if let Some(var) = &spec.token_env
        && std::env::var(var).is_err()
    {
        return Err(format!("the environment variable {var} (token_env) is not set"));
    }
    for tool in spec.tools.iter().flatten() {
        if !valid_name(&format!("{name}{SEPARATOR}{tool}")) {
            return Err(format!("the tool name `{name}{SEPARATOR}{tool}` does not fit `^[a-zA-Z0-9_-]{{1,64}}$`"));
        }
    }
    Ok(())
}

/// Calls, errors and time per server and tool (`/metrics`).
#[derive(Debug, Clone, Default)]
pub struct ToolStats {
    pub calls: u64,
    pub errors: u64,
    pub seconds: f64,
}

/// One configured server: its shared client, or its conversations' processes.
struct Server {
    name: String,
    spec: Arc<McpServer>,
    /// Canonical roots a conversation's folder must lie in.
    roots: Vec<PathBuf>,
    /// The shared client (`shared` servers, once [`Toolbox::start`]ed).
    shared: std::sync::OnceLock<Arc<Connection>>,
    conversations: Mutex<HashMap<String, Arc<Connection>>>,
    stats: Mutex<BTreeMap<String, ToolStats>>,
}

/// Every configured MCP server.
pub struct Toolbox {
    servers: BTreeMap<String, Arc<Server>>,
    max_result: usize,
    tasks: TaskTracker,
    closing: CancellationToken,
    /// The MCP endpoint for agent programs, listening once the first one needs it.
    bridge: Mutex<Option<Arc<bridge::Bridge>>>,
}

/// What `GET /tools` says of one server.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ServerView {
    pub name: String,
    /// `stdio` or `http`.
    pub transport: &'static str,
    /// `shared` or `conversation`.
    pub scope: &'static str,
    /// `starting`, `ready`, `failed` or `stopped`; for a conversation server, its shared view
    /// is `ready` when any conversation's process is, else what the last one started says
    /// (`idle` when none runs).
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Processes running (conversation servers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub processes: Option<usize>,
    pub tools: Vec<ToolView>,
}

#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ToolView {
    /// The name the model calls it by: `<server>__<tool>`.
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub input_schema: Value,
}

impl Toolbox {
    /// The configured servers, none started yet.
    pub fn new(specs: &BTreeMap<String, McpServer>, max_result: usize) -> Toolbox {
        let servers = specs
            .iter()
            .map(|(name, spec)| {
                let spec = Arc::new(spec.clone());
                let mut roots = spec.cwd_roots.clone();
                if roots.is_empty() {
                    roots.extend(std::env::current_dir().ok());
                }
                let roots = crate::folders::canonical_roots(&roots, name);
                let server = Server {
                    name: name.clone(),
                    spec,
                    roots,
                    shared: Default::default(),
                    conversations: Mutex::default(),
                    stats: Mutex::default(),
                };
                (name.clone(), Arc::new(server))
            })
            .collect();
        Toolbox {
            servers,
            max_result,
            tasks: TaskTracker::new(),
            closing: CancellationToken::new(),
            bridge: Default::default(),
        }
    }

    /// Starts the shared servers, in the background (a turn that needs one waits for it at
    /// most its `startup_timeout_secs`), and the idle sweep of conversation servers.
    pub fn start(&self) {
        for server in self.servers.values().filter(|s| s.spec.scope() == McpScope::Shared) {
            server.shared.get_or_init(|| Connection::start(&server.name, server.spec.clone(), None, &self.tasks));
        }
        self.sweep_idle();
    }

    /// Whether the servers `names` include one run per conversation in its folder.
    pub fn uses_folders(&self, names: &[String]) -> bool {
        names.iter().filter_map(|n| self.servers.get(n)).any(|s| s.spec.scope() == McpScope::Conversation)
    }

    /// `cwd` as a conversation's server would be started in it: inside one of the roots of every
    /// conversation server in `names` (the rule of docs/security.md: canonical, symlinks followed).
    pub fn folder(&self, names: &[String], cwd: &str) -> Option<PathBuf> {
        let mut folder = None;
        for server in
            names.iter().filter_map(|n| self.servers.get(n)).filter(|s| s.spec.scope() == McpScope::Conversation)
        {
            let inside = crate::folders::inside(&server.roots, cwd)?;
            folder = Some(inside);
        }
        folder.or_else(|| Some(PathBuf::from(cwd)))
    }

    /// The tools of servers `names` for a turn of `conversation_id` in `folder`: each server's
    /// that is ready, or becomes so within its `startup_timeout_secs`.
    pub async fn for_turn(
        self: &Arc<Self>,
        names: &[String],
        conversation_id: &str,
        folder: Option<&Path>,
    ) -> TurnTools {
        let (mut tools, mut down) = (Vec::new(), Vec::new());
        for server in names.iter().filter_map(|n| self.servers.get(n)) {
            let Some(connection) = server.connection(conversation_id, folder, &self.tasks) else {
                down.push((server.name.clone(), "every one of its processes is in a call (max_processes)".to_owned()));
                continue;
            };
            let wait = Duration::from_secs(server.spec.startup_timeout_secs.max(1));
            let listed = match connection.settled(wait).await {
                State::Ready(listed) => listed,
                state => {
                    tracing::warn!(server = %server.name, ?state, "an MCP server is not ready: its tools are left out of the turn");
                    let why = match state {
                        State::Failed(why) => why,
                        State::Starting => "it is still starting".to_owned(),
                        _ => "it is stopped".to_owned(),
                    };
                    down.push((server.name.clone(), why));
                    continue;
                }
            };
            for tool in listed.iter() {
                if server.spec.tools.as_ref().is_some_and(|allowed| !allowed.contains(&tool.name)) {
                    continue;
                }
                let name = format!("{}{SEPARATOR}{}", server.name, tool.name);
                if !valid_name(&name) {
                    tracing::warn!(server = %server.name, tool = %tool.name, "a tool's name does not fit `^[a-zA-Z0-9_-]{{1,64}}$` as `<server>__<tool>`; left out");
                    continue;
                }
                tools.push(TurnTool {
                    name,
                    tool: tool.name.clone(),
                    description: tool.description.clone(),
                    input_schema: tool.input_schema.clone(),
                    server: server.clone(),
                    connection: connection.clone(),
                });
            }
        }
        TurnTools { tools, down, max_result: self.max_result }
    }

    /// A way in for an agent program of `conversation` working in `folder` to the servers
    /// `names`, through the gateway's MCP endpoint (`bridge.rs`): the tools the `openai` loop
    /// would get, nothing else. Fails when the endpoint cannot listen.
    pub fn pass(
        self: &Arc<Self>,
        names: &[String],
        conversation: &str,
        folder: Option<PathBuf>,
    ) -> Result<Pass, String> {
        let mut bridge = self.bridge.lock().unwrap_or_else(|p| p.into_inner());
        if bridge.is_none() {
            let started = bridge::Bridge::start(Arc::downgrade(self), &self.tasks, self.closing.clone())
                .map_err(|e| format!("the MCP endpoint for agent programs cannot listen: {e}"))?;
            *bridge = Some(started);
        }
        Ok(bridge.as_ref().expect("started above").pass(names, conversation, folder))
    }

    /// Every server and its tools, for `GET /tools`.
    pub fn view(&self) -> Vec<ServerView> {
        self.servers.values().map(|s| s.view()).collect()
    }

    /// The servers' counters in Prometheus' text format (`/metrics`): whether each is ready,
    /// and calls, errors and seconds per server and tool.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write;
        if self.servers.is_empty() {
            return;
        }
        let label = |s: &str| s.replace(['\\', '"', '\n'], "_");
        let _ = writeln!(
            out,
            "# HELP dispatch_mcp_server_ready MCP servers ready (1) or not (0); conversation servers: processes ready.\n# TYPE dispatch_mcp_server_ready gauge"
        );
        for server in self.servers.values() {
            let ready = match server.spec.scope() {
                McpScope::Shared => {
                    usize::from(server.shared.get().is_some_and(|c| matches!(c.state(), State::Ready(_))))
                }
                McpScope::Conversation => {
                    let conversations = server.conversations.lock().unwrap_or_else(|p| p.into_inner());
                    conversations.values().filter(|c| matches!(c.state(), State::Ready(_))).count()
                }
            };
            let _ = writeln!(out, "dispatch_mcp_server_ready{{server=\"{}\"}} {ready}", label(&server.name));
        }
        let families = [
            ("dispatch_tool_calls_total", "counter", "Tool calls, by server and tool."),
            ("dispatch_tool_errors_total", "counter", "Tool calls that ended in an error result, by server and tool."),
            ("dispatch_tool_call_seconds_total", "counter", "Seconds spent in tool calls, by server and tool."),
        ];
        for (i, (name, kind, help)) in families.iter().enumerate() {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for server in self.servers.values() {
                for (tool, stats) in server.stats.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                    let value = match i {
                        0 => stats.calls.to_string(),
                        1 => stats.errors.to_string(),
                        _ => format!("{:.6}", stats.seconds),
                    };
                    let _ =
                        writeln!(out, "{name}{{server=\"{}\",tool=\"{}\"}} {value}", label(&server.name), label(tool));
                }
            }
        }
    }

    /// Stops a deleted conversation's servers.
    pub fn release(&self, conversation_id: &str) {
        for server in self.servers.values() {
            if let Some(c) = server.conversations.lock().unwrap_or_else(|p| p.into_inner()).remove(conversation_id) {
                c.stop();
            }
        }
    }

    /// Stops every server and waits (bounded) for them to be gone. Called at shutdown.
    pub async fn shutdown(&self) {
        self.closing.cancel();
        for server in self.servers.values() {
            if let Some(shared) = server.shared.get() {
                shared.stop();
            }
            for (_, c) in server.conversations.lock().unwrap_or_else(|p| p.into_inner()).drain() {
                c.stop();
            }
        }
        self.tasks.close();
        if tokio::time::timeout(Duration::from_secs(10), self.tasks.wait()).await.is_err() {
            tracing::warn!("MCP servers still stopping at the shutdown deadline");
        }
    }

    /// Stops conversation servers idle past their `idle_timeout_secs`, every few seconds.
    fn sweep_idle(&self) {
        let servers: Vec<Arc<Server>> =
            self.servers.values().filter(|s| s.spec.scope() == McpScope::Conversation).cloned().collect();
        if servers.is_empty() {
            return;
        }
        let closing = self.closing.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = closing.cancelled() => return,
                }
                for server in &servers {
                    let idle = Duration::from_secs(server.spec.idle_timeout_secs);
                    server.conversations.lock().unwrap_or_else(|p| p.into_inner()).retain(|conversation, c| {
                        let keep = c.busy() || c.idle_since().elapsed() < idle;
                        if !keep {
                            tracing::info!(server = %server.name, %conversation, "stopping an idle MCP server");
                            c.stop();
                        }
                        keep
                    });
                }
            }
        });
    }
}

impl Server {
    /// The connection a turn of `conversation_id` in `folder` uses: the shared one, or the
    /// conversation's (started now, or again in a new folder). `None` when every place is taken
    /// by a conversation in a call.
    fn connection(&self, conversation_id: &str, folder: Option<&Path>, tasks: &TaskTracker) -> Option<Arc<Connection>> {
        if self.spec.scope() == McpScope::Shared {
            return self.shared.get().cloned();
        }
        let folder = folder.map(Path::to_path_buf).or_else(|| self.roots.first().cloned());
        let mut conversations = self.conversations.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = conversations.get(conversation_id) {
            if c.folder == folder && !matches!(c.state(), State::Stopped) {
                return Some(c.clone());
            }
            c.stop();
            conversations.remove(conversation_id);
        }
        if conversations.len() >= self.spec.max_processes.max(1) {
            // Room: the process idle longest that is not in a call.
            let oldest = conversations
                .iter()
                .filter(|(_, c)| !c.busy())
                .min_by_key(|(_, c)| c.idle_since())
                .map(|(id, _)| id.clone());
            let Some(oldest) = oldest else {
                tracing::warn!(server = %self.name, max_processes = self.spec.max_processes, "every process of an MCP server is in a call: the turn gets none of its tools");
                return None;
            };
            if let Some(c) = conversations.remove(&oldest) {
                tracing::info!(server = %self.name, conversation = %oldest, "stopping an MCP server's process to make room");
                c.stop();
            }
        }
        let c = Connection::start(&self.name, self.spec.clone(), folder, tasks);
        conversations.insert(conversation_id.to_owned(), c.clone());
        Some(c)
    }

    fn record(&self, tool: &str, ok: bool, took: Duration) {
        let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        // Tool names come from the server's list: as many as it lists.
        let entry = stats.entry(tool.to_owned()).or_default();
        entry.calls += 1;
        entry.errors += u64::from(!ok);
        entry.seconds += took.as_secs_f64();
    }

    fn view(&self) -> ServerView {
        let transport = if self.spec.command.is_some() { "stdio" } else { "http" };
        let (scope, state, processes) = match self.spec.scope() {
            McpScope::Shared => ("shared", self.shared.get().map_or(State::Stopped, |s| s.state()), None),
            McpScope::Conversation => {
                let conversations = self.conversations.lock().unwrap_or_else(|p| p.into_inner());
                let ready = conversations.values().map(|c| c.state()).find(|s| matches!(s, State::Ready(_)));
                let any = ready.or_else(|| conversations.values().last().map(|c| c.state()));
                ("conversation", any.unwrap_or(State::Stopped), Some(conversations.len()))
            }
        };
        let (state, error, tools) = match state {
            State::Starting => ("starting", None, Vec::new()),
            State::Ready(tools) => ("ready", None, tools.to_vec()),
            State::Failed(why) => ("failed", Some(why), Vec::new()),
            State::Stopped if processes.is_some() => ("idle", None, Vec::new()),
            State::Stopped => ("stopped", None, Vec::new()),
        };
        let tools = tools
            .into_iter()
            .filter(|t| self.spec.tools.as_ref().is_none_or(|allowed| allowed.contains(&t.name)))
            .map(|t| ToolView {
                name: format!("{}{SEPARATOR}{}", self.name, t.name),
                description: t.description,
                input_schema: t.input_schema,
            })
            .collect();
        ServerView { name: self.name.clone(), transport, scope, state: state.into(), error, processes, tools }
    }
}

/// The tools one turn may call.
pub struct TurnTools {
    tools: Vec<TurnTool>,
    /// The turn's servers that gave no tools, and why: a call to one says so.
    down: Vec<(String, String)>,
    max_result: usize,
}

struct TurnTool {
    name: String,
    tool: String,
    description: Option<String>,
    input_schema: Value,
    server: Arc<Server>,
    connection: Arc<Connection>,
}

/// A call's result as the model gets it.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub content: String,
    pub is_error: bool,
}

impl TurnTools {
    pub fn none() -> TurnTools {
        TurnTools { tools: Vec::new(), down: Vec::new(), max_result: 0 }
    }

    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// Each tool's name (`<server>__<tool>`), description and input schema.
    pub fn listed(&self) -> impl Iterator<Item = (&str, Option<&str>, &Value)> {
        self.tools.iter().map(|t| (t.name.as_str(), t.description.as_deref(), &t.input_schema))
    }

    /// The request's `tools`: Chat Completions function definitions.
    pub fn definitions(&self) -> Vec<Value> {
        self.tools
            .iter()
            .map(|t| {
                let mut function = json!({"name": t.name, "parameters": t.input_schema});
                if let Some(description) = &t.description {
                    function["description"] = json!(description);
                }
                json!({"type": "function", "function": function})
            })
            .collect()
    }

    /// Runs the model's call `name(input)`; progress lines go to `progress`. Every failure is a
    /// result that says why (`is_error`), for the model to read: the turn goes on.
    pub async fn call(
        &self,
        name: &str,
        input: &Value,
        progress: mpsc::Sender<String>,
        cancel: &CancellationToken,
    ) -> Outcome {
        let error = |content: String| Outcome { content, is_error: true };
        let Some(tool) = self.tools.iter().find(|t| t.name == name) else {
            let server = name.split_once(SEPARATOR).map(|(server, _)| server);
            return error(match self.down.iter().find(|(down, _)| Some(down.as_str()) == server) {
                Some((server, why)) => format!("the MCP server `{server}` is not available: {why}"),
                None => format!("there is no tool `{name}`"),
            });
        };
        let arguments = match input {
            Value::Object(map) => map.clone(),
            Value::Null => Default::default(),
            other => {
                return error(format!("the arguments are not a JSON object: {}", capped(other.to_string(), 200)));
            }
        };
        let started = Instant::now();
        let timeout = Duration::from_secs(tool.server.spec.call_timeout_secs.max(1));
        let outcome = match tool.connection.call(&tool.tool, arguments, timeout, progress, cancel).await {
            Ok(result) => Outcome {
                content: result_text(&result, self.max_result),
                is_error: result.get("isError").and_then(Value::as_bool).unwrap_or(false),
            },
            Err(why) => error(why),
        };
        tool.server.record(&tool.tool, !outcome.is_error, started.elapsed());
        outcome
    }
}
