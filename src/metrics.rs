//! Counters for `GET /metrics`, in the Prometheus text format.
//!
//! Plain atomics, shared by the parts of one gateway through an `Arc`; rendering reads them
//! without stopping anyone.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod models;
mod process;

pub use models::{Models, Outcome, TTFT_BUCKETS, code_label};

use crate::encoding::Transport;
use crate::hub::Deliveries;

/// Upper bounds of the SQLite write latency histogram, in seconds.
const WRITE_BUCKETS: [f64; 12] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

/// What holds one of `--max-streams`' places, for the per-transport gauge: a live stream, or
/// a `GET /conversations/:id/last` waiting for a running turn (held as long as a stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    Live(Transport),
    Last,
}

impl Holder {
    const ALL: [Holder; 4] = [
        Holder::Live(Transport::Sse),
        Holder::Live(Transport::Ndjson),
        Holder::Live(Transport::WebSocket),
        Holder::Last,
    ];

    fn index(self) -> usize {
        match self {
            Holder::Live(t) => t as usize,
            Holder::Last => Transport::ALL.len(),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Holder::Live(t) => t.label(),
            Holder::Last => "last",
        }
    }
}

#[derive(Default)]
pub struct Metrics {
    pub turns_started: AtomicU64,
    pub turns_sealed: AtomicU64,
    pub turns_failed: AtomicU64,
    pub turns_aborted: AtomicU64,
    /// Turns whose quota charge was (partly) estimated, and the tokens so charged.
    pub quota_estimated_turns: AtomicU64,
    pub quota_estimated_tokens: AtomicU64,
    pub events_emitted: AtomicU64,
    /// Events delivered and the rounds' writes (counted by the hub's parked streams too).
    pub deliveries: Arc<Deliveries>,
    open_streams: [AtomicU64; Holder::ALL.len()],
    pub lag_recoveries: AtomicU64,
    pub subscriber_drops: AtomicU64,
    write_buckets: [AtomicU64; WRITE_BUCKETS.len()],
    write_count: AtomicU64,
    write_micros: AtomicU64,
    runtime_errors: Mutex<BTreeMap<&'static str, u64>>,
    /// Turns by model and credential (`metrics/models.rs`).
    pub models: Models,
    responses: Responses,
    pub bus: BusCounters,
}

/// HTTP responses by status code (100 to 599).
struct Responses([AtomicU64; 500]);

