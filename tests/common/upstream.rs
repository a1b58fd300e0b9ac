//! A fake OpenAI-compatible upstream on a real socket: canned streams, error statuses, broken
//! streams and stalls, recording every request and every client disconnect.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// What the upstream answers to one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// 200 with these `data:` payloads, then `data: [DONE]`.
    Stream(Vec<Value>),
    /// A status with a JSON error body.
    Status(u16),
    /// 200 with these payloads, then the connection is cut (no `[DONE]`).
    Broken(Vec<Value>),
    /// 200 with these payloads, then nothing: the upstream waits for the client to leave.
    Stall(Vec<Value>),
    /// This exact response text (head and body), then the connection closes.
    Raw(String),
    /// The request is read and never answered: not even a status line.
    Silent,
    /// Each piece of this response text (head and body) after its pause, then nothing: the
    /// connection stays open until the client leaves.
    Drip(Vec<(std::time::Duration, String)>),
    /// A model with a context of `window` tokens that counts as [`counted_tokens`] does: a
    /// request whose messages and `max_tokens` do not fit is refused as OpenAI refuses it
    /// (saying how many tokens the messages were when `says_count`); one that fits is answered
    /// `answer`, with its usage. Each refusal takes the next reply's place: the reply stays
    /// for the request that fits.
    Counted { window: u64, answer: String, says_count: bool },
}

/// How the `Counted` model counts a request's messages: a token per two bytes of content
/// (twice the gateway's four-byte estimate) and eight a message.
pub fn counted_tokens(messages: &Value) -> u64 {
    let messages = messages.as_array().map_or(&[][..], Vec::as_slice);
    messages.iter().map(|m| (m["content"].as_str().map_or(0, str::len) as u64).div_ceil(2) + 8).sum()
}

#[derive(Debug, Clone)]
pub struct Recorded {
    pub body: Value,
    pub authorization: Option<String>,
    pub headers: Vec<(String, String)>,
    /// Where the connection came from.
    pub peer: Option<SocketAddr>,
    /// When the request had arrived whole.
    pub at: std::time::Instant,
}

#[derive(Default)]
struct State {
    replies: Mutex<VecDeque<Reply>>,
    requests: Mutex<Vec<Recorded>>,
    /// Disconnects seen while stalled.
    disconnects: Mutex<usize>,
    disconnected: Notify,
}

pub struct FakeUpstream {
    pub addr: SocketAddr,
    state: Arc<State>,
}

impl FakeUpstream {
    pub async fn start(replies: Vec<Reply>) -> FakeUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State { replies: Mutex::new(replies.into()), ..State::default() });
        let shared = state.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(serve(socket, shared.clone()));
            }
        });
        FakeUpstream { addr, state }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn push(&self, reply: Reply) {
        self.state.replies.lock().unwrap().push_back(reply);
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.state.requests.lock().unwrap().clone()
    }

    pub fn disconnects(&self) -> usize {
        *self.state.disconnects.lock().unwrap()
    }

    /// Waits until a stalled stream's client has gone.
    pub async fn wait_disconnect(&self) {
        loop {
            let notified = self.state.disconnected.notified();
            if self.disconnects() > 0 {
                return;
            }
            notified.await;
        }
    }
}

/// The first assistant tool call's arguments in `body` that are not JSON.
fn unparsed_arguments(body: &Value) -> Option<String> {
    let messages = body["messages"].as_array()?;
    let calls = messages.iter().filter_map(|m| m["tool_calls"].as_array()).flatten();
    calls
        .filter_map(|c| c["function"]["arguments"].as_str())
        .find(|a| serde_json::from_str::<Value>(a).is_err())
        .map(str::to_owned)
}

/// Reads a request head: what was read (the head and whatever came after it) and where the
/// head ends; None when the peer leaves first.
pub async fn read_head(socket: &mut TcpStream) -> Option<(Vec<u8>, usize)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some((buf, i + 4));
        }
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

