//! dispatch-bench: the load generator of `bench/run`.
//!
//! Each subcommand runs one workload against a running server (the gateway, or a peer for the
//! fan-out workloads: nginx with Nchan, or Pushpin), checks every delivery for order and completeness, reads
//! the server's CPU time and memory from `/proc`, and prints one JSON object with its figures.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod tools;

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

fn now_micros() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// Utime + stime of the processes, in microseconds (from /proc, in clock ticks of 10 ms).
fn cpu_micros(pids: &[u32]) -> u64 {
    let usage = Usage::read(pids);
    usage.user_us + usage.sys_us
}

/// What the server processes have used so far: CPU in user space and in the kernel (from
/// /proc/PID/stat, in microseconds) and write system calls (`syscw` of /proc/PID/io: write and
/// writev, which the gateway's SSE and NDJSON streams and Nchan use; not send, which WebSocket
/// frames go out by).
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    user_us: u64,
    sys_us: u64,
    writes: u64,
    host: Host,
}

/// The machine's CPU time in clock ticks (the `cpu` line of /proc/stat): all of it, and the
/// time the hypervisor ran something else while this machine had work (`steal`), during which
/// a server's wall clock runs on without it.
#[derive(Debug, Clone, Copy, Default)]
struct Host {
    ticks: u64,
    steal: u64,
}

impl Host {
    fn read() -> Host {
        Host::parse(&std::fs::read_to_string("/proc/stat").unwrap_or_default())
    }

    /// The `cpu` line's first eight fields: user, nice, system, idle, iowait, irq, softirq, steal.
    fn parse(stat: &str) -> Host {
        let fields: Vec<u64> = stat
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("cpu "))
            .map(|l| l.split_whitespace().take(8).filter_map(|f| f.parse().ok()).collect())
            .unwrap_or_default();
        Host { ticks: fields.iter().sum(), steal: fields.get(7).copied().unwrap_or(0) }
    }

    fn since(self, before: Host) -> Host {
        Host { ticks: self.ticks.saturating_sub(before.ticks), steal: self.steal.saturating_sub(before.steal) }
    }

    /// The share of the machine's time the hypervisor took (`null` when /proc/stat says nothing).
    fn steal_share(&self) -> Value {
        if self.ticks == 0 { Value::Null } else { json!(self.steal as f64 / self.ticks as f64) }
    }
}

impl Usage {
    fn read(pids: &[u32]) -> Usage {
        let mut usage = Usage { host: Host::read(), ..Usage::default() };
        for pid in pids {
            if let Some((user, sys)) = stat_cpu_micros(&format!("/proc/{pid}/stat")) {
                usage.user_us += user;
                usage.sys_us += sys;
            }
            usage.writes += std::fs::read_to_string(format!("/proc/{pid}/io"))
                .ok()
                .and_then(|io| io.lines().find_map(|l| l.strip_prefix("syscw:")?.trim().parse::<u64>().ok()))
                .unwrap_or(0);
        }
        usage
    }

    fn since(self, before: Usage) -> Usage {
        Usage {
            user_us: self.user_us.saturating_sub(before.user_us),
            sys_us: self.sys_us.saturating_sub(before.sys_us),
            writes: self.writes.saturating_sub(before.writes),
            host: self.host.since(before.host),
        }
    }

    fn cpu_us(&self) -> u64 {
        self.user_us + self.sys_us
    }

    /// Where a fan-out's server CPU went, per delivery and per write system call.
    fn split(&self, delivered: u64) -> Value {
        let per = |n: u64, d: u64| if d == 0 { Value::Null } else { json!(n as f64 / d as f64) };
        json!({
            "server_user_us_per_delivery": per(self.user_us, delivered),
            "server_sys_us_per_delivery": per(self.sys_us, delivered),
            "server_writes": self.writes,
            "deliveries_per_write": per(delivered, self.writes),
            "server_sys_us_per_write": per(self.sys_us, self.writes),
            "host_steal_share": self.host.steal_share(),
        })
    }
}

/// User and kernel CPU time from a /proc `stat` file (of a process, or `/proc/thread-self/stat`
/// for the calling thread), in microseconds (counted in clock ticks of 10 ms).
fn stat_cpu_micros(path: &str) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string(path).ok()?;
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11).map(|f| f.parse::<u64>().ok());
    Some((fields.next()?? * 10_000, fields.next()?? * 10_000))
}

/// CPU time of the calling thread so far: (user, kernel) in microseconds.
fn thread_cpu_micros() -> (u64, u64) {
    stat_cpu_micros("/proc/thread-self/stat").unwrap_or_default()
}

/// The write floor (see [`Workload::WriteFloor`]): writes go out round-robin in millisecond
/// ticks (as a server's rounds spread over time), each one `write` call on a non-blocking socket;
/// the readers count every byte, and the run is correct only if they got all of them.
async fn write_floor(connections: usize, rate: u64, bytes: usize, seconds: f64) -> Value {
    use std::io::Write;
    use tokio::io::AsyncReadExt;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let address = listener.local_addr().expect("its address");
    let sender = std::thread::spawn(move || {
        let mut sockets = Vec::with_capacity(connections);
        for _ in 0..connections {
            let (socket, _) = listener.accept().expect("a reader connects");
            socket.set_nodelay(true).expect("nodelay");
            socket.set_nonblocking(true).expect("non-blocking");
            sockets.push(socket);
        }
        let payload = vec![b'x'; bytes];
        let per_tick = connections as f64 * rate as f64 / 1000.0;
        let ticks = (seconds * 1000.0) as u32;
        let (mut writes, mut sent, mut would_block, mut due, mut next) = (0u64, 0u64, 0u64, 0.0, 0);
        let (user0, sys0) = thread_cpu_micros();
        let process0 = cpu_micros(&[std::process::id()]);
        let host0 = Host::read();
        let started = Instant::now();
        for tick in 1..=ticks {
            due += per_tick;
            while due >= 1.0 {
                due -= 1.0;
                match sockets[next].write(&payload) {
                    Ok(n) => {
                        writes += 1;
                        sent += n as u64;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => would_block += 1,
                    Err(e) => panic!("write: {e}"),
                }
                next = (next + 1) % sockets.len();
            }
            if let Some(wait) = (started + Duration::from_millis(tick.into())).checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        let elapsed = started.elapsed().as_secs_f64();
        let (user1, sys1) = thread_cpu_micros();
        let process = cpu_micros(&[std::process::id()]) - process0;
        let readers_cpu = process.saturating_sub((user1 - user0) + (sys1 - sys0));
        let host = Host::read().since(host0);
        (writes, sent, would_block, elapsed, user1 - user0, sys1 - sys0, readers_cpu, host)
    });
    let received = Arc::new(AtomicU64::new(0));
    let mut readers = Vec::with_capacity(connections);
    for _ in 0..connections {
        let mut socket = tokio::net::TcpStream::connect(address).await.expect("connects");
        let received = received.clone();
        readers.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            while let Ok(n @ 1..) = socket.read(&mut buf).await {
                received.fetch_add(n as u64, Ordering::Relaxed);
            }
        }));
    }
    let (writes, sent, would_block, elapsed, user, sys, readers_cpu, host) =
        tokio::task::spawn_blocking(move || sender.join().expect("the sender runs")).await.expect("joins");
    for reader in readers {
        reader.await.expect("a reader ends");
    }
    let per_write = |us: u64| us as f64 / writes.max(1) as f64;
    json!({
        "connections": connections,
        "rate": rate,
        "bytes_per_write": bytes,
        "seconds": elapsed,
        "writes": writes,
        "writes_per_second": writes as f64 / elapsed,
        "would_block": would_block,
        "sender_user_us_per_write": per_write(user),
        "sender_sys_us_per_write": per_write(sys),
        "sender_cpu_us_per_write": per_write(user + sys),
        "sender_cores": (user + sys) as f64 / 1e6 / elapsed,
        // The receiving side's reads (each also sends the window update the sender's side
        // processes): the rest of this process's CPU over the same interval.
        "readers_cpu_us_per_write": per_write(readers_cpu),
        "readers_cores": readers_cpu as f64 / 1e6 / elapsed,
        "host_steal_share": host.steal_share(),
        "correct": received.load(Ordering::Relaxed) == sent && would_block == 0,
    })
}

