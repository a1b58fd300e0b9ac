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
#[command(
    name = "dispatch-gateway",
    version,
    about = "Turns, an append-only log and live streams for agent runtimes"
)]
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
            log_format: LogFormat::Text,
        }
    }
}
