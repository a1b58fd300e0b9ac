//! Configuration: flags, each also settable by a `DISPATCH_*` environment variable.
//! With none at all the gateway serves on 127.0.0.1:24203 with SQLite at
//! `./data/dispatch.db` and the scripted runtime as `demo/scripted`.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Parser)]
#[command(name = "dispatch-gateway", version, about = "Turns, an append-only log and live streams for agent runtimes")]
pub struct Config {
    /// Address the HTTP API (and the WebSocket at /ws) listens on.
    #[arg(long, env = "DISPATCH_LISTEN", default_value = "127.0.0.1:24203")]
    pub listen: SocketAddr,

    /// SQLite database file; its folder is created when missing.
    #[arg(long, env = "DISPATCH_DATABASE", default_value = "./data/dispatch.db")]
    pub database: PathBuf,

    /// Pace of the scripted runtime in tokens per second (0 = as fast as possible).
    #[arg(long, env = "DISPATCH_SCRIPTED_PACE", default_value_t = 40.0)]
    pub scripted_pace: f64,

    /// Whether the scripted runtime's default reply streams a reasoning part first.
    #[arg(long, env = "DISPATCH_SCRIPTED_REASONING", default_value_t = true, action = clap::ArgAction::Set)]
    pub scripted_reasoning: bool,

    /// A JSON script for the scripted runtime (see docs/scripted-runtime.md).
    #[arg(long, env = "DISPATCH_SCRIPTED_SCRIPT")]
    pub scripted_script: Option<PathBuf>,

    /// Largest request body accepted, in bytes (413 past it).
    #[arg(long, env = "DISPATCH_MAX_BODY_BYTES", default_value_t = 1024 * 1024)]
    pub max_body_bytes: usize,

    /// Bytes a turn's replay buffer may hold before runs of deltas in it are coalesced.
    #[arg(long, env = "DISPATCH_TURN_BUFFER_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub turn_buffer_bytes: usize,

    /// Seconds between keep-alives on idle streams (SSE comment, NDJSON empty line, WebSocket
    /// ping).
    #[arg(long, env = "DISPATCH_KEEPALIVE_SECS", default_value_t = 15)]
    pub keepalive_secs: u64,

    /// Seconds a connection may go without its socket taking any bytes while the gateway has
    /// bytes for it; past that it is closed (the client comes back with its cursor).
    #[arg(long, env = "DISPATCH_DRAIN_TIMEOUT_SECS", default_value_t = 30)]
    pub drain_timeout_secs: u64,

    /// Most live streams (SSE, NDJSON, WebSocket) open at once; past it, 503.
    #[arg(long, env = "DISPATCH_MAX_STREAMS", default_value_t = 10_000)]
    pub max_streams: usize,

    /// Seconds a non-streaming request may take before it is answered 503.
    #[arg(long, env = "DISPATCH_REQUEST_TIMEOUT_SECS", default_value_t = 30)]
    pub request_timeout_secs: u64,

    /// Seconds shutdown waits for running turns to seal and streams to finish.
    #[arg(long, env = "DISPATCH_SHUTDOWN_TIMEOUT_SECS", default_value_t = 10)]
    pub shutdown_timeout_secs: u64,

    /// API keys, comma-separated. When set, every route but /health, /ready and /openapi.json
    /// needs `Authorization: Bearer <key>` (or `?access_token=<key>`).
    #[arg(long, env = "DISPATCH_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,

    /// Origins allowed by CORS, comma-separated; `*` (the default) allows any.
    #[arg(long, env = "DISPATCH_CORS_ORIGINS", value_delimiter = ',', default_value = "*")]
    pub cors_origins: Vec<String>,

    /// Seconds a client may take to send a complete request head.
    #[arg(long, env = "DISPATCH_HEADER_READ_TIMEOUT_SECS", default_value_t = 10)]
    pub header_read_timeout_secs: u64,

    /// A second listener that upgrades any path to the WebSocket protocol (existing web
    /// clients open their socket on port 24205 with no path).
    #[arg(long, env = "DISPATCH_WS_LISTEN")]
    pub ws_listen: Option<SocketAddr>,

    /// Print the OpenAPI document and exit (`openapi/openapi.json` is this output).
    #[arg(long)]
    pub print_openapi: bool,

    /// Log output format.
    #[arg(long, env = "DISPATCH_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

impl Config {
    /// The defaults, as if started with no flags and no environment (for tests and embedding).
    pub fn defaults() -> Config {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 24203)),
            database: PathBuf::from("./data/dispatch.db"),
            scripted_pace: 40.0,
            scripted_reasoning: true,
            scripted_script: None,
            max_body_bytes: 1024 * 1024,
            turn_buffer_bytes: 16 * 1024 * 1024,
            keepalive_secs: 15,
            drain_timeout_secs: 30,
            header_read_timeout_secs: 10,
            max_streams: 10_000,
            request_timeout_secs: 30,
            shutdown_timeout_secs: 10,
            api_keys: Vec::new(),
            cors_origins: vec!["*".to_owned()],
            ws_listen: None,
            print_openapi: false,
            log_format: LogFormat::Text,
        }
    }
}
