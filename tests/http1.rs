//! Live streams as raw HTTP/1.1 sees them: chunked framing, keep-alive and pipelined requests
//! after a stream, `Connection: close`, error answers, and heads too long for the stream
//! path (which the general HTTP server takes over).

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// One HTTP/1.1 response read off a raw socket.
struct RawResponse {
    status: u16,
    /// Header lines, names lowercased.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Sizes of the chunks the body came in (empty when it had a content-length).
    chunks: Vec<usize>,
}

impl RawResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8(self.body.clone()).expect("a UTF-8 body")
    }
}

/// Reads a response head: the status and the header lines, names lowercased.
async fn read_head(reader: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    reader.read_line(&mut line).await.unwrap();
    assert!(line.starts_with("HTTP/1.1 "), "a status line: {line:?}");
    let status = line[9..12].parse().unwrap();
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line).await.unwrap();
        assert!(line.ends_with("\r\n"), "header lines end with CRLF: {line:?}");
        if line == "\r\n" {
            return (status, headers);
        }
        let (name, value) = line.trim_end().split_once(": ").expect("name: value");
        headers.push((name.to_ascii_lowercase(), value.to_owned()));
    }
}

/// Reads a chunked body up to its last (empty) chunk: the bytes and the size of each chunk.
async fn read_chunked(reader: &mut BufReader<TcpStream>) -> (Vec<u8>, Vec<usize>) {
    let (mut body, mut sizes) = (Vec::new(), Vec::new());
    let mut line = String::new();
    loop {
        line.clear();
        reader.read_line(&mut line).await.unwrap();
        let size = usize::from_str_radix(line.trim_end(), 16).expect("a hex chunk size");
        let mut chunk = vec![0u8; size + 2];
        reader.read_exact(&mut chunk).await.unwrap();
        assert_eq!(&chunk[size..], b"\r\n", "a chunk ends with CRLF");
        if size == 0 {
            return (body, sizes);
        }
        sizes.push(size);
        body.extend_from_slice(&chunk[..size]);
    }
}

/// Reads one response: its head, then a chunked or content-length body.
async fn read_response(reader: &mut BufReader<TcpStream>) -> RawResponse {
    let read = async {
        let (status, headers) = read_head(reader).await;
        let mut response = RawResponse { status, headers, body: Vec::new(), chunks: Vec::new() };
        if response.header("transfer-encoding") == Some("chunked") {
            assert!(response.header("content-length").is_none());
            (response.body, response.chunks) = read_chunked(reader).await;
        } else {
            let length: usize = response.header("content-length").expect("a length or chunks").parse().unwrap();
            response.body.resize(length, 0);
            reader.read_exact(&mut response.body).await.unwrap();
        }
        response
    };
    tokio::time::timeout(Duration::from_secs(30), read).await.expect("a response within 30 s")
}

async fn connect(server: &TestServer) -> BufReader<TcpStream> {
    BufReader::new(TcpStream::connect(server.addr).await.unwrap())
}

