//! Configuration: one TOML file (`--config`, default `dispatch-gateway.toml` when present),
//! every key of which is also a `DISPATCH_*` environment variable, the main ones flags too.
//! Flags win over the environment, the environment over the file, the file over defaults.
//! With nothing at all the gateway serves on 127.0.0.1:24203 with SQLite at
//! `./data/dispatch.db` and the scripted runtime as `demo/scripted`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

mod credentials;
mod database;
mod load;
mod origins;
mod reference;

pub use credentials::{
    CommandCredential, Credential, Dialect, MAX_GRACE_SECS, McpScope, McpServer, OpenAiCredential, Quotas,
    RequestParams, ScriptedCredential,
};
pub use database::Database;
use load::url_parts;
pub use load::{ConfigError, redacted};
pub use origins::LOOPBACK_ORIGINS;
pub use reference::reference;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The highest `--max-headers` takes (the connection's head parser keeps room for this many on
/// its stack, `net/http1.rs`).
pub const MOST_HEADERS: usize = 1000;

/// Flags that do something once and exit instead of serving: the command line's only.
const ACTIONS: [&str; 3] = ["print_openapi", "print_configuration", "backup"];

/// The log levels `RUST_LOG` asks for: a level, `target=level` entries, or both,
/// comma-separated; unset or anything else is `info` (docs/operations.md, "Logs").
pub fn log_filter() -> tracing_subscriber::filter::Targets {
    levels(std::env::var("RUST_LOG").ok().as_deref())
}

fn levels(asked: Option<&str>) -> tracing_subscriber::filter::Targets {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    let parsed = asked.and_then(|v| v.parse::<Targets>().ok());
    let filter = parsed.unwrap_or_else(|| Targets::new().with_default(tracing::Level::INFO));
    let Some(default) = filter.default_level() else { return filter };
    let named = |target: &str| asked.is_some_and(|v| v.contains(target));
    QUIET
        .into_iter()
        .filter(|target| !named(target))
        .fold(filter, |filter, target| filter.with_target(target, default.min(LevelFilter::WARN)))
}

/// Libraries whose `info` lines are noise for an operator; they show from `warn` up unless
/// `RUST_LOG` names them. The NATS client says every failed reconnection attempt, several a
/// second while the bus is down (the gateway says the loss once, bus/mod.rs); PostgreSQL's
/// notices say at every start that the migrations' table exists; the MCP client says every
/// notification a server sends (the gateway says what matters, tools/server.rs).
const QUIET: [&str; 3] = ["async_nats", "sqlx::postgres::notice", "rmcp"];

#[derive(Debug, Clone, Parser)]
#[command(name = "dispatch-gateway", version, about = "Turns, an append-only log and live streams for agent runtimes")]
pub struct Config {
    /// The TOML configuration file (default: `dispatch-gateway.toml` when it exists).
    #[arg(long, env = "DISPATCH_CONFIG")]
    pub config: Option<PathBuf>,

    /// The model a turn runs on when neither the request nor the conversation names one
    /// (default: the first model configured).
    #[arg(long, env = "DISPATCH_DEFAULT_MODEL")]
    pub default_model: Option<String>,

    /// Address the HTTP API (and the WebSocket at /ws) listens on.
    #[arg(long, env = "DISPATCH_LISTEN", default_value = "127.0.0.1:24203")]
    pub listen: SocketAddr,

    /// Where the data lives: a SQLite file (its folder is created when missing), or a
    /// `postgres://` URL for several gateways sharing one database.
    #[arg(long, env = "DISPATCH_DATABASE", default_value = "./data/dispatch.db")]
    pub database: Database,

    /// Most PostgreSQL connections this gateway opens at once.
    #[arg(long, env = "DISPATCH_POSTGRES_MAX_CONNECTIONS", default_value_t = 16)]
    pub postgres_max_connections: u32,

    /// Milliseconds a running turn's lease on its conversation lasts unless renewed (renewed
    /// every third of it). With several gateways on one database, a turn whose gateway died is
    /// marked interrupted by another within about 1.3 times this (docs/storage.md); with
    /// `--bus`, also how long a gateway hears nothing of a turn it follows before it asks the
    /// database whether the turn still runs (docs/cluster.md). At least 100.
    #[arg(long, env = "DISPATCH_LEASE_TTL_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..))]
    pub lease_ttl_ms: u64,

    /// `nats://` (or `tls://`, TLS required) URL of the bus that gateways sharing a PostgreSQL
    /// database watch and steer each other's turns through (NATS with JetStream; none: this
    /// gateway alone; the `cluster` build); several, comma-separated, for a cluster. `user:password@` or `token@` before the
    /// host authenticates (put it in DISPATCH_BUS rather than on the command line).
    #[arg(long, env = "DISPATCH_BUS")]
    pub bus: Option<String>,

    /// PEM file of the certificate authorities the bus's TLS certificate is checked against
    /// (besides the system's); TLS is then required.
    #[arg(long, env = "DISPATCH_BUS_CA_FILE")]
    pub bus_ca_file: Option<std::path::PathBuf>,

    /// PEM certificate this gateway presents to the bus (with `--bus-client-key`), for a NATS
    /// server that verifies its clients; TLS is then required.
    #[arg(long, env = "DISPATCH_BUS_CLIENT_CERT", requires = "bus_client_key")]
    pub bus_client_cert: Option<std::path::PathBuf>,

    /// The PEM private key of `--bus-client-cert`.
    #[arg(long, env = "DISPATCH_BUS_CLIENT_KEY", requires = "bus_client_cert")]
    pub bus_client_key: Option<std::path::PathBuf>,

    /// A NATS credentials file (a user JWT and its NKEY seed, as `nsc` writes them) this
    /// gateway authenticates to the bus with: a NATS server in operator (JWT) mode. Read at every
    /// connection: a file renewed in place is used at the next reconnect.
    #[arg(long, env = "DISPATCH_BUS_CREDS", conflicts_with = "bus_nkey")]
    pub bus_creds: Option<std::path::PathBuf>,

    /// A file holding the user NKEY seed (`SU...`) this gateway authenticates to the bus with:
    /// a NATS server whose `authorization` lists the key's public half. Read at every connection.
    /// One of `--bus-creds`, `--bus-nkey` or a URL's user, not two.
    #[arg(long, env = "DISPATCH_BUS_NKEY")]
    pub bus_nkey: Option<std::path::PathBuf>,

    /// Seconds a turn's events stay in the bus's stream (a late joiner elsewhere replays from
    /// it), and a turn's end waits for a bus that is down. Set when the stream is created: a
    /// stream that exists keeps its own, which is logged.
    #[arg(long, env = "DISPATCH_BUS_MAX_AGE_SECS", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..))]
    pub bus_max_age_secs: u64,

    /// Bytes the bus's stream holds at most; past it the oldest events leave (set when the
    /// stream is created, as `--bus-max-age-secs`).
    #[arg(long, env = "DISPATCH_BUS_MAX_BYTES", default_value_t = 1 << 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub bus_max_bytes: u64,

    /// Milliseconds a request over the bus (a stop, a queued message) may take, and a new
    /// watcher waits for a conversation to be caught up from it; also how long a watcher waits
    /// for a turn's events the bus lost to be sent again, and a turn's gateway goes on sending
    /// them after its end (docs/cluster.md).
    #[arg(long, env = "DISPATCH_BUS_TIMEOUT_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    pub bus_timeout_ms: u64,

    /// Milliseconds a write waits for another process's lock on the database.
    #[arg(long, env = "DISPATCH_SQLITE_BUSY_TIMEOUT_MS", default_value_t = 5000)]
    pub sqlite_busy_timeout_ms: u64,

    /// Largest database size in pages (0 = no limit): past it writes fail and turns end with an
    /// error until space is freed.
    #[arg(long, env = "DISPATCH_SQLITE_MAX_PAGES", default_value_t = 0)]
    pub sqlite_max_pages: u64,

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

    /// Most chunks a history read holds at once: a longer read (no `limit`, or a larger one)
    /// is sent in pages of this many, each read when the previous one is written
    /// (docs/storage.md). 1 to 1,000,000.
    #[arg(long, env = "DISPATCH_HISTORY_PAGE_CHUNKS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub history_page_chunks: u64,

    /// Most bytes of chunks a history page holds, and of turns' metrics a metrics page: a page
    /// ends at this many bytes or at its count (`--history-page-chunks`,
    /// `--metrics-page-turns`), whichever comes first (one chunk or turn larger than it is a
    /// page of its own): a reader that stops reading holds about three pages, whatever the
    /// chunks' sizes. 1 KiB to 4 GiB.
    #[arg(long, env = "DISPATCH_HISTORY_PAGE_BYTES", default_value_t = 4 * 1024 * 1024,
          value_parser = clap::value_parser!(u64).range(1024..=1 << 32))]
    pub history_page_bytes: u64,

    /// Most turns a `GET /conversations/{id}/metrics` read holds at once: a longer read is
    /// sent in pages of this many, each read when the previous one is written. 1 to 1,000,000.
    #[arg(long, env = "DISPATCH_METRICS_PAGE_TURNS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub metrics_page_turns: u64,

    /// Most rows one write of a conversation's deletion removes: a long conversation goes in
    /// batches of this many, so the writes of other conversations wait for one batch at most
    /// (the conversation is gone for reads at once; docs/storage.md). 1 to 1,000,000.
    #[arg(long, env = "DISPATCH_DELETE_BATCH_ROWS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub delete_batch_rows: u64,

    /// Bytes a turn's replay buffer may hold before runs of deltas in it are coalesced. On a
    /// bus, also the most a turn's outbox holds waiting for NATS, and of a turn its gateway
    /// keeps to send again (docs/cluster.md).
    #[arg(long, env = "DISPATCH_TURN_BUFFER_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub turn_buffer_bytes: usize,

    /// Most bytes a turn's replay buffer holds, every event kind and framing counted: past it
    /// (after coalescing) its oldest events go, down to three quarters of it, and a watcher
    /// that needed them gets `resync` and reads history (SSE, WebSocket; an NDJSON watcher is
    /// cut) (docs/streaming.md).
    #[arg(long, env = "DISPATCH_TURN_BUFFER_MAX_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub turn_buffer_max_bytes: usize,

    /// Most bytes the replay buffers of every turn hold together: past it the turn publishing
    /// gives up its oldest events, as past `--turn-buffer-max-bytes` (`/metrics` shows the
    /// total as `dispatch_hub_buffer_bytes`).
    #[arg(long, env = "DISPATCH_REPLAY_MAX_BYTES", default_value_t = 1024 * 1024 * 1024)]
    pub replay_max_bytes: usize,

    /// Largest line an agent program prints (the `command` runtimes) or event an
    /// OpenAI-compatible upstream streams, in bytes: past it the turn ends with an error
    /// (`agent-protocol`, the process stopped; `upstream`). Also the most of an upstream's
    /// error response that is read.
    #[arg(long, env = "DISPATCH_MAX_RUNTIME_LINE_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub max_runtime_line_bytes: usize,

    /// Largest tool result a model gets back, in bytes: past it the result is cut, with a line
    /// saying how much was left out (docs/tools.md). Also the most of a turn's streamed tool
    /// output the log keeps with its results (all its calls together).
    #[arg(long, env = "DISPATCH_MAX_TOOL_RESULT_BYTES", default_value_t = 1024 * 1024)]
    pub max_tool_result_bytes: usize,

    /// Most bytes of conversation an OpenAI-compatible request carries (its messages' text
    /// and tool calls, as the context trimming counts them): past it the oldest turns are left
    /// out, with or without a `context_window`, so a turn never reads or sends a whole long log.
    /// 1 KiB to 1 GiB.
    #[arg(long, env = "DISPATCH_MAX_RUNTIME_REQUEST_BYTES", default_value_t = 16 * 1024 * 1024,
          value_parser = clap::value_parser!(u64).range(1024..=1 << 30))]
    pub max_runtime_request_bytes: u64,

    /// Most bytes of text, reasoning and tool-call arguments one step of an OpenAI-compatible
    /// upstream streams: past it the turn ends with code `upstream`. Each event is bounded by
    /// `--max-runtime-line-bytes`; this bounds what a step gathers (its text and arguments go
    /// up again in the agent loop's next request). 1 KiB to 1 GiB.
    #[arg(long, env = "DISPATCH_MAX_STEP_BYTES", default_value_t = 16 * 1024 * 1024,
          value_parser = clap::value_parser!(u64).range(1024..=1 << 30))]
    pub max_step_bytes: u64,

    /// Seconds between keep-alives on idle streams (SSE comment, NDJSON empty line, WebSocket
    /// ping).
    #[arg(long, env = "DISPATCH_KEEPALIVE_SECS", default_value_t = 15)]
    pub keepalive_secs: u64,

    /// The flush window, in sweeps: a sweep is the time the gateway's workers take to write
    /// one event to every watcher reading a turn in flight, at the cost of a socket write the
    /// rounds measure. Deltas published within the window of the last round of wake-ups share
    /// the next one (and one write per watcher). Larger saves CPU under fan-out, smaller cuts
    /// latency; 0 sends every delta at once. See "Pacing" in docs/streaming.md.
    #[arg(long, env = "DISPATCH_FLUSH_SWEEPS", default_value_t = dispatch_fanout::hub::FlushWindow::SWEEPS)]
    pub flush_sweeps: u32,

    /// Longest flush window, in milliseconds, while two sweeps fit under it (past that the
    /// window is two sweeps: the rounds would otherwise fall behind). The latency a delta may
    /// be held for fewer writes: when writes get dearer, the window stops here rather than
    /// trade more latency for CPU.
    #[arg(long, env = "DISPATCH_FLUSH_MAX_MS", default_value_t = dispatch_fanout::hub::FlushWindow::MAX_MS)]
    pub flush_max_ms: u64,

    /// Seconds a connection may go without its socket taking any bytes while the gateway has
    /// bytes for it; past that it is closed (the client comes back with its cursor).
    #[arg(long, env = "DISPATCH_DRAIN_TIMEOUT_SECS", default_value_t = 30)]
    pub drain_timeout_secs: u64,

    /// Most live streams (SSE, NDJSON, WebSocket) open at once, and `/last` requests waiting
    /// for a turn; past it, 503. The open-file limit is raised to the hard limit at start, with
    /// a warning when that leaves too little (docs/operations.md).
    #[arg(long, env = "DISPATCH_MAX_STREAMS", default_value_t = 10_000)]
    pub max_streams: usize,

    /// Seconds a turn may run; past it, it ends with `error{code:"timeout"}` and
    /// `done{reason:"error"}`, keeping what it streamed.
    #[arg(long, env = "DISPATCH_MAX_TURN_SECS", default_value_t = 3600,
          value_parser = clap::value_parser!(u64).range(1..=365 * 24 * 3600))]
    pub max_turn_secs: u64,

    /// Client connections open at once, on both listeners (default: --max-streams + 1024);
    /// past it new connections wait in the listen queue.
    #[arg(long, env = "DISPATCH_MAX_CONNECTIONS", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: Option<u64>,

    /// Turns this gateway runs at once (from their start until their seal is written; a
    /// conversation being deleted takes a place too); past it, a new turn is 503 on every route
    /// and `chat.error` on the WebSocket (`/ready` stays 200: reads and streams go on).
    #[arg(long, env = "DISPATCH_MAX_TURNS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_turns: u64,

    /// Seconds a non-streaming request may take before it is answered 503; a request body not
    /// in within this long of its head is answered 408.
    #[arg(long, env = "DISPATCH_REQUEST_TIMEOUT_SECS", default_value_t = 30)]
    pub request_timeout_secs: u64,

    /// Seconds shutdown waits for running turns to seal and streams to finish.
    #[arg(long, env = "DISPATCH_SHUTDOWN_TIMEOUT_SECS", default_value_t = 10)]
    pub shutdown_timeout_secs: u64,

    /// Milliseconds the gateway goes on serving reads after the last running turn has sealed at
    /// shutdown (within the shutdown timeout), so clients can read the history and metrics of
    /// what just ended; `/ready` and new turns are 503 meanwhile.
    #[arg(long, env = "DISPATCH_SHUTDOWN_GRACE_MS", default_value_t = 1000)]
    pub shutdown_grace_ms: u64,

    /// API keys, comma-separated: each is an administrator's credential (docs/identity.md).
    /// With keys or tokens set, every route but /health, /ready, /openapi.json and the pages
    /// (and every WebSocket upgrade, on any path) needs `Authorization: Bearer <key or
    /// token>`, `?access_token=` or the session cookie. An empty entry (`"k,"`) stops the start.
    #[arg(long, env = "DISPATCH_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,

    /// A file whose bytes (less one trailing newline) are the HS256 secret that signs tokens
    /// (32 bytes at least).
    #[arg(long, env = "DISPATCH_JWT_SECRET_FILE", value_name = "FILE")]
    pub jwt_secret_file: Option<PathBuf>,

    /// A PEM public key (RSA: RS256; EC P-256: ES256) that signs tokens.
    #[arg(long, env = "DISPATCH_JWT_PUBLIC_KEY_FILE", value_name = "FILE")]
    pub jwt_public_key_file: Option<PathBuf>,

    /// A JWKS URL whose keys sign tokens: fetched at start, cached, fetched again for a token
    /// naming an unknown `kid` (at most once a minute).
    #[arg(long, env = "DISPATCH_JWKS_URL")]
    pub jwks_url: Option<String>,

    /// Largest JWKS document read, in bytes; a bigger one is not taken.
    #[arg(long, env = "DISPATCH_JWKS_MAX_BYTES", default_value_t = 1024 * 1024,
          value_parser = clap::value_parser!(u64).range(1024..=64 * 1024 * 1024))]
    pub jwks_max_bytes: u64,

    /// Bytes of tokens already verified that are remembered (up to a minute, never past their
    /// `exp`), so that a client's every request does not verify its signature again; 0: none.
    #[arg(long, env = "DISPATCH_TOKEN_CACHE_BYTES", default_value_t = 1024 * 1024,
          value_parser = clap::value_parser!(u64).range(0..=1 << 30))]
    pub token_cache_bytes: u64,

    /// Seconds between JWKS fetches a token with an unknown `kid` may cause (60; tests
    /// shorten it).
    #[arg(skip = 60u64)]
    pub jwks_refetch_secs: u64,

    /// Seconds between reads of the JWKS (sooner when its `Cache-Control: max-age` says so, at
    /// most every 10 s): a key withdrawn from the set is refused from the next read on, and the
    /// streams and sessions it opened end then.
    #[arg(long, env = "DISPATCH_JWKS_REFRESH_SECS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub jwks_refresh_secs: u64,

    /// The `iss` every token must carry, when set.
    #[arg(long, env = "DISPATCH_JWT_ISSUER")]
    pub jwt_issuer: Option<String>,

    /// The `aud` every token must carry (one of its values), when set.
    #[arg(long, env = "DISPATCH_JWT_AUDIENCE")]
    pub jwt_audience: Option<String>,

    /// Marks the session cookie `Secure` for requests whose `X-Forwarded-Proto` is `https`:
    /// set it only behind a proxy that sets that header itself.
    #[arg(long, env = "DISPATCH_TRUST_FORWARDED_PROTO")]
    pub trust_forwarded_proto: bool,

    /// A folder of static files (a web client) served from the gateway's own origin at
    /// `--web-path`: its pages then sign in once and use the session cookie.
    #[arg(long, env = "DISPATCH_WEB_ROOT", value_name = "DIR")]
    pub web_root: Option<PathBuf>,

    /// Where `--web-root` is served: a path that starts and ends with `/`.
    #[arg(long, env = "DISPATCH_WEB_PATH", default_value = "/app/")]
    pub web_path: String,

    /// Conversations one WebSocket session may subscribe to at once; past it `chat.error`.
    #[arg(long, env = "DISPATCH_MAX_WS_SUBSCRIPTIONS", default_value_t = 256)]
    pub max_ws_subscriptions: usize,

    /// Seconds a WebSocket frame, or a fragmented message, may take to arrive complete once
    /// its first byte has; past it the session is closed (1008).
    #[arg(long, env = "DISPATCH_WS_MESSAGE_TIMEOUT_SECS", default_value_t = 10)]
    pub ws_message_timeout_secs: u64,

    /// Messages that may wait for a running turn's next step (`/queue`, `chat.queue`); past
    /// it, 409.
    #[arg(long, env = "DISPATCH_MAX_QUEUED_MESSAGES", default_value_t = 32)]
    pub max_queued_messages: usize,

    /// Bytes of text that may wait for a running turn's next step; past it, 413.
    #[arg(long, env = "DISPATCH_MAX_QUEUED_BYTES", default_value_t = 256 * 1024)]
    pub max_queued_bytes: usize,

    /// Origins whose pages may use the gateway (CORS, WebSocket handshakes, state changes),
    /// comma-separated: `scheme://host[:port]`, `scheme://host:*` for any port, `*` for any
    /// origin. The default lets pages on this machine in (a web client's dev server) and no
    /// others (docs/security.md).
    #[arg(
        long,
        env = "DISPATCH_CORS_ORIGINS",
        value_delimiter = ',',
        default_value = "http://localhost:*,http://127.0.0.1:*,http://[::1]:*"
    )]
    pub cors_origins: Vec<String>,

    /// Origins besides the gateway's own whose pages may use the session cookie alone to change
    /// state or open a WebSocket, comma-separated, as `--cors-origins` writes them. Default:
    /// none, so a page on another port of this machine (same-site to the browser, which sends
    /// it the cookie) cannot act as the person signed in at the console.
    #[arg(long, env = "DISPATCH_SESSION_ORIGINS", value_delimiter = ',')]
    pub session_origins: Vec<String>,

    /// Host names the gateway answers to, comma-separated (`*`: any); a request naming another
    /// `Host` is refused (421) before routing, which closes DNS rebinding. Default: listening on
    /// a loopback address, the loopback names (`localhost`, `127.0.0.1`, `[::1]`, any port);
    /// listening beyond loopback, any (a proxy in front decides).
    #[arg(long, env = "DISPATCH_ALLOWED_HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,

    /// Bytes of request bodies (and WebSocket messages being assembled) the gateway reads at
    /// once, over every connection (a body takes its declared length, a chunked one
    /// `--max-body-bytes`); past it a request with a body is answered 503 with Retry-After,
    /// and a WebSocket that needs more closes 1013. 1 KiB to 1 TiB.
    #[arg(long, env = "DISPATCH_MAX_READING_BYTES", default_value_t = 64 * 1024 * 1024,
          value_parser = clap::value_parser!(u64).range(1024..=1 << 40))]
    pub max_reading_bytes: u64,

    /// Seconds a client may take to send a complete request head.
    #[arg(long, env = "DISPATCH_HEADER_READ_TIMEOUT_SECS", default_value_t = 10)]
    pub header_read_timeout_secs: u64,

    /// Longest request head (request line and headers) in bytes; 431 past it. At least 8 KiB
    /// (hyper's floor for the connections it serves), at most 1 MiB. While a stream is open, at
    /// most 16 KiB of a client's next request is kept.
    #[arg(long, env = "DISPATCH_MAX_HEAD_BYTES", default_value_t = 64 * 1024,
          value_parser = clap::value_parser!(u64).range(8 * 1024..=1024 * 1024))]
    pub max_head_bytes: u64,

    /// Most header lines a request may have; 431 past it (1 to 1000).
    #[arg(long, env = "DISPATCH_MAX_HEADERS", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=MOST_HEADERS as u64))]
    pub max_headers: u64,

    /// A second listener that upgrades any path to the WebSocket protocol (existing web
    /// clients open their socket on port 24205 with no path).
    #[arg(long, env = "DISPATCH_WS_LISTEN")]
    pub ws_listen: Option<SocketAddr>,

    /// Print the OpenAPI document and exit: the served one (`openapi/openapi.json`), or in a
    /// build with `--features openapi`, the one the code's annotations generate.
    #[arg(long)]
    pub print_openapi: bool,

    /// Print the configuration reference (`docs/configuration.md`, generated from these flags'
    /// docs) and exit.
    #[arg(long)]
    pub print_configuration: bool,

    /// Copy the SQLite database (`--database`) into this new file and exit: a consistent copy,
    /// taken while a gateway may be running on it (docs/storage.md, "Backups").
    #[arg(long, value_name = "FILE")]
    pub backup: Option<PathBuf>,

    /// Log output format, `text` or `json`; the level comes from `RUST_LOG` (docs/operations.md).
    #[arg(long, env = "DISPATCH_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Base URL of an OTLP/HTTP receiver (an OpenTelemetry Collector's `http://host:4318`):
    /// each turn's spans (the turn, its runtime attempts, steps, tool calls and seal) are posted
    /// to `<URL>/v1/traces` as protobuf. Needs a build with the `otlp` feature (the Docker image
    /// has it); unset, nothing is exported (docs/operations.md, "Traces").
    #[arg(long, env = "DISPATCH_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,

    /// Credentials by name, from the file's `[credentials.<name>]` tables and
    /// `DISPATCH_CREDENTIALS__<NAME>__<KEY>` variables. None: the `demo` scripted credential.
    #[arg(skip)]
    pub credentials: BTreeMap<String, Credential>,

    /// What each subject who is not an administrator may use, from the file's `[quotas]`
    /// table (docs/identity.md).
    #[arg(skip)]
    pub quotas: Quotas,

    /// MCP servers by name, from the file's `[mcp.<name>]` tables: the tools credentials with
    /// `mcp` give their models (docs/tools.md).
    #[arg(skip)]
    pub mcp: BTreeMap<String, McpServer>,
}

