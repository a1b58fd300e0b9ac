//! Hostile clients: a watcher that reads one byte a second, one that never reads, 10,000
//! connections opened and dropped in a loop, floods of WebSocket frames, and malformed input
//! of every kind. The turn and the healthy watchers are unaffected, memory stays bounded,
//! file descriptors are released, and nothing answers 5xx.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn rss_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn raw_watcher(server: &TestServer, conversation: &str) -> tokio::net::TcpStream {
    raw_get(server, &format!("/conversations/{conversation}/events"), "*/*").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_stalled_and_churning_clients_do_not_hurt_the_turn_or_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.drain_timeout_secs = 2;
    // Big enough that nothing is coalesced (healthy NDJSON watchers read every event), and a
    // turn longer than what the stalled socket's buffers absorb (so its writes block).
    config.turn_buffer_bytes = 64 << 20;
    config.scripted_script = Some(write_script(
        dir.path(),
        json!({"rules": [{"match": "long", "pace": 0, "steps": [{"text": "tok ", "repeat": 40000}]}]}),
    ));
    let server = TestServer::start(config).await;
    server.chat("warm", "hello").await;
    let fds_before = open_fds();
    let rss_before = rss_kib("VmRSS:");

    let mut never = raw_watcher(&server, "hostile").await;
    let mut slow = raw_watcher(&server, "hostile").await;
    let slow_reader = tokio::spawn(async move {
        let mut byte = [0u8; 1];
        for _ in 0..6 {
            if slow.read(&mut byte).await.unwrap_or(0) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    // Healthy watchers count what they get and keep only the last line, so the test's own
    // memory stays out of the measure.
    let mut healthy = Vec::new();
    for _ in 0..20 {
        let mut stream = server.ndjson("hostile", "?until=sealed").await;
        healthy.push(tokio::spawn(async move {
            let (mut count, mut last) = (0, String::new());
            while let Some(line) = stream.next_line().await {
                count += 1;
                last = line;
            }
            (count, last)
        }));
    }
    // Connections opened and dropped in a loop, some mid-request, some mid-stream.
    let addr = server.addr;
    let churn: Vec<_> = (0..4)
        .map(|lane| {
            tokio::spawn(async move {
                for i in 0..2500 {
                    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else { continue };
                    match (lane + i) % 3 {
                        0 => {}
                        1 => {
                            let _ =
                                s.write_all(b"GET /conversations/hostile/events HTTP/1.1\r\nhost: localhost\r\n").await;
                        }
                        _ => {
                            let _ = s
                                .write_all(b"GET /conversations/hostile/events HTTP/1.1\r\nhost: localhost\r\n\r\n")
                                .await;
                            let mut buf = [0u8; 64];
                            let _ = tokio::time::timeout(Duration::from_millis(5), s.read(&mut buf)).await;
                        }
                    }
                }
            })
        })
        .collect();

    let (status, _) = server.post("/conversations/hostile/messages", json!({"message": "long"})).await;
    assert_eq!(status, 202);
    for h in healthy {
        let (count, last) = h.await.unwrap();
        assert_eq!(count, 40_006, "every event reached every healthy watcher");
        assert_eq!(serde_json::from_str::<Value>(&last).unwrap()["type"], "turn-sealed");
    }
    for c in churn {
        c.await.unwrap();
    }
    let _ = slow_reader.await;
    let peak_kib = rss_kib("VmHWM:");

    // The stalled socket is cut by the drain timeout; everything else was closed by its client.
    assert!(closed_by_peer(&mut never, Duration::from_secs(30)).await, "the stalled watcher was not closed");
    drop(never);
    let released = eventually(200, || async { open_fds() <= fds_before + 8 }).await;
    assert!(released, "file descriptors: {} before, {} after", fds_before, open_fds());
    let rss_after = rss_kib("VmRSS:");
    println!(
        "RSS before {rss_before} KiB, after {rss_after} KiB, peak {peak_kib} KiB (test process: clients and server)"
    );
    // The turn's buffer (40,000 framed events) and 10,000 short connections fit well within
    // this; an unbounded queue per watcher would not.
    assert!(peak_kib < rss_before + 128 * 1024, "memory stays bounded: peak {peak_kib} KiB");
    assert_eq!(server.get("/health").await.0, 200);
    let metrics = server.metrics().await;
    assert!(metrics.contains("dispatch_open_streams{transport=\"sse\"} 0"), "{metrics}");
}

#[tokio::test]
async fn hostile_ids_bodies_and_headers_get_clean_4xx() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let long = "a".repeat(4096);
    let bad_ids = ["a%0D%0Ab", "%E2%9C%93", "%FF%FE", &long, "..%2F..%2Fetc", "a b", "%00"];
    for id in bad_ids {
        for path in [
            format!("/conversations/{id}"),
            format!("/conversations/{id}/events"),
            format!("/conversations/{id}/status"),
        ] {
            let (status, body) = server.get(&path).await;
            assert_eq!(status, 400, "{path}: {body}");
        }
    }
    for id in ["a\r\nSet-Cookie: x=1", "✓", &long, "a\u{0}b", ""] {
        let r = server
            .client
            .post(server.url("/chat"))
            .json(&json!({"conversationId": id, "message": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{id:?}");
        assert!(r.headers().get("set-cookie").is_none());
        assert!(r.headers().get("x-conversation-id").is_none());
    }
    // 10 MiB, declared and streamed.
    let big = vec![b'x'; 10 << 20];
    let (status, body) = server.post_raw("/chat", big.clone()).await;
    assert_eq!(status, 413, "{body}");
    let parts: Vec<Result<Vec<u8>, std::io::Error>> = big.chunks(1 << 16).map(|c| Ok(c.to_vec())).collect();
    let (status, _) =
        server.post_raw("/conversations", reqwest::Body::wrap_stream(futures_util::stream::iter(parts))).await;
    assert_eq!(status, 413);
    // Invalid UTF-8 and deep nesting.
    let (status, _) = server.post_raw("/conversations/x/messages", b"{\"message\": \"\xc3\x28\"}".to_vec()).await;
    assert_eq!(status, 400);
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let (status, _) = server.post_raw("/chat", deep).await;
    assert_eq!(status, 400);
    // A request id is echoed as the client sent it, and only as one header.
    let r = server.client.get(server.url("/health")).header("x-request-id", "abc-123").send().await.unwrap();
    assert_eq!(r.headers().get_all("x-request-id").iter().count(), 1);
    assert_eq!(r.headers()["x-request-id"], "abc-123");
    // Raw bytes that are not HTTP at all.
    let mut s = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    s.write_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    assert!(!String::from_utf8_lossy(&buf).contains(" 500 "));
    assert_eq!(server.get("/health").await.0, 200);
}

#[tokio::test]
async fn a_websocket_flood_is_answered_or_cut_and_the_gateway_stays_up() {
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::Message;
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let mut ws = server.ws().await;
    ws.next().await.unwrap();
    for i in 0..5000 {
        let frame = match i % 4 {
            0 => Message::text("{nope"),
            1 => Message::text(json!({"type": "chat.subscribe", "conversationId": format!("f{}", i % 50)}).to_string()),
            2 => Message::binary(vec![0xff; 32]),
            _ => {
                Message::text(json!({"type": "chat.unsubscribe", "conversationId": format!("f{}", i % 50)}).to_string())
            }
        };
        if ws.socket.feed(frame).await.is_err() {
            break;
        }
    }
    let _ = ws.socket.flush().await;
    let mut errors = 0;
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(2), ws.next()).await {
        if m["type"] == "error" {
            errors += 1;
        }
        if errors == 2500 {
            break;
        }
    }
    assert_eq!(errors, 2500, "every unparseable frame got its error");
    assert_eq!(server.get("/health").await.0, 200);
    let events = server.chat("f1", "hello").await;
    assert_eq!(events.last().unwrap()["type"], "turn-sealed");
}
