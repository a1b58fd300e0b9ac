//! The bus between gateways: NATS, with JetStream as the shared replay buffer.
//!
//! A turn's events go to one JetStream stream, a message per run of consecutive events (NDJSON,
//! the hub's own encoding), on two subjects per conversation: `open` for a turn's first message
//! in the stream and `more` for the rest (`publish.rs`). A gateway where a conversation is
//! watched follows it from the last `open` on, with one consumer per conversation, and feeds
//! the turns other gateways run into its hub with the same event indices (`follow.rs`). The stream itself, and
//! what happens when it is lost, is `shared_stream.rs`; the end of a turn whose gateway died,
//! published by another, `interrupted.rs`. Status changes and control requests go
//! over plain NATS (`status.rs`, `control.rs`). Every message names the gateway whose turn it
//! carries, so none reads its own turns back. `docs/cluster.md` explains the design and its
//! limits.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Weak;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::{ConnectOptions, ServerAddr};

use crate::hub::{Following, Hub, Outbox, Remote};
use crate::metrics::Metrics;
use crate::store::Store;
use shared_stream::SharedStream;

mod cluster;
mod control;
mod follow;
mod interrupted;
mod key;
mod publish;
mod readers;
mod shared_stream;
mod sign;
mod status;

/// How soon what failed on the bus is tried again: a follower's consumer, a turn's sending,
/// a check that the stream exists (each at most this often).
const RETRY: Duration = Duration::from_secs(1);

/// The stream holding every gateway's turn events.
const STREAM: &str = "DISPATCH";
/// Headers every event message carries.
const NODE: &str = "Dispatch-Node";
const TURN: &str = "Dispatch-Turn";
const INDEX: &str = "Dispatch-Index";
/// `k/n`: the message is part `k` of `n` of one event's line (an event too large for one).
const PART: &str = "Dispatch-Part";

/// What the configuration says about the bus.
#[derive(Debug, Clone)]
pub struct BusOptions {
    /// Events older than this leave the stream.
    pub max_age: Duration,
    /// The stream's size past which the oldest events leave it.
    pub max_bytes: i64,
    /// How long a request to NATS (and a new watcher's catch-up) may take.
    pub timeout: Duration,
    /// Certificate authorities for the server's certificate, besides the system's.
    pub ca_file: Option<PathBuf>,
    /// The certificate and key this gateway presents.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// A key file this gateway authenticates with, instead of a URL's user or token.
    pub key: Option<BusKey>,
}

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("cannot connect to NATS at {url}: {reason}")]
    Connect { url: String, reason: String },
    #[error("NATS JetStream: {0}")]
    JetStream(String),
}

impl BusError {
    fn js(e: impl std::fmt::Display) -> BusError {
        BusError::JetStream(e.to_string())
    }
}

/// A gateway's connection to the bus (cheap to clone).
#[derive(Clone)]
pub struct Bus(Arc<Inner>);

struct Inner {
    client: async_nats::Client,
    js: jetstream::Context,
    shared: SharedStream,
    /// This gateway's name on the bus: new at every start.
    node: String,
    timeout: Duration,
    /// How long the stream keeps events: a turn's end not yet on the bus waits that long.
    max_age: Duration,
    /// The database, which says whether a turn followed here still runs (`follow.rs`).
    store: Store,
    /// Status changes to send (`status.rs`).
    statuses: tokio::sync::mpsc::UnboundedSender<(String, bytes::Bytes)>,
    metrics: Arc<Metrics>,
    /// Signs what this gateway sends and checks what it hears (`sign.rs`).
    signer: Arc<sign::Signer>,
}