impl Config {
    /// Checks what the parser cannot: an empty API key (`--api-keys "k,"`) would let requests
    /// without a key in, so it stops the start. An empty value as a whole
    /// (`DISPATCH_API_KEYS=`, as compose files pass an unset variable) is no keys: auth off.
    pub fn check(&mut self) -> Result<(), ConfigError> {
        if self.api_keys.len() == 1 && self.api_keys[0].trim().is_empty() {
            self.api_keys.clear();
        }
        if self.api_keys.iter().any(|k| k.trim().is_empty()) {
            return Err(ConfigError::EmptyApiKey);
        }
        if !(self.web_path.len() > 1 && self.web_path.starts_with('/') && self.web_path.ends_with('/')) {
            return Err(ConfigError::Arguments(format!(
                "--web-path {:?}: a path that starts and ends with `/`, not `/` alone",
                self.web_path
            )));
        }
        if !cfg!(feature = "cluster") {
            if matches!(self.database, Database::Postgres(_)) {
                return Err(ConfigError::NotBuilt("a postgres:// database"));
            }
            if self.bus.is_some() {
                return Err(ConfigError::NotBuilt("a bus"));
            }
        }
        let tls = self.bus_ca_file.is_some() || self.bus_client_cert.is_some();
        if tls && self.bus.is_none() {
            return Err(ConfigError::Bus("a bus certificate or authority is set, but no --bus".into()));
        }
        let key = self.bus_creds.is_some() || self.bus_nkey.is_some();
        if key && self.bus.is_none() {
            return Err(ConfigError::Bus("a bus credentials or NKEY file is set, but no --bus".into()));
        }
        if let Some(bus) = &self.bus {
            if !bus.split(',').all(|url| url.trim().starts_with("nats://") || url.trim().starts_with("tls://")) {
                return Err(ConfigError::Bus(format!("nats:// or tls:// URLs, got {:?}", redacted(bus, true))));
            }
            // NATS takes one identity per client.
            let names_someone = bus.split(',').any(|url| url_parts(url).2.contains('@'));
            if key && names_someone {
                return Err(ConfigError::Bus(
                    "the bus URL names a user or token and a credentials or NKEY file is set: NATS takes one".into(),
                ));
            }
            if !matches!(self.database, Database::Postgres(_)) {
                return Err(ConfigError::Bus(
                    "gateways on a bus share a PostgreSQL database: set `database` to a postgres:// URL".into(),
                ));
            }
        }
        Ok(())
    }

