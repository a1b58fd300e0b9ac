//! dispatch-bench: the load generator of `bench/run`.
//!
//! Each subcommand runs one workload against a running server (the gateway, or nginx with
//! Nchan for the fan-out workloads), checks every delivery for order and completeness, reads
//! the server's CPU time and memory from `/proc`, and prints one JSON object with its figures.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
}

#[derive(Subcommand)]
enum Workload {
    /// One conversation (channel), many SSE watchers, `events` events at `rate` per second
    /// (0 = as fast as the server emits).
    Fanout {
        #[arg(long, value_enum)]
        server: Server,
        #[arg(long)]
        base: String,
        #[arg(long)]
        watchers: usize,
        #[arg(long)]
        events: usize,
        #[arg(long, default_value_t = 0)]
        rate: u64,
        /// Server process ids whose CPU time and memory are read from /proc.
        #[arg(long, value_delimiter = ',')]
        pids: Vec<u32>,
    },
    /// Many SSE watchers doing nothing: resident memory per stream.
    Idle {
        #[arg(long, value_enum)]
        server: Server,
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
        #[arg(long)]
        base: String,
        #[arg(long)]
        events: usize,
        #[arg(long)]
        rate: u64,
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

fn now_micros() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// Utime + stime of the processes, in microseconds (from /proc, in clock ticks of 10 ms).
fn cpu_micros(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            let after = stat.rsplit_once(')')?.1;
            let fields: Vec<&str> = after.split_whitespace().collect();
            let utime: u64 = fields.get(11)?.parse().ok()?;
            let stime: u64 = fields.get(12)?.parse().ok()?;
            Some((utime + stime) * 10_000)
        })
        .sum()
}

