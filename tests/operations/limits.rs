//! Limits on streams, slow heads and WebSocket frames, and how a stop closes sessions.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_streams_slow_headers_and_websocket_frames() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_streams = 2;
    config.header_read_timeout_secs = 1;
    config.max_body_bytes = 64 * 1024;
    let server = TestServer::start(config).await;

    // Two streams fit; the third is 503 on every transport; closing one makes room.
    let first = server.events("cap", "", &[]).await;
    let _second = server.events("cap", "", &[("accept", "application/x-ndjson")]).await;
    let (status, body) = server.get("/conversations/cap/events").await;
    assert_eq!(status, 503, "{body}");
    let (status, _) = server.post("/chat", json!({"message": "hi"})).await;
    assert_eq!(status, 503);
    assert!(tokio_tungstenite::connect_async(format!("ws://{}/ws", server.addr)).await.is_err());
    let (_, metrics) = read_json(server.client.get(server.url("/metrics")).send().await.unwrap()).await;
    let metrics = metrics.as_str().unwrap().to_owned();
    assert!(metrics.contains("dispatch_open_streams{transport=\"sse\"} 1"), "{metrics}");
    assert!(metrics.contains("dispatch_open_streams{transport=\"ndjson\"} 1"), "{metrics}");
    drop(first);
    let mut ok = false;
    for _ in 0..100 {
        if server.client.get(server.url("/conversations/cap/events")).send().await.unwrap().status() == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ok, "a closed stream frees its place");

    // A client that never finishes its request head is disconnected.
    let mut slow = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n").await.unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(30), slow.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "the slow client was not disconnected");
    assert!(!String::from_utf8_lossy(&buf).contains("200 OK"));

    // A request body past the limit is 413.
    let (status, body) = server.post("/conversations", json!({"title": "x".repeat(70 * 1024)})).await;
    assert_eq!(status, 413, "{body}");
}

#[tokio::test]
async fn an_oversized_websocket_frame_closes_the_socket() {
    use futures_util::SinkExt;
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_body_bytes = 16 * 1024;
    let server = TestServer::start(config).await;
    let mut ws = server.ws().await;
    ws.next().await.unwrap();
    let big = json!({"type": "chat.send", "message": "x".repeat(64 * 1024)}).to_string();
    let _ = ws.socket.send(tokio_tungstenite::tungstenite::Message::text(big)).await;
    assert_eq!(ws.close_code().await, Some(1009), "closed as too big");
    assert_eq!(ws.next().await, None, "the socket is closed");
    // The gateway is fine.
    assert_eq!(server.get("/health").await.0, 200);
}

#[tokio::test]
async fn a_graceful_stop_closes_websockets_as_going_away() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let mut ws = server.ws().await;
    assert_eq!(ws.next().await.unwrap()["type"], "catalog");
    ws.send(json!({"type": "chat.subscribe", "conversationId": "away"})).await;
    let (_, code) = tokio::join!(server.stop(), ws.close_code());
    assert_eq!(code, Some(1001));
}
