//! A real gateway on an ephemeral port with a real SQLite file, and a client for it. Every
//! response the helpers read is checked against the OpenAPI document.
#![allow(dead_code)]

pub mod raw;
pub mod schema;
pub mod upstream;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use bytes::{Buf, BytesMut};
pub use dispatch_gateway::config::Database;
use dispatch_gateway::{Config, Gateway};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub struct TestServer {
    /// The running gateway's state (hub, turns, store), for looking inside.
    pub state: dispatch_gateway::http::AppState,
    pub addr: SocketAddr,
    pub ws_addr: Option<SocketAddr>,
    /// Requests to it (`server.get(..)` and the rest reach these through `Deref`).
    pub api: Api,
    pub config: Config,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

/// A scripted runtime's rules with a tool-call turn ("weather": two steps, a tool call between),
/// a failing one ("fail") and a stalling one ("stall").
pub fn tool_script() -> Value {
    json!({"rules": [
        {"match": "weather", "steps": [
            {"reasoning": "Let me check.", "text": "Checking the weather.",
             "toolCalls": [{"id": "call_w", "name": "weather", "input": {"city": "Paris"},
                            "output": "fetching", "result": "sunny", "durationMs": 7}],
             "usage": {"inputTokens": 100, "outputTokens": 20}},
            {"text": "It is sunny in Paris.",
             "usage": {"inputTokens": 150, "outputTokens": 8, "cacheReadTokens": 90}}
        ]},
        {"match": "fail", "steps": [{"text": "partial answer"}],
         "error": {"message": "model exploded", "code": "upstream"}},
        {"match": "stall", "steps": [{"text": "waiting", "stallMs": 1500}]}
    ]})
}

/// A turn's opening write as a process that dies before sealing it makes one (straight to the
/// store, no runtime).
pub fn opening<'a>(
    conversation_id: &'a str,
    turn_id: &'a str,
    text: &'a str,
) -> dispatch_gateway::store::BeginTurn<'a> {
    dispatch_gateway::store::BeginTurn {
        conversation_id,
        turn_id,
        model: "demo/scripted",
        sticky_model: None,
        user_text: text,
        default_title: text,
        idempotency: None,
        owner: None,
        budget: None,
        now: 1,
    }
}

/// The turn's `error` event, after checking that the turn sealed and that the error has this
/// code and says this.
pub fn turn_error<'a>(events: &'a [Value], code: &str, says: &str) -> &'a Value {
    let error = events.iter().find(|e| e["type"] == "error").unwrap_or_else(|| panic!("no error event: {events:?}"));
    assert_eq!(error["code"], code, "{error}");
    assert!(error["message"].as_str().unwrap().contains(says), "{error}");
    assert_eq!(events.last().unwrap()["type"], "turn-sealed", "{events:?}");
    error
}

/// The SQLite file a test config names.
pub fn sqlite_file(config: &Config) -> PathBuf {
    match &config.database {
        Database::Sqlite(path) => path.clone(),
        Database::Postgres(_) => panic!("a test that reads the SQLite file ran on PostgreSQL"),
    }
}

/// A config for tests: the given folder's database, scripted runtime at full speed.
pub fn test_config(dir: &Path) -> Config {
    let mut config = Config::defaults();
    config.listen = "127.0.0.1:0".parse().unwrap();
    config.database = Database::Sqlite(dir.join("gateway.db"));
    config.scripted_pace = 0.0;
    // Every test's stop would wait for it; the grace has a test of its own.
    config.shutdown_grace_ms = 0;
    config
}