/// Resident memory of the processes, in KiB.
fn rss_kib(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
        .filter_map(|s| s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

fn percentile<T: Copy + Into<u64>>(sorted: &[T], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize].into()
}

/// The transport a watcher reads the gateway with.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Transport {
    Sse,
    Ndjson,
    Ws,
    /// Watchers take SSE, NDJSON and WebSocket in turn.
    Mixed,
}

impl Transport {
    /// The transport of the `i`th watcher.
    fn nth(self, i: usize) -> Transport {
        match self {
            Transport::Mixed => [Transport::Sse, Transport::Ndjson, Transport::Ws][i % 3],
            t => t,
        }
    }
}

/// One subscription over a raw socket: HTTP/1.1 (or the WebSocket protocol) by hand, chunked
/// bodies and WebSocket frames decoded in place, messages found by scanning bytes, no
/// allocation per event. The client shares the cores with the server, so it has to cost less
/// per delivery than the server does.
///
/// Messages are SSE blocks (ended by a blank line), NDJSON lines, or WebSocket text payloads
/// (stored with a `\n` after each, so they read like NDJSON lines).
struct Feed {
    stream: tokio::net::TcpStream,
    dec: Decoder,
}

/// A feed's bytes: what was read, what is decoded, where the next message starts.
struct Decoder {
    transport: Transport,
    /// Raw bytes read but not yet decoded.
    raw: Vec<u8>,
    /// The decoded messages; read from `at`.
    body: Vec<u8>,
    at: usize,
    chunked: bool,
    /// Bytes left in the current chunk.
    chunk_left: usize,
    ended: bool,
    /// WebSocket control frames to answer (pongs), written before the next read.
    reply: Vec<u8>,
    /// When the last read returned (unix microseconds): the arrival time of what it brought.
    read_at: u64,
}

impl Feed {
    /// Opens an SSE or NDJSON stream (`url`), or a WebSocket to `url` subscribed to
    /// `conversation`.
    async fn open(transport: Transport, url: &str, conversation: &str) -> Result<Feed, String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rest = url.strip_prefix("http://").ok_or("http only")?;
        let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
        let mut stream = tokio::net::TcpStream::connect(host).await.map_err(|e| format!("{url}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let request = match transport {
            Transport::Ws => format!(
                "GET {path} HTTP/1.1\r\nhost: {host}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
                 sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
            ),
            Transport::Ndjson => format!("GET {path} HTTP/1.1\r\nhost: {host}\r\naccept: application/x-ndjson\r\n\r\n"),
            _ => format!("GET {path} HTTP/1.1\r\nhost: {host}\r\naccept: text/event-stream\r\n\r\n"),
        };
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
        let expected = if transport == Transport::Ws { "http/1.1 101" } else { "http/1.1 200" };
        if !head.starts_with(expected) {
            return Err(format!("{url}: {}", head.lines().next().unwrap_or("")));
        }
        let chunked = head.contains("transfer-encoding: chunked");
        raw.drain(..head_end);
        if transport == Transport::Ws {
            let op = json!({"type": "chat.subscribe", "conversationId": conversation}).to_string();
            stream.write_all(&client_frame(0x1, op.as_bytes())).await.map_err(|e| e.to_string())?;
        }
        let mut body = Vec::with_capacity(1 << 16);
        // The pages the first reads land in, faulted in now rather than when events arrive.
        prefault(&mut raw);
        prefault(&mut body);
        let mut dec = Decoder {
            transport,
            raw,
            body,
            at: 0,
            chunked,
            chunk_left: 0,
            ended: false,
            reply: Vec::new(),
            read_at: 0,
        };
        dec.decode();
        Ok(Feed { stream, dec })
    }

    /// The next message, or None at the end of the stream.
    async fn next_message(&mut self) -> Option<std::ops::Range<usize>> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            if let Some(message) = self.dec.message() {
                return Some(message);
            }
            if self.dec.ended {
                return None;
            }
            if !self.dec.reply.is_empty() {
                let reply = std::mem::take(&mut self.dec.reply);
                if self.stream.write_all(&reply).await.is_err() {
                    return None;
                }
            }
            match self.stream.read_buf(self.dec.room()).await {
                Ok(0) | Err(_) => return None,
                Ok(_) => self.dec.arrived(now_micros()),
            }
        }
    }
}

impl Decoder {
    /// The next whole message in the body, if there is one.
    fn message(&mut self) -> Option<std::ops::Range<usize>> {
        let delimiter: &[u8] = if self.transport == Transport::Sse { b"\n\n" } else { b"\n" };
        loop {
            let end = find(&self.body[self.at..], delimiter)?;
            let message = self.at..self.at + end;
            self.at += end + delimiter.len();
            if !message.is_empty() {
                return Some(message);
            }
            // (an NDJSON keep-alive)
        }
    }

    /// The buffer the next read goes to (the body itself when there is nothing to decode),
    /// with room in it; what was taken from the body is dropped first.
    fn room(&mut self) -> &mut Vec<u8> {
        if self.at == self.body.len() {
            self.body.clear();
            self.at = 0;
        } else if self.at > (1 << 20) {
            self.body.drain(..self.at);
            self.at = 0;
        }
        let buf = if self.reads_into_body() { &mut self.body } else { &mut self.raw };
        make_room(buf);
        buf
    }

    fn reads_into_body(&self) -> bool {
        !self.chunked && self.transport != Transport::Ws
    }

    /// A read into `room()` returned at `now` (unix microseconds).
    fn arrived(&mut self, now: u64) {
        self.read_at = now;
        if !self.reads_into_body() {
            self.decode();
        }
    }

    /// Moves what can be decoded from `raw` to `body`.
    fn decode(&mut self) {
        if self.transport == Transport::Ws {
            return self.decode_frames();
        }
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
            let Some(eol) = find(&rest[skip..], b"\r\n") else { break };
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

    /// Server frames are never masked: opcode, length, payload.
    fn decode_frames(&mut self) {
        let mut i = 0;
        while let Some(frame) = dispatch_testkit::server_frame(&self.raw[i..]) {
            match frame.opcode() {
                0x0..=0x2 => {
                    self.body.extend_from_slice(frame.payload);
                    self.body.push(b'\n');
                }
                0x8 => self.ended = true,
                0x9 => self.reply.extend_from_slice(&client_frame(0xA, frame.payload)),
                _ => {}
            }
            i += frame.len;
        }
        self.raw.drain(..i);
    }
}

/// Room for the next read. Only when little is left: the buffers usually hold a few
/// undecoded bytes (the CRLF after an HTTP chunk, a partial frame), and reserving a whole
/// read's room on top of them would double every buffer at its first event, copying and
/// faulting in 5,000 x 64 KiB just as a workload starts.
fn make_room(buf: &mut Vec<u8>) {
    if buf.capacity() - buf.len() < 1 << 13 {
        buf.reserve(1 << 16);
    }
}

/// Touches the first pages of `buf`'s spare capacity.
fn prefault(buf: &mut Vec<u8>) {
    let spare = buf.spare_capacity_mut();
    let n = spare.len().min(16 * 1024);
    spare[..n].fill(std::mem::MaybeUninit::new(0));
}

/// A masked client frame (the mask is zero: XOR with it leaves the payload as it is).
fn client_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    dispatch_testkit::client_frame(0x80 | opcode, payload, [0; 4])
}

