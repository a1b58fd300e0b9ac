//! W9, tool calls: an MCP server's calls made directly (the official SDK, the client the
//! gateway uses) and through the gateway's agent loop (a fake OpenAI upstream that asks for
//! them, a client reading `POST /chat`). What the gateway adds per call is the difference of
//! the two latencies at each quantile; its calls per second against the server's own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use rmcp::ServiceExt;
use serde_json::{Value, json};

/// Calls per step in the throughput turns (the gateway's `max_parallel_tools` is set to it).
pub const CALLS_PER_STEP: usize = 8;

/// Calls made before measuring, on each path: the server's and the gateway's first calls warm
/// caches and connections.
const WARMUP: usize = 20;

pub struct Plan<'a> {
    pub base: &'a str,
    pub upstream: &'a str,
    pub model: &'a str,
    /// The stdio server, the same program the gateway's `[mcp]` table runs.
    pub server: &'a [String],
    /// Tool to call (its name on the server; the gateway's is `<server>__<tool>`).
    pub tool: &'a str,
    pub exposed: &'a str,
    pub calls: usize,
    pub clients: usize,
    pub seconds: f64,
}

pub async fn tools(plan: Plan<'_>) -> Value {
    let listener = tokio::net::TcpListener::bind(plan.upstream).await.expect("binds the upstream address");
    let exposed = plan.exposed.to_owned();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(upstream(socket, exposed.clone()));
        }
    });
    let (program, args) = plan.server.split_first().expect("a server command");
    let mut command = tokio::process::Command::new(program);
    command.args(args);
    let transport = rmcp::transport::TokioChildProcess::new(command).expect("the server starts");
    let client = ().serve(transport).await.expect("the server initializes");
    let peer = client.peer().clone();
    let call = |i: usize| {
        let peer = peer.clone();
        let params = serde_json::from_value(json!({"name": plan.tool, "arguments": {"n": i}})).unwrap();
        async move { peer.call_tool(params).await.is_ok() }
    };

    // Latency, one call at a time: directly, then through the gateway.
    let mut correct = true;
    for i in 0..WARMUP {
        correct &= call(i).await;
    }
    let mut direct = Vec::with_capacity(plan.calls);
    for i in 0..plan.calls {
        let started = Instant::now();
        correct &= call(i).await;
        direct.push(started.elapsed().as_micros() as u64);
    }
    let http = reqwest::Client::new();
    let mut via = Vec::with_capacity(plan.calls);
    for i in 0..WARMUP + plan.calls {
        let (intervals, ok) = turn(&http, plan.base, plan.model, &format!("lat{i}"), 1).await;
        correct &= ok && intervals.len() == 1;
        if i >= WARMUP {
            via.extend(intervals);
        }
    }

    // Calls per second: `clients` callers at once for `seconds`, directly, then through the
    // gateway (each turn a step of CALLS_PER_STEP calls).
    let window = Duration::from_secs_f64(plan.seconds);
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let callers: Vec<_> = (0..plan.clients)
        .map(|c| {
            let done = done.clone();
            async move {
                let mut i = c * 1_000_000;
                while started.elapsed() < window {
                    if call(i).await {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    i += 1;
                }
            }
        })
        .collect();
    futures_util::future::join_all(callers).await;
    let direct_rate = done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    let results = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let clients: Vec<_> = (0..plan.clients)
        .map(|c| {
            let (http, results) = (http.clone(), results.clone());
            let (base, model) = (plan.base.to_owned(), plan.model.to_owned());
            tokio::spawn(async move {
                let mut ok = true;
                let mut n = 0;
                while started.elapsed() < window {
                    let (intervals, fine) = turn(&http, &base, &model, &format!("rate{c}-{n}"), CALLS_PER_STEP).await;
                    ok &= fine && intervals.len() == CALLS_PER_STEP;
                    results.fetch_add(intervals.len() as u64, Ordering::Relaxed);
                    n += 1;
                }
                ok
            })
        })
        .collect();
    for client in clients {
        correct &= client.await.unwrap_or(false);
    }
    let via_rate = results.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    let _ = client.cancel().await;

    let mut result = crate::added_latency(direct, via);
    result.extend([
        ("calls".into(), json!(plan.calls)),
        ("clients".into(), json!(plan.clients)),
        ("calls_per_step".into(), json!(CALLS_PER_STEP)),
        ("direct_calls_per_second".into(), json!(direct_rate)),
        ("gateway_calls_per_second".into(), json!(via_rate)),
        ("correct".into(), json!(correct)),
    ]);
    Value::Object(result)
}

/// One turn whose first step asks for `calls` calls: for each call, the microseconds from its
/// `tool-call` event to its `tool-result` event as the client reads them; and whether every
/// result came, none an error, and the turn ended `stop`.
async fn turn(http: &reqwest::Client, base: &str, model: &str, id: &str, calls: usize) -> (Vec<u64>, bool) {
    let body = json!({"conversationId": id, "message": format!("calls-{calls}"), "model": model});
    let Ok(r) = http.post(format!("{base}/chat")).json(&body).send().await else { return (Vec::new(), false) };
    let mut stream = r.bytes_stream();
    let (mut buf, mut asked, mut intervals, mut ok, mut stopped) = (Vec::new(), Vec::new(), Vec::new(), true, false);
    while let Some(Ok(bytes)) = stream.next().await {
        let now = Instant::now();
        buf.extend_from_slice(&bytes);
        while let Some(end) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=end).collect();
            let Ok(event) = serde_json::from_slice::<Value>(&line) else { continue };
            match event["type"].as_str() {
                Some("tool-call") => asked.push((event["toolCallId"].clone(), now)),
                Some("tool-result") => {
                    ok &= event["isError"] == false;
                    match asked.iter().find(|(id, _)| *id == event["toolCallId"]) {
                        Some((_, at)) => intervals.push(now.duration_since(*at).as_micros() as u64),
                        None => ok = false,
                    }
                }
                Some("done") => stopped = event["reason"] == "stop",
                _ => {}
            }
        }
    }
    (intervals, ok && stopped)
}

/// The fake upstream: a request whose last message is a tool result is answered with text; any
/// other with a step asking for `calls-N`'s N calls of `tool` (distinct arguments: identical
/// calls would run once).
async fn upstream(mut socket: tokio::net::TcpStream, tool: String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = socket.set_nodelay(true);
    let (mut buf, mut chunk) = (Vec::new(), [0u8; 16384]);
    loop {
        // One request per connection turn: head, then its body.
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let request: Value = serde_json::from_slice(&buf[head_end..head_end + length]).unwrap_or(Value::Null);
        buf.drain(..head_end + length);
        let messages = request["messages"].as_array().cloned().unwrap_or_default();
        let last = messages.last().cloned().unwrap_or(Value::Null);
        let mut events = Vec::new();
        if last["role"] == "tool" {
            events.push(json!({"choices": [{"index": 0, "delta": {"content": "done"}}]}));
            events.push(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}));
        } else {
            let text = last["content"].as_str().unwrap_or_default();
            let calls: usize = text.strip_prefix("calls-").and_then(|n| n.parse().ok()).unwrap_or(1);
            for i in 0..calls {
                events
                    .push(json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, "id": format!("c{i}"),
                    "type": "function", "function": {"name": tool, "arguments": format!("{{\"n\": {i}}}")}}]}}]}));
            }
            events.push(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}));
        }
        let mut body = String::new();
        for e in events {
            body.push_str(&format!("data: {e}\n\n"));
        }
        body.push_str("data: [DONE]\n\n");
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if socket.write_all(response.as_bytes()).await.is_err() {
            return;
        }
    }
}
