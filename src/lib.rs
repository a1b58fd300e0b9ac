//! dispatch-gateway: sits between agent runtimes and the clients that watch them.
//!
//! Data flows one way: request → turn → runtime → turn → hub → transports, and only the turn
//! writes the store. With several gateways, the hub also meets the others' over the bus.

/// NATS between gateways: turn events through JetStream, status changes, control (the
/// `cluster` feature; the hub and the turns meet it through the traits it implements,
/// `hub::Remote` and `turn::Cluster`, and a build without it has none).
#[cfg(feature = "cluster")]
pub mod bus;
/// What a child process (agent program, MCP server) keeps of the gateway's environment.
pub mod child_env;
/// The program: configuration, logs, signals, serving until shutdown.
pub mod cli;
/// Flags and environment.
pub mod config;
/// The bytes of the wire: SSE, NDJSON, WebSocket frames, HTTP chunks (crates/fanout).
pub use dispatch_fanout::encoding;
/// The folders agents and their tools may work in.
pub mod folders;
/// The HTTP API: one module per resource.
pub mod http;
/// Replay buffers and fan-out of turn events (crates/fanout).
pub use dispatch_fanout::hub;
/// Who a request comes from: API keys, signed tokens, session cookies.
pub mod identity;
/// Live streams between the routes that open them and the connections that serve them.
pub mod live;
/// Client-chosen text as it goes into log lines: control characters escaped.
pub mod log_text;
/// Counters for `GET /metrics`.
pub mod metrics;
/// The listening socket: connections that stop draining are closed.
pub mod net;
/// The limit on open files, raised at start.
mod open_files;
/// A turn's spans over OTLP (the `otlp` feature).
#[cfg(feature = "otlp")]
pub mod otlp;
/// Agent runtimes: the contract and its providers.
pub mod runtime;
/// Building the gateway and serving it.
pub mod server;
/// Shutting down, in order: closing, runtimes stopped, grace, drained.
pub mod shutdown;
/// Status changes: a conversation went active, idle or closed, for every session.
pub mod status;
/// SQLite or PostgreSQL: conversations, the chunk log, turns and metrics.
pub mod store;
/// MCP servers and the tools they give models.
pub mod tools;
/// Running turns: wire events, chunks, metrics, sealing.
pub mod turn;
/// The `@dispatch/wire` types (crates/wire).
pub use dispatch_wire as wire;

pub use config::Config;
pub use server::Gateway;