/// The number after the last ':' of an `id:` line, and the data line, of an event block.
fn fields(block: &[u8]) -> (Option<u64>, &[u8]) {
    let (mut id, mut data): (Option<u64>, &[u8]) = (None, &[]);
    let mut rest = block;
    while !rest.is_empty() {
        let end = memchr::memchr(b'\n', rest).unwrap_or(rest.len());
        let line = &rest[..end];
        if let Some(v) = line.strip_prefix(b"id: ") {
            id = number(memchr::memrchr(b':', v).map_or(v, |i| &v[i + 1..]));
        } else if let Some(v) = line.strip_prefix(b"data: ") {
            data = v;
        }
        rest = &rest[(end + 1).min(rest.len())..];
    }
    (id, data)
}

fn number(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

/// Substring search with a searcher built once per needle (building one costs more than
/// searching a short message).
fn find(haystack: &[u8], needle: &'static [u8]) -> Option<usize> {
    use memchr::memmem::Finder;
    use std::sync::LazyLock;
    static FINDERS: LazyLock<Vec<Finder<'static>>> = LazyLock::new(|| NEEDLES.iter().map(Finder::new).collect());
    match needle {
        [byte] => memchr::memchr(*byte, haystack),
        _ => match NEEDLES.iter().position(|n| *n == needle) {
            Some(i) => FINDERS[i].find(haystack),
            None => memchr::memmem::find(haystack, needle),
        },
    }
}

const NEEDLES: [&[u8]; 9] = [
    b"\n\n",
    b"\r\n",
    b"\r\n\r\n",
    b"\"delta\":\"",
    b"\"content\":\"",
    b"\"type\":\"chat.delta\"",
    b"\"type\":\"turn-sealed\"",
    b"\"type\":\"text-delta\"",
    b"\"type\":\"done\"",
];

fn subscribe_url(server: Server, transport: Transport, base: &str, channel: &str) -> String {
    match (server, transport) {
        (Server::Nchan | Server::Pushpin, _) => format!("{base}/sub/{channel}"),
        (Server::Gateway, Transport::Ws) => format!("{base}/ws"),
        (Server::Gateway, _) => format!("{base}/conversations/{channel}/events?until=sealed"),
    }
}

async fn subscribe(server: Server, transport: Transport, base: &str, channel: &str) -> Feed {
    let url = subscribe_url(server, transport, base, channel);
    Feed::open(transport, &url, channel).await.expect("subscribes")
}

/// What one watcher saw: deliveries, order violations, latencies of stamped events.
#[derive(Default)]
struct Seen {
    /// Which node of a cluster the watcher subscribed at (see `Target`).
    group: usize,
    delivered: u64,
    stamped: u64,
    out_of_order: u64,
    latencies: Vec<u64>,
    /// For each latency, in the same order: how much of it the event spent waiting for the
    /// newest event of the read that brought it (that one's send time minus its own). What
    /// is left, the latency minus this, is the time from the newest one's send to the read:
    /// a server that batches shows its batching in the first part, its writing in the second.
    held: Vec<u32>,
    /// The read the last latencies came in (its time) and where its latencies start.
    read: (u64, usize),
    /// The send times of the first stamped events (as many as `watch` was asked to keep).
    early: Vec<u64>,
    sealed: bool,
}

impl Seen {
    /// A stamped event read at `now` with `latency`.
    fn latency(&mut self, now: u64, latency: u64) {
        if now != self.read.0 {
            self.end_read();
            self.read = (now, self.latencies.len());
        }
        self.latencies.push(latency);
    }

    /// The latencies of the last read: each one's wait for the newest (the smallest latency).
    fn end_read(&mut self) {
        let read = &self.latencies[self.read.1..];
        let newest = read.iter().copied().min().unwrap_or(0);
        self.held.extend(read.iter().map(|l| (l - newest).min(u64::from(u32::MAX)) as u32));
        self.read.1 = self.latencies.len();
    }
}

/// A stamped delta's `<micros>:<index>:` prefix.
fn stamp_of(data: &[u8]) -> Option<(u64, u64)> {
    let at = find(data, b"\"delta\":\"")?;
    let mut parts = data[at + 9..].splitn(3, |b| *b == b':');
    Some((number(parts.next()?)?, number(parts.next()?)?))
}

/// The checks of one subscription, message by message: SSE ids without gaps, stamped deltas in
/// index order without gaps, `turn-sealed` (or a peer's last message) at the end.
struct Watcher {
    server: Server,
    transport: Transport,
    events: usize,
    keep: usize,
    seen: Seen,
    last_index: Option<u64>,
}

impl Watcher {
    fn new(server: Server, transport: Transport, events: usize, keep: usize) -> Watcher {
        // Sized and touched now, before the workload's clock starts: grown as events arrive,
        // the lists would be copied a dozen times and fault their pages in while latencies are
        // measured.
        fn touched<T: Copy + Default>(n: usize) -> Vec<T> {
            let mut v = Vec::with_capacity(n);
            v.spare_capacity_mut().fill(std::mem::MaybeUninit::new(T::default()));
            v
        }
        let seen = Seen {
            latencies: touched(events),
            held: touched(events),
            early: touched(keep.min(events)),
            ..Seen::default()
        };
        Watcher { server, transport, events, keep, seen, last_index: None }
    }

    /// Takes one message, read at `now` (unix microseconds); true once the stream is complete.
    fn take(&mut self, message: &[u8], now: u64) -> bool {
        let seen = &mut self.seen;
        let (id, data) = if self.transport == Transport::Sse { fields(message) } else { (None, message) };
        if data.is_empty() || (self.transport == Transport::Ws && find(data, b"\"type\":\"chat.delta\"").is_none()) {
            return false; // a comment, a keep-alive, or a WebSocket message other than an event
        }
        seen.delivered += 1;
        match self.server {
            Server::Gateway => {
                // SSE ids are <turnId>:<n>, n from 0 without gaps.
                if self.transport == Transport::Sse {
                    if id != Some(self.last_index.map_or(0, |l| l + 1)) {
                        seen.out_of_order += 1;
                    }
                    self.last_index = id;
                }
                if let Some((stamp, index)) = stamp_of(data) {
                    if index != seen.stamped {
                        seen.out_of_order += 1;
                    }
                    seen.stamped += 1;
                    seen.latency(now, now.saturating_sub(stamp));
                    if seen.early.len() < self.keep {
                        seen.early.push(stamp);
                    }
                } else if find(data, b"\"type\":\"turn-sealed\"").is_some() {
                    // (A stamped delta is not the seal: most events skip this search.)
                    seen.sealed = true;
                }
            }
            Server::Nchan | Server::Pushpin => {
                // data: <seq>:<stamp>:<padding>
                let mut parts = data.splitn(3, |b| *b == b':');
                let seq = parts.next().and_then(number);
                let stamp = parts.next().and_then(number);
                if seq != Some(self.last_index.map_or(0, |l| l + 1)) {
                    seen.out_of_order += 1;
                }
                self.last_index = seq;
                if let Some(stamp) = stamp {
                    seen.stamped += 1;
                    seen.latency(now, now.saturating_sub(stamp));
                }
                if seq == Some(self.events as u64 - 1) {
                    seen.sealed = true;
                }
            }
        }
        seen.sealed
    }
}

/// Reads many subscriptions until the end of the workload, on as many threads as there are
/// cores, each one epoll loop over its share of the sockets (edge-triggered; a read that
/// returns less than it had room for emptied the socket, so it is not followed by another).
/// The load generator shares the cores with the server, and an async task per subscription
/// (woken, scheduled and polled for every read) cost it 10-15% more CPU in W3; every
/// microsecond it spends is one the server may wait for a core, and shows up in the latencies
/// it measures.
/// `groups`: the feeds were opened at that many nodes in turn (feed i at node i % groups).
fn watch_all(
    server: Server,
    feeds: Vec<Feed>,
    events: usize,
    keep: usize,
    groups: usize,
) -> tokio::task::JoinHandle<Vec<Seen>> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).min(feeds.len()).max(1);
    let mut shares: Vec<Vec<(std::net::TcpStream, Decoder, Watcher)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, feed) in feeds.into_iter().enumerate() {
        let mut watcher = Watcher::new(server, feed.dec.transport, events, keep);
        watcher.seen.group = i % groups.max(1);
        let stream = feed.stream.into_std().expect("the socket leaves the runtime");
        shares[i % threads].push((stream, feed.dec, watcher));
    }
    let handles: Vec<_> = shares.into_iter().map(|share| std::thread::spawn(move || epoll_watch(share))).collect();
    tokio::task::spawn_blocking(move || handles.into_iter().flat_map(|h| h.join().expect("a reader thread")).collect())
}