impl Bus {
    /// Connects and makes sure the stream exists (the first gateway creates it; the others
    /// use it as it is).
    pub async fn connect(url: &str, options: BusOptions, metrics: Arc<Metrics>, store: Store) -> Result<Bus, BusError> {
        let node = uuid::Uuid::now_v7().to_string();
        // async-nats takes TLS's crypto from rustls's process default, which a build with two
        // providers compiled in (tests unify reqwest's aws-lc) leaves unset: ring, as upstreams use.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let failed = |reason: String| BusError::Connect { url: crate::config::redacted(url, true), reason };
        let (servers, connect) = connect_options(url, &options).map_err(failed)?;
        let connections = tokio::sync::watch::Sender::new(0);
        let news = connections.clone();
        let health = metrics.clone();
        let client = connect
            .name(format!("dispatch-gateway {node}"))
            .event_callback(move |event| {
                match event {
                    async_nats::Event::Connected => {
                        health.bus.connected.store(true, Relaxed);
                        news.send_modify(|e| *e += 1);
                    }
                    async_nats::Event::Disconnected => health.bus.connected.store(false, Relaxed),
                    _ => {}
                }
                async move { log_event(event) }
            })
            .connection_timeout(options.timeout)
            .request_timeout(Some(options.timeout))
            .connect(servers)
            .await
            .map_err(|e| failed(e.to_string()))?;
        // The cluster's key, from the database every gateway shares: the first gateway makes it.
        let secret = store
            .bus_secret(&sign::new_secret())
            .await
            .map_err(|e| BusError::JetStream(format!("the bus's key could not be read from the database: {e}")))?;
        let signer = Arc::new(sign::Signer::new(secret.as_bytes()));
        let js = jetstream::new(client.clone());
        let shared = SharedStream::open(&client, &js, &options, connections.subscribe()).await?;
        tracing::info!(%node, stream = STREAM, "joined the bus");
        metrics.bus.configured.store(true, Relaxed);
        metrics.bus.connected.store(connected(&client), Relaxed);
        let (statuses, changes) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(status::send_statuses(client.clone(), signer.clone(), changes));
        let (timeout, max_age) = (options.timeout, options.max_age);
        Ok(Bus(Arc::new(Inner { client, js, shared, node, timeout, max_age, store, statuses, metrics, signer })))
    }

    /// Whether the connection to NATS is up now.
    pub fn connected(&self) -> bool {
        connected(&self.0.client)
    }

    /// A subscription to `subject` (what the other gateways send there: `what`), or none, said
    /// in the log, when NATS refuses it.
    async fn listen(&self, subject: &str, what: &str) -> Option<async_nats::Subscriber> {
        match self.0.client.subscribe(subject.to_owned()).await {
            Ok(subscriber) => Some(subscriber),
            Err(e) => {
                tracing::error!(error = %e, subject, "cannot hear the other gateways' {what}");
                None
            }
        }
    }
}

impl Remote for Bus {
    fn outbox(&self, conversation_id: &str, turn_id: &str, cap: usize) -> Outbox {
        publish::outbox(&self.0, conversation_id, turn_id, cap)
    }

    fn follow(&self, hub: Weak<Hub>, conversation_id: Arc<str>) -> Following {
        follow::start(self.0.clone(), hub, conversation_id)
    }

    fn share_readers(&self, hub: Weak<Hub>) {
        tokio::spawn(readers::share(self.0.clone(), hub));
    }

    fn catch_up_timeout(&self) -> Duration {
        self.0.timeout
    }
}

/// The client's news of its connection, in the gateway's words: it reconnects by itself, with
/// backoff, for as long as the gateway runs. Each failed attempt is only a debug line: a bus
/// down for an hour would otherwise write one every few seconds after `lost the bus`.
fn log_event(event: async_nats::Event) {
    match event {
        async_nats::Event::Connected => tracing::info!("connected to the bus"),
        async_nats::Event::Disconnected => tracing::warn!("lost the bus: reconnecting"),
        async_nats::Event::ClientError(e) => tracing::debug!(error = %e, "the bus: an attempt failed"),
        other => tracing::warn!(event = %other, "the bus"),
    }
}

/// A conversation id as one subject token: ids may hold `.`, which NATS reads as a separator.
fn token(conversation_id: &str) -> String {
    hex(conversation_id.as_bytes())
}

/// Bytes as lowercase hex (subject tokens, signatures).
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether a client's connection to NATS is up now.
fn connected(client: &async_nats::Client) -> bool {
    client.connection_state() == async_nats::connection::State::Connected
}

fn open_subject(conversation_id: &str) -> String {
    format!("dispatch.events.open.{}", token(conversation_id))
}

fn more_subject(conversation_id: &str) -> String {
    format!("dispatch.events.more.{}", token(conversation_id))
}

/// Both subjects of a conversation, for its consumer.
fn conversation_filter(conversation_id: &str) -> String {
    format!("dispatch.events.*.{}", token(conversation_id))
}

