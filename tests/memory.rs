//! What clients can make the gateway hold, measured (docs/security.md): the gateway's
//! binary as a child process, its resident memory (`VmRSS`) read before, during and after each
//! hostile shape at the caps set here, and held within the caps plus a fixed allowance for what
//! any gateway holds while it works (the allocator's, the database's caches, the tasks'):
//!
//! - bodies: 200 keyless clients that each declare a body of 1 MiB and send all but its last
//!   byte, then 100 with the key (the reading budget: 16 MiB);
//! - history: 4 readers of a conversation of 48 messages of 1 MiB that stop reading (pages of
//!   1 MiB);
//! - replay: a turn of 60 tool results of 1 MiB, watched by a reader that stopped (a turn's
//!   buffer: 8 MiB).
//!
//! Before the caps each of these grew the gateway by a few hundred MiB.

mod common;

use std::time::Duration;

use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const MIB: u64 = 1024 * 1024;
/// What a working gateway may grow by besides the caps, in MiB.
const ALLOWANCE: u64 = 48;

fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb / 1024
}

/// The highest resident size seen over `during`, sampled every 50 ms.
async fn peak_over(pid: u32, during: Duration) -> u64 {
    let until = tokio::time::Instant::now() + during;
    let mut peak = rss_mib(pid);
    while tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
        peak = peak.max(rss_mib(pid));
    }
    peak
}

