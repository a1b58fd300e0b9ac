//! Assembling the gateway from its configuration, and serving it until shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::config::Config;
use crate::http::{AppState, router, ws_router};
use crate::hub::Hub;
use crate::net::{ConnectionLimits, serve};
use crate::runtime::scripted::{Script, ScriptedRuntime};
use crate::runtime::{ModelInfo, Registry};
use crate::store::{Store, StoreError};
use crate::turn::Turns;

/// How long shutdown waits for aborted turns to seal.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Config(String),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: std::io::Error },
}

/// A gateway ready to serve: store open, runtimes registered.
pub struct Gateway {
    state: AppState,
}

impl Gateway {
    pub async fn build(config: Config) -> Result<Gateway, StartupError> {
        let script = match &config.scripted_script {
            Some(path) => Script::load(path).map_err(StartupError::Config)?,
            None => Script::default(),
        };
        let mut registry = Registry::new("demo/scripted");
        let scripted = ScriptedRuntime::new(config.scripted_pace, config.scripted_reasoning, script);
        registry.add("demo", "scripted", Arc::new(scripted), ModelInfo { context_window: Some(32_768) });

        let store = Store::open(&config.database).await?;
        let hub = Hub::new(config.turn_buffer_bytes);
        let turns = Turns::new(store.clone(), hub.clone(), Arc::new(registry));
        Ok(Gateway { state: AppState { config: Arc::new(config), store, hub, turns, drained: Default::default() } })
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Binds the configured address.
    pub async fn bind(&self) -> Result<TcpListener, StartupError> {
        let addr = self.state.config.listen;
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
        let turns = state.turns.clone();
        let limits = ConnectionLimits {
            drain_timeout: Duration::from_secs(state.config.drain_timeout_secs.max(1)),
            header_read_timeout: Duration::from_secs(state.config.header_read_timeout_secs.max(1)),
        };
        // Streams and listeners stop once the turns have drained.
        let drained = state.drained.clone();
        let ws_task = ws_listener.map(|l| tokio::spawn(serve(l, ws_router(state.clone()), limits, drained.clone())));
        let main_task = tokio::spawn(serve(listener, router(state), limits, drained.clone()));

        shutdown.await;
        tracing::info!(running = turns.running(), "shutting down: aborting running turns");
        turns.abort_all();
        let deadline = tokio::time::Instant::now() + DRAIN_DEADLINE;
        while turns.running() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drained.cancel();
        let result = main_task.await.map_err(std::io::Error::other);
        if let Some(task) = ws_task {
            let _ = task.await;
        }
        self.state.store.close().await;
        result
    }
}
