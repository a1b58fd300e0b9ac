//! dispatch-bench: the load generator of `bench/run`.
//!
//! Each subcommand runs one workload against a running server (the gateway, or a peer for the
//! fan-out workloads: nginx with Nchan, or Pushpin), checks every delivery for order and completeness, reads
//! the server's CPU time and memory from `/proc`, and prints one JSON object with its figures.

// These imports are every module's too: each reads the crate root with `use crate::*` (its
// items, and the modules' items re-exported here), so a workload's file holds only its workload.
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod fanout;
mod feed;
mod floor;
mod measure;
mod proxy;
mod reads;
mod scale;
mod tools;
mod watch;
mod workloads;

use fanout::*;
use feed::*;
use floor::*;
use measure::*;
use proxy::*;
use reads::*;
use scale::*;
use watch::*;
use workloads::*;

use clap::{Parser, Subcommand, ValueEnum};
use futures_util::StreamExt;
use serde_json::{Value, json};

#[derive(Parser)]
#[command(about = "Load generator for dispatch-gateway benchmarks")]
struct Cli {
    #[command(subcommand)]
    workload: Workload,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Server {
    Gateway,
    Nchan,
    /// Pushpin in front of an origin that holds every `/sub/<channel>` request as an SSE
    /// stream on that channel; published through Pushpin's HTTP control API (`--publish`).
    Pushpin,
}

#[derive(Subcommand)]
enum Workload {
    /// One conversation (channel), many SSE watchers, `events` events at `rate` per second
    /// (0 = as fast as the server emits).
    Fanout {
        #[arg(long, value_enum)]
        server: Server,
        #[arg(long, value_enum, default_value = "sse")]
        transport: Transport,
        #[arg(long)]
        base: String,
        #[arg(long)]
        watchers: usize,
        #[arg(long)]
        events: usize,
        #[arg(long, default_value_t = 0)]
        rate: u64,
        /// Where a peer takes publishes, when not at `base` (Pushpin's control API).
        #[arg(long)]
        publish: Option<String>,
        /// Server process ids whose CPU time and memory are read from /proc.
        #[arg(long, value_delimiter = ',')]
        pids: Vec<u32>,
        /// Gateways of one cluster the watchers subscribe at, in turn (default: `base`, where
        /// the turn starts): what each node delivers is reported apart.
        #[arg(long, value_delimiter = ',')]
        watch_at: Vec<String>,
        /// The process id of each node of `watch-at`, in order: CPU per delivery per node.
        #[arg(long, value_delimiter = ',')]
        node_pids: Vec<u32>,
    },
    /// Many SSE watchers doing nothing: resident memory per stream.
    Idle {
        #[arg(long, value_enum)]
        server: Server,
        #[arg(long, value_enum, default_value = "sse")]
        transport: Transport,
        #[arg(long)]
        base: String,
        #[arg(long)]
        watchers: usize,
        #[arg(long, value_delimiter = ',')]
        pids: Vec<u32>,
    },
    /// A watcher joins a turn that already emitted `events` events: time until it holds them.
    Latejoin {
        #[arg(long, value_enum)]
        server: Server,
        /// The late watcher's transport (the early one reads SSE).
        #[arg(long, value_enum, default_value = "sse")]
        transport: Transport,
        #[arg(long)]
        base: String,
        #[arg(long)]
        events: usize,
        #[arg(long)]
        rate: u64,
        /// Where a peer takes publishes, when not at `base` (Pushpin's control API).
        #[arg(long)]
        publish: Option<String>,
    },
    /// Many conversations with paced turns at once, many watchers on each.
    Scale {
        #[arg(long, value_enum, default_value = "sse")]
        transport: Transport,
        #[arg(long)]
        base: String,
        #[arg(long)]
        conversations: usize,
        #[arg(long)]
        watchers: usize,
        #[arg(long)]
        events: usize,
        #[arg(long)]
        rate: u64,
        #[arg(long, value_delimiter = ',')]
        pids: Vec<u32>,
    },
    /// Healthy watchers of a burst turn alone, then beside one that never reads.
    Stalled {
        #[arg(long)]
        base: String,
        #[arg(long)]
        watchers: usize,
        #[arg(long)]
        events: usize,
        #[arg(long, value_delimiter = ',')]
        pids: Vec<u32>,
    },
    /// A fake OpenAI-compatible upstream read directly and through the gateway, in alternating
    /// rounds.
    Proxy {
        #[arg(long)]
        base: String,
        /// Address the fake upstream listens on (the gateway's credential points at it).
        #[arg(long)]
        upstream: String,
        /// The gateway model that runs on the upstream.
        #[arg(long)]
        model: String,
        #[arg(long)]
        chunks: usize,
        #[arg(long)]
        rate: u64,
    },
    /// W9: an MCP server's tool called directly and through the gateway's agent loop (a fake
    /// upstream that asks for the calls): latency one call at a time, calls per second with
    /// `clients` at once.
    Tools {
        #[arg(long)]
        base: String,
        /// Address the fake upstream listens on (the gateway's credential points at it).
        #[arg(long)]
        upstream: String,
        /// The gateway model whose credential has the server.
        #[arg(long)]
        model: String,
        /// The server's tool, by its own name and as the gateway names it.
        #[arg(long)]
        tool: String,
        #[arg(long)]
        exposed: String,
        #[arg(long)]
        calls: usize,
        #[arg(long)]
        clients: usize,
        #[arg(long)]
        seconds: f64,
        /// The stdio server's program and arguments (what the gateway's `[mcp]` table runs).
        #[arg(last = true, required = true)]
        server: Vec<String>,
    },
    /// Clients running turns back to back with `POST /chat`.
    Turns {
        #[arg(long)]
        base: String,
        #[arg(long)]
        clients: usize,
        #[arg(long)]
        seconds: f64,
        #[arg(long, value_delimiter = ',')]
        pids: Vec<u32>,
    },
    /// History windows of one long conversation.
    History {
        #[arg(long)]
        base: String,
        #[arg(long)]
        conversation: String,
        #[arg(long)]
        concurrency: usize,
        #[arg(long)]
        seconds: f64,
    },
    /// The floor under any server's fan-out on this machine: a sender that does nothing but
    /// write `bytes` bytes to each of `connections` loopback sockets `rate` times a second
    /// (readers in this process), and the CPU its thread spends per write system call.
    WriteFloor {
        #[arg(long)]
        connections: usize,
        #[arg(long)]
        rate: u64,
        #[arg(long)]
        bytes: usize,
        #[arg(long)]
        seconds: f64,
    },
    /// Writes a conversation of `chunks` chunks straight into a (migrated) database file.
    Seed {
        #[arg(long)]
        database: String,
        #[arg(long)]
        conversation: String,
        #[arg(long)]
        chunks: u64,
    },
}

#[tokio::main]
async fn main() {
    // Built beside the gateway, reqwest carries rustls without a crypto provider (the
    // gateway's choice); the load generator speaks plain HTTP, but a client needs one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    let result = match cli.workload {
        Workload::Fanout { server, transport, base, publish, watchers, events, rate, pids, watch_at, node_pids } => {
            let publish = publish.unwrap_or_else(|| base.clone());
            let nodes = if watch_at.is_empty() { vec![base.clone()] } else { watch_at };
            assert!(node_pids.is_empty() || node_pids.len() == nodes.len(), "one --node-pids entry per --watch-at");
            let target = Target { base: &base, publish: &publish, nodes: &nodes, node_pids: &node_pids };
            fanout(server, transport, target, watchers, events, rate, &pids).await
        }
        Workload::Idle { server, transport, base, watchers, pids } => {
            idle(server, transport, &base, watchers, &pids).await
        }
        Workload::Latejoin { server, transport, base, events, rate, publish } => {
            let publish = publish.unwrap_or_else(|| base.clone());
            latejoin(server, transport, &base, &publish, events, rate).await
        }
        Workload::Scale { transport, base, conversations, watchers, events, rate, pids } => {
            scale(transport, &base, conversations, watchers, events, rate, &pids).await
        }
        Workload::Stalled { base, watchers, events, pids } => stalled(&base, watchers, events, &pids).await,
        Workload::Proxy { base, upstream, model, chunks, rate } => proxy(&base, &upstream, &model, chunks, rate).await,
        Workload::Turns { base, clients, seconds, pids } => turns(&base, clients, seconds, &pids).await,
        Workload::Tools { base, upstream, model, tool, exposed, calls, clients, seconds, server } => {
            let plan = tools::Plan {
                base: &base,
                upstream: &upstream,
                model: &model,
                server: &server,
                tool: &tool,
                exposed: &exposed,
                calls,
                clients,
                seconds,
            };
            tools::tools(plan).await
        }
        Workload::History { base, conversation, concurrency, seconds } => {
            history(&base, &conversation, concurrency, seconds).await
        }
        Workload::WriteFloor { connections, rate, bytes, seconds } => {
            write_floor(connections, rate, bytes, seconds).await
        }
        Workload::Seed { database, conversation, chunks } => seed(&database, &conversation, chunks),
    };
    println!("{result}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_steal_is_the_eighth_field_of_the_cpu_line_over_all_eight() {
        let before = Host::parse("cpu  100 0 50 800 10 0 20 20 0 0\ncpu0 50 0 25 400 5 0 10 10 0 0\n");
        let after = Host::parse("cpu  200 0 100 1500 10 0 40 150 0 0\ncpu0 100 0 50 750 5 0 20 75 0 0\n");
        // 1,000 ticks passed, 130 of them stolen.
        assert_eq!(after.since(before).steal_share(), json!(0.13));
        // Nothing passed, or nothing readable: no share rather than a division by zero.
        assert_eq!(after.since(after).steal_share(), Value::Null);
        assert_eq!(Host::parse("").steal_share(), Value::Null);
    }
}
