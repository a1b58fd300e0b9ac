//! One MCP server the gateway is a client of: started (a process, or a Streamable HTTP
//! session), initialized, its tools listed and followed, restarted with backoff after it dies,
//! stopped when told. The official SDK (`rmcp`) speaks the protocol; this file keeps the
//! server's state for `GET /tools` and the turns that call it.

// Roots and log messages are deprecated in the protocol's newest revision, but the servers in
// use (the registries' filesystem server among them) still ask for roots and log through them.
#![allow(deprecated)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::model::{
    CallToolRequest, CancelledNotification, CancelledNotificationParam, ClientInfo, ClientRequest, ListRootsResult,
    LoggingMessageNotificationParam, ProgressNotificationParam, ServerResult,
};
use rmcp::service::{NotificationContext, PeerRequestOptions, RequestContext, RunningService};
use rmcp::{ClientHandler, Peer, RoleClient, ServiceError, ServiceExt};
use serde_json::{Map, Value};
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::config::McpServer;

/// The first wait before a dead server is started again; doubled each time up to the most.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MOST_BACKOFF: Duration = Duration::from_secs(60);

/// A server's state, as `GET /tools` shows it.
#[derive(Debug, Clone)]
pub enum State {
    Starting,
    Ready(Arc<Vec<Tool>>),
    /// Failed to start, or died; started again after a backoff (unless stopped).
    Failed(String),
    Stopped,
}

/// One tool as the server lists it.
#[derive(Debug, Clone)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    pub input_schema: Value,
}

/// A call's failure, said for the model (it becomes an `isError` result).
pub type CallError = String;

/// The calls in flight on a connection, by progress token, and where their progress goes.
type Routes = Arc<Mutex<HashMap<String, mpsc::Sender<String>>>>;

/// One client of one server (the shared one, or a conversation's).
pub struct Connection {
    pub server: String,
    /// The conversation's folder it was started in (conversation servers).
    pub folder: Option<PathBuf>,
    state: watch::Sender<State>,
    peer: Mutex<Option<Peer<RoleClient>>>,
    routes: Routes,
    /// When a call last ended or began (conversation servers stop once idle).
    last_used: Mutex<Instant>,
    stop: CancellationToken,
}

/// What the SDK calls back: roots, progress, log messages, a changed tool list.
struct Handler {
    info: ClientInfo,
    roots: Vec<String>,
    routes: Routes,
    relist: Arc<Notify>,
    server: String,
}

impl ClientHandler for Handler {
    fn get_info(&self) -> ClientInfo {
        self.info.clone()
    }

    async fn list_roots(&self, _: RequestContext<RoleClient>) -> Result<ListRootsResult, rmcp::ErrorData> {
        let roots = self.roots.iter().map(|uri| serde_json::json!({"uri": uri, "name": "conversation folder"}));
        let result = serde_json::json!({"roots": roots.collect::<Vec<_>>()});
        Ok(serde_json::from_value(result).expect("a roots list"))
    }

    async fn on_progress(&self, params: ProgressNotificationParam, _: NotificationContext<RoleClient>) {
        let token = token_key(&serde_json::to_value(&params.progress_token).unwrap_or_default());
        let route = self.routes.lock().unwrap_or_else(|p| p.into_inner()).get(&token).cloned();
        let Some(route) = route else { return };
        let text = match (&params.message, params.total) {
            (Some(message), _) => message.clone(),
            (None, Some(total)) => format!("progress {} of {total}", params.progress),
            (None, None) => format!("progress {}", params.progress),
        };
        // Progress that cannot keep up is dropped, never waited for: the call goes on.
        let _ = route.try_send(text);
    }

    async fn on_logging_message(&self, params: LoggingMessageNotificationParam, _: NotificationContext<RoleClient>) {
        let text = match &params.data {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        tracing::debug!(server = %self.server, message = %text, "an MCP server's log message");
        // A log message names no call: it goes to the call in flight when there is exactly one
        // (always so for a conversation's server that runs one call at a time), else only to
        // the gateway's log, so that one conversation never reads another's.
        let routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        if routes.len() == 1
            && let Some(route) = routes.values().next()
        {
            let _ = route.try_send(text);
        }
    }

    async fn on_tool_list_changed(&self, _: NotificationContext<RoleClient>) {
        self.relist.notify_one();
    }
}

/// A progress token as a map key (a number or a string in the protocol).
fn token_key(token: &Value) -> String {
    token.to_string()
}

impl Connection {
    /// Starts the server in the background (a turn never waits on a dead server here); the
    /// connection keeps it running, restarting it after it dies, until [`Connection::stop`].
    pub fn start(
        server: &str,
        spec: Arc<McpServer>,
        folder: Option<PathBuf>,
        tasks: &tokio_util::task::TaskTracker,
    ) -> Arc<Connection> {
        let connection = Arc::new(Connection {
            server: server.to_owned(),
            folder,
            state: watch::Sender::new(State::Starting),
            peer: Mutex::new(None),
            routes: Routes::default(),
            last_used: Mutex::new(Instant::now()),
            stop: CancellationToken::new(),
        });
        tasks.spawn(connection.clone().supervise(spec));
        connection
    }