/// Seconds of silence on every open subscription of a reader thread after which it stops.
const QUIET_SECONDS: u32 = 10;

/// One thread's loop of [`watch_all`].
fn epoll_watch(mut share: Vec<(std::net::TcpStream, Decoder, Watcher)>) -> Vec<Seen> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain epoll calls on descriptors this thread owns; `events` outlives each wait.
    let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(epoll >= 0, "epoll_create1: {}", std::io::Error::last_os_error());
    for (i, (stream, _, _)) in share.iter().enumerate() {
        let mut event =
            libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLET) as u32, u64: i as u64 };
        let r = unsafe { libc::epoll_ctl(epoll, libc::EPOLL_CTL_ADD, stream.as_raw_fd(), &mut event) };
        assert_eq!(r, 0, "epoll_ctl: {}", std::io::Error::last_os_error());
    }
    let mut open: Vec<bool> = vec![true; share.len()];
    let mut left = share.len();
    // Serves one socket; at its end, shuts it down as the async reader's drop would (the
    // server sees the watcher go).
    let turn = |i: usize, share: &mut [(std::net::TcpStream, Decoder, Watcher)], open: &mut [bool]| -> bool {
        if open[i] && !serve(&mut share[i]) {
            open[i] = false;
            unsafe { libc::shutdown(share[i].0.as_raw_fd(), libc::SHUT_RDWR) };
            return true;
        }
        false
    };
    // What was read with the response head, and anything already waiting.
    for i in 0..share.len() {
        left -= usize::from(turn(i, &mut share, &mut open));
    }
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
    let mut quiet = 0;
    while left > 0 {
        let n = unsafe { libc::epoll_wait(epoll, events.as_mut_ptr(), events.len() as i32, 1000) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            assert_eq!(e.kind(), std::io::ErrorKind::Interrupted, "epoll_wait: {e}");
            continue;
        }
        // A server that lost a stream's last event never ends it: the watchers still open are
        // given up (and counted incomplete) once none of them heard anything for a while.
        quiet = if n == 0 { quiet + 1 } else { 0 };
        if quiet >= QUIET_SECONDS {
            break;
        }
        for event in &events[..n as usize] {
            left -= usize::from(turn(event.u64 as usize, &mut share, &mut open));
        }
    }
    unsafe { libc::close(epoll) };
    share.into_iter().map(|(_, _, watcher)| watcher.seen).collect()
}

/// Takes everything a socket has: decodes, checks each message, answers pings. False once the
/// stream is complete or gone.
fn serve((stream, dec, watcher): &mut (std::net::TcpStream, Decoder, Watcher)) -> bool {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    // Set by a read that returned less than it had room for: the socket is empty, so after
    // what it brought (and the pongs it asks for) the loop waits for the next edge.
    let mut emptied = false;
    loop {
        while let Some(range) = dec.message() {
            if watcher.take(&dec.body[range], dec.read_at) {
                return false;
            }
        }
        if dec.ended {
            return false;
        }
        if !dec.reply.is_empty() {
            // Pongs, a few bytes each: the socket's buffer takes them.
            let reply = std::mem::take(&mut dec.reply);
            if stream.write_all(&reply).is_err() {
                return false;
            }
        }
        if emptied {
            return true;
        }
        let buf = dec.room();
        let spare = buf.spare_capacity_mut();
        let room = spare.len();
        // SAFETY: `recv` writes at most `room` bytes into the spare capacity, and the length
        // grows by what it wrote.
        let read = unsafe { libc::recv(stream.as_raw_fd(), spare.as_mut_ptr().cast(), room, 0) };
        match read {
            0 => return false,
            n if n > 0 => {
                unsafe { buf.set_len(buf.len() + n as usize) };
                dec.arrived(now_micros());
                emptied = (n as usize) < room;
            }
            _ => match std::io::Error::last_os_error().kind() {
                std::io::ErrorKind::WouldBlock => return true,
                std::io::ErrorKind::Interrupted => {}
                _ => return false,
            },
        }
    }
}