/// A client that stopped reading: a tiny receive buffer, nothing read.
async fn stalled(addr: std::net::SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(addr).await.unwrap()
}

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The gateway's binary with `flags` on a free loopback port and a database in `dir`, once it
/// answers `/health`.
async fn gateway(dir: &std::path::Path, flags: &[[&str; 2]]) -> (Child, std::net::SocketAddr) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"))
        .args(["--listen", &addr.to_string(), "--database", dir.join("g.db").to_str().unwrap()])
        .args(flags.iter().flatten())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let child = Child(child);
    let client = reqwest::Client::new();
    let health = format!("http://{addr}/health");
    assert!(common::eventually(200, || async { client.get(&health).send().await.is_ok() }).await, "the gateway starts");
    (child, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_shapes_at_their_caps_stay_within_the_documented_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let result = "r".repeat(MIB as usize);
    let calls: Vec<_> =
        (0..60).map(|i| json!({"id": format!("call_{i}"), "name": "read", "input": {}, "result": result})).collect();
    let script = common::write_script(
        dir.path(),
        json!({"rules": [{"match": "tools", "pace": 0, "steps": [{"text": "reading", "toolCalls": calls}]}]}),
    );
    let (child, addr) = gateway(
        dir.path(),
        &[
            ["--scripted-pace", "0"],
            ["--scripted-script", script.to_str().unwrap()],
            ["--api-keys", "k"],
            ["--max-body-bytes", &(2 * MIB).to_string()],
            ["--max-reading-bytes", &(16 * MIB).to_string()],
            ["--history-page-bytes", &MIB.to_string()],
            ["--turn-buffer-max-bytes", &(8 * MIB).to_string()],
            ["--replay-max-bytes", &(64 * MIB).to_string()],
            ["--request-timeout-secs", "60"],
        ],
    )
    .await;
    let pid = child.0.id();
    let client = reqwest::Client::new();
    let url = |path: &str| format!("http://{addr}{path}");
    let mut report = Vec::new();

    // Bodies: keyless clients are refused from the head; keyed ones fit the budget or get 503.
    let before = rss_mib(pid);
    let head = |key: bool| {
        format!(
            "POST /chat HTTP/1.1\r\nhost: localhost\r\n{}content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            if key { "authorization: Bearer k\r\n" } else { "" },
            MIB
        )
    };
    let mut held = Vec::new();
    for i in 0..300 {
        let mut socket = TcpStream::connect(addr).await.unwrap();
        socket.write_all(head(i >= 200).as_bytes()).await.unwrap();
        held.push(tokio::spawn(async move {
            // All but the last byte, as fast as the gateway takes it (a refused client's stops
            // when its socket is closed).
            let _ = socket.write_all(&vec![b' '; MIB as usize - 1]).await;
            socket
        }));
    }
    let during = peak_over(pid, Duration::from_secs(3)).await;
    drop(held);
    let bound = 16 + ALLOWANCE;
    report.push(("bodies", before, during, bound));

    // History: a conversation of 48 messages of 1 MiB, read by 4 clients that stop reading.
    let message = "m".repeat(MIB as usize - 100);
    for i in 0..48 {
        let r = client
            .post(url("/conversations/big/messages"))
            .bearer_auth("k")
            .json(&json!({"message": format!("{i} {message}")}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        assert!(
            common::eventually(200, || async {
                let s = client.get(url("/conversations/big/status")).bearer_auth("k").send().await.unwrap();
                s.json::<serde_json::Value>().await.unwrap()["isActive"] == false
            })
            .await
        );
    }
    let before = rss_mib(pid);
    let mut readers = Vec::new();
    for _ in 0..4 {
        let mut socket = stalled(addr).await;
        socket
            .write_all(b"GET /conversations/big HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer k\r\n\r\n")
            .await
            .unwrap();
        readers.push(socket);
    }
    let during = peak_over(pid, Duration::from_secs(3)).await;
    drop(readers);
    // Three pages a reader, each a page of 1 MiB and the chunk that ended it.
    let bound = 4 * 3 * 2 + ALLOWANCE;
    report.push(("history", before, during, bound));

    // Replay: a turn of 60 tool results of 1 MiB, its watcher stopped.
    let before = rss_mib(pid);
    let mut watcher = stalled(addr).await;
    watcher
        .write_all(b"GET /conversations/tools/events?until=sealed HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer k\r\n\r\n")
        .await
        .unwrap();
    let r = client
        .post(url("/conversations/tools/messages"))
        .bearer_auth("k")
        .json(&json!({"message": "tools"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let during = peak_over(pid, Duration::from_secs(4)).await;
    let metrics = client.get(url("/metrics")).bearer_auth("k").send().await.unwrap().text().await.unwrap();
    let buffered: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("dispatch_hub_buffer_bytes "))
        .and_then(|v| v.parse().ok())
        .expect("the gauge");
    drop(watcher);
    let bound = 8 + ALLOWANCE;
    report.push(("replay", before, during, bound));
    let after = rss_mib(pid);

    for (shape, before, during, bound) in &report {
        eprintln!("{shape}: resident {before} MiB before, {during} MiB during (bound +{bound} MiB)");
    }
    eprintln!("after: {after} MiB");
    assert!(buffered <= 8 * MIB + 2 * MIB, "the replay buffers hold {buffered} bytes");
    for (shape, before, during, bound) in report {
        assert!(during <= before + bound, "{shape}: {before} MiB before, {during} MiB during; bound +{bound} MiB");
    }
}

/// The agent loop and `--web-root` at their bounds (docs/security.md): an upstream that asks
/// for 200 calls of a 1 MiB result a step (`max_tool_calls` 16, requests within 16 MiB), one
/// that streams 128 MiB of text in 1 MiB events (`--max-step-bytes` 16 MiB), and 16 readers of
/// a 32 MiB file of the web root that stop reading (a 64 KiB chunk each, and the connection's
/// buffer). Before the bounds these grew the gateway by ~1 GiB, ~1.3 GiB and 512 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_loop_and_the_web_root_stay_within_their_bounds() {
    use common::upstream::{FakeUpstream, Reply};
    let dir = tempfile::tempdir().unwrap();
    let web = dir.path().join("web");
    std::fs::create_dir_all(&web).unwrap();
    std::fs::write(web.join("index.html"), "<!doctype html>").unwrap();
    std::fs::write(web.join("big.bin"), vec![b'b'; 32 * MIB as usize]).unwrap();

    // A step of 200 calls of a 1 MiB result; three of them, then an answer.
    let calls: Vec<serde_json::Value> = (0..200)
        .map(|i| {
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, "id": format!("c{i}"),
                "type": "function", "function": {"name": "py__big", "arguments": format!("{{\"size\": {}}}", MIB + i)}}]}}]})
        })
        .chain([json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})])
        .collect();
    let says =
        Reply::Stream(vec![json!({"choices": [{"index": 0, "delta": {"content": "done"}, "finish_reason": "stop"}]})]);
    let mib_text = "t".repeat(MIB as usize - 64);
    let text: Vec<serde_json::Value> =
        (0..128).map(|_| json!({"choices": [{"index": 0, "delta": {"content": mib_text}}]})).collect();
    let python = std::env::var("DISPATCH_TEST_MCP_PYTHON").ok();
    assert!(python.is_some() || std::env::var_os("DISPATCH_REQUIRE_MCP").is_none(), "a Python with `mcp` is required");
    let mut replies = vec![Reply::Stream(text)];
    if python.is_some() {
        replies.extend([Reply::Stream(calls.clone()), Reply::Stream(calls.clone()), Reply::Stream(calls), says]);
    }
    let upstream = FakeUpstream::start(replies).await;
    let server_py = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tools/server.py");
    let mut toml =
        format!("[credentials.up]\nkind = \"openai\"\nbase_url = \"{}\"\nmodels = [\"m\"]\n", upstream.base_url());
    if let Some(python) = &python {
        toml += &format!(
            "mcp = [\"py\"]\n\n[mcp.py]\ncommand = {python:?}\nargs = [{:?}, \"stdio\"]\nscope = \"shared\"\n",
            server_py.display().to_string()
        );
    }
    std::fs::write(dir.path().join("gateway.toml"), toml).unwrap();

    let config = dir.path().join("gateway.toml");
    let (child, addr) = gateway(
        dir.path(),
        &[
            ["--config", config.to_str().unwrap()],
            ["--web-root", web.to_str().unwrap()],
            ["--turn-buffer-max-bytes", &(8 * MIB).to_string()],
        ],
    )
    .await;
    let pid = child.0.id();
    let client = reqwest::Client::new();
    let url = |path: &str| format!("http://{addr}{path}");
    let idle = |id: &'static str| {
        let client = client.clone();
        let status = url(&format!("/conversations/{id}/status"));
        async move {
            common::eventually(600, || async {
                let s = client.get(&status).send().await.unwrap();
                s.json::<serde_json::Value>().await.unwrap()["isActive"] == false
            })
            .await
        }
    };
    let mut report = Vec::new();

    // A step that streams 128 MiB of text.
    let before = rss_mib(pid);
    let r = client.post(url("/conversations/text/messages")).json(&json!({"message": "talk"})).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let peak = tokio::spawn(peak_over(pid, Duration::from_secs(6)));
    assert!(idle("text").await, "the turn ends");
    let during = peak.await.unwrap();
    // The step's text (16 MiB), and each delta's copies on its way: the wire event, its
    // framings in the turn's buffer, the log's batch (measured ~9x the step; docs/security.md).
    report.push(("step text", before, during, 10 * 16 + ALLOWANCE));

    // Three steps of 200 calls of 1 MiB each.
    if python.is_some() {
        let before = rss_mib(pid);
        let r =
            client.post(url("/conversations/loop/messages")).json(&json!({"message": "read"})).send().await.unwrap();
        assert_eq!(r.status(), 202);
        let peak = tokio::spawn(peak_over(pid, Duration::from_secs(15)));
        assert!(idle("loop").await, "the loop ends");
        let during = peak.await.unwrap();
        let requests = upstream.requests();
        let largest = requests.iter().map(|r| r.body.to_string().len()).max().unwrap();
        assert!(largest <= 17 * MIB as usize, "the largest request: {largest} bytes");
        // A step's 16 results, what the turn keeps of its steps (12 MiB), the request as JSON and
        // as bytes (16 MiB each), the results in the turn's buffer.
        report.push(("loop", before, during, 16 + 12 + 2 * 16 + 8 + ALLOWANCE));
    }

    // 16 readers of a 32 MiB file that stop reading.
    let before = rss_mib(pid);
    let mut readers = Vec::new();
    for _ in 0..16 {
        let mut socket = stalled(addr).await;
        socket.write_all(b"GET /app/big.bin HTTP/1.1\r\nhost: localhost\r\n\r\n").await.unwrap();
        readers.push(socket);
    }
    let during = peak_over(pid, Duration::from_secs(3)).await;
    drop(readers);
    report.push(("web root", before, during, 16 + ALLOWANCE));

    let after = rss_mib(pid);
    for (shape, before, during, bound) in &report {
        eprintln!("{shape}: resident {before} MiB before, {during} MiB during (bound +{bound} MiB)");
    }
    eprintln!("after: {after} MiB");
    for (shape, before, during, bound) in report {
        assert!(during <= before + bound, "{shape}: {before} MiB before, {during} MiB during; bound +{bound} MiB");
    }
}