/// Writes a scripted-runtime script into `dir` and returns its path.
pub fn write_script(dir: &Path, script: Value) -> PathBuf {
    let path = dir.join("script.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&script).unwrap()).unwrap();
    path
}

impl TestServer {
    pub async fn start(config: Config) -> TestServer {
        // Logs show with `RUST_LOG=...` and `--nocapture`.
        if std::env::var_os("RUST_LOG").is_some() {
            use tracing_subscriber::layer::SubscriberExt;
            use tracing_subscriber::util::SubscriberInitExt;
            let logs = tracing_subscriber::fmt::layer().with_test_writer();
            let _ = tracing_subscriber::registry().with(logs).with(dispatch_gateway::config::log_filter()).try_init();
        }
        let gateway = Gateway::build(config.clone()).await.expect("gateway builds");
        let state = gateway.state().clone();
        let listener = gateway.bind().await.expect("binds");
        let ws_listener = gateway.bind_ws().await.expect("binds the WebSocket listener");
        let ws_addr = ws_listener.as_ref().map(|l| l.local_addr().unwrap());
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(gateway.serve(listener, ws_listener, async move {
            let _ = stopped.await;
        }));
        let api = Api::new(addr.to_string());
        TestServer { state, addr, ws_addr, api, config, stop: Some(stop), task: Some(task) }
    }

    /// Graceful stop: running turns abort and seal, the database is closed.
    pub async fn stop(mut self) {
        self.shutdown().await;
    }

    async fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.expect("server task").expect("server ran");
        }
    }

    /// Stops this server and starts another on the same database file.
    pub async fn restart(mut self) -> TestServer {
        self.shutdown().await;
        let mut config = self.config.clone();
        config.listen = "127.0.0.1:0".parse().unwrap();
        TestServer::start(config).await
    }
}

impl std::ops::Deref for ChildGateway {
    type Target = Api;
    fn deref(&self) -> &Api {
        &self.api
    }
}

impl Drop for ChildGateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Reads a JSON response and checks it against the document.
pub async fn checked(method: &str, path: &str, r: reqwest::Response) -> (u16, Value) {
    let (status, body) = read_json(r).await;
    if !body.is_null() {
        schema::check_response(method, path, status, &body);
    }
    (status, body)
}

pub async fn read_json(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let value = if text.is_empty() { Value::Null } else { serde_json::from_str(&text).unwrap_or(Value::String(text)) };
    (status, value)
}

/// Reads NDJSON lines off a streaming response.
pub struct EventStream {
    pub headers: reqwest::header::HeaderMap,
    body: futures_util::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: BytesMut,
}

impl EventStream {
    pub fn new(r: reqwest::Response) -> EventStream {
        EventStream { headers: r.headers().clone(), body: r.bytes_stream().boxed(), buf: BytesMut::new() }
    }

    /// The next line, or None at the end of the stream.
    pub async fn next_line(&mut self) -> Option<String> {
        loop {
            if let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                let line = self.buf.split_to(pos + 1);
                let mut line = line.chunk()[..pos].to_vec();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Some(String::from_utf8(line).expect("utf-8 line"));
            }
            match self.body.next().await {
                Some(Ok(bytes)) => self.buf.extend_from_slice(&bytes),
                Some(Err(e)) => panic!("stream failed: {e}"),
                None => {
                    assert!(self.buf.is_empty(), "stream ended inside a line");
                    return None;
                }
            }
        }
    }

    /// The next line, or None at the end of the stream or when it breaks.
    pub async fn try_next_line(&mut self) -> Option<String> {
        loop {
            if let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                let line = self.buf.split_to(pos + 1);
                return Some(String::from_utf8_lossy(&line[..pos]).into_owned());
            }
            match self.body.next().await {
                Some(Ok(bytes)) => self.buf.extend_from_slice(&bytes),
                Some(Err(_)) | None => return None,
            }
        }
    }

    /// The next event, or None at the end of the stream.
    pub async fn next_event(&mut self) -> Option<Value> {
        let line = self.next_line().await?;
        let event: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad NDJSON line {line:?}: {e}"));
        schema::check_event(&event);
        Some(event)
    }

    pub async fn collect(mut self) -> Vec<Value> {
        let mut out = Vec::new();
        while let Some(e) = self.next_event().await {
            out.push(e);
        }
        out
    }
}

/// One SSE message.
#[derive(Debug, Clone, PartialEq)]
pub struct SseMessage {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

impl SseMessage {
    pub fn json(&self) -> Value {
        let value = serde_json::from_str(&self.data).unwrap_or_else(|e| panic!("bad SSE data {:?}: {e}", self.data));
        if self.event.is_none() {
            schema::check_event(&value);
        }
        value
    }
}

/// Reads SSE messages (comments skipped) off a streaming response.
pub struct SseStream {
    lines: EventStream,
    pub comments: usize,
}

impl SseStream {
    pub fn new(r: reqwest::Response) -> SseStream {
        assert_eq!(r.headers()["content-type"], "text/event-stream");
        SseStream { lines: EventStream::new(r), comments: 0 }
    }