/// Publishes `events` messages of about 120 bytes (`<seq>:<send time>:<padding>`) to a peer's
/// channel at `rate` per second, each after the previous one was accepted (the only way to keep
/// them in order): to Nchan's publisher location, or as an `http-stream` item (an SSE event) to
/// Pushpin's control API.
async fn publish(server: Server, client: &reqwest::Client, publish: &str, channel: &str, events: usize, rate: u64) {
    let start = Instant::now();
    let padding = "x".repeat(90);
    for seq in 0..events {
        if rate > 0 {
            let due = start + Duration::from_secs_f64(seq as f64 / rate as f64);
            tokio::time::sleep_until(due.into()).await;
        }
        let message = format!("{seq}:{}:{padding}", now_micros());
        let request = match server {
            Server::Pushpin => client.post(format!("{publish}/publish/")).json(&json!({"items": [{
                "channel": channel,
                "formats": {"http-stream": {"content": format!("data: {message}\n\n")}},
            }]})),
            _ => client.post(format!("{publish}/pub/{channel}")).body(message),
        };
        let _ = request.send().await;
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

/// Every watcher's [`Seen`], summed.
#[derive(Default)]
struct Tally {
    watchers: u64,
    delivered: u64,
    out_of_order: u64,
    incomplete: u64,
    latencies: Vec<u64>,
    /// Each latency's two parts (see `Seen::held`): the wait for the newest event of its read,
    /// and the time from that one's send to the read.
    held: Vec<u32>,
    since_newest: Vec<u32>,
    /// Send time and latency of the events each watcher kept the send time of (see `watch`).
    early: Vec<(u64, u64)>,
    /// With a split asked for (`head` > 0): the latencies of each watcher's first `head`
    /// events, and of the rest.
    split: Option<(usize, Vec<u64>, Vec<u64>)>,
    /// Deliveries and latencies per node, when watchers were spread over several.
    by_group: Vec<(u64, Vec<u64>)>,
}

impl Tally {
    async fn collect(watching: tokio::task::JoinHandle<Vec<Seen>>, events: usize, head: usize) -> Tally {
        let mut tally = Tally { split: (head > 0).then(|| (head, Vec::new(), Vec::new())), ..Tally::default() };
        let seen_all = watching.await.expect("the readers end");
        let groups = seen_all.iter().map(|s| s.group + 1).max().unwrap_or(1);
        if groups > 1 {
            tally.by_group = vec![(0, Vec::new()); groups];
        }
        for mut seen in seen_all {
            seen.end_read();
            let since =
                seen.latencies.iter().zip(&seen.held).map(|(l, h)| (l - u64::from(*h)).min(u32::MAX.into()) as u32);
            tally.since_newest.extend(since);
            tally.held.extend_from_slice(&seen.held);
            if let Some((delivered, latencies)) = tally.by_group.get_mut(seen.group) {
                *delivered += seen.delivered;
                latencies.extend_from_slice(&seen.latencies);
            }
            tally.watchers += 1;
            tally.delivered += seen.delivered;
            tally.out_of_order += seen.out_of_order;
            if seen.stamped != events as u64 || !seen.sealed {
                tally.incomplete += 1;
            }
            if let Some((head, first, rest)) = tally.split.as_mut() {
                let at = (*head).min(seen.latencies.len());
                first.extend_from_slice(&seen.latencies[..at]);
                rest.extend_from_slice(&seen.latencies[at..]);
            }
            tally.early.extend(seen.early.iter().copied().zip(seen.latencies.iter().copied()));
            tally.latencies.extend(seen.latencies);
        }
        tally
    }

    /// p50 and p99 of the kept events by when they were sent: 100 ms slices of the second from
    /// `from` (micros since the epoch) on.
    fn by_send_time(&self, from: u64) -> Vec<Value> {
        let mut slices: Vec<Vec<u64>> = vec![Vec::new(); 10];
        for (sent, latency) in &self.early {
            if let Some(slice) = slices.get_mut((sent.saturating_sub(from) / 100_000) as usize) {
                slice.push(*latency);
            }
        }
        slices
            .iter_mut()
            .enumerate()
            .filter(|(_, v)| !v.is_empty())
            .map(|(i, v)| {
                v.sort_unstable();
                json!({
                    "sent_from_ms": i * 100,
                    "deliveries": v.len(),
                    "latency_p50_ms": percentile(v, 0.5) as f64 / 1000.0,
                    "latency_p99_ms": percentile(v, 0.99) as f64 / 1000.0,
                })
            })
            .collect()
    }

    /// The p99 of every watcher's first `head` events and of the rest (see `split`).
    /// `None` for a part with no events.
    fn split_p99(&mut self) -> (Option<f64>, Option<f64>) {
        let Some((_, first, rest)) = self.split.as_mut() else { return (None, None) };
        let p99 = |v: &mut Vec<u64>| {
            v.sort_unstable();
            (!v.is_empty()).then(|| percentile(v, 0.99) as f64 / 1000.0)
        };
        (p99(first), p99(rest))
    }

    /// Waits for every watcher; returns the tally, the seconds since `started` and what the
    /// server used since `before`, both read before the latencies are sorted (20 million of
    /// them take a while).
    async fn finish(
        watching: tokio::task::JoinHandle<Vec<Seen>>,
        events: usize,
        head: usize,
        started: Instant,
        before: Usage,
        pids: &[u32],
    ) -> (Tally, f64, Usage) {
        let mut tally = Tally::collect(watching, events, head).await;
        let elapsed = started.elapsed().as_secs_f64();
        let used = Usage::read(pids).since(before);
        tally.latencies.sort_unstable();
        tally.held.sort_unstable();
        tally.since_newest.sort_unstable();
        (tally, elapsed, used)
    }

    fn correct(&self) -> bool {
        self.out_of_order == 0 && self.incomplete == 0 && self.watchers > 0
    }

    fn p(&self, p: f64) -> f64 {
        percentile(&self.latencies, p) as f64 / 1000.0
    }

    /// The p99 of each part of the latencies (see `held`), in milliseconds.
    fn parts_p99(&self) -> Value {
        json!({
            "latency_held_p99_ms": percentile(&self.held, 0.99) as f64 / 1000.0,
            "latency_since_newest_p99_ms": percentile(&self.since_newest, 0.99) as f64 / 1000.0,
        })
    }
}

/// Where a fan-out runs: the turn (or publish) goes to `base`; watchers subscribe at each of
/// `nodes` in turn.
struct Target<'a> {
    base: &'a str,
    publish: &'a str,
    nodes: &'a [String],
    node_pids: &'a [u32],
}

async fn fanout(
    server: Server,
    transport: Transport,
    target: Target<'_>,
    watchers: usize,
    events: usize,
    rate: u64,
    pids: &[u32],
) -> Value {
    let Target { base, publish: publish_base, nodes, node_pids } = target;
    let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let channel = format!("fanout{}", now_micros());
    let mut subscriptions = Vec::with_capacity(watchers);
    for i in 0..watchers {
        subscriptions.push(subscribe(server, transport.nth(i), &nodes[i % nodes.len()], &channel).await);
    }
    let watching = watch_all(server, subscriptions, events, 0, nodes.len());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = Usage::read(pids);
    let nodes_before: Vec<Usage> = node_pids.iter().map(|pid| Usage::read(&[*pid])).collect();
    let started = Instant::now();
    match server {
        Server::Gateway => start_turn(&client, base, &channel, &format!("fanout-{events}-{rate}")).await,
        Server::Nchan | Server::Pushpin => publish(server, &client, publish_base, &channel, events, rate).await,
    }
    let (mut tally, elapsed, used) = Tally::finish(watching, events, 0, started, before, pids).await;
    let nodes_used: Vec<Usage> =
        node_pids.iter().zip(nodes_before).map(|(pid, before)| Usage::read(&[*pid]).since(before)).collect();
    let cpu = used.cpu_us();
    let mut result = json!({
        "transport": format!("{transport:?}").to_lowercase(),
        "watchers": watchers,
        "events": events,
        "rate": rate,
        "delivered": tally.delivered,
        "seconds": elapsed,
        "deliveries_per_second": tally.delivered as f64 / elapsed,
        "server_cpu_us_per_delivery": cpu as f64 / tally.delivered.max(1) as f64,
        "latency_p50_ms": tally.p(0.50),
        "latency_p99_ms": tally.p(0.99),
        "out_of_order": tally.out_of_order,
        "incomplete_watchers": tally.incomplete,
        "correct": tally.correct(),
    });
    merge(&mut result, used.split(tally.delivered));
    merge(&mut result, tally.parts_p99());
    if nodes.len() > 1 {
        let per_node: Vec<Value> = tally
            .by_group
            .iter_mut()
            .enumerate()
            .map(|(i, (delivered, latencies))| {
                latencies.sort_unstable();
                let cpu = nodes_used.get(i).map(|u| u.cpu_us() as f64 / (*delivered).max(1) as f64);
                json!({
                    "base": nodes[i],
                    "delivered": delivered,
                    "latency_p50_ms": percentile(latencies, 0.50) as f64 / 1000.0,
                    "latency_p99_ms": percentile(latencies, 0.99) as f64 / 1000.0,
                    "server_cpu_us_per_delivery": cpu,
                })
            })
            .collect();
        result["nodes"] = Value::Array(per_node);
    }
    result
}

/// Adds the fields of `more` to the object `into`.
fn merge(into: &mut Value, more: Value) {
    if let (Value::Object(into), Value::Object(more)) = (into, more) {
        into.extend(more);
    }
}

/// W3: `conversations` turns at `rate` tokens/s at once, `watchers` on each, turn starts spread
/// over one token interval (independent conversations are not in step).
async fn scale(
    transport: Transport,
    base: &str,
    conversations: usize,
    watchers: usize,
    events: usize,
    rate: u64,
    pids: &[u32],
) -> Value {
    let client = reqwest::Client::new();
    let prefix = format!("scale{}", now_micros());
    let mut feeds = Vec::with_capacity(conversations * watchers);
    for c in 0..conversations {
        for w in 0..watchers {
            feeds.push(
                subscribe(Server::Gateway, transport.nth(c * watchers + w), base, &format!("{prefix}-{c}")).await,
            );
        }
    }
    let watching = watch_all(Server::Gateway, feeds, events, rate as usize, 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = Usage::read(pids);
    let client_before = cpu_micros(&[std::process::id()]);
    let started = Instant::now();
    let started_micros = now_micros();
    // Each start is its own request at its own instant: awaited one after another, the starts
    // queue behind the streams already running and spread over seconds instead of one interval,
    // so the conversations would not all stream at once.
    let spread = Duration::from_secs_f64(1.0 / rate.max(1) as f64 / conversations as f64);
    let starts: Vec<_> = (0..conversations)
        .map(|c| {
            let (client, base) = (client.clone(), base.to_owned());
            let (conversation, message) = (format!("{prefix}-{c}"), format!("paced-{events}-{rate}"));
            let at = started + spread * c as u32;
            tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                start_turn(&client, &base, &conversation, &message).await;
                started.elapsed()
            })
        })
        .collect();
    let mut starts_took = Duration::ZERO;
    for start in starts {
        starts_took = starts_took.max(start.await.expect("a turn starts"));
    }
    // The first second of each turn apart: the turns' starts fall in it.
    let (mut tally, elapsed, used) = Tally::finish(watching, events, rate as usize, started, before, pids).await;
    let (p99_first_second, p99_after) = tally.split_p99();
    let client_cpu = cpu_micros(&[std::process::id()]) - client_before;
    let cpu = used.cpu_us();
    let mut result = json!({
        "transport": format!("{transport:?}").to_lowercase(),
        // The load generator's own CPU: it reads every delivery on the same cores.
        "client_cores": client_cpu as f64 / 1e6 / elapsed,
        "conversations": conversations,
        "watchers_per_conversation": watchers,
        "events": events,
        "rate": rate,
        "delivered": tally.delivered,
        "seconds": elapsed,
        "turns_started_within_ms": starts_took.as_secs_f64() * 1e3,
        "latency_p50_ms": tally.p(0.50),
        "latency_p99_ms": tally.p(0.99),
        "latency_p99_first_second_ms": p99_first_second,
        "latency_p99_after_first_second_ms": p99_after,
        // The first second again, by when each event was sent (from the first turn's request).
        "first_second_by_send_time": tally.by_send_time(started_micros),
        "server_cores": cpu as f64 / 1e6 / elapsed,
        "server_cpu_us_per_delivery": cpu as f64 / tally.delivered.max(1) as f64,
        "out_of_order": tally.out_of_order,
        "incomplete_watchers": tally.incomplete,
        "correct": tally.correct(),
    });
    merge(&mut result, used.split(tally.delivered));
    merge(&mut result, tally.parts_p99());
    result
}