    pub fn state(&self) -> State {
        self.state.borrow().clone()
    }

    /// The state once it is not `Starting`, or `Starting` after `wait`.
    pub async fn settled(&self, wait: Duration) -> State {
        let mut states = self.state.subscribe();
        let settled = states.wait_for(|s| !matches!(s, State::Starting));
        match tokio::time::timeout(wait, settled).await {
            Ok(Ok(state)) => state.clone(),
            _ => self.state(),
        }
    }

    pub fn idle_since(&self) -> Instant {
        *self.last_used.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn busy(&self) -> bool {
        !self.routes.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }

    fn touch(&self) {
        *self.last_used.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// Stops the server (its process group, or its session) for good.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Calls `tool` with `arguments`; its progress and log lines go to `progress`. Cancelled
    /// (MCP `notifications/cancelled`) after `timeout` or when `cancel` fires.
    pub async fn call(
        &self,
        tool: &str,
        arguments: Map<String, Value>,
        timeout: Duration,
        progress: mpsc::Sender<String>,
        cancel: &CancellationToken,
    ) -> Result<Value, CallError> {
        let peer = self.peer.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some(peer) = peer else {
            return Err(match self.state() {
                State::Failed(why) => format!("the MCP server `{}` is not running: {why}", self.server),
                _ => format!("the MCP server `{}` is not running", self.server),
            });
        };
        self.touch();
        let params = serde_json::json!({"name": tool, "arguments": arguments});
        let params = serde_json::from_value(params).map_err(|e| format!("the call cannot be made: {e}"))?;
        let request = ClientRequest::CallToolRequest(CallToolRequest::new(params));
        let handle = peer
            .send_cancellable_request(request, PeerRequestOptions::with_timeout(timeout))
            .await
            .map_err(|e| self.failure(e, timeout))?;
        let key = token_key(&serde_json::to_value(&handle.progress_token).unwrap_or_default());
        self.routes.lock().unwrap_or_else(|p| p.into_inner()).insert(key.clone(), progress);
        let id = handle.id.clone();
        let outcome = tokio::select! {
            outcome = handle.await_response() => outcome.map_err(|e| self.failure(e, timeout)),
            _ = cancel.cancelled() => {
                let notification = CancelledNotification::new(CancelledNotificationParam::new(
                    Some(id),
                    Some("the turn was stopped".into()),
                ));
                // Best effort: a server that is gone needs no telling.
                let _ = tokio::time::timeout(Duration::from_secs(1), peer.send_notification(notification.into())).await;
                Err("Aborted".to_owned())
            }
        };
        self.routes.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
        self.touch();
        match outcome? {
            ServerResult::CallToolResult(result) => {
                serde_json::to_value(result).map_err(|e| format!("the result cannot be read: {e}"))
            }
            _ => Err(format!("the MCP server `{}` answered the call with something that is not a result", self.server)),
        }
    }

    fn failure(&self, error: ServiceError, timeout: Duration) -> CallError {
        match error {
            ServiceError::Timeout { .. } => {
                format!("the call took longer than {} s (call_timeout_secs) and was cancelled", timeout.as_secs())
            }
            ServiceError::McpError(e) => format!("the MCP server `{}` answered an error: {}", self.server, e.message),
            ServiceError::TransportClosed | ServiceError::TransportSend(_) => {
                format!("the MCP server `{}` went away during the call", self.server)
            }
            other => format!("the MCP server `{}` failed the call: {other}", self.server),
        }
    }

    /// Runs the server until stopped: start, serve, and after a death wait and start again.
    async fn supervise(self: Arc<Self>, spec: Arc<McpServer>) {
        let mut backoff = FIRST_BACKOFF;
        loop {
            self.state.send_replace(State::Starting);
            let started = tokio::select! {
                started = self.open(&spec) => started,
                _ = self.stop.cancelled() => break,
            };
            match started {
                Ok((service, relist)) => {
                    let lived = Instant::now();
                    self.serve(service, relist).await;
                    if self.stop.is_cancelled() {
                        break;
                    }
                    // A server that ran a while before dying starts again at once; one that dies
                    // as it starts waits longer each time.
                    if lived.elapsed() > MOST_BACKOFF {
                        backoff = FIRST_BACKOFF;
                    }
                    self.state.send_replace(State::Failed("the server exited; starting it again".into()));
                    tracing::warn!(server = %self.server, "an MCP server exited; starting it again");
                }
                Err(why) => {
                    tracing::warn!(server = %self.server, error = %why, backoff_s = backoff.as_secs(), "an MCP server could not be started");
                    self.state.send_replace(State::Failed(why));
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = self.stop.cancelled() => break,
            }
            backoff = (backoff * 2).min(MOST_BACKOFF);
        }
        self.state.send_replace(State::Stopped);
    }

    /// Starts the server and lists its tools, within `startup_timeout_secs`.
    async fn open(&self, spec: &McpServer) -> Result<(RunningService<RoleClient, Handler>, Arc<Notify>), String> {
        let relist = Arc::new(Notify::new());
        let roots = self.folder.iter().map(|f| format!("file://{}", f.display())).collect();
        let handler = Handler {
            info: client_info(),
            roots,
            routes: self.routes.clone(),
            relist: relist.clone(),
            server: self.server.clone(),
        };
        let limit = Duration::from_secs(spec.startup_timeout_secs.max(1));
        let opened = tokio::time::timeout(limit, async {
            let service = match (&spec.command, &spec.url) {
                (Some(program), _) => {
                    let mut command = tokio::process::Command::new(program);
                    // Nothing of the gateway's environment but the basics: a server that
                    // prints its environment shows none of the gateway's secrets.
                    crate::child_env::clean(&mut command);
                    command.args(&spec.args).envs(&spec.env).kill_on_drop(true);
                    if let Some(folder) = &self.folder {
                        command.current_dir(folder);
                    }
                    let mut wrapped = process_wrap::tokio::CommandWrap::from(command);
                    wrapped.wrap(process_wrap::tokio::ProcessGroup::leader());
                    let (transport, stderr) = rmcp::transport::TokioChildProcess::builder(wrapped)
                        .stderr(std::process::Stdio::piped())
                        .spawn()
                        .map_err(|e| format!("`{program}` could not be started: {e}"))?;
                    if let Some(stderr) = stderr {
                        tokio::spawn(log_stderr(self.server.clone(), stderr));
                    }
                    handler.serve(transport).await.map_err(|e| format!("`initialize` failed: {e}"))?
                }
                (None, Some(url)) => {
                    let mut config =
                        rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(
                            url.as_str(),
                        );
                    if let Some(var) = &spec.token_env
                        && let Ok(token) = std::env::var(var)
                    {
                        config = config.auth_header(token);
                    }
                    let transport = rmcp::transport::StreamableHttpClientTransport::from_config(config);
                    handler.serve(transport).await.map_err(|e| format!("`initialize` failed: {e}"))?
                }
                (None, None) => return Err("neither `command` nor `url` is set".to_owned()),
            };
            let tools = list(service.peer()).await?;
            Ok::<_, String>((service, tools))
        })
        .await
        .map_err(|_| {
            format!("it did not start and list its tools within {} s (startup_timeout_secs)", limit.as_secs())
        })??;
        let (service, tools) = opened;
        *self.peer.lock().unwrap_or_else(|p| p.into_inner()) = Some(service.peer().clone());
        tracing::info!(server = %self.server, tools = tools.len(), folder = ?self.folder, "an MCP server is ready");
        self.state.send_replace(State::Ready(Arc::new(tools)));
        Ok((service, relist))
    }

    /// Serves a started server until it dies or the connection stops, listing its tools again
    /// whenever it says they changed.
    async fn serve(&self, service: RunningService<RoleClient, Handler>, relist: Arc<Notify>) {
        let peer = service.peer().clone();
        let cancel = service.cancellation_token();
        let mut ended = std::pin::pin!(service.waiting());
        loop {
            tokio::select! {
                _ = &mut ended => break,
                _ = self.stop.cancelled() => {
                    cancel.cancel();
                    let _ = tokio::time::timeout(Duration::from_secs(5), &mut ended).await;
                    break;
                }
                _ = relist.notified() => {
                    // Older tools stay listed if the new list cannot be read.
                    if let Ok(tools) = list(&peer).await {
                        tracing::info!(server = %self.server, tools = tools.len(), "an MCP server's tools changed");
                        self.state.send_replace(State::Ready(Arc::new(tools)));
                    }
                }
            }
        }
        *self.peer.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// The server's tools (all of them: the allow-list is applied where names are given out).
async fn list(peer: &Peer<RoleClient>) -> Result<Vec<Tool>, String> {
    let tools = peer.list_all_tools().await.map_err(|e| format!("`tools/list` failed: {e}"))?;
    Ok(tools
        .into_iter()
        .map(|t| Tool {
            name: t.name.to_string(),
            description: t.description.map(|d| d.to_string()),
            input_schema: Value::Object((*t.input_schema).clone()),
        })
        .collect())
}

/// What the gateway tells a server of itself: its name, and that it serves roots.
fn client_info() -> ClientInfo {
    let capabilities =
        serde_json::from_value(serde_json::json!({"roots": {"listChanged": false}})).expect("client capabilities");
    ClientInfo::new(capabilities, rmcp::model::Implementation::new("dispatch-gateway", env!("CARGO_PKG_VERSION")))
}

/// A stdio server's standard error into the gateway's log, a line (or 8 KiB of one) at a time:
/// a server that never ends a line does not grow a buffer.
async fn log_stderr(server: String, stderr: tokio::process::ChildStderr) {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    let mut reader = tokio::io::BufReader::new(stderr);
    let mut line = Vec::new();
    loop {
        line.clear();
        match (&mut reader).take(8192).read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let text = String::from_utf8_lossy(&line);
                tracing::debug!(server = %server, line = %text.trim_end(), "an MCP server's standard error");
            }
        }
    }
}
