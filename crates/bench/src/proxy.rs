//! The second half of W8: a fake OpenAI-compatible upstream, its chunks read directly and
//! through the gateway, and the latency the gateway adds.

use crate::*;

/// One unlabelled series of the gateway's `/metrics`.
pub(crate) async fn metric(client: &reqwest::Client, base: &str, name: &str) -> Option<f64> {
    let text = client.get(format!("{base}/metrics")).send().await.ok()?.text().await.ok()?;
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')).and_then(|v| v.trim().parse().ok())
}

/// Rounds of the proxy workload: direct and through the gateway alternate, so a hiccup of the
/// machine lands in both sides' samples instead of in one side's whole run.
pub(crate) const PROXY_ROUNDS: usize = 5;

/// W8, second half: a fake OpenAI-compatible upstream on `listen` streams stamped chunks at
/// `rate` per second, `chunks` in all; read directly and through the gateway's `openai` runtime
/// (`model`) in alternating rounds, the per-chunk latency of both.
pub(crate) async fn proxy(base: &str, listen: &str, model: &str, chunks: usize, rate: u64) -> Value {
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
pub(crate) fn added_latency(mut direct: Vec<u64>, mut via: Vec<u64>) -> serde_json::Map<String, Value> {
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
pub(crate) async fn proxy_direct(listen: &str, chunks: usize, latencies: &mut Vec<u64>) -> bool {
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
pub(crate) async fn proxy_via(base: &str, model: &str, round: usize, chunks: usize, latencies: &mut Vec<u64>) -> bool {
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
pub(crate) fn content_stamp(message: &[u8]) -> Option<(u64, u64)> {
    let at = find(message, b"\"content\":\"")?;
    let mut parts = message[at + 11..].splitn(3, |b| *b == b':');
    Some((number(parts.next()?)?, number(parts.next()?)?))
}

/// Answers one Chat Completions request with `chunks` stamped content chunks at `rate`/s.
pub(crate) async fn fake_upstream(mut socket: tokio::net::TcpStream, chunks: usize, rate: u64) {
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
