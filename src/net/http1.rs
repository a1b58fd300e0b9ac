//! HTTP/1.1 written by the gateway itself, for the requests live streams come in.
//!
//! A connection's request heads are read here first. A `GET` over HTTP/1.1 with no body (an
//! SSE or NDJSON watcher, a WebSocket upgrade, and the reads a web client makes between them),
//! and a `POST`, `PUT`, `DELETE`, `PATCH` or `OPTIONS` whose body has a `Content-Length` within
//! the body limit (a web client's messages), run through the same router, middleware and
//! handler as any request; only the body is read and the response written here. The body is
//! read from the socket as the handler reads it, so the layers' checks of the head (host,
//! origin, key, reading budget) come before any byte of it. A response that hands over a live stream ([`Handoff`]) is served on the socket
//! next: a watch as chunks, each batch in one vectored write, a session by `net::websocket`.
//! Such a stream holds no per-connection read or write buffer while it is open (a generic
//! HTTP/1.1 connection keeps several KiB of each for its whole life, which is most of what an
//! idle watcher costs), and a batch goes from the hub to the socket without being queued a
//! second time.
//!
//! Any other request (a chunked body or one past the limit, `Expect`, another method or
//! version), and everything after it on the same connection, is served by hyper, which is
//! handed the bytes read so far: a web client's watch after its `POST` is parked as any other.

use std::future::{Future, poll_fn};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::http::header::{CONNECTION, CONTENT_LENGTH, DATE, TRANSFER_ENCODING};
use axum::http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body as _;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower::ServiceExt;

use super::ConnectionLimits;
use super::socket::{Connection, Parking, write_all};
use crate::config::MOST_HEADERS;
use crate::encoding::{CHUNK_END, LAST_CHUNK, chunk_size, has_token};
use crate::hub::BATCH;
use crate::live::{Action, Cancelled, Handoff, Live, Wake, Watch};
use crate::metrics::Metrics;

/// How the connection goes on after this module is done with it.
pub enum Next {
    /// Close it.
    Closed,
    /// Close it, and drop what the client still sends for a moment first: the answer went to a
    /// request whose body was left unread.
    Linger,
    /// Serve it with hyper, which reads these bytes first.
    Hyper(Vec<u8>),
}

/// Serves the connection's requests until one that is hyper's, the end of the connection, or
/// shutdown (between requests).
pub async fn serve(
    stream: &Arc<Connection>,
    router: &Router,
    limits: &ConnectionLimits,
    metrics: &Metrics,
    drained: &mut Cancelled,
) -> Next {
    let mut pending = Vec::new();
    loop {
        let (mut request, close, length) = match read_head(stream, &mut pending, limits, drained).await {
            Head::Direct(request, close, length) => (request, close, length),
            Head::Other => return Next::Hyper(pending),
            Head::Closed => return Next::Closed,
            Head::Refused(status, why) => {
                // A head the gateway cannot read is answered here, as every error, with a
                // `{"error"}` body (hyper would answer with an empty one), then the connection
                // closes: where the next request would start is unknown.
                let _ = refuse(stream, status, why, limits.drain_timeout, metrics).await;
                return Next::Closed;
            }
        };
        // The body is read from the socket only when the handler asks for it, after the
        // layers have checked the head (host, origin, type, key, reading budget): a refused
        // request costs no more than its head.
        let read = (length > 0).then(|| {
            let body = SocketBody::new(stream, &mut pending, length, limits.body_read_timeout);
            let read = body.read.clone();
            *request.body_mut() = Body::new(body);
            read
        });
        let response = match router.clone().oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
        // A client that left part way through its body gets nothing. A body the handler left
        // unread (or part read) leaves the connection where no request starts: it closes after
        // the answer.
        let read = read.map(|read| read.load(std::sync::atomic::Ordering::Acquire));
        if read == Some(BODY_GONE) {
            return Next::Closed;
        }
        if read.is_some_and(|read| read != BODY_WHOLE) {
            let _ = respond(stream, response, true, &mut Vec::new(), limits, false).await;
            return Next::Linger;
        }
        match respond(stream, response, close, &mut pending, limits, true).await {
            Ok(true) => {}
            Ok(false) | Err(_) => return Next::Closed,
        }
    }
}

