//! The gateway's HTTP from the load generator: the authorization `bench/ab --auth` sets, a
//! hand-written keep-alive GET client, and W7 (history reads).

use crate::*;

/// The `Authorization` the gateway's requests carry, from `DISPATCH_BENCH_AUTHORIZATION` (an
/// API key or a user's token, `Bearer ...`): `bench/ab --auth` compares the two on W6 and W7.
pub(crate) fn authorization() -> Option<String> {
    std::env::var("DISPATCH_BENCH_AUTHORIZATION").ok().filter(|v| !v.is_empty())
}

/// A client whose requests carry [`authorization`].
pub(crate) fn authorized_client() -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(value) = authorization() {
        headers.insert(reqwest::header::AUTHORIZATION, value.parse().expect("a header value"));
    }
    reqwest::Client::builder().default_headers(headers).build().unwrap()
}

/// One keep-alive HTTP/1.1 connection for GET requests with `content-length` answers, by hand
/// (the client shares the cores with the server: a general-purpose client costs about as much
/// per request as the server does).
pub(crate) struct Getter {
    pub(crate) stream: tokio::net::TcpStream,
    pub(crate) request: Vec<u8>,
    pub(crate) buf: Vec<u8>,
}

impl Getter {
    pub(crate) async fn connect(base: &str, path: &str) -> Result<Getter, String> {
        let host = base.strip_prefix("http://").ok_or("http only")?;
        let stream = tokio::net::TcpStream::connect(host).await.map_err(|e| format!("{base}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let auth = authorization().map(|v| format!("authorization: {v}\r\n")).unwrap_or_default();
        let request =
            format!("GET {path} HTTP/1.1\r\nhost: {host}\r\naccept: application/json\r\n{auth}\r\n").into_bytes();
        Ok(Getter { stream, request, buf: Vec::with_capacity(1 << 16) })
    }

    /// Sends the request; returns the status and the body.
    pub(crate) async fn get(&mut self) -> Result<(u16, Vec<u8>), String> {
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

pub(crate) async fn history(base: &str, conversation: &str, concurrency: usize, seconds: f64) -> Value {
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
pub(crate) fn window_is_whole(body: &[u8], n: usize) -> bool {
    let seqs: Vec<u64> = memchr::memmem::find_iter(body, b"\"seq\":")
        .filter_map(|at| {
            let digits = &body[at + 6..];
            number(&digits[..digits.iter().position(|b| !b.is_ascii_digit()).unwrap_or(digits.len())])
        })
        .collect();
    seqs.len() == n && seqs.windows(2).all(|w| w[1] == w[0] + 1)
}

pub(crate) fn seed(database: &str, conversation: &str, chunks: u64) -> Value {
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