impl Default for Responses {
    fn default() -> Responses {
        Responses(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

/// The bus's health, rendered by a gateway on a bus only (`--bus`).
#[derive(Default)]
pub struct BusCounters {
    pub configured: AtomicBool,
    pub connected: AtomicBool,
    /// Messages of this gateway's turns the bus did not take.
    pub messages_missed: AtomicU64,
    /// Times a turn of this gateway was sent again (from the first event the stream did not acknowledge).
    pub turns_resent: AtomicU64,
    /// Turns of other gateways ended here with events missing (watchers read the rest from history).
    pub turns_cut: AtomicU64,
    /// Bus messages refused: not signed with the cluster's key, stale, or inconsistent.
    pub rejected: AtomicU64,
}

/// A credential's agent processes: how many run now and how many were started so far (each
/// runtime that runs processes says, `runtime::Runtime::processes`).
#[derive(Debug, Clone, PartialEq)]
pub struct Processes {
    pub credential: String,
    pub running: usize,
    pub started: u64,
}

/// The hub's pacing, for the gauges.
#[derive(Debug, Clone, Copy)]
pub struct Pacing {
    pub window: std::time::Duration,
    pub write_cost: std::time::Duration,
    /// Watchers reading in-flight turns here, and on the cluster's other gateways.
    pub readers: usize,
    pub readers_elsewhere: usize,
}

impl Metrics {
    pub fn open_streams(&self) -> u64 {
        self.open_streams.iter().map(|g| g.load(Relaxed)).sum()
    }

    /// Records the duration of one write transaction of turns (either backend).
    pub fn observe_write(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        for (bucket, bound) in self.write_buckets.iter().zip(WRITE_BUCKETS) {
            if seconds <= bound {
                bucket.fetch_add(1, Relaxed);
            }
        }
        self.write_count.fetch_add(1, Relaxed);
        self.write_micros.fetch_add(took.as_micros() as u64, Relaxed);
    }

    /// Write transactions of turns so far.
    pub fn writes(&self) -> u64 {
        self.write_count.load(Relaxed)
    }

    /// Counts a response with this status, answered by the router or refused by the connection.
    pub fn responded(&self, status: axum::http::StatusCode) {
        if let Some(count) = self.responses.0.get(usize::from(status.as_u16()).wrapping_sub(100)) {
            count.fetch_add(1, Relaxed);
        }
    }

    /// Counts a turn error of `kind`: a bounded set (an error code's label, `retried`), so that
    /// no client or agent program makes new series.
    pub fn runtime_error(&self, kind: &'static str) {
        let mut errors = self.runtime_errors.lock().unwrap_or_else(|p| p.into_inner());
        *errors.entry(kind).or_default() += 1;
    }

    /// The text exposition; `running`, `channels`, `buffered`, `pacing` and `connections` are
    /// read from their owners.
    pub fn render(
        &self,
        running: usize,
        channels: usize,
        buffered: usize,
        pacing: Pacing,
        connections: usize,
        agents: &[Processes],
    ) -> String {
        let mut out = Exposition(String::with_capacity(4096));
        self.render_turns(&mut out);
        out.gauge("dispatch_turns_running", "Turns running now.", running);
        out.gauge("dispatch_open_connections", "Client connections open (--max-connections).", connections);
        render_hub(&mut out, channels, buffered, pacing);
        out.family("dispatch_open_streams", "gauge", "Open live streams.");
        for t in Holder::ALL {
            out.sample(
                "dispatch_open_streams",
                &format!("transport=\"{}\"", t.label()),
                self.open_streams[t.index()].load(Relaxed),
            );
        }
        self.render_writes(&mut out);
        self.render_errors(&mut out);
        self.models.render(&mut out);
        render_agents(&mut out, agents);
        out.family(
            "dispatch_build_info",
            "gauge",
            "The gateway's version (1): which version each gateway of a cluster runs.",
        );
        out.sample("dispatch_build_info", &format!("version=\"{}\"", env!("CARGO_PKG_VERSION")), 1);
        let mut out = out.0;
        self.bus.render(&mut out);
        process::render(&mut out);
        out
    }

    /// Turns and their events, and what delivering them cost.
    fn render_turns(&self, out: &mut Exposition) {
        out.counter("dispatch_turns_started_total", "Turns started.", self.turns_started.load(Relaxed));
        out.counter(
            "dispatch_quota_estimated_turns_total",
            "Turns counted against a tokens_per_day quota with an estimate for a step that reported no usage (stopped, failed, cut).",
            self.quota_estimated_turns.load(Relaxed),
        );
        out.counter(
            "dispatch_quota_estimated_tokens_total",
            "Tokens those turns were charged in all (reported and estimated).",
            self.quota_estimated_tokens.load(Relaxed),
        );
        out.counter(
            "dispatch_turns_sealed_total",
            "Turns sealed, whatever their end.",
            self.turns_sealed.load(Relaxed),
        );
        out.counter(
            "dispatch_turns_failed_total",
            "Turns that ended with done{reason:error}.",
            self.turns_failed.load(Relaxed),
        );
        out.counter(
            "dispatch_turns_aborted_total",
            "Turns that ended with done{reason:aborted}.",
            self.turns_aborted.load(Relaxed),
        );
        out.counter("dispatch_events_emitted_total", "Events published by turns.", self.events_emitted.load(Relaxed));
        out.counter(
            "dispatch_events_delivered_total",
            "Events handed to watchers' connections (one per watcher).",
            self.deliveries.events.load(Relaxed),
        );
        out.counter(
            "dispatch_subscriber_lag_recoveries_total",
            "Watchers whose position was coalesced away and who were resynced.",
            self.lag_recoveries.load(Relaxed),
        );
        out.counter(
            "dispatch_subscriber_drops_total",
            "Watchers disconnected because they could not be refilled or did not drain.",
            self.subscriber_drops.load(Relaxed),
        );
        out.counter(
            "dispatch_round_writes_total",
            "Writes a turn's round made itself to the sockets of parked SSE and NDJSON streams.",
            self.deliveries.round_writes.load(Relaxed),
        );
        out.counter(
            "dispatch_round_short_writes_total",
            "Rounds' writes the socket took only part of (a slow reader): its stream's task writes the rest.",
            self.deliveries.round_short_writes.load(Relaxed),
        );
    }

    /// The latency histogram of the turns' write transactions.
    fn render_writes(&self, out: &mut Exposition) {
        let name = "dispatch_sqlite_write_seconds";
        out.family(
            name,
            "histogram",
            "Latency of the write transactions of turns (opens, appends, seals; group-committed) on either backend.",
        );
        for (bucket, bound) in self.write_buckets.iter().zip(WRITE_BUCKETS) {
            out.sample(&format!("{name}_bucket"), &format!("le=\"{bound}\""), bucket.load(Relaxed));
        }
        let count = self.write_count.load(Relaxed);
        out.sample(&format!("{name}_bucket"), "le=\"+Inf\"", count);
        out.sample(&format!("{name}_sum"), "", self.write_micros.load(Relaxed) as f64 / 1e6);
        out.sample(&format!("{name}_count"), "", count);
    }

    /// Turn errors by kind, and HTTP responses by status.
    fn render_errors(&self, out: &mut Exposition) {
        out.family("dispatch_runtime_errors_total", "counter", "Turn errors by kind.");
        for (kind, n) in self.runtime_errors.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            out.sample("dispatch_runtime_errors_total", &format!("kind=\"{}\"", label_value(kind)), n);
        }
        out.family(
            "dispatch_http_responses_total",
            "counter",
            "HTTP responses by status code (a live stream counts when it opens).",
        );
        for (code, n) in (100..).zip(&self.responses.0).map(|(code, n)| (code, n.load(Relaxed))).filter(|(_, n)| *n > 0)
        {
            out.sample("dispatch_http_responses_total", &format!("code=\"{code}\""), n);
        }
    }
}

/// The hub: conversations held, bytes buffered, and the pacing of its rounds.
fn render_hub(out: &mut Exposition, channels: usize, buffered: usize, pacing: Pacing) {
    out.gauge("dispatch_hub_channels", "Conversations the hub holds state for.", channels);
    out.gauge(
        "dispatch_hub_buffer_bytes",
        "Bytes held by replay buffers (turns in flight, and sealed turns still being read).",
        buffered,
    );
    out.gauge(
        "dispatch_flush_window_seconds",
        "How long paced deltas may wait for their round now.",
        pacing.window.as_secs_f64(),
    );
    out.gauge(
        "dispatch_round_write_seconds",
        "What a round's write to one socket costs, as measured (the flush window follows it).",
        pacing.write_cost.as_secs_f64(),
    );
    out.gauge(
        "dispatch_watchers_reading",
        "Watchers reading turns in flight here (the flush window follows them).",
        pacing.readers,
    );
    out.gauge(
        "dispatch_watchers_reading_elsewhere",
        "Watchers reading turns in flight on the cluster's other gateways, as they last said (the flush window counts them too).",
        pacing.readers_elsewhere,
    );
}

/// The command runtimes' processes, by credential (none without a command credential).
fn render_agents(out: &mut Exposition, agents: &[Processes]) {
    if agents.is_empty() {
        return;
    }
    let label = |a: &Processes| format!("credential=\"{}\"", label_value(&a.credential));
    out.family("dispatch_agent_processes", "gauge", "Agent processes running, by credential (max_processes).");
    for a in agents {
        out.sample("dispatch_agent_processes", &label(a), a.running);
    }
    out.family(
        "dispatch_agent_starts_total",
        "counter",
        "Agent processes started, by credential (a restart for another model, folder, effort or session, or after a death, counts).",
    );
    for a in agents {
        out.sample("dispatch_agent_starts_total", &label(a), a.started);
    }
}

/// A label's value as the exposition format can carry it: no backslash, quote or newline.
fn label_value(value: &str) -> String {
    value.replace(['\\', '"', '\n'], "_")
}

/// The Prometheus text exposition, written a metric family at a time.
struct Exposition(String);

impl Exposition {
    /// A family's `HELP` and `TYPE` lines.
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    /// One sample, with its labels (`a="x",b="y"`, or none).
    fn sample(&mut self, name: &str, labels: &str, value: impl std::fmt::Display) {
        if labels.is_empty() {
            let _ = writeln!(self.0, "{name} {value}");
        } else {
            let _ = writeln!(self.0, "{name}{{{labels}}} {value}");
        }
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.family(name, "counter", help);
        self.sample(name, "", value);
    }

    fn gauge(&mut self, name: &str, help: &str, value: impl std::fmt::Display) {
        self.family(name, "gauge", help);
        self.sample(name, "", value);
    }
}

impl BusCounters {
    fn render(&self, out: &mut String) {
        if !self.configured.load(Relaxed) {
            return;
        }
        let connected = u8::from(self.connected.load(Relaxed));
        let _ = writeln!(
            out,
            "# HELP dispatch_bus_connected Whether the gateway is connected to the bus (1) or reconnecting (0).\n# TYPE dispatch_bus_connected gauge\ndispatch_bus_connected {connected}"
        );
        for (name, help, value) in [
            (
                "dispatch_bus_messages_missed_total",
                "Messages of this gateway's turns the bus did not take.",
                &self.messages_missed,
            ),
            (
                "dispatch_bus_turns_resent_total",
                "Times a turn was sent to the bus again, as the bus may have lost part of it.",
                &self.turns_resent,
            ),
            (
                "dispatch_bus_turns_cut_total",
                "Other gateways' turns ended here with events missing or without their end: their watchers read the rest from history.",
                &self.turns_cut,
            ),
            (
                "dispatch_bus_rejected_total",
                "Bus messages refused: not signed with the cluster's key, stale, or not what their subject and headers say.",
                &self.rejected,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", value.load(Relaxed));
        }
    }
}

/// A stream's own early end: cancelled, with why, when the credential that opened it is taken
/// back. Its token is a child of the shutdown's (`drained`), so a stream waits on one token for
/// both and asks [`Ending::why`] which it was.
#[derive(Clone)]
pub struct Ending {
    pub token: tokio_util::sync::CancellationToken,
    why: Arc<std::sync::OnceLock<String>>,
}

impl Ending {
    pub fn under(drained: &tokio_util::sync::CancellationToken) -> Ending {
        Ending { token: drained.child_token(), why: Arc::default() }
    }

    /// Ends the stream, saying why (the first reason stands).
    pub fn end(&self, why: &str) {
        let _ = self.why.set(why.to_owned());
        self.token.cancel();
    }

    /// Why the stream was ended early (none: it was not, or only by the shutdown).
    pub fn why(&self) -> Option<&str> {
        self.why.get().map(String::as_str)
    }
}

/// Counts a stream open for as long as it lives, against the cap.
pub struct StreamPermit {
    metrics: std::sync::Arc<Metrics>,
    holder: Holder,
    /// What else the stream holds until it ends (its subject's place under a quota, its grant).
    _held: Option<Box<dyn Send + Sync>>,
    /// The stream's early end, when its caller signed in (none with auth off).
    ending: Option<Ending>,
}

impl StreamPermit {
    /// Opens a stream unless `max` are open already.
    pub fn acquire(metrics: &std::sync::Arc<Metrics>, holder: Holder, max: usize) -> Option<StreamPermit> {
        let gauge = &metrics.open_streams[holder.index()];
        gauge.fetch_add(1, Relaxed);
        if metrics.open_streams() > max as u64 {
            gauge.fetch_sub(1, Relaxed);
            return None;
        }
        Some(StreamPermit { metrics: metrics.clone(), holder, _held: None, ending: None })
    }

    /// The permit of a stream that ends early with `ending`.
    pub fn ending(mut self, ending: Ending) -> StreamPermit {
        self.ending = Some(ending);
        self
    }

    /// The token a stream ends on: its own early end, else the shutdown's `drained`.
    pub fn end_token<'a>(
        &'a self,
        drained: &'a tokio_util::sync::CancellationToken,
    ) -> &'a tokio_util::sync::CancellationToken {
        self.ending.as_ref().map_or(drained, |e| &e.token)
    }

    /// Why the stream was ended early, if it was (not the shutdown).
    pub fn ended(&self) -> Option<&str> {
        self.ending.as_ref().and_then(Ending::why)
    }

    /// The permit holding `held` too, for as long as the stream lives.
    pub fn holding(mut self, held: impl Send + Sync + 'static) -> StreamPermit {
        self._held = Some(Box::new(held));
        self
    }
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        self.metrics.open_streams[self.holder.index()].fetch_sub(1, Relaxed);
    }
}