    pub async fn next(&mut self) -> Option<SseMessage> {
        let mut message = SseMessage { id: None, event: None, data: String::new() };
        let mut has_field = false;
        loop {
            let line = self.lines.next_line().await?;
            if line.is_empty() {
                if has_field {
                    return Some(message);
                }
                continue;
            }
            if line.starts_with(':') {
                self.comments += 1;
                continue;
            }
            let (field, value) = line.split_once(": ").unwrap_or((line.as_str(), ""));
            has_field = true;
            match field {
                "id" => message.id = Some(value.to_owned()),
                "event" => message.event = Some(value.to_owned()),
                "data" => message.data.push_str(value),
                other => panic!("unexpected SSE field {other:?}"),
            }
        }
    }

    /// Messages until the stream ends or `turn-sealed` has been read.
    pub async fn until_sealed(&mut self) -> Vec<SseMessage> {
        let mut out = Vec::new();
        while let Some(m) = self.next().await {
            let sealed = m.event.is_none() && m.json()["type"] == "turn-sealed";
            out.push(m);
            if sealed {
                break;
            }
        }
        out
    }
}

/// A raw connection with a small receive buffer (its socket fills fast) that has sent
/// `GET <path>` and reads nothing yet.
pub async fn raw_get(server: &TestServer, path: &str, accept: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(server.addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nhost: localhost\r\naccept: {accept}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    stream
}

/// The value of a metric without labels in a Prometheus text exposition.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in metrics:\n{text}"))
}

/// Requests to a gateway at an address: an in-process [`TestServer`] or a [`ChildGateway`].
pub struct Api {
    /// `host:port`.
    pub addr: String,
    pub client: reqwest::Client,
}

impl Api {
    pub fn new(addr: String) -> Api {
        Api { addr, client: reqwest::Client::new() }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self.client.get(self.url(path)).send().await.unwrap();
        checked("GET", path, r).await
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.client.post(self.url(path)).json(&body).send().await.unwrap();
        checked("POST", path, r).await
    }

    pub async fn post_raw(&self, path: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        checked("POST", path, r).await
    }

    pub async fn put(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.client.put(self.url(path)).json(&body).send().await.unwrap();
        checked("PUT", path, r).await
    }

    pub async fn delete(&self, path: &str) -> (u16, Value) {
        let r = self.client.delete(self.url(path)).send().await.unwrap();
        checked("DELETE", path, r).await
    }

    /// Starts a turn with `POST /chat` and returns the open NDJSON stream.
    pub async fn chat_stream(&self, body: Value) -> EventStream {
        let r = self.client.post(self.url("/chat")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200, "POST /chat answered {}", r.status());
        assert_eq!(r.headers()["content-type"], "application/x-ndjson");
        EventStream::new(r)
    }

    /// Runs a whole turn with `POST /chat` and returns its events.
    pub async fn chat(&self, conversation_id: &str, message: &str) -> Vec<Value> {
        self.chat_stream(json!({"conversationId": conversation_id, "message": message})).await.collect().await
    }

    /// Every chunk of a conversation's log.
    pub async fn history(&self, conversation_id: &str) -> Vec<Value> {
        let (status, body) = self.get(&format!("/conversations/{conversation_id}")).await;
        assert_eq!(status, 200);
        body["chunks"].as_array().unwrap().clone()
    }

    /// `GET /metrics`.
    pub async fn metrics(&self) -> String {
        self.client.get(self.url("/metrics")).send().await.unwrap().text().await.unwrap()
    }

    /// Opens `GET /conversations/:id/events` with extra query and headers.
    pub async fn events(&self, conversation_id: &str, query: &str, headers: &[(&str, &str)]) -> reqwest::Response {
        let mut req = self.client.get(self.url(&format!("/conversations/{conversation_id}/events{query}")));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 200, "events stream answered {}", r.status());
        r
    }

    pub async fn sse(&self, conversation_id: &str, query: &str) -> SseStream {
        SseStream::new(self.events(conversation_id, query, &[]).await)
    }

    pub async fn ndjson(&self, conversation_id: &str, query: &str) -> EventStream {
        let r = self.events(conversation_id, query, &[("accept", "application/x-ndjson")]).await;
        assert_eq!(r.headers()["content-type"], "application/x-ndjson");
        EventStream::new(r)
    }

    pub async fn ws(&self) -> WsClient {
        let (socket, _) =
            tokio_tungstenite::connect_async(format!("ws://{}/ws", self.addr)).await.expect("ws connects");
        WsClient { socket }
    }
}

impl std::ops::Deref for TestServer {
    type Target = Api;
    fn deref(&self) -> &Api {
        &self.api
    }
}