    /// `--max-connections`, or room for every stream and a thousand requests besides (at most
    /// u32::MAX, as a semaphore counts them).
    pub fn max_connections(&self) -> usize {
        let max = self.max_connections.map_or(self.max_streams.saturating_add(1024), |max| max as usize);
        max.min(u32::MAX as usize)
    }

    /// The defaults, as if started with no flags and no environment (for tests and embedding).
    pub fn defaults() -> Config {
        Config {
            config: None,
            default_model: None,
            credentials: BTreeMap::new(),
            listen: SocketAddr::from(([127, 0, 0, 1], 24203)),
            database: Database::Sqlite(PathBuf::from("./data/dispatch.db")),
            sqlite_busy_timeout_ms: 5000,
            sqlite_max_pages: 0,
            postgres_max_connections: 16,
            lease_ttl_ms: 10_000,
            bus: None,
            bus_ca_file: None,
            bus_client_cert: None,
            bus_client_key: None,
            bus_creds: None,
            bus_nkey: None,
            bus_max_age_secs: 3600,
            bus_max_bytes: 1 << 30,
            bus_timeout_ms: 5000,
            scripted_pace: 40.0,
            scripted_reasoning: true,
            scripted_script: None,
            max_body_bytes: 1024 * 1024,
            history_page_chunks: 1000,
            history_page_bytes: 4 * 1024 * 1024,
            metrics_page_turns: 1000,
            delete_batch_rows: 1000,
            turn_buffer_bytes: 16 * 1024 * 1024,
            turn_buffer_max_bytes: 64 * 1024 * 1024,
            replay_max_bytes: 1024 * 1024 * 1024,
            max_runtime_line_bytes: 16 * 1024 * 1024,
            max_tool_result_bytes: 1024 * 1024,
            max_runtime_request_bytes: 16 * 1024 * 1024,
            max_step_bytes: 16 * 1024 * 1024,
            keepalive_secs: 15,
            flush_sweeps: 4,
            flush_max_ms: 15,
            drain_timeout_secs: 30,
            header_read_timeout_secs: 10,
            max_head_bytes: 64 * 1024,
            max_headers: 100,
            max_streams: 10_000,
            max_turns: 1000,
            max_turn_secs: 3600,
            max_connections: None,
            request_timeout_secs: 30,
            shutdown_timeout_secs: 10,
            shutdown_grace_ms: 1000,
            api_keys: Vec::new(),
            jwt_secret_file: None,
            jwt_public_key_file: None,
            jwks_url: None,
            jwks_max_bytes: 1024 * 1024,
            token_cache_bytes: 1024 * 1024,
            jwks_refetch_secs: 60,
            jwks_refresh_secs: 300,
            jwt_issuer: None,
            jwt_audience: None,
            trust_forwarded_proto: false,
            web_root: None,
            web_path: "/app/".into(),
            quotas: Quotas::default(),
            mcp: BTreeMap::new(),
            max_ws_subscriptions: 256,
            ws_message_timeout_secs: 10,
            max_queued_messages: 32,
            max_queued_bytes: 256 * 1024,
            cors_origins: LOOPBACK_ORIGINS.iter().map(|o| (*o).to_owned()).collect(),
            session_origins: Vec::new(),
            allowed_hosts: Vec::new(),
            max_reading_bytes: 64 * 1024 * 1024,
            ws_listen: None,
            print_openapi: false,
            print_configuration: false,
            backup: None,
            log_format: LogFormat::Text,
            otlp_endpoint: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Config;

    /// Chatty libraries' lines are warnings and up at the default level and at any level
    /// asked for, unless named; they are never raised above what is asked.
    #[test]
    fn chatty_libraries_stay_out_of_the_log_unless_asked_for() {
        use tracing::Level;
        let shows = |asked: Option<&str>, target: &str, level: Level| super::levels(asked).would_enable(target, &level);
        assert!(shows(None, "dispatch_gateway::bus", Level::INFO));
        assert!(!shows(None, "async_nats", Level::INFO));
        assert!(shows(None, "async_nats", Level::WARN));
        assert!(!shows(Some("debug"), "async_nats", Level::INFO));
        assert!(shows(Some("debug"), "dispatch_gateway", Level::DEBUG));
        assert!(!shows(Some("error"), "async_nats", Level::WARN));
        assert!(shows(Some("info,async_nats=debug"), "async_nats", Level::DEBUG));
        assert!(!shows(None, "sqlx::postgres::notice", Level::INFO));
        assert!(shows(None, "sqlx::postgres::notice", Level::WARN));
        assert!(!shows(Some("dispatch_gateway=debug"), "async_nats", Level::WARN));
        assert!(!shows(Some("dispatch_gateway=loud"), "async_nats", Level::INFO));
        assert!(shows(Some("dispatch_gateway=loud"), "dispatch_gateway", Level::INFO));
    }

    /// The flags' defaults and `Config::defaults()` (which tests, the hub's test window and
    /// embedders use) are written twice; they must say the same.
    #[test]
    fn the_flags_defaults_are_config_defaults() {
        let command = Config::command();
        let set: Vec<_> =
            command.get_arguments().filter_map(|a| a.get_env()).filter(|e| std::env::var_os(e).is_some()).collect();
        if !set.is_empty() {
            eprintln!("skipped: the environment sets {set:?}");
            return;
        }
        let parsed = Config::try_parse_from(["dispatch-gateway"]).expect("no flags parse");
        assert_eq!(format!("{parsed:?}"), format!("{:?}", Config::defaults()));
    }

    /// A bus URL's credentials never reach an error or a log line, whatever the URL holds.
    #[test]
    fn a_bus_urls_credentials_are_redacted() {
        for (url, shown) in [
            ("nats://u:s3cret@127.0.0.1:4222", "nats://u:***@127.0.0.1:4222"),
            ("tls://t0ken@nats.example:4222/x?y=1", "tls://***@nats.example:4222/x?y=1"),
            ("nats://u:p@ss:w@h:1,nats://h2:2", "nats://u:***@h:1,nats://h2:2"),
            ("nats://h:1/a@b", "nats://h:1/a@b"),
            ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
            ("u:secret@host", "u:***@host"),
            ("s3cret@host", "***@host"),
        ] {
            assert_eq!(super::redacted(url, true), shown, "{url}");
        }
        // A PostgreSQL user alone is no secret.
        assert_eq!(super::redacted("postgres://u@h/db", false), "postgres://u@h/db");
    }
}