async fn serve(mut socket: TcpStream, state: Arc<State>) {
    let mut chunk = [0u8; 8192];
    let Some((mut buf, head_end)) = read_head(&mut socket).await else { return };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut headers = Vec::new();
    for line in head.lines().skip(1) {
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_lowercase(), v.trim().to_owned()));
        }
    }
    let length: usize =
        headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
    while buf.len() < head_end + length {
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let body: Value = serde_json::from_slice(&buf[head_end..head_end + length]).unwrap_or(Value::Null);
    let authorization = headers.iter().find(|(k, _)| k == "authorization").map(|(_, v)| v.clone());
    state.requests.lock().unwrap().push(Recorded {
        body: body.clone(),
        authorization,
        headers,
        peer: socket.peer_addr().ok(),
        at: std::time::Instant::now(),
    });
    // As llama-server does: a request with a tool call whose arguments are not JSON is refused
    // whole (a reply waiting stays for the next request).
    if let Some(bad) = unparsed_arguments(&body) {
        let body =
            json!({"error": {"code": 500, "message": format!("Failed to parse tool call arguments as JSON: {bad}")}});
        let body = body.to_string();
        let response = format!(
            "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = socket.write_all(response.as_bytes()).await;
        return;
    }
    let reply = state.replies.lock().unwrap().pop_front().unwrap_or(Reply::Status(500));
    let stream_head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    let data = |payloads: &[Value]| payloads.iter().map(|p| format!("data: {p}\n\n")).collect::<String>();
    match reply {
        Reply::Stream(payloads) => {
            let _ = socket.write_all(format!("{stream_head}{}data: [DONE]\n\n", data(&payloads)).as_bytes()).await;
        }
        Reply::Status(code) => {
            let body = format!(r#"{{"error":{{"message":"status {code}"}}}}"#);
            let response = format!(
                "HTTP/1.1 {code} Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = socket.write_all(response.as_bytes()).await;
        }
        Reply::Broken(payloads) => {
            let _ = socket.write_all(format!("{stream_head}{}", data(&payloads)).as_bytes()).await;
            let _ = socket.flush().await;
            // Cut the connection with no end to the stream.
            #[allow(deprecated)]
            let _ = socket.set_linger(Some(std::time::Duration::ZERO));
            return;
        }
        Reply::Raw(text) => {
            let _ = socket.write_all(text.as_bytes()).await;
        }
        Reply::Drip(pieces) => {
            for (pause, piece) in pieces {
                tokio::time::sleep(pause).await;
                if socket.write_all(piece.as_bytes()).await.is_err() {
                    return;
                }
            }
            until_gone(&mut socket).await;
        }
        Reply::Silent => until_gone(&mut socket).await,
        Reply::Counted { window, answer, says_count } => {
            let prompt = counted_tokens(&body["messages"]);
            let asked = body["max_tokens"].as_u64().unwrap_or(0);
            let response = if prompt + asked > window {
                state.replies.lock().unwrap().push_front(Reply::Counted { window, answer, says_count });
                let message = match says_count {
                    true => format!(
                        "This model's maximum context length is {window} tokens. However, you requested {} tokens ({prompt} in the messages, {asked} in the completion). Please reduce the length of the messages or completion.",
                        prompt + asked
                    ),
                    false => format!(
                        "This model's maximum context length is {window} tokens. Please reduce the length of the messages."
                    ),
                };
                let error = serde_json::json!({"error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "code": "context_length_exceeded",
                }})
                .to_string();
                format!(
                    "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{error}",
                    error.len()
                )
            } else {
                let completion = (answer.len() as u64).div_ceil(2);
                let payloads = [
                    serde_json::json!({"choices": [{"index": 0, "delta": {"content": answer}, "finish_reason": null}]}),
                    serde_json::json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                    serde_json::json!({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}),
                ];
                format!("{stream_head}{}data: [DONE]\n\n", data(&payloads))
            };
            let _ = socket.write_all(response.as_bytes()).await;
        }
        Reply::Stall(payloads) => {
            let _ = socket.write_all(format!("{stream_head}{}", data(&payloads)).as_bytes()).await;
            let _ = socket.flush().await;
            // Send nothing more; notice when the client closes its end.
            let mut sink = [0u8; 64];
            loop {
                match socket.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            *state.disconnects.lock().unwrap() += 1;
            state.disconnected.notify_waiters();
        }
    }
    let _ = socket.shutdown().await;
}

/// Reads (and drops) whatever the client sends until it leaves.
async fn until_gone(socket: &mut TcpStream) {
    let mut sink = [0u8; 64];
    while let Ok(n) = socket.read(&mut sink).await {
        if n == 0 {
            break;
        }
    }
}