type WsSocket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A WebSocket client speaking the gateway's JSON ops.
pub struct WsClient {
    pub socket: WsSocket,
}

impl WsClient {
    pub async fn send(&mut self, value: Value) {
        use futures_util::SinkExt;
        self.socket.send(tokio_tungstenite::tungstenite::Message::text(value.to_string())).await.unwrap();
    }

    pub async fn send_raw(&mut self, text: &str) {
        use futures_util::SinkExt;
        self.socket.send(tokio_tungstenite::tungstenite::Message::text(text)).await.unwrap();
    }

    /// The next JSON text message (pings and pongs skipped); None when the socket closed.
    pub async fn next(&mut self) -> Option<Value> {
        use tokio_tungstenite::tungstenite::Message;
        loop {
            match self.socket.next().await? {
                Ok(Message::Text(t)) => return Some(serde_json::from_str(t.as_str()).unwrap()),
                Ok(Message::Close(_)) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    }

    /// The code of the close frame the server sends, skipping every other message; None when
    /// the connection ends without one.
    pub async fn close_code(&mut self) -> Option<u16> {
        use tokio_tungstenite::tungstenite::Message;
        loop {
            match self.socket.next().await? {
                Ok(Message::Close(frame)) => return frame.map(|f| u16::from(f.code)),
                Err(_) => return None,
                Ok(_) => {}
            }
        }
    }

    /// The `event`s of `chat.delta` messages for one conversation until its `turn-sealed`;
    /// other messages are returned apart.
    pub async fn deltas_until_sealed(&mut self, conversation_id: &str) -> (Vec<Value>, Vec<Value>) {
        let (mut events, mut other) = (Vec::new(), Vec::new());
        while let Some(m) = self.next().await {
            if m["type"] == "chat.delta" && m["event"]["conversationId"] == conversation_id {
                schema::check_event(&m["event"]);
                let sealed = m["event"]["type"] == "turn-sealed";
                events.push(m["event"].clone());
                if sealed {
                    break;
                }
            } else {
                other.push(m);
            }
        }
        (events, other)
    }
}

/// The `type` of each event.
pub fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

/// Row counts of every table, read straight from the database file.
pub async fn table_counts(db: &Path) -> Vec<(String, i64)> {
    let conn = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let mut out = Vec::new();
    for table in ["conversations", "chunks", "turns"] {
        let n: i64 = conn.query_row(&format!("SELECT COUNT(*) FROM {table}"), (), |row| row.get(0)).unwrap();
        out.push((table.to_owned(), n));
    }
    out
}

/// The real binary as a child process, on an ephemeral port.
pub struct ChildGateway {
    pub child: std::process::Child,
    pub addr: String,
    /// Requests to it (also through `Deref`).
    pub api: Api,
    /// Every JSON log line the gateway has written so far.
    pub logs: std::sync::Arc<std::sync::Mutex<Vec<Value>>>,
}

impl ChildGateway {
    /// Starts the built binary with `args` and waits for the address it logs.
    pub fn spawn(args: &[std::ffi::OsString]) -> ChildGateway {
        Self::spawn_with_env(args, &[])
    }

    /// [`ChildGateway::spawn`] with these environment variables set too.
    pub fn spawn_with_env(args: &[std::ffi::OsString], env: &[(&str, &str)]) -> ChildGateway {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"));
        command.envs(env.iter().copied());
        Self::start(command, args)
    }

    /// [`ChildGateway::spawn`] under a limit on open files (soft, hard), set by the shell that
    /// then becomes the gateway.
    pub fn spawn_with_open_files(soft: u32, hard: u32, args: &[std::ffi::OsString]) -> ChildGateway {
        let mut command = std::process::Command::new("sh");
        let limits = format!("ulimit -S -n {soft} && ulimit -H -n {hard} && exec \"$0\" \"$@\"");
        command.args(["-c", &limits, env!("CARGO_BIN_EXE_dispatch-gateway")]);
        Self::start(command, args)
    }

    fn start(mut command: std::process::Command, args: &[std::ffi::OsString]) -> ChildGateway {
        use std::io::{BufRead, BufReader};
        let mut child = command
            .args(["--listen", "127.0.0.1:0", "--log-format", "json"])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the gateway binary starts");
        let stdout = child.stdout.take().unwrap();
        // What the gateway says on stderr before its log is set up (a refused flag, a database
        // it cannot open, a full disk) is kept, so a gateway that never starts says why.
        let mut stderr = child.stderr.take().unwrap();
        let said = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
            text
        });
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let logs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let Ok(v) = serde_json::from_str::<Value>(&line) else { continue };
                if let Some(addr) = v["fields"]["addr"].as_str() {
                    let _ = addr_tx.send(addr.to_owned());
                }
                kept.lock().unwrap().push(v);
            }
        });
        let addr = match addr_rx.recv_timeout(std::time::Duration::from_secs(60)) {
            Ok(addr) => addr,
            Err(e) => {
                let _ = child.kill();
                let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
                let said = said.join().unwrap_or_default();
                let logs = logs.lock().unwrap().iter().map(Value::to_string).collect::<Vec<_>>().join("\n");
                panic!("the gateway did not log its address ({e}; {status}); its log:\n{logs}\nits stderr:\n{said}");
            }
        };
        ChildGateway { child, api: Api::new(addr.clone()), addr, logs }
    }

    /// SIGTERM, and wait for a clean exit.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill runs");
        self.child.wait().expect("the gateway exits")
    }
}