/// W8, first half: `watchers` healthy watchers of a burst turn, once alone and once beside a
/// watcher that never reads; healthy throughput of both runs and the server's memory growth.
async fn stalled(base: &str, watchers: usize, events: usize, pids: &[u32]) -> Value {
    use tokio::io::AsyncWriteExt;
    let client = reqwest::Client::new();
    // Twelve runs of each, medians compared: one run is a second or two, and single runs
    // differ by 10-20% here with nothing changed (with six of each, the ratio of the medians
    // still moved by +-5% between runs of the workload). The order is alone, beside, beside,
    // alone, ...: the machine's speed drifts during a run, and in this order a steady drift
    // slows both sides alike (in alternating pairs, the side that always runs second would
    // take all of it).
    let mut runs = Vec::new();
    for with_stalled in (0..24).map(|i| matches!(i % 4, 1 | 2)) {
        let channel = format!("stalled{}", now_micros());
        let mut feeds = Vec::with_capacity(watchers);
        for _ in 0..watchers {
            feeds.push(subscribe(Server::Gateway, Transport::Sse, base, &channel).await);
        }
        let watching = watch_all(Server::Gateway, feeds, events, 0, 1);
        // The stalled watcher: asks for the stream, then never reads a byte.
        let stalled = if with_stalled {
            let host = base.strip_prefix("http://").unwrap_or(base);
            let mut socket = tokio::net::TcpStream::connect(host).await.expect("connects");
            let request = format!("GET /conversations/{channel}/events HTTP/1.1\r\nhost: {host}\r\n\r\n");
            socket.write_all(request.as_bytes()).await.unwrap();
            Some(socket)
        } else {
            None
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let rss0 = rss_kib(pids);
        let peak = Arc::new(AtomicU64::new(rss0));
        let sampler = {
            let (peak, pids) = (peak.clone(), pids.to_vec());
            tokio::spawn(async move {
                loop {
                    peak.fetch_max(rss_kib(&pids), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };
        let started = Instant::now();
        start_turn(&client, base, &channel, &format!("fanout-{events}-0")).await;
        let tally = Tally::collect(watching, events, 0).await;
        let elapsed = started.elapsed().as_secs_f64();
        sampler.abort();
        // The turn has sealed: what the hub still holds is what the stalled watcher keeps alive.
        let held = metric(&client, base, "dispatch_hub_buffer_bytes").await;
        drop(stalled);
        runs.push(json!({
            "stalled_watcher": with_stalled,
            "deliveries_per_second": tally.delivered as f64 / elapsed,
            "seconds": elapsed,
            "rss_growth_kib": peak.load(Ordering::Relaxed).saturating_sub(rss0),
            "hub_bytes_after_seal": held,
            "correct": tally.correct(),
        }));
    }
    let median = |stalled: bool, key: &str| {
        let mut v: Vec<f64> =
            runs.iter().filter(|r| r["stalled_watcher"] == stalled).filter_map(|r| r[key].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => 0.0,
            n if n % 2 == 0 => (v[n / 2 - 1] + v[n / 2]) / 2.0,
            n => v[n / 2],
        }
    };
    json!({
        "watchers": watchers,
        "events": events,
        "healthy_throughput_ratio": median(true, "deliveries_per_second") / median(false, "deliveries_per_second").max(1.0),
        "rss_growth_alone_kib": median(false, "rss_growth_kib"),
        "hub_bytes_after_seal_alone": median(false, "hub_bytes_after_seal"),
        "hub_bytes_after_seal_beside_stalled": median(true, "hub_bytes_after_seal"),
        "rss_growth_beside_stalled_kib": median(true, "rss_growth_kib"),
        "correct": runs.iter().all(|r| r["correct"] == true),
        "runs": runs,
    })
}

/// One unlabelled series of the gateway's `/metrics`.
async fn metric(client: &reqwest::Client, base: &str, name: &str) -> Option<f64> {
    let text = client.get(format!("{base}/metrics")).send().await.ok()?.text().await.ok()?;
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')).and_then(|v| v.trim().parse().ok())
}

/// Rounds of the proxy workload: direct and through the gateway alternate, so a hiccup of the
/// machine lands in both sides' samples instead of in one side's whole run.
const PROXY_ROUNDS: usize = 5;

/// W8, second half: a fake OpenAI-compatible upstream on `listen` streams stamped chunks at
/// `rate` per second, `chunks` in all; read directly and through the gateway's `openai` runtime
/// (`model`) in alternating rounds, the per-chunk latency of both.
async fn proxy(base: &str, listen: &str, model: &str, chunks: usize, rate: u64) -> Value {
    let per_round = chunks.div_ceil(PROXY_ROUNDS).max(1);
    let listener = tokio::net::TcpListener::bind(listen).await.expect("binds the upstream address");
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(fake_upstream(socket, per_round, rate));
        }
    });
    let (mut direct, mut via, mut correct) = (Vec::new(), Vec::new(), true);
    for round in 0..PROXY_ROUNDS {
        correct &= proxy_direct(listen, per_round, &mut direct).await;
        correct &= proxy_via(base, model, round, per_round, &mut via).await;
    }
    let mut result = added_latency(direct, via);
    result.extend([
        ("chunks".into(), json!(per_round * PROXY_ROUNDS)),
        ("rounds".into(), json!(PROXY_ROUNDS)),
        ("rate".into(), json!(rate)),
        ("correct".into(), json!(correct)),
    ]);
    Value::Object(result)
}

/// Latencies in microseconds measured directly and through the gateway: each path's p50 and
/// p99 in ms, and what the gateway adds at each (its quantile less the direct one).
fn added_latency(mut direct: Vec<u64>, mut via: Vec<u64>) -> serde_json::Map<String, Value> {
    direct.sort_unstable();
    via.sort_unstable();
    let ms = |v: &[u64], p: f64| percentile(v, p) as f64 / 1000.0;
    let fields = json!({
        "direct_p50_ms": ms(&direct, 0.5),
        "direct_p99_ms": ms(&direct, 0.99),
        "gateway_p50_ms": ms(&via, 0.5),
        "gateway_p99_ms": ms(&via, 0.99),
        "added_p50_ms": ms(&via, 0.5) - ms(&direct, 0.5),
        "added_p99_ms": ms(&via, 0.99) - ms(&direct, 0.99),
    });
    let Value::Object(fields) = fields else { unreachable!("an object") };
    fields
}

/// The client reads the upstream's stream itself; whether every chunk came, in order.
async fn proxy_direct(listen: &str, chunks: usize, latencies: &mut Vec<u64>) -> bool {
    let client = reqwest::Client::new();
    let r = client
        .post(format!("http://{listen}/v1/chat/completions"))
        .json(&json!({"model": "fake", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .expect("the upstream answers");
    let mut body = r.bytes_stream();
    let (mut buf, mut expected, mut bad) = (Vec::new(), 0u64, 0u64);
    while let Some(Ok(b)) = body.next().await {
        let now = now_micros();
        buf.extend_from_slice(&b);
        while let Some(end) = find(&buf, b"\n\n") {
            if let Some((stamp, index)) = content_stamp(&buf[..end]) {
                bad += u64::from(index != expected);
                expected += 1;
                latencies.push(now.saturating_sub(stamp));
            }
            buf.drain(..end + 2);
        }
    }
    bad == 0 && expected == chunks as u64
}

/// An SSE watcher of a turn on the openai model; whether every chunk came, in order, and the
/// turn sealed.
async fn proxy_via(base: &str, model: &str, round: usize, chunks: usize, latencies: &mut Vec<u64>) -> bool {
    let channel = format!("proxy{}-{round}", now_micros());
    let mut feed = subscribe(Server::Gateway, Transport::Sse, base, &channel).await;
    let client = reqwest::Client::new();
    let r = client
        .post(format!("{base}/conversations/{channel}/messages"))
        .json(&json!({"message": "proxy", "model": model}))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(r.status(), 202, "starting the proxied turn");
    let (mut expected, mut bad, mut sealed) = (0u64, 0u64, false);
    while let Some(range) = feed.next_message().await {
        let now = feed.dec.read_at;
        let (_, data) = fields(&feed.dec.body[range]);
        if let Some((stamp, index)) = stamp_of(data) {
            bad += u64::from(index != expected);
            expected += 1;
            latencies.push(now.saturating_sub(stamp));
        }
        if find(data, b"\"type\":\"turn-sealed\"").is_some() {
            sealed = true;
            break;
        }
    }
    bad == 0 && sealed && expected == chunks as u64
}

/// The `<micros>:<index>:` stamp of an upstream chunk's content.
fn content_stamp(message: &[u8]) -> Option<(u64, u64)> {
    let at = find(message, b"\"content\":\"")?;
    let mut parts = message[at + 11..].splitn(3, |b| *b == b':');
    Some((number(parts.next()?)?, number(parts.next()?)?))
}

/// Answers one Chat Completions request with `chunks` stamped content chunks at `rate`/s.
async fn fake_upstream(mut socket: tokio::net::TcpStream, chunks: usize, rate: u64) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = socket.set_nodelay(true);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let length: usize =
        head.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    while buf.len() < head_end + length {
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    if socket.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    let start = Instant::now();
    for i in 0..chunks {
        if rate > 0 {
            tokio::time::sleep_until((start + Duration::from_secs_f64(i as f64 / rate as f64)).into()).await;
        }
        let payload = json!({"id": "bench", "object": "chat.completion.chunk", "model": "fake",
            "choices": [{"index": 0, "delta": {"content": format!("{}:{i}:x ", now_micros())}, "finish_reason": null}]});
        if socket.write_all(format!("data: {payload}\n\n").as_bytes()).await.is_err() {
            return;
        }
    }
    let last = json!({"id": "bench", "object": "chat.completion.chunk", "model": "fake",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": chunks}});
    let _ = socket.write_all(format!("data: {last}\n\ndata: [DONE]\n\n").as_bytes()).await;
}

async fn idle(server: Server, transport: Transport, base: &str, watchers: usize, pids: &[u32]) -> Value {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kib(pids);
    let mut open = Vec::with_capacity(watchers);
    for i in 0..watchers {
        open.push(subscribe(server, transport.nth(i), base, &format!("idle{}", i % 100)).await);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_kib(pids);
    let per_stream = after.saturating_sub(before) as f64 / watchers as f64;
    drop(open);
    json!({"transport": format!("{transport:?}").to_lowercase(), "watchers": watchers, "rss_before_kib": before,
           "rss_after_kib": after, "kib_per_stream": per_stream, "correct": true})
}

async fn latejoin(
    server: Server,
    transport: Transport,
    base: &str,
    publish_base: &str,
    events: usize,
    rate: u64,
) -> Value {
    if server == Server::Pushpin {
        // Its reliable mode asks the origin for what a subscriber missed: the replay would be
        // the origin's, not Pushpin's.
        eprintln!("latejoin: Pushpin keeps no messages to replay to a late subscriber");
        std::process::exit(2);
    }
    let client = reqwest::Client::new();
    let channel = format!("late{}", now_micros());
    let mut early = subscribe(server, Transport::Sse, base, &channel).await;
    let produced = Arc::new(AtomicU64::new(0));
    let publisher = match server {
        Server::Gateway => {
            start_turn(&client, base, &channel, &format!("latejoin-{events}-{rate}")).await;
            None
        }
        Server::Nchan | Server::Pushpin => {
            let (client, base, channel) = (client.clone(), publish_base.to_owned(), channel.clone());
            Some(tokio::spawn(async move { publish(server, &client, &base, &channel, events, rate).await }))
        }
    };
    let is_event = |server: Server, data: &[u8]| {
        !data.is_empty() && (server != Server::Gateway || find(data, b"\"type\":\"text-delta\"").is_some())
    };
    // Wait until the early watcher holds every event: the turn has emitted them all.
    let mut count = 0;
    while count < events {
        let Some(range) = early.next_message().await else { break };
        if is_event(server, fields(&early.dec.body[range]).1) {
            count += 1;
        }
    }
    produced.store(count as u64, Ordering::Relaxed);
    if let Some(p) = publisher {
        p.await.unwrap();
    }
    let started = Instant::now();
    // Without `until=sealed`: the turn is still open.
    let late_url = match (server, transport) {
        (Server::Gateway, Transport::Ws) => format!("{base}/ws"),
        (Server::Gateway, _) => format!("{base}/conversations/{channel}/events"),
        (Server::Nchan | Server::Pushpin, _) => format!("{base}/sub/{channel}"),
    };
    let mut late = Feed::open(transport, &late_url, &channel).await.expect("subscribes");
    let mut got = 0;
    while got < events {
        let Some(range) = late.next_message().await else { break };
        let message = &late.dec.body[range];
        let data = if transport == Transport::Sse { fields(message).1 } else { message };
        if is_event(server, data) {
            got += 1;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if server == Server::Gateway {
        let _ = client.post(format!("{base}/conversations/{channel}/stop")).send().await;
    }
    json!({"transport": format!("{transport:?}").to_lowercase(), "events": events, "rate": rate,
           "emitted": produced.load(Ordering::Relaxed), "received": got, "seconds": seconds, "correct": got == events})
}

async fn turns(base: &str, clients: usize, seconds: f64, pids: &[u32]) -> Value {
    let client = authorized_client();
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let writes0 = metric(&client, base, "dispatch_sqlite_write_seconds_count").await.unwrap_or(0.0);
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
                        let now = Instant::now();
                        buf.extend_from_slice(&b);
                        let mut at = 0;
                        while let Some(end) = find(&buf[at..], b"\n") {
                            let line = &buf[at..at + end];
                            at += end + 1;
                            if find(line, b"\"type\":\"done\"").is_some() {
                                done_at = Some(now);
                            } else if find(line, b"\"type\":\"turn-sealed\"").is_some() {
                                ok = done_at.is_some();
                                if let Some(d) = done_at {
                                    gaps.push(now.duration_since(d).as_micros() as u64);
                                }
                            }
                        }
                        buf.drain(..at);
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
    let writes = metric(&client, base, "dispatch_sqlite_write_seconds_count").await.unwrap_or(0.0) - writes0;
    gaps.sort_unstable();
    json!({
        "clients": clients,
        "write_transactions_per_turn": writes / sealed.max(1) as f64,
        "sealed": sealed,
        "seconds": elapsed,
        "turns_per_second": sealed as f64 / elapsed,
        "done_to_sealed_p50_ms": percentile(&gaps, 0.5) as f64 / 1000.0,
        "done_to_sealed_p99_ms": percentile(&gaps, 0.99) as f64 / 1000.0,
        "server_cpu_seconds": cpu_micros(pids).saturating_sub(cpu0) as f64 / 1e6,
        "correct": bad == 0 && sealed > 0,
    })
}

/// The `Authorization` the gateway's requests carry, from `DISPATCH_BENCH_AUTHORIZATION` (an
/// API key or a user's token, `Bearer ...`): `bench/ab --auth` compares the two on W6 and W7.
fn authorization() -> Option<String> {
    std::env::var("DISPATCH_BENCH_AUTHORIZATION").ok().filter(|v| !v.is_empty())
}

/// A client whose requests carry [`authorization`].
fn authorized_client() -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(value) = authorization() {
        headers.insert(reqwest::header::AUTHORIZATION, value.parse().expect("a header value"));
    }
    reqwest::Client::builder().default_headers(headers).build().unwrap()
}

/// One keep-alive HTTP/1.1 connection for GET requests with `content-length` answers, by hand
/// (the client shares the cores with the server: a general-purpose client costs about as much
/// per request as the server does).
struct Getter {
    stream: tokio::net::TcpStream,
    request: Vec<u8>,
    buf: Vec<u8>,
}

impl Getter {
    async fn connect(base: &str, path: &str) -> Result<Getter, String> {
        let host = base.strip_prefix("http://").ok_or("http only")?;
        let stream = tokio::net::TcpStream::connect(host).await.map_err(|e| format!("{base}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let auth = authorization().map(|v| format!("authorization: {v}\r\n")).unwrap_or_default();
        let request =
            format!("GET {path} HTTP/1.1\r\nhost: {host}\r\naccept: application/json\r\n{auth}\r\n").into_bytes();
        Ok(Getter { stream, request, buf: Vec::with_capacity(1 << 16) })
    }

    /// Sends the request; returns the status and the body.
    async fn get(&mut self) -> Result<(u16, Vec<u8>), String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        self.stream.write_all(&self.request).await.map_err(|e| e.to_string())?;
        let head_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i + 4;
            }
            if self.stream.read_buf(&mut self.buf).await.map_err(|e| e.to_string())? == 0 {
                return Err("closed before the response head".into());
            }
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).to_lowercase();
        let status = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .ok_or("no content-length")?;
        while self.buf.len() < head_end + length {
            if self.stream.read_buf(&mut self.buf).await.map_err(|e| e.to_string())? == 0 {
                return Err("closed inside the body".into());
            }
        }
        let body = self.buf[head_end..head_end + length].to_vec();
        self.buf.drain(..head_end + length);
        Ok((status, body))
    }
}

async fn history(base: &str, conversation: &str, concurrency: usize, seconds: f64) -> Value {
    let path = format!("/conversations/{conversation}?sinceSeq=0&limit=100");
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        let mut getter = Getter::connect(base, &path).await.expect("connects");
        tasks.push(tokio::spawn(async move {
            let (mut latencies, mut bad) = (Vec::new(), 0u64);
            while Instant::now() < deadline {
                let t = Instant::now();
                let (status, body) = getter.get().await.expect("the gateway answers");
                latencies.push(t.elapsed().as_micros() as u64);
                if status != 200 || !window_is_whole(&body, 100) {
                    bad += 1;
                }
            }
            (latencies, bad)
        }));
    }
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
        "correct": bad == 0 && !latencies.is_empty(),
    })
}

/// A history window holds `n` chunks with consecutive seqs (scanned, not parsed: the client
/// shares the cores with the server).
fn window_is_whole(body: &[u8], n: usize) -> bool {
    let seqs: Vec<u64> = memchr::memmem::find_iter(body, b"\"seq\":")
        .filter_map(|at| {
            let digits = &body[at + 6..];
            number(&digits[..digits.iter().position(|b| !b.is_ascii_digit()).unwrap_or(digits.len())])
        })
        .collect();
    seqs.len() == n && seqs.windows(2).all(|w| w[1] == w[0] + 1)
}

fn seed(database: &str, conversation: &str, chunks: u64) -> Value {
    let mut conn = rusqlite::Connection::open(database).expect("opens the database");
    let tx = conn.transaction().unwrap();
    tx.execute(
        "INSERT INTO conversations (id, title, status, created_at, last_activity_at, last_seq, last_message_id, sealed_seq)
         VALUES (?1, 'bench', 'idle', 0, 0, ?2, ?2, ?2)",
        (conversation, chunks as i64),
    )
    .unwrap();
    {
        let mut insert = tx
            .prepare("INSERT INTO chunks (conversation_id, seq, message_id, turn_id, role, chunk) VALUES (?, ?, ?, 'seed', 'assistant', ?)")
            .unwrap();
        for seq in 1..=chunks as i64 {
            let text = format!(r#"{{"type":"text","text":"chunk {seq} of the long conversation"}}"#);
            insert.execute((conversation, seq, seq, text)).unwrap();
        }
    }
    tx.commit().unwrap();
    json!({"conversation": conversation, "chunks": chunks, "correct": true})
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