/// Resident memory of the processes, in KiB.
fn rss_kib(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
        .filter_map(|s| s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// One SSE subscription over a raw socket: HTTP/1.1 by hand, chunked bodies decoded in
/// place, events found by scanning bytes, no allocation per event. The client shares the cores
/// with the server, so it has to cost less per delivery than the server does.
struct Sse {
    stream: tokio::net::TcpStream,
    /// Raw bytes read but not yet de-chunked.
    raw: Vec<u8>,
    /// The decoded body; events are read from `at`.
    body: Vec<u8>,
    at: usize,
    chunked: bool,
    /// Bytes left in the current chunk.
    chunk_left: usize,
    ended: bool,
}

impl Sse {
    async fn open(url: &str) -> Result<Sse, String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rest = url.strip_prefix("http://").ok_or("http only")?;
        let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
        let mut stream = tokio::net::TcpStream::connect(host).await.map_err(|e| format!("{url}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let request = format!("GET {path} HTTP/1.1\r\nhost: {host}\r\naccept: text/event-stream\r\n\r\n");
        stream.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
        let mut raw = Vec::with_capacity(1 << 16);
        let head_end = loop {
            if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).await.map_err(|e| e.to_string())?;
            if n == 0 {
                return Err(format!("{url}: closed before the response head"));
            }
            raw.extend_from_slice(&buf[..n]);
        };
        let head = String::from_utf8_lossy(&raw[..head_end]).to_lowercase();
        if !head.starts_with("http/1.1 200") {
            return Err(format!("{url}: {}", head.lines().next().unwrap_or("")));
        }
        let chunked = head.contains("transfer-encoding: chunked");
        raw.drain(..head_end);
        Ok(Sse { stream, raw, body: Vec::with_capacity(1 << 16), at: 0, chunked, chunk_left: 0, ended: false })
    }

    /// Moves what can be de-chunked from `raw` to `body`.
    fn decode(&mut self) {
        if !self.chunked {
            self.body.extend_from_slice(&self.raw);
            self.raw.clear();
            return;
        }
        let mut i = 0;
        loop {
            if self.chunk_left > 0 {
                let take = self.chunk_left.min(self.raw.len() - i);
                self.body.extend_from_slice(&self.raw[i..i + take]);
                i += take;
                self.chunk_left -= take;
                if self.chunk_left > 0 {
                    break;
                }
                continue;
            }
            // A size line, possibly preceded by the CRLF that ends the previous chunk.
            let rest = &self.raw[i..];
            let skip = if rest.starts_with(b"\r\n") { 2 } else { 0 };
            let Some(eol) = rest[skip..].windows(2).position(|w| w == b"\r\n") else { break };
            let line = &rest[skip..skip + eol];
            let size = line
                .iter()
                .take_while(|b| b.is_ascii_hexdigit())
                .fold(0usize, |n, b| n * 16 + (*b as char).to_digit(16).unwrap_or(0) as usize);
            i += skip + eol + 2;
            if size == 0 {
                self.ended = true;
                break;
            }
            self.chunk_left = size;
        }
        self.raw.drain(..i);
    }

    /// The next event block (between blank lines), or None at the end of the stream.
    async fn next_block(&mut self) -> Option<std::ops::Range<usize>> {
        use tokio::io::AsyncReadExt;
        loop {
            if let Some(end) = self.body[self.at..].windows(2).position(|w| w == b"\n\n") {
                let block = self.at..self.at + end;
                self.at += end + 2;
                return Some(block);
            }
            if self.ended {
                return None;
            }
            if self.at > (1 << 20) {
                self.body.drain(..self.at);
                self.at = 0;
            }
            let mut buf = [0u8; 1 << 16];
            match self.stream.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.raw.extend_from_slice(&buf[..n]),
            }
            self.decode();
        }
    }
}

/// The number after the last ':' of an `id:` line, and the data line, of an event block.
fn fields(block: &[u8]) -> (Option<u64>, &[u8]) {
    let (mut id, mut data): (Option<u64>, &[u8]) = (None, &[]);
    for line in block.split(|b| *b == b'\n') {
        if let Some(v) = line.strip_prefix(b"id: ") {
            let n = v.rsplit(|b| *b == b':').next().unwrap_or(v);
            id = number(n);
        } else if let Some(v) = line.strip_prefix(b"data: ") {
            data = v;
        }
    }
    (id, data)
}

fn number(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn subscribe_url(server: Server, base: &str, channel: &str) -> String {
    match server {
        Server::Gateway => format!("{base}/conversations/{channel}/events?until=sealed"),
        Server::Nchan => format!("{base}/sub/{channel}"),
    }
}

/// What one watcher saw: deliveries, order violations, latencies of stamped events.
#[derive(Default)]
struct Seen {
    delivered: u64,
    stamped: u64,
    out_of_order: u64,
    latencies: Vec<u64>,
}

/// Reads a subscription until the end of the workload and checks its order.
async fn watch(server: Server, mut sse: Sse, events: usize) -> Seen {
    let mut seen = Seen::default();
    let mut last_index: Option<u64> = None;
    while let Some(range) = sse.next_block().await {
        let now = now_micros();
        let block = &sse.body[range];
        let (id, data) = fields(block);
        if data.is_empty() {
            continue; // a comment or a keep-alive
        }
        seen.delivered += 1;
        match server {
            Server::Gateway => {
                // id: <turnId>:<n>, n from 0 without gaps.
                if id != Some(last_index.map_or(0, |l| l + 1)) {
                    seen.out_of_order += 1;
                }
                last_index = id;
                if let Some(at) = find(data, b"\"delta\":\"") {
                    let digits = &data[at + 9..];
                    let end = digits.iter().position(|b| *b == b':').unwrap_or(0);
                    if let Some(stamp) = number(&digits[..end]) {
                        seen.stamped += 1;
                        seen.latencies.push(now.saturating_sub(stamp));
                    }
                }
                if find(data, b"\"type\":\"turn-sealed\"").is_some() {
                    break;
                }
            }
            Server::Nchan => {
                // data: <seq>:<stamp>:<padding>
                let mut parts = data.splitn(3, |b| *b == b':');
                let seq = parts.next().and_then(number);
                let stamp = parts.next().and_then(number);
                if seq != Some(last_index.map_or(0, |l| l + 1)) {
                    seen.out_of_order += 1;
                }
                last_index = seq;
                if let Some(stamp) = stamp {
                    seen.stamped += 1;
                    seen.latencies.push(now.saturating_sub(stamp));
                }
                if seq == Some(events as u64 - 1) {
                    break;
                }
            }
        }
    }
    seen
}

/// Publishes `events` messages of about 120 bytes to an Nchan channel at `rate` per second.
async fn publish_nchan(client: &reqwest::Client, base: &str, channel: &str, events: usize, rate: u64) {
    let start = Instant::now();
    let padding = "x".repeat(90);
    for seq in 0..events {
        if rate > 0 {
            let due = start + Duration::from_secs_f64(seq as f64 / rate as f64);
            tokio::time::sleep_until(due.into()).await;
        }
        let body = format!("{seq}:{}:{padding}", now_micros());
        let _ = client.post(format!("{base}/pub/{channel}")).body(body).send().await;
    }
}

async fn start_turn(client: &reqwest::Client, base: &str, conversation: &str, message: &str) {
    let r = client
        .post(format!("{base}/conversations/{conversation}/messages"))
        .json(&json!({"message": message}))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(r.status(), 202, "starting the turn");
}

async fn fanout(server: Server, base: &str, watchers: usize, events: usize, rate: u64, pids: &[u32]) -> Value {
    let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let channel = format!("fanout{}", now_micros());
    let mut subscriptions = Vec::with_capacity(watchers);
    for _ in 0..watchers {
        subscriptions.push(Sse::open(&subscribe_url(server, base, &channel)).await.expect("subscribes"));
    }
    let tasks: Vec<_> = subscriptions.into_iter().map(|sse| tokio::spawn(watch(server, sse, events))).collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cpu0 = cpu_micros(pids);
    let started = Instant::now();
    match server {
        Server::Gateway => start_turn(&client, base, &channel, &format!("fanout-{events}-{rate}")).await,
        Server::Nchan => publish_nchan(&client, base, &channel, events, rate).await,
    }
    let mut delivered = 0;
    let mut out_of_order = 0;
    let mut incomplete = 0;
    let mut latencies = Vec::new();
    for t in tasks {
        let seen = t.await.unwrap();
        delivered += seen.delivered;
        out_of_order += seen.out_of_order;
        if seen.stamped != events as u64 {
            incomplete += 1;
        }
        latencies.extend(seen.latencies);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_micros(pids).saturating_sub(cpu0);
    latencies.sort_unstable();
    json!({
        "watchers": watchers,
        "events": events,
        "rate": rate,
        "delivered": delivered,
        "seconds": elapsed,
        "deliveries_per_second": delivered as f64 / elapsed,
        "server_cpu_us_per_delivery": cpu as f64 / delivered.max(1) as f64,
        "latency_p50_ms": percentile(&latencies, 0.50) as f64 / 1000.0,
        "latency_p99_ms": percentile(&latencies, 0.99) as f64 / 1000.0,
        "out_of_order": out_of_order,
        "incomplete_watchers": incomplete,
        "correct": out_of_order == 0 && incomplete == 0,
    })
}

async fn idle(server: Server, base: &str, watchers: usize, pids: &[u32]) -> Value {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kib(pids);
    let mut open = Vec::with_capacity(watchers);
    for i in 0..watchers {
        let url = subscribe_url(server, base, &format!("idle{}", i % 100));
        open.push(Sse::open(&url).await.expect("subscribes"));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_kib(pids);
    let per_stream = after.saturating_sub(before) as f64 / watchers as f64;
    drop(open);
    json!({"watchers": watchers, "rss_before_kib": before, "rss_after_kib": after, "kib_per_stream": per_stream, "correct": true})
}

async fn latejoin(server: Server, base: &str, events: usize, rate: u64) -> Value {
    let client = reqwest::Client::new();
    let channel = format!("late{}", now_micros());
    let url = subscribe_url(server, base, &channel);
    let mut early = Sse::open(&url).await.expect("subscribes");
    let produced = Arc::new(AtomicU64::new(0));
    let publisher = match server {
        Server::Gateway => {
            start_turn(&client, base, &channel, &format!("latejoin-{events}-{rate}")).await;
            None
        }
        Server::Nchan => {
            let (client, base, channel) = (client.clone(), base.to_owned(), channel.clone());
            Some(tokio::spawn(async move { publish_nchan(&client, &base, &channel, events, rate).await }))
        }
    };
    // Wait until the early watcher holds every event: the turn has emitted them all.
    let mut count = 0;
    while count < events {
        let Some(range) = early.next_block().await else { break };
        let (_, data) = fields(&early.body[range]);
        if !data.is_empty() && (server == Server::Nchan || find(data, b"\"type\":\"text-delta\"").is_some()) {
            count += 1;
        }
    }
    produced.store(count as u64, Ordering::Relaxed);
    if let Some(p) = publisher {
        p.await.unwrap();
    }
    let started = Instant::now();
    let late_url = match server {
        Server::Gateway => format!("{base}/conversations/{channel}/events"),
        Server::Nchan => format!("{base}/sub/{channel}"),
    };
    let mut late = Sse::open(&late_url).await.expect("subscribes");
    let mut got = 0;
    while got < events {
        let Some(range) = late.next_block().await else { break };
        let (_, data) = fields(&late.body[range]);
        if !data.is_empty() && (server == Server::Nchan || find(data, b"\"type\":\"text-delta\"").is_some()) {
            got += 1;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if server == Server::Gateway {
        let _ = client.post(format!("{base}/conversations/{channel}/stop")).send().await;
    }
    json!({"events": events, "rate": rate, "emitted": produced.load(Ordering::Relaxed), "received": got, "seconds": seconds, "correct": got == events})
}

async fn turns(base: &str, clients: usize, seconds: f64, pids: &[u32]) -> Value {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let cpu0 = cpu_micros(pids);
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (client, base) = (client.clone(), base.to_owned());
            tokio::spawn(async move {
                let (mut sealed, mut bad, mut gaps) = (0u64, 0u64, Vec::new());
                let conversation = format!("turns{c}-{}", now_micros());
                while Instant::now() < deadline {
                    let r = client
                        .post(format!("{base}/chat"))
                        .json(&json!({"conversationId": conversation, "message": "turn-w6"}))
                        .send()
                        .await
                        .unwrap();
                    let mut body = r.bytes_stream();
                    let (mut buf, mut done_at, mut ok) = (Vec::new(), None, false);
                    while let Some(Ok(b)) = body.next().await {
                        buf.extend_from_slice(&b);
                        while let Some(pos) = buf.iter().position(|x| *x == b'\n') {
                            let line: Vec<u8> = buf.drain(..=pos).collect();
                            if line.windows(13).any(|w| w == b"\"type\":\"done\"") {
                                done_at = Some(Instant::now());
                            } else if line.windows(20).any(|w| w == b"\"type\":\"turn-sealed\"") {
                                ok = done_at.is_some();
                                if let Some(d) = done_at {
                                    gaps.push(d.elapsed().as_micros() as u64);
                                }
                            }
                        }
                    }
                    if ok { sealed += 1 } else { bad += 1 }
                }
                (sealed, bad, gaps)
            })
        })
        .collect();
    let (mut sealed, mut bad, mut gaps) = (0, 0, Vec::new());
    for t in tasks {
        let (s, b, g) = t.await.unwrap();
        sealed += s;
        bad += b;
        gaps.extend(g);
    }
    let elapsed = started.elapsed().as_secs_f64();
    gaps.sort_unstable();
    json!({
        "clients": clients,
        "sealed": sealed,
        "seconds": elapsed,
        "turns_per_second": sealed as f64 / elapsed,
        "done_to_sealed_p50_ms": percentile(&gaps, 0.5) as f64 / 1000.0,
        "done_to_sealed_p99_ms": percentile(&gaps, 0.99) as f64 / 1000.0,
        "server_cpu_seconds": cpu_micros(pids).saturating_sub(cpu0) as f64 / 1e6,
        "correct": bad == 0 && sealed > 0,
    })
}

async fn history(base: &str, conversation: &str, concurrency: usize, seconds: f64) -> Value {
    let client = reqwest::Client::new();
    let url = format!("{base}/conversations/{conversation}?sinceSeq=0&limit=100");
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let (mut latencies, mut bad) = (Vec::new(), 0u64);
                while Instant::now() < deadline {
                    let t = Instant::now();
                    let body = client.get(&url).send().await.unwrap().bytes().await.unwrap();
                    latencies.push(t.elapsed().as_micros() as u64);
                    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    if v["chunks"].as_array().map(Vec::len) != Some(100) {
                        bad += 1;
                    }
                }
                (latencies, bad)
            })
        })
        .collect();
    let (mut latencies, mut bad) = (Vec::new(), 0);
    for t in tasks {
        let (l, b) = t.await.unwrap();
        latencies.extend(l);
        bad += b;
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort_unstable();
    json!({
        "requests": latencies.len(),
        "seconds": elapsed,
        "requests_per_second": latencies.len() as f64 / elapsed,
        "latency_p50_ms": percentile(&latencies, 0.5) as f64 / 1000.0,
        "latency_p99_ms": percentile(&latencies, 0.99) as f64 / 1000.0,
        "correct": bad == 0,
    })
}

async fn seed(database: &str, conversation: &str, chunks: u64) -> Value {
    use sqlx::Connection;
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{database}")).await.expect("opens the database");
    let mut tx = conn.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO conversations (id, title, status, created_at, last_activity_at, last_seq, last_message_id)
         VALUES (?1, 'bench', 'idle', 0, 0, ?2, ?2)",
    )
    .bind(conversation)
    .bind(chunks as i64)
    .execute(&mut *tx)
    .await
    .unwrap();
    for seq in 1..=chunks as i64 {
        let text = format!(r#"{{"type":"text","text":"chunk {seq} of the long conversation"}}"#);
        sqlx::query("INSERT INTO chunks (conversation_id, seq, message_id, turn_id, role, chunk) VALUES (?, ?, ?, 'seed', 'assistant', ?)")
            .bind(conversation)
            .bind(seq)
            .bind(seq)
            .bind(text)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    json!({"conversation": conversation, "chunks": chunks, "correct": true})
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let result = match cli.workload {
        Workload::Fanout { server, base, watchers, events, rate, pids } => {
            fanout(server, &base, watchers, events, rate, &pids).await
        }
        Workload::Idle { server, base, watchers, pids } => idle(server, &base, watchers, &pids).await,
        Workload::Latejoin { server, base, events, rate } => latejoin(server, &base, events, rate).await,
        Workload::Turns { base, clients, seconds, pids } => turns(&base, clients, seconds, &pids).await,
        Workload::History { base, conversation, concurrency, seconds } => {
            history(&base, &conversation, concurrency, seconds).await
        }
        Workload::Seed { database, conversation, chunks } => seed(&database, &conversation, chunks).await,
    };
    println!("{result}");
}