/// The servers `urls` (comma-separated) name, and the options that authenticate to them: the
/// first URL's `user:password@` or `token@`, or a key file (NATS takes one identity per client;
/// `Config::check` refuses both), TLS required when a certificate file is given.
fn connect_options(urls: &str, options: &BusOptions) -> Result<(Vec<ServerAddr>, ConnectOptions), String> {
    let servers = urls
        .split(',')
        .map(|url| url.trim().parse::<ServerAddr>().map_err(|e| format!("not a NATS URL: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let decoded = |part: &str| percent_encoding::percent_decode_str(part).decode_utf8_lossy().into_owned();
    let mut connect = match &options.key {
        Some(key) => key.connect_options()?,
        None => ConnectOptions::new(),
    };
    if let Some(first) = servers.first()
        && let Some(user) = first.username()
    {
        connect = match first.password() {
            Some(password) => connect.user_and_password(decoded(user), decoded(password)),
            None => connect.token(decoded(user)),
        };
    }
    if let Some(ca) = &options.ca_file {
        connect = connect.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let Some((cert, key)) = &options.client_cert {
        connect = connect.add_client_certificate(cert.clone(), key.clone()).require_tls(true);
    }
    Ok((servers, connect))
}

/// What a message of a turn's events says of itself: the subject it goes to, the gateway that
/// runs the turn, the turn, the index of its first event.
struct Head<'a> {
    subject: &'a str,
    node: &'a str,
    turn_id: &'a str,
    index: u32,
    /// Part `k` of `n` of event `index`'s line.
    part: Option<(u32, u32)>,
}

/// The headers of a message of events, signed over `payload`.
fn message_headers(signer: &sign::Signer, head: Head<'_>, payload: &[u8]) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(NODE, head.node);
    headers.insert(TURN, head.turn_id);
    headers.insert(INDEX, head.index.to_string().as_str());
    if let Some((k, n)) = head.part {
        headers.insert(PART, format!("{k}/{n}").as_str());
    }
    signer.sign(head.subject, &mut headers, payload);
    headers
}

/// A message's gateway, turn and first index, from its headers, when the message is signed with
/// the cluster's key (else refused: counted and said).
fn message_head(
    inner: &Inner,
    subject: &str,
    headers: Option<&async_nats::HeaderMap>,
    payload: &[u8],
) -> Option<(String, String, u32)> {
    if !inner.signer.verify(subject, headers, payload) {
        sign::reject(&inner.metrics, "a turn's events", subject);
        return None;
    }
    let headers = headers?;
    let node = headers.get(NODE)?.as_str().to_owned();
    let turn = headers.get(TURN)?.as_str().to_owned();
    let index = headers.get(INDEX)?.as_str().parse().ok()?;
    Some((node, turn, index))
}

/// Part `k` of `n` of one event, when a message is one (`k` in `1..=n`).
fn message_part(headers: Option<&async_nats::HeaderMap>) -> Option<(u32, u32)> {
    let (k, n) = headers?.get(PART)?.as_str().split_once('/')?;
    let (k, n): (u32, u32) = (k.parse().ok()?, n.parse().ok()?);
    (1..=n).contains(&k).then_some((k, n))
}

pub use key::BusKey;

#[cfg(test)]
mod tests {
    use super::*;

    /// A URL NATS cannot parse stops the connection before any network, and the error names
    /// every URL without its password.
    #[tokio::test]
    async fn a_malformed_bus_url_is_refused_without_its_password() {
        let options = BusOptions {
            max_age: Duration::from_secs(1),
            max_bytes: 1,
            timeout: Duration::from_secs(1),
            ca_file: None,
            client_cert: None,
            key: None,
        };
        let urls = "nats://gw:s3cret@127.0.0.1:1,nats://gw:s3cret@[::1";
        let dir = tempfile::tempdir().unwrap();
        let database = crate::config::Database::Sqlite(dir.path().join("bus.db"));
        let store = Store::open(&database, Default::default()).await.unwrap();
        let Err(refused) = Bus::connect(urls, options, Default::default(), store).await else {
            panic!("a malformed URL connected")
        };
        let said = refused.to_string();
        assert!(
            said.starts_with("cannot connect to NATS at nats://gw:***@127.0.0.1:1,nats://gw:***@[::1: not a NATS URL"),
            "{said}"
        );
        assert!(!said.contains("s3cret"), "{said}");
    }
}