async fn send(reader: &mut BufReader<TcpStream>, bytes: &str) {
    reader.get_mut().write_all(bytes.as_bytes()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_then_pipelined_and_later_requests_share_one_connection() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let mut conn = connect(&server).await;
    // The stream and, behind it on the same write, the next request.
    send(
        &mut conn,
        "GET /conversations/keep/events?until=sealed HTTP/1.1\r\nhost: localhost\r\n\r\n\
         GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n",
    )
    .await;
    // The head arrives before any event (an EventSource opens on it).
    let (status, headers) = read_head(&mut conn).await;
    assert_eq!(status, 200);
    let head = format!("{headers:?}");
    for expected in [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")] {
        assert!(headers.iter().any(|(n, v)| (n.as_str(), v.as_str()) == expected), "{expected:?} in {head}");
    }
    assert!(headers.iter().any(|(n, _)| n == "x-request-id") && headers.iter().any(|(n, _)| n == "date"), "{head}");

    let (status, body) = server.post("/conversations/keep/messages", json!({"message": "hello there"})).await;
    assert_eq!(status, 202, "{body}");
    // Chunks up to the terminating one; the stream ends after turn-sealed.
    let (body, _) = read_chunked(&mut conn).await;
    let text = String::from_utf8(body).unwrap();
    // Ids are `<turnId>:<index>`.
    let ids: Vec<u64> = text
        .lines()
        .filter_map(|l| l.strip_prefix("id: "))
        .map(|v| v.rsplit_once(':').unwrap().1.parse().unwrap())
        .collect();
    assert!(ids.len() > 4, "{text}");
    assert_eq!(ids, (0..ids.len() as u64).collect::<Vec<_>>(), "every event once, in order: {text}");
    assert!(text.contains(r#""type":"turn-sealed""#), "{text}");
    assert!(text.ends_with("\n\n"), "whole SSE messages: {text:?}");

    // The pipelined request is answered after the stream, on the same connection.
    let health = read_response(&mut conn).await;
    assert_eq!((health.status, health.text()), (200, r#"{"ok":true}"#.to_owned()));

    // A bad stream request is a JSON error with a length, and the connection carries on.
    send(&mut conn, "GET /conversations/keep/events?format=xml HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
    let bad = read_response(&mut conn).await;
    assert_eq!(bad.status, 400);
    assert!(bad.chunks.is_empty());
    let error: serde_json::Value = serde_json::from_slice(&bad.body).unwrap();
    assert!(error["error"].as_str().unwrap().contains("format"), "{error}");
    send(&mut conn, "GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
    assert_eq!(read_response(&mut conn).await.status, 200);

    // A stream request after requests the general server answered is still answered.
    send(&mut conn, "GET /conversations/keep/events?format=ndjson&sinceSeq=0 HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await;
    assert_eq!(read_head(&mut conn).await.0, 200);
    drop(conn);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_sends_more_than_a_next_request_while_its_stream_is_open_is_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    for (sent, cut) in [(8 * 1024, false), (20 * 1024, true)] {
        let mut conn = connect(&server).await;
        send(&mut conn, "GET /conversations/chatty/events HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
        assert_eq!(read_head(&mut conn).await.0, 200);
        // Kept as the start of its next request, up to 16 KiB; past that the gateway closes.
        send(&mut conn, &format!("GET /health HTTP/1.1\r\nx-pad: {}", "p".repeat(sent))).await;
        let mut rest = Vec::new();
        let ended = tokio::time::timeout(Duration::from_secs(3), conn.read_to_end(&mut rest)).await;
        assert_eq!(ended.is_ok(), cut, "{sent} bytes sent while the stream is open");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_close_is_honoured_and_a_dropped_watcher_frees_its_stream() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_streams = 1;
    let server = TestServer::start(config).await;

    // `Connection: close`: the answer says so and the server closes after it.
    let mut conn = connect(&server).await;
    send(&mut conn, "GET /conversations/c/events?format=xml HTTP/1.1\r\nhost: localhost\r\nConnection: close\r\n\r\n")
        .await;
    let bad = read_response(&mut conn).await;
    assert_eq!((bad.status, bad.header("connection")), (400, Some("close")));
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut rest)).await;
    assert!(matches!(closed, Ok(Ok(0))), "closed with nothing more: {rest:?}");

    // The one stream place is taken, and freed as soon as its client goes away.
    let mut watcher = connect(&server).await;
    send(&mut watcher, "GET /conversations/c/events HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
    assert_eq!(read_head(&mut watcher).await.0, 200);
    let (status, body) = server.get("/conversations/c/events").await;
    assert_eq!(status, 503, "{body}");
    drop(watcher);
    let freed = eventually(200, || async {
        server.client.get(server.url("/conversations/c/events")).send().await.unwrap().status() == 200
    })
    .await;
    assert!(freed, "a closed connection frees its stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_request_with_a_long_head_is_still_served() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let mut conn = connect(&server).await;
    let pad = "p".repeat(40 * 1024);
    send(
        &mut conn,
        &format!("GET /conversations/long/events?format=xml HTTP/1.1\r\nhost: localhost\r\nx-pad: {pad}\r\n\r\n"),
    )
    .await;
    let bad = read_response(&mut conn).await;
    assert_eq!(bad.status, 400, "{}", bad.text());
    // And the next one on that connection too.
    send(&mut conn, "GET /conversations/long/events?format=xml HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
    assert_eq!(read_response(&mut conn).await.status, 400);
}

/// A gateway whose scripted turns stream deltas 10 ms apart (paced), and a connection to it.
async fn paced(dir: &std::path::Path) -> (TestServer, BufReader<TcpStream>) {
    let mut config = test_config(dir);
    config.scripted_pace = 100.0;
    let server = TestServer::start(config).await;
    let conn = connect(&server).await;
    (server, conn)
}

/// Runs a paced turn in conversation `id` while `conn` watches it until it seals: its text, and
/// how many writes the turn's rounds made to parked streams meanwhile.
async fn watched_turn(server: &TestServer, conn: &mut BufReader<TcpStream>, id: &str) -> (String, f64) {
    let before = metric(&server.metrics().await, "dispatch_round_writes_total");
    let (status, body) =
        server.post(&format!("/conversations/{id}/messages"), json!({"message": "tell me something longer"})).await;
    assert_eq!(status, 202, "{body}");
    let (body, _) = read_chunked(conn).await;
    let text = String::from_utf8(body).unwrap();
    assert!(text.contains(r#""type":"turn-sealed""#), "{text}");
    let after = metric(&server.metrics().await, "dispatch_round_writes_total");
    (text, after - before)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_watcher_of_a_paced_turn_is_written_by_the_turns_rounds_at_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    // The default flush window, closed for one watcher: once the turn knows its spacing, its
    // rounds write to the parked stream instead of waking the watcher's task.
    let (server, mut conn) = paced(dir.path()).await;
    send(&mut conn, "GET /conversations/lone/events?until=sealed HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
    assert_eq!(read_head(&mut conn).await.0, 200);
    let (text, written) = watched_turn(&server, &mut conn, "lone").await;
    let deltas = text.matches(r#""type":"text-delta""#).count();
    assert!(deltas >= 5, "{text}");
    // The first deltas go through the task (no spacing known yet), then one write per round.
    assert!(written >= 3.0, "the turn's rounds wrote to the watcher's socket ({written} writes, {deltas} deltas)");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_after_other_reads_on_a_kept_alive_connection_is_written_by_the_turns_rounds() {
    let dir = tempfile::tempdir().unwrap();
    // A parked stream is written by the turn's rounds (which only a stream the gateway writes
    // itself can be).
    let (server, mut conn) = paced(dir.path()).await;
    // A web client's reads first, then its EventSource, on the same connection.
    send(&mut conn, "GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
    assert_eq!(read_response(&mut conn).await.status, 200);
    send(&mut conn, "GET /conversations/reads/history HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
    read_response(&mut conn).await;
    send(&mut conn, "GET /conversations/reads/events?until=sealed HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
    assert_eq!(read_head(&mut conn).await.0, 200);
    let (_, written) = watched_turn(&server, &mut conn, "reads").await;
    assert!(written > 0.0, "the turn's rounds wrote to the watcher's socket ({written} writes)");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_after_requests_with_bodies_on_a_kept_alive_connection_is_written_by_the_turns_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut conn) = paced(dir.path()).await;
    // A web client's writes first: a body in one piece, one in two (the socket's read ends
    // inside it), a request with none pipelined with the next.
    send(&mut conn, "POST /conversations HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{\"id\":\"posted\"}")
        .await;
    let created = read_response(&mut conn).await;
    assert_eq!(created.status, 201, "{}", created.text());
    let title = r#"{"title":"in two pieces"}"#;
    let head = format!(
        "PUT /conversations/posted/title HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        title.len()
    );
    send(&mut conn, &format!("{head}{}", &title[..9])).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    send(&mut conn, &title[9..]).await;
    let renamed = read_response(&mut conn).await;
    assert_eq!(
        (renamed.status, renamed.text()),
        (200, r#"{"conversationId":"posted","title":"in two pieces"}"#.into())
    );
    send(
        &mut conn,
        "DELETE /conversations/nobody HTTP/1.1\r\nhost: localhost\r\n\r\nGET /health HTTP/1.1\r\nhost: localhost\r\n\r\n",
    )
    .await;
    let missing = read_response(&mut conn).await;
    assert_eq!(missing.status, 404, "{}", missing.text());
    assert!(serde_json::from_slice::<serde_json::Value>(&missing.body).unwrap()["error"].is_string());
    assert_eq!(read_response(&mut conn).await.status, 200);
    // Then its EventSource, on the same connection: parked like any other watch.
    send(&mut conn, "GET /conversations/posted/events?until=sealed HTTP/1.1\r\nhost: localhost\r\n\r\n").await;
    assert_eq!(read_head(&mut conn).await.0, 200);
    let (_, written) = watched_turn(&server, &mut conn, "posted").await;
    assert!(written > 0.0, "the turn's rounds wrote to the watcher's socket ({written} writes)");
    server.stop().await;
}

/// A request names its host once, as `host[:port]` (RFC 9112 3.2): without one (in HTTP/1.1),
/// with two, or with one that is not a host, it is refused with a 400 `{"error"}`, on the
/// gateway's own request path and on the general server's alike, and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_names_its_host_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let mut conn = connect(&server).await;
    let refused = [
        "GET /health HTTP/1.1\r\n\r\n",
        "GET /health HTTP/1.1\r\nhost: localhost\r\nhost: elsewhere\r\n\r\n",
        "GET /health HTTP/1.1\r\nhost: user@gateway\r\n\r\n",
        "GET /health HTTP/1.1\r\nhost: gateway/health\r\n\r\n",
        // Not the gateway's own path (a chunked body): the general server's.
        "POST /conversations HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        "GET /ws HTTP/1.1\r\nhost: localhost\r\nhost: evil.example\r\nupgrade: websocket\r\nconnection: upgrade\r\n\
         sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\norigin: http://evil.example\r\n\r\n",
    ];
    for request in refused {
        send(&mut conn, request).await;
        let response = read_response(&mut conn).await;
        assert_eq!(response.status, 400, "{request:?}: {}", response.text());
        let body: serde_json::Value = serde_json::from_slice(&response.body).expect("a JSON body");
        assert!(body["error"].as_str().is_some_and(|e| e.contains("Host")), "{body}");
    }
    // The connection goes on, now on the general server.
    for host in ["localhost", "localhost:8080", "[::1]:8080", "127.0.0.1"] {
        send(&mut conn, &format!("GET /health HTTP/1.1\r\nhost: {host}\r\n\r\n")).await;
        assert_eq!(read_response(&mut conn).await.status, 200, "{host}");
    }
    // HTTP/1.0 has no Host to name.
    let mut old = TcpStream::connect(server.addr).await.unwrap();
    old.write_all(b"GET /health HTTP/1.0\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    old.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.0 200 "), "{answer}");
    server.stop().await;
}