// Built and moved once per request: not worth a box.
#[allow(clippy::large_enum_variant)]
enum Head {
    /// A request served here, whether the client asked to close after it, and the length of
    /// its body (still to be read).
    Direct(Request<Body>, bool, usize),
    /// Anything else (or something this module does not parse): hyper's.
    Other,
    /// The client went away, sent nothing in time, or the server is stopping.
    Closed,
    /// A head that cannot be served: too long, too many headers, or not HTTP.
    Refused(StatusCode, &'static str),
}

/// Answers a request head that cannot be served and ends the connection.
async fn refuse(
    stream: &TcpStream,
    status: StatusCode,
    why: &str,
    drain: Duration,
    metrics: &Metrics,
) -> io::Result<()> {
    metrics.responded(status);
    let body = serde_json::json!({ "error": why }).to_string();
    let head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\ndate: {}\r\n\r\n",
        status.as_str(),
        status.canonical_reason().unwrap_or(""),
        body.len(),
        httpdate::fmt_http_date(SystemTime::now()),
    );
    write_all(stream, &mut [IoSlice::new(head.as_bytes()), IoSlice::new(body.as_bytes())], drain).await
}

/// Reads until `pending` holds a complete request head and parses it.
async fn read_head(
    stream: &TcpStream,
    pending: &mut Vec<u8>,
    limits: &ConnectionLimits,
    drained: &mut Cancelled,
) -> Head {
    let deadline = Instant::now() + limits.header_read_timeout;
    loop {
        if !pending.is_empty() {
            match parse(pending, limits.max_headers, limits.max_body_bytes) {
                Parsed::Complete(request, close, length, body) => {
                    pending.drain(..length);
                    if pending.is_empty() {
                        // Give the head's buffer back: the stream may stay open for hours.
                        *pending = Vec::new();
                    }
                    return Head::Direct(request, close, body);
                }
                Parsed::Partial if pending.len() < limits.max_head_bytes => {}
                Parsed::Partial => {
                    return Head::Refused(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "the request head is too large");
                }
                Parsed::TooManyHeaders => {
                    return Head::Refused(
                        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                        "the request has too many headers",
                    );
                }
                Parsed::Malformed(why) => return Head::Refused(StatusCode::BAD_REQUEST, why),
                Parsed::Other => return Head::Other,
            }
        }
        if pending.capacity() - pending.len() < 512 {
            pending.reserve(1024);
        }
        match stream.try_read_buf(pending) {
            Ok(0) => return Head::Closed,
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return Head::Closed,
        }
        tokio::select! {
            biased;
            _ = &mut *drained => return Head::Closed,
            ready = stream.readable() => if ready.is_err() { return Head::Closed },
            _ = tokio::time::sleep_until(deadline) => return Head::Closed,
        }
    }
}

/// The most of a body one read takes from the socket.
const BODY_STEP: usize = 64 * 1024;

/// A request body read from the socket as its handler reads it: the bytes that came with the
/// head first, then the socket's, no further than the body's end (what follows is the next
/// request's). An error when the client leaves or the body does not arrive within the body
/// timeout (`TimedOut`: the handler answers 408).
struct SocketBody {
    stream: Arc<Connection>,
    first: Option<bytes::Bytes>,
    left: usize,
    /// What the socket gave, read into spare capacity (no zeroing per read).
    buf: bytes::BytesMut,
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// How far it was read: `BODY_WHOLE` once all of it, `BODY_GONE` when the client left.
    read: Arc<std::sync::atomic::AtomicU8>,
}

const BODY_WHOLE: u8 = 1;
const BODY_GONE: u8 = 2;

impl SocketBody {
    fn new(stream: &Arc<Connection>, pending: &mut Vec<u8>, length: usize, timeout: Duration) -> SocketBody {
        let have = length.min(pending.len());
        let first: Vec<u8> = pending.drain(..have).collect();
        if pending.is_empty() {
            *pending = Vec::new();
        }
        SocketBody {
            stream: stream.clone(),
            first: (!first.is_empty()).then(|| first.into()),
            left: length - have,
            buf: bytes::BytesMut::new(),
            deadline: Box::pin(tokio::time::sleep(timeout)),
            read: Arc::default(),
        }
    }
}

