//! Assembling the gateway from its configuration, and serving it until shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::config::{Config, ConfigError, Credential, MAX_GRACE_SECS, ScriptedCredential};
use crate::http::{AppState, Shared, router, ws_router};
use crate::hub::Hub;
use crate::metrics::Metrics;
use crate::net::{ConnectionLimits, serve};
use crate::runtime::command::{AgentTools, CommandRuntime};
use crate::runtime::openai::{OpenAiRuntime, OpenAiSettings};
use crate::runtime::scripted::{Script, ScriptedRuntime};
use crate::runtime::{ModelInfo, Registry, Runtime};
use crate::store::{Store, StoreError, StoreOptions};
use crate::turn::{Cluster, Turns};

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[cfg(feature = "cluster")]
    #[error(transparent)]
    Bus(#[from] crate::bus::BusError),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: std::io::Error },
    /// A token key that cannot be read or used.
    #[error("{0}")]
    Identity(String),
}

/// A gateway ready to serve: store open, runtimes registered.
pub struct Gateway {
    state: AppState,
}

impl Gateway {
    pub async fn build(mut config: Config) -> Result<Gateway, StartupError> {
        config.check()?;
        // The one TLS provider of every client (MCP servers over HTTPS, the bus): ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let registry = registry(&config)?;
        registry.tools().start();
        let metrics = Arc::new(Metrics::default());
        let limits = StoreOptions {
            busy_timeout: Duration::from_millis(config.sqlite_busy_timeout_ms),
            max_pages: config.sqlite_max_pages,
            max_connections: config.postgres_max_connections,
            lease_ttl: Duration::from_millis(config.lease_ttl_ms),
            delete_batch_rows: config.delete_batch_rows,
        };
        let store = Store::open_with(&config.database, metrics.clone(), limits).await?;
        let auth = crate::identity::Authenticator::new(&config, store.clone()).map_err(StartupError::Identity)?;
        let flush = crate::hub::FlushWindow::new(config.flush_sweeps, Duration::from_millis(config.flush_max_ms));
        let (remote, cluster) = connect_bus(&config, &metrics, &store).await?.unzip();
        let caps = crate::hub::Caps {
            coalesce: config.turn_buffer_bytes,
            turn: config.turn_buffer_max_bytes,
            total: config.replay_max_bytes,
        };
        let hub = Hub::with_remote(caps, flush, remote);
        let queue_limits =
            crate::runtime::QueueLimits { messages: config.max_queued_messages, bytes: config.max_queued_bytes };
        let limits = crate::turn::TurnLimits {
            queue: queue_limits,
            max_turns: config.max_turns as usize,
            max_duration: Duration::from_secs(config.max_turn_secs),
            max_tool_output: config.max_tool_result_bytes,
        };
        // Users (who see only their own) come with signed tokens and made keys.
        let identities = crate::turn::Identities { quotas: config.quotas, users: auth.enabled() };
        let turns =
            Turns::new(store.clone(), hub.clone(), Arc::new(registry), metrics.clone(), limits, cluster, identities);
        let stream_quota = crate::identity::StreamQuota::new(store.clone(), &config.quotas, auth.enabled());
        let connections = crate::net::ConnectionSlots::new(config.max_connections());
        let reading = crate::live::ReadingBudget::new(config.max_reading_bytes as usize);
        Ok(Gateway {
            state: AppState::new(Shared {
                config: Arc::new(config),
                store,
                hub,
                turns,
                reading,
                connections,
                metrics,
                auth,
                stream_quota,
                drained: Default::default(),
            }),
        })
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Binds the configured address.
    pub async fn bind(&self) -> Result<TcpListener, StartupError> {
        let addr = self.state.config.listen;
        let open = !self.state.auth.enabled();
        if open {
            tracing::info!("auth is off: no API keys or token keys are configured");
        }
        let config = &self.state.config;
        for addr in std::iter::once(addr).chain(config.ws_listen) {
            if open && !addr.ip().is_loopback() {
                tracing::warn!(%addr, "listening beyond loopback with no API keys: anyone who can reach this port can use the gateway");
            }
            if !addr.ip().is_loopback() && config.allowed_hosts.is_empty() {
                tracing::warn!(%addr, "listening beyond loopback with no --allowed-hosts: any Host is served (set the names clients use, or let a proxy in front check them)");
            }
        }
        if config.any_origin() {
            tracing::warn!(
                "--cors-origins is *: a page of any web site the operator visits may use this gateway{}",
                if open { ", and no key is needed" } else { "" }
            );
        }
        TcpListener::bind(addr).await.map_err(|source| StartupError::Listen { addr: addr.to_string(), source })
    }

    /// Binds the optional WebSocket-only listener (`--ws-listen`).
    pub async fn bind_ws(&self) -> Result<Option<TcpListener>, StartupError> {
        let Some(addr) = self.state.config.ws_listen else { return Ok(None) };
        let listener =
            TcpListener::bind(addr).await.map_err(|source| StartupError::Listen { addr: addr.to_string(), source })?;
        Ok(Some(listener))
    }

    /// Serves until `shutdown` resolves; then running turns end `done{aborted}` and seal,
    /// their streams finish, and the database is closed.
    pub async fn serve(
        self,
        listener: TcpListener,
        ws_listener: Option<TcpListener>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let state = self.state.clone();
        let limits = ConnectionLimits {
            drain_timeout: Duration::from_secs(state.config.drain_timeout_secs.max(1)),
            header_read_timeout: Duration::from_secs(state.config.header_read_timeout_secs.max(1)),
            max_head_bytes: state.config.max_head_bytes as usize,
            max_headers: state.config.max_headers as usize,
            max_body_bytes: state.config.max_body_bytes,
            body_read_timeout: Duration::from_secs(state.config.request_timeout_secs.max(1)),
        };
        // Streams and listeners stop once shutdown has drained the turns (`shutdown.rs`).
        let drained = state.drained.clone();
        let metrics = state.metrics.clone();
        let slots = state.connections.clone();
        let ws_task = ws_listener.map(|l| {
            tokio::spawn(serve(l, ws_router(state.clone()), limits, slots.clone(), metrics.clone(), drained.clone()))
        });
        let main_task = tokio::spawn(serve(listener, router(state), limits, slots, metrics, drained.clone()));

        shutdown.await;
        let listeners = async {
            let _ = main_task.await;
            if let Some(task) = ws_task {
                let _ = task.await;
            }
        };
        crate::shutdown::run(&self.state, listeners).await;
        Ok(())
    }
}

/// The other gateways, as the hub and the turns meet them.
type Others = (Arc<dyn crate::hub::Remote>, Arc<dyn Cluster>);

/// The bus the configuration names, connected.
#[cfg(feature = "cluster")]
async fn connect_bus(config: &Config, metrics: &Arc<Metrics>, store: &Store) -> Result<Option<Others>, StartupError> {
    let Some(url) = &config.bus else { return Ok(None) };
    let options = crate::bus::BusOptions {
        max_age: Duration::from_secs(config.bus_max_age_secs),
        max_bytes: i64::try_from(config.bus_max_bytes).unwrap_or(i64::MAX),
        timeout: Duration::from_millis(config.bus_timeout_ms),
        ca_file: config.bus_ca_file.clone(),
        client_cert: config.bus_client_cert.clone().zip(config.bus_client_key.clone()),
        key: match (&config.bus_creds, &config.bus_nkey) {
            (Some(creds), _) => Some(crate::bus::BusKey::Creds(creds.clone())),
            (None, Some(nkey)) => Some(crate::bus::BusKey::Nkey(nkey.clone())),
            (None, None) => None,
        },
    };
    let bus = crate::bus::Bus::connect(url, options, metrics.clone(), store.clone()).await?;
    Ok(Some((Arc::new(bus.clone()), Arc::new(bus))))
}

/// No bus in a build without the `cluster` feature (`Config::check` refuses `--bus` there).
#[cfg(not(feature = "cluster"))]
async fn connect_bus(_: &Config, _: &Arc<Metrics>, _: &Store) -> Result<Option<Others>, StartupError> {
    Ok(None)
}

/// The models the configuration names, each with its runtime; with no credentials configured,
/// the `demo` scripted credential from the `--scripted-*` flags.
pub fn registry(config: &Config) -> Result<Registry, ConfigError> {
    let mut credentials = config.credentials.clone();
    if credentials.is_empty() {
        credentials.insert(
            "demo".to_owned(),
            Credential::Scripted(ScriptedCredential {
                models: vec!["scripted".to_owned()],
                pace: None,
                reasoning: None,
                script: config.scripted_script.clone(),
            }),
        );
    }
    let first = credentials.iter().find_map(|(name, c)| c.models().first().map(|m| format!("{name}/{m}")));
    let default_model = config.default_model.clone().or(first).ok_or(ConfigError::NoModel)?;
    for (name, server) in &config.mcp {
        crate::tools::check_server(name, server).map_err(|e| ConfigError::Mcp { name: name.clone(), message: e })?;
    }
    let toolbox = Arc::new(crate::tools::Toolbox::new(&config.mcp, config.max_tool_result_bytes));
    let mut registry = Registry::new(default_model.clone(), toolbox.clone());
    for (name, credential) in &credentials {
        if name.is_empty() || name.contains('/') {
            return Err(ConfigError::credential(name, "a credential name has no '/'"));
        }
        if credential.models().is_empty() {
            return Err(ConfigError::credential(name, "`models` lists no model"));
        }
        // What each kind reads of a conversation's settings (`/models` says it per model).
        let (runtime, context_window, settings): (Arc<dyn Runtime>, Option<u64>, Vec<&'static str>) = match credential {
            Credential::Scripted(c) => {
                let script = match &c.script {
                    Some(path) => Script::load(path).map_err(|e| ConfigError::credential(name, e))?,
                    None => Script::default(),
                };
                let pace = c.pace.unwrap_or(config.scripted_pace);
                let reasoning = c.reasoning.unwrap_or(config.scripted_reasoning);
                (Arc::new(ScriptedRuntime::new(pace, reasoning, script)), Some(32_768), vec![])
            }
            Credential::Openai(c) => {
                let api_key = match &c.api_key_env {
                    Some(var) => Some(std::env::var(var).map_err(|_| {
                        ConfigError::credential(
                            name,
                            format!("the environment variable {var} (api_key_env) is not set"),
                        )
                    })?),
                    None => None,
                };
                let settings = OpenAiSettings {
                    base_url: c.base_url.clone(),
                    api_key,
                    headers: c.headers.clone().into_iter().collect(),
                    connect_timeout: Duration::from_secs(c.connect_timeout_secs.max(1)),
                    idle_timeout: Duration::from_secs(c.idle_timeout_secs.max(1)),
                    max_event_bytes: config.max_runtime_line_bytes,
                    max_request_bytes: config.max_runtime_request_bytes,
                    max_step_bytes: config.max_step_bytes as usize,
                    system_prompt: c.system_prompt.clone(),
                    context_window: c.context_window,
                    params: c.params.clone(),
                    model_params: c.model_params.clone(),
                    tools: (!c.mcp.is_empty()).then(|| crate::runtime::openai::ToolSettings {
                        toolbox: toolbox.clone(),
                        servers: c.mcp.clone(),
                        max_steps: c.max_steps,
                        max_parallel: c.max_parallel_tools,
                        max_calls: c.max_tool_calls,
                    }),
                };
                servers_exist(name, &c.mcp, config)?;
                if let Some(model) = c.model_params.keys().find(|m| !c.models.contains(m)) {
                    return Err(ConfigError::credential(name, format!("model_params.{model}: not one of `models`")));
                }
                let runtime = OpenAiRuntime::new(settings).map_err(|e| ConfigError::credential(name, e))?;
                // The effort goes into the request; the folder only to MCP servers, when it has them.
                let reads = if c.mcp.is_empty() { vec!["reasoningEffort"] } else { vec!["cwd", "reasoningEffort"] };
                (Arc::new(runtime), c.context_window, reads)
            }
            Credential::Command(c) => {
                if c.grace_secs > MAX_GRACE_SECS {
                    let why = format!("`grace_secs` is at most {MAX_GRACE_SECS}, got {}", c.grace_secs);
                    return Err(ConfigError::credential(name, why));
                }
                servers_exist(name, &c.mcp, config)?;
                let tools =
                    (!c.mcp.is_empty()).then(|| AgentTools { toolbox: toolbox.clone(), servers: c.mcp.clone() });
                let runtime = CommandRuntime::new(name, c.clone(), config.max_runtime_line_bytes, tools);
                (Arc::new(runtime), None, vec!["cwd", "reasoningEffort", "session"])
            }
        };
        for model in credential.models() {
            registry.add(name, model, runtime.clone(), ModelInfo { context_window, settings: settings.clone() });
        }
    }
    if !registry.contains(&default_model) {
        return Err(ConfigError::UnknownDefaultModel(default_model));
    }
    Ok(registry)
}

/// Every server a credential's `mcp` names is configured.
fn servers_exist(credential: &str, servers: &[String], config: &Config) -> Result<(), ConfigError> {
    match servers.iter().find(|s| !config.mcp.contains_key(*s)) {
        Some(missing) => Err(ConfigError::credential(
            credential,
            format!("`mcp` names {missing:?}, which is no [mcp.{missing}] server"),
        )),
        None => Ok(()),
    }
}