/// Reads a socket until the peer closes it; false if that takes longer than `within`.
pub async fn closed_by_peer(socket: &mut tokio::net::TcpStream, within: std::time::Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut sink = vec![0u8; 1 << 16];
    tokio::time::timeout(within, async {
        loop {
            match socket.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

/// Polls `check` every 50 ms until it holds; false after `tries` attempts.
pub async fn eventually<F, Fut>(tries: usize, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..tries {
        if check().await {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    false
}

/// A program a test drives for real (see [`installed`]), or `None`, said, when it is not
/// installed: then the test passes without it, unless `$required` is set (as CI sets it).
pub fn program(env_var: &str, name: &str, required: &str, install: &str) -> Option<std::path::PathBuf> {
    let found = installed(env_var, name);
    if found.is_none() {
        assert!(std::env::var_os(required).is_none(), "{name} is required ({required}) but not found");
        eprintln!("skipped: {name} is not installed ({install})");
    }
    found
}

/// Chromium and playwright-core's folder for a browser test (`$DISPATCH_TEST_CHROMIUM`, else
/// `chromium` on the PATH; `$DISPATCH_TEST_PLAYWRIGHT`), or `None`, said, when either is
/// missing: then the test passes without them, unless `DISPATCH_REQUIRE_BROWSER` is set (as
/// `.ci/run` does, after installing both).
pub fn browser() -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let chromium = installed("DISPATCH_TEST_CHROMIUM", "chromium");
    let playwright = std::env::var_os("DISPATCH_TEST_PLAYWRIGHT").map(std::path::PathBuf::from);
    let (Some(chromium), Some(playwright)) = (chromium, playwright) else {
        assert!(std::env::var_os("DISPATCH_REQUIRE_BROWSER").is_none(), "Chromium and playwright-core are required");
        eprintln!("skipped: needs Chromium and $DISPATCH_TEST_PLAYWRIGHT (npm install playwright-core)");
        return None;
    };
    Some((chromium, playwright))
}

/// Runs a browser driver (`node DRIVER`, a file under `tests/`) with Chromium and playwright-core
/// and `env`, and returns the JSON it prints on its `REPORT ` line.
pub async fn browser_report(driver: &str, chromium: &Path, playwright: &Path, env: &[(&str, &str)]) -> Value {
    let driver = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join(driver);
    let child = tokio::process::Command::new("node")
        .arg(driver)
        .env("PLAYWRIGHT", playwright)
        .env("CHROMIUM", chromium)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("node runs the browser driver");
    let out = tokio::time::timeout(std::time::Duration::from_secs(180), child.wait_with_output())
        .await
        .expect("the driver finishes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the browser driver failed ({}): {stdout}", out.status);
    let report: Value = stdout
        .lines()
        .find_map(|l| l.strip_prefix("REPORT "))
        .map(|r| serde_json::from_str(r).unwrap())
        .unwrap_or_else(|| panic!("no report: {stdout}"));
    eprintln!("{report:#}");
    report
}

/// A program the tests drive for real: `$env_var`, else `name` on the PATH.
pub fn installed(env_var: &str, name: &str) -> Option<std::path::PathBuf> {
    if let Some(path) = std::env::var_os(env_var) {
        return Some(std::path::PathBuf::from(path));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| p.is_file())
}