impl http_body::Body for SocketBody {
    type Data = bytes::Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, io::Error>>> {
        let this = &mut *self;
        if let Some(first) = this.first.take() {
            if this.left == 0 {
                this.read.store(BODY_WHOLE, std::sync::atomic::Ordering::Release);
            }
            return Poll::Ready(Some(Ok(http_body::Frame::data(first))));
        }
        if this.left == 0 {
            this.read.store(BODY_WHOLE, std::sync::atomic::Ordering::Release);
            return Poll::Ready(None);
        }
        loop {
            // No further than the body's end: what follows is the next request's.
            let step = this.left.min(BODY_STEP);
            this.buf.reserve(step);
            match this.stream.try_read_buf(&mut bytes::BufMut::limit(&mut this.buf, step)) {
                Ok(0) => {
                    this.read.store(BODY_GONE, std::sync::atomic::Ordering::Release);
                    return Poll::Ready(Some(Err(io::ErrorKind::UnexpectedEof.into())));
                }
                Ok(n) => {
                    this.left -= n;
                    if this.left == 0 {
                        this.read.store(BODY_WHOLE, std::sync::atomic::Ordering::Release);
                    }
                    return Poll::Ready(Some(Ok(http_body::Frame::data(this.buf.split().freeze()))));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
            if this.deadline.as_mut().poll(cx).is_ready() {
                let late = io::Error::new(io::ErrorKind::TimedOut, "the request body did not arrive in time");
                return Poll::Ready(Some(Err(late)));
            }
            match this.stream.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact((self.left + self.first.as_ref().map_or(0, |f| f.len())) as u64)
    }
}

#[allow(clippy::large_enum_variant)]
enum Parsed {
    /// A request served here, whether to close after it, the length of its head, and of its
    /// body.
    Complete(Request<Body>, bool, usize, usize),
    Partial,
    /// A well-formed request that hyper serves.
    Other,
    /// A head that cannot be served, and why.
    Malformed(&'static str),
    TooManyHeaders,
}

/// Methods whose requests are served here with a body (GET only without one).
const WITH_BODY: [&str; 5] = ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"];

fn parse(bytes: &[u8], max_headers: usize, max_body: usize) -> Parsed {
    // Room for the most headers `--max-headers` allows, on the stack and left uninitialized: a
    // head is parsed again after every read that did not complete it.
    let mut headers = [const { std::mem::MaybeUninit::uninit() }; MOST_HEADERS];
    let mut head = httparse::Request::new(&mut []);
    let length = match head.parse_with_uninit_headers(bytes, &mut headers[..max_headers.min(MOST_HEADERS)]) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(httparse::Error::TooManyHeaders) => return Parsed::TooManyHeaders,
        Err(_) => return Parsed::Malformed("the request head is not valid HTTP/1.1"),
    };
    if let Err(why) = framing(head.version, head.headers) {
        return Parsed::Malformed(why);
    }
    let get = head.method == Some("GET");
    let Some(method) = head.method.filter(|m| get || WITH_BODY.contains(m)) else { return Parsed::Other };
    if head.version != Some(1) {
        return Parsed::Other;
    }
    // Origin-form only (`OPTIONS *` and absolute forms are hyper's).
    let Some(uri) = head.path.filter(|p| p.starts_with('/')).and_then(|p| p.parse::<Uri>().ok()) else {
        return Parsed::Other;
    };
    // An upgrade to anything but WebSocket, or of anything but a GET, is hyper's (it refuses
    // h2c).
    let websocket = get
        && head
            .headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("upgrade"))
            .all(|h| h.value.eq_ignore_ascii_case(b"websocket"));
    let mut request = Request::new(Body::empty());
    *request.method_mut() = Method::from_bytes(method.as_bytes()).expect("a listed method");
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    let mut close = false;
    let mut body = 0;
    for header in head.headers.iter() {
        let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(header.name.as_bytes()), HeaderValue::from_bytes(header.value))
        else {
            return Parsed::Other;
        };
        // A chunked body, one past the limit (hyper's handler answers 413), a GET's, a switch
        // to another protocol or `Expect` (a `100 Continue` to send) is hyper's to handle.
        let ours = match name.as_str() {
            // `framing` checked it is one number.
            "content-length" => {
                body =
                    std::str::from_utf8(header.value).ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(usize::MAX);
                body <= max_body && (body == 0 || !get)
            }
            "upgrade" => websocket,
            "transfer-encoding" | "expect" => false,
            _ => true,
        };
        if !ours {
            return Parsed::Other;
        }
        if name == CONNECTION {
            close |= has_token(value.as_bytes(), b"close");
        }
        request.headers_mut().append(name, value);
    }
    Parsed::Complete(request, close, length, body)
}

/// Checks the body's framing headers as hyper reads them (RFC 9112, 6.1-6.3), so that a head
/// hyper would answer with an empty 400 gets the gateway's `{"error"}`: every `Content-Length`
/// one number (repeats must agree), a `Transfer-Encoding` only in HTTP/1.1 and ending in
/// `chunked`.
fn framing(version: Option<u8>, headers: &[httparse::Header<'_>]) -> Result<(), &'static str> {
    let mut length: Option<&[u8]> = None;
    let mut coding: Option<&[u8]> = None;
    for header in headers {
        if header.name.eq_ignore_ascii_case("content-length") {
            let number = header.value.iter().all(u8::is_ascii_digit)
                && std::str::from_utf8(header.value).is_ok_and(|v| v.parse::<u64>().is_ok());
            if !number {
                return Err("the request's Content-Length is not a number");
            }
            if length.is_some_and(|l| l != header.value) {
                return Err("the request's Content-Length headers disagree");
            }
            length = Some(header.value);
        } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
            if version != Some(1) {
                return Err("an HTTP/1.0 request cannot have a Transfer-Encoding");
            }
            coding = header.value.rsplit(|b| *b == b',').next().map(<[u8]>::trim_ascii);
        }
    }
    match coding {
        Some(last) if !last.eq_ignore_ascii_case(b"chunked") => {
            Err("the request's Transfer-Encoding must end in chunked")
        }
        _ => Ok(()),
    }
}

/// What happened while a body was being waited for.
enum BodyStep {
    Frame(Option<Result<http_body::Frame<bytes::Bytes>, axum::Error>>),
    /// The client closed its side (or reset it, or sent more than a request head may hold).
    Gone,
}

/// Writes `response`; whether the connection can carry another request.
async fn respond(
    stream: &Arc<Connection>,
    response: Response<Body>,
    close: bool,
    pending: &mut Vec<u8>,
    limits: &ConnectionLimits,
    listen: bool,
) -> io::Result<bool> {
    let drain = limits.drain_timeout;
    let (parts, mut body) = response.into_parts();
    let status = parts.status;
    let live = Handoff::take(&parts.extensions);
    let upgrade = matches!(live, Some(Live::Session(_))) && status == StatusCode::SWITCHING_PROTOCOLS;
    let watch = matches!(live, Some(Live::Watch(_)));
    let bodyless =
        !watch && (status.is_informational() || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED);
    let length = if watch || parts.headers.contains_key(CONTENT_LENGTH) { None } else { body.size_hint().exact() };
    let chunked = watch || (!bodyless && length.is_none() && !parts.headers.contains_key(CONTENT_LENGTH));
    let mut head = Vec::with_capacity(256);
    head.extend_from_slice(b"HTTP/1.1 ");
    head.extend_from_slice(status.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    head.extend_from_slice(b"\r\n");
    for (name, value) in &parts.headers {
        if name == TRANSFER_ENCODING || (name == CONNECTION && !upgrade) || (name == CONTENT_LENGTH && watch) {
            continue;
        }
        line(&mut head, name.as_str(), value.as_bytes());
    }
    if !parts.headers.contains_key(DATE) {
        line(&mut head, "date", httpdate::fmt_http_date(SystemTime::now()).as_bytes());
    }
    if chunked {
        line(&mut head, "transfer-encoding", b"chunked");
    } else if let Some(n) = length.filter(|_| !bodyless) {
        line(&mut head, "content-length", n.to_string().as_bytes());
    }
    if close && !upgrade {
        line(&mut head, "connection", b"close");
    }
    head.extend_from_slice(b"\r\n");
    // The head's parts (headers, extensions) are not kept for the stream's life: an idle
    // watcher holds only what it needs to write.
    drop(parts);
    write_all(stream, &mut [IoSlice::new(&head)], drain).await?;
    drop(head);
    match live {
        Some(Live::Session(session)) if upgrade => {
            // Boxed: a session's loop holds several KiB, and every connection's task would
            // otherwise be that large, idle watchers included.
            Box::pin(super::websocket::serve(stream, *session, std::mem::take(pending), drain)).await;
            return Ok(false);
        }
        Some(Live::Watch(watch)) => {
            drop(body);
            if !watch_stream(stream, watch, pending, limits).await? {
                return Ok(false);
            }
            write_all(stream, &mut [IoSlice::new(LAST_CHUNK)], drain).await?;
            return Ok(!close);
        }
        _ => {}
    }
    if bodyless {
        return Ok(!close);
    }
    loop {
        let step = poll_fn(|cx| {
            // The client side first: its end (or reset) ends the stream at once. (Not while
            // the request's own body is still on the socket: that is no next request.)
            if listen && poll_gone(stream, pending, limits, cx).is_ready() {
                return Poll::Ready(BodyStep::Gone);
            }
            Pin::new(&mut body).poll_frame(cx).map(BodyStep::Frame)
        })
        .await;
        let data = match step {
            BodyStep::Gone | BodyStep::Frame(Some(Err(_))) => return Ok(false),
            BodyStep::Frame(None) => break,
            BodyStep::Frame(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) if !data.is_empty() => data,
                _ => continue,
            },
        };
        if chunked {
            write_chunk(stream, &data, drain).await?;
        } else {
            write_all(stream, &mut [IoSlice::new(&data)], drain).await?;
        }
    }
    if chunked {
        write_all(stream, &mut [IoSlice::new(LAST_CHUNK)], drain).await?;
    }
    Ok(!close)
}

/// The most a client's next request may hold while its stream is open (or the head limit, if
/// lower): what an idle watcher may be made to keep stays small.
const MAX_NEXT_HEAD: usize = 16 * 1024;

/// Ready once the client has closed its side (or reset it, or sent more than `MAX_NEXT_HEAD`);
/// bytes it sends meanwhile (its next request) are kept in `pending`.
fn poll_gone(
    stream: &TcpStream,
    pending: &mut Vec<u8>,
    limits: &ConnectionLimits,
    cx: &mut std::task::Context<'_>,
) -> Poll<()> {
    let most = limits.max_head_bytes.min(MAX_NEXT_HEAD);
    while stream.poll_read_ready(cx).is_ready() {
        let mut scratch = [0u8; 512];
        match stream.try_read(&mut scratch) {
            Ok(n) if n > 0 && pending.len() + n <= most => pending.extend_from_slice(&scratch[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            _ => return Poll::Ready(()),
        }
    }
    Poll::Pending
}

/// A watcher's stream (SSE or NDJSON): the actions [`Watch`] decides, written as chunks. While the
/// watcher has read everything there is and the turn is paced, it parks, and the turn's rounds
/// write to the socket themselves. True when the stream ended (the last chunk is due), false
/// when the client is gone.
async fn watch_stream(
    stream: &Arc<Connection>,
    mut watch: Watch,
    pending: &mut Vec<u8>,
    limits: &ConnectionLimits,
) -> io::Result<bool> {
    let drain = limits.drain_timeout;
    let mut parking = Parking::new(stream, watch.format, watch.metrics.clone());
    let mut action = watch.opening().await;
    loop {
        match action {
            Action::Write(bytes) => write_chunk(stream, &bytes, drain).await?,
            Action::Last(bytes) => {
                write_chunk(stream, &bytes, drain).await?;
                return Ok(true);
            }
            Action::End => return Ok(true),
            Action::Cut(bytes) => {
                write_chunk(stream, &bytes, drain).await?;
                return Ok(false);
            }
            Action::Idle => {}
        }
        let wake = match watch.cursor.try_batch(BATCH) {
            Some(delivery) => Wake::Delivery(delivery),
            None => match watch.cursor.position().filter(|(buffer, _)| buffer.paced()) {
                Some((buffer, next)) => {
                    let buffer = buffer.clone();
                    parking.attach(&buffer);
                    parking.stream.park(buffer.as_ref(), next);
                    let handed = parking.stream.handed_back();
                    tokio::pin!(handed);
                    // `None`: a round handed the stream back; `Err`: the client is gone.
                    let woke = poll_fn(|cx| {
                        if handed.as_mut().poll(cx).is_ready() {
                            Poll::Ready(None)
                        } else if poll_gone(stream, pending, limits, cx).is_ready() {
                            Poll::Ready(Some(Err(())))
                        } else {
                            watch.poll_timers(cx).map(|wake| Some(Ok(wake)))
                        }
                    })
                    .await;
                    let back = parking.take_back(&mut watch.cursor, drain).await?;
                    if watch.unparked(&back) {
                        return Ok(true);
                    }
                    match woke {
                        None => {
                            action = Action::Idle;
                            continue;
                        }
                        Some(Err(())) => return Ok(false),
                        Some(Ok(wake)) => wake,
                    }
                }
                None => {
                    // Between turns, or rounds are not paced: the cursor wakes this task.
                    parking.detach();
                    tokio::select! {
                        biased;
                        wake = watch.wake() => wake,
                        _ = poll_fn(|cx| poll_gone(stream, pending, limits, cx)) => return Ok(false),
                    }
                }
            },
        };
        action = watch.next(wake).await;
    }
}

/// Writes `data` as one chunk of a chunked body.
async fn write_chunk(stream: &TcpStream, data: &[u8], drain: Duration) -> io::Result<()> {
    let mut size = [0u8; 18];
    let size = chunk_size(&mut size, data.len());
    write_all(stream, &mut [IoSlice::new(size), IoSlice::new(data), IoSlice::new(CHUNK_END)], drain).await
}

fn line(head: &mut Vec<u8>, name: &str, value: &[u8]) {
    head.extend_from_slice(name.as_bytes());
    head.extend_from_slice(b": ");
    head.extend_from_slice(value);
    head.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests;
