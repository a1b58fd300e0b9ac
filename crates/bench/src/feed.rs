//! One subscription over a raw socket, by transport: the request by hand, and a decoder of its
//! SSE blocks, NDJSON lines or WebSocket frames.

use crate::*;

/// The transport a watcher reads the gateway with.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
pub(crate) enum Transport {
    Sse,
    Ndjson,
    Ws,
    /// Watchers take SSE, NDJSON and WebSocket in turn.
    Mixed,
}

impl Transport {
    /// The transport of the `i`th watcher.
    pub(crate) fn nth(self, i: usize) -> Transport {
        match self {
            Transport::Mixed => [Transport::Sse, Transport::Ndjson, Transport::Ws][i % 3],
            t => t,
        }
    }
}

/// One subscription over a raw socket: HTTP/1.1 (or the WebSocket protocol) by hand, chunked
/// bodies and WebSocket frames decoded in place, messages found by scanning bytes, no
/// allocation per event. The client shares the cores with the server, so it has to cost less
/// per delivery than the server does.
///
/// Messages are SSE blocks (ended by a blank line), NDJSON lines, or WebSocket text payloads
/// (stored with a `\n` after each, so they read like NDJSON lines).
pub(crate) struct Feed {
    pub(crate) stream: tokio::net::TcpStream,
    pub(crate) dec: Decoder,
}

/// A feed's bytes: what was read, what is decoded, where the next message starts.
pub(crate) struct Decoder {
    pub(crate) transport: Transport,
    /// Raw bytes read but not yet decoded.
    pub(crate) raw: Vec<u8>,
    /// The decoded messages; read from `at`.
    pub(crate) body: Vec<u8>,
    pub(crate) at: usize,
    pub(crate) chunked: bool,
    /// Bytes left in the current chunk.
    pub(crate) chunk_left: usize,
    pub(crate) ended: bool,
    /// WebSocket control frames to answer (pongs), written before the next read.
    pub(crate) reply: Vec<u8>,
    /// When the last read returned (unix microseconds): the arrival time of what it brought.
    pub(crate) read_at: u64,
}

impl Feed {
    /// Opens an SSE or NDJSON stream (`url`), or a WebSocket to `url` subscribed to
    /// `conversation`.
    pub(crate) async fn open(transport: Transport, url: &str, conversation: &str) -> Result<Feed, String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rest = url.strip_prefix("http://").ok_or("http only")?;
        let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
        let mut stream = tokio::net::TcpStream::connect(host).await.map_err(|e| format!("{url}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let request = match transport {
            Transport::Ws => format!(
                "GET {path} HTTP/1.1\r\nhost: {host}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
                 sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
            ),
            Transport::Ndjson => format!("GET {path} HTTP/1.1\r\nhost: {host}\r\naccept: application/x-ndjson\r\n\r\n"),
            _ => format!("GET {path} HTTP/1.1\r\nhost: {host}\r\naccept: text/event-stream\r\n\r\n"),
        };
        stream.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
        let mut raw = Vec::with_capacity(1 << 16);
        let head_end = loop {
            if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).await.map_err(|e| e.to_string())?;
            if n == 0 {
                return Err(format!("{url}: closed before the response head"));
            }
            raw.extend_from_slice(&buf[..n]);
        };
        let head = String::from_utf8_lossy(&raw[..head_end]).to_lowercase();
        let expected = if transport == Transport::Ws { "http/1.1 101" } else { "http/1.1 200" };
        if !head.starts_with(expected) {
            return Err(format!("{url}: {}", head.lines().next().unwrap_or("")));
        }
        let chunked = head.contains("transfer-encoding: chunked");
        raw.drain(..head_end);
        if transport == Transport::Ws {
            let op = json!({"type": "chat.subscribe", "conversationId": conversation}).to_string();
            stream.write_all(&client_frame(0x1, op.as_bytes())).await.map_err(|e| e.to_string())?;
        }
        let mut body = Vec::with_capacity(1 << 16);
        // The pages the first reads land in, faulted in now rather than when events arrive.
        prefault(&mut raw);
        prefault(&mut body);
        let mut dec = Decoder {
            transport,
            raw,
            body,
            at: 0,
            chunked,
            chunk_left: 0,
            ended: false,
            reply: Vec::new(),
            read_at: 0,
        };
        dec.decode();
        Ok(Feed { stream, dec })
    }

    /// The next message, or None at the end of the stream.
    pub(crate) async fn next_message(&mut self) -> Option<std::ops::Range<usize>> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            if let Some(message) = self.dec.message() {
                return Some(message);
            }
            if self.dec.ended {
                return None;
            }
            if !self.dec.reply.is_empty() {
                let reply = std::mem::take(&mut self.dec.reply);
                if self.stream.write_all(&reply).await.is_err() {
                    return None;
                }
            }
            match self.stream.read_buf(self.dec.room()).await {
                Ok(0) | Err(_) => return None,
                Ok(_) => self.dec.arrived(now_micros()),
            }
        }
    }
}

impl Decoder {
    /// The next whole message in the body, if there is one.
    pub(crate) fn message(&mut self) -> Option<std::ops::Range<usize>> {
        let delimiter: &[u8] = if self.transport == Transport::Sse { b"\n\n" } else { b"\n" };
        loop {
            let end = find(&self.body[self.at..], delimiter)?;
            let message = self.at..self.at + end;
            self.at += end + delimiter.len();
            if !message.is_empty() {
                return Some(message);
            }
            // (an NDJSON keep-alive)
        }
    }

    /// The buffer the next read goes to (the body itself when there is nothing to decode),
    /// with room in it; what was taken from the body is dropped first.
    pub(crate) fn room(&mut self) -> &mut Vec<u8> {
        if self.at == self.body.len() {
            self.body.clear();
            self.at = 0;
        } else if self.at > (1 << 20) {
            self.body.drain(..self.at);
            self.at = 0;
        }
        let buf = if self.reads_into_body() { &mut self.body } else { &mut self.raw };
        make_room(buf);
        buf
    }

    pub(crate) fn reads_into_body(&self) -> bool {
        !self.chunked && self.transport != Transport::Ws
    }

    /// A read into `room()` returned at `now` (unix microseconds).
    pub(crate) fn arrived(&mut self, now: u64) {
        self.read_at = now;
        if !self.reads_into_body() {
            self.decode();
        }
    }

    /// Moves what can be decoded from `raw` to `body`.
    pub(crate) fn decode(&mut self) {
        if self.transport == Transport::Ws {
            return self.decode_frames();
        }
        if !self.chunked {
            self.body.extend_from_slice(&self.raw);
            self.raw.clear();
            return;
        }
        let mut i = 0;
        loop {
            if self.chunk_left > 0 {
                let take = self.chunk_left.min(self.raw.len() - i);
                self.body.extend_from_slice(&self.raw[i..i + take]);
                i += take;
                self.chunk_left -= take;
                if self.chunk_left > 0 {
                    break;
                }
                continue;
            }
            // A size line, possibly preceded by the CRLF that ends the previous chunk.
            let rest = &self.raw[i..];
            let skip = if rest.starts_with(b"\r\n") { 2 } else { 0 };
            let Some(eol) = find(&rest[skip..], b"\r\n") else { break };
            let line = &rest[skip..skip + eol];
            let size = line
                .iter()
                .take_while(|b| b.is_ascii_hexdigit())
                .fold(0usize, |n, b| n * 16 + (*b as char).to_digit(16).unwrap_or(0) as usize);
            i += skip + eol + 2;
            if size == 0 {
                self.ended = true;
                break;
            }
            self.chunk_left = size;
        }
        self.raw.drain(..i);
    }

    /// Server frames are never masked: opcode, length, payload.
    pub(crate) fn decode_frames(&mut self) {
        let mut i = 0;
        while let Some(frame) = dispatch_testkit::server_frame(&self.raw[i..]) {
            match frame.opcode() {
                0x0..=0x2 => {
                    self.body.extend_from_slice(frame.payload);
                    self.body.push(b'\n');
                }
                0x8 => self.ended = true,
                0x9 => self.reply.extend_from_slice(&client_frame(0xA, frame.payload)),
                _ => {}
            }
            i += frame.len;
        }
        self.raw.drain(..i);
    }
}

/// Room for the next read. Only when little is left: the buffers usually hold a few
/// undecoded bytes (the CRLF after an HTTP chunk, a partial frame), and reserving a whole
/// read's room on top of them would double every buffer at its first event, copying and
/// faulting in 5,000 x 64 KiB just as a workload starts.
pub(crate) fn make_room(buf: &mut Vec<u8>) {
    if buf.capacity() - buf.len() < 1 << 13 {
        buf.reserve(1 << 16);
    }
}

/// Touches the first pages of `buf`'s spare capacity.
pub(crate) fn prefault(buf: &mut Vec<u8>) {
    let spare = buf.spare_capacity_mut();
    let n = spare.len().min(16 * 1024);
    spare[..n].fill(std::mem::MaybeUninit::new(0));
}

/// A masked client frame (the mask is zero: XOR with it leaves the payload as it is).
pub(crate) fn client_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    dispatch_testkit::client_frame(0x80 | opcode, payload, [0; 4])
}

/// The number after the last ':' of an `id:` line, and the data line, of an event block.
pub(crate) fn fields(block: &[u8]) -> (Option<u64>, &[u8]) {
    let (mut id, mut data): (Option<u64>, &[u8]) = (None, &[]);
    let mut rest = block;
    while !rest.is_empty() {
        let end = memchr::memchr(b'\n', rest).unwrap_or(rest.len());
        let line = &rest[..end];
        if let Some(v) = line.strip_prefix(b"id: ") {
            id = number(memchr::memrchr(b':', v).map_or(v, |i| &v[i + 1..]));
        } else if let Some(v) = line.strip_prefix(b"data: ") {
            data = v;
        }
        rest = &rest[(end + 1).min(rest.len())..];
    }
    (id, data)
}

pub(crate) fn number(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

/// Substring search with a searcher built once per needle (building one costs more than
/// searching a short message).
pub(crate) fn find(haystack: &[u8], needle: &'static [u8]) -> Option<usize> {
    use memchr::memmem::Finder;
    use std::sync::LazyLock;
    static FINDERS: LazyLock<Vec<Finder<'static>>> = LazyLock::new(|| NEEDLES.iter().map(Finder::new).collect());
    match needle {
        [byte] => memchr::memchr(*byte, haystack),
        _ => match NEEDLES.iter().position(|n| *n == needle) {
            Some(i) => FINDERS[i].find(haystack),
            None => memchr::memmem::find(haystack, needle),
        },
    }
}

pub(crate) const NEEDLES: [&[u8]; 9] = [
    b"\n\n",
    b"\r\n",
    b"\r\n\r\n",
    b"\"delta\":\"",
    b"\"content\":\"",
    b"\"type\":\"chat.delta\"",
    b"\"type\":\"turn-sealed\"",
    b"\"type\":\"text-delta\"",
    b"\"type\":\"done\"",
];

pub(crate) fn subscribe_url(server: Server, transport: Transport, base: &str, channel: &str) -> String {
    match (server, transport) {
        (Server::Nchan | Server::Pushpin, _) => format!("{base}/sub/{channel}"),
        (Server::Gateway, Transport::Ws) => format!("{base}/ws"),
        (Server::Gateway, _) => format!("{base}/conversations/{channel}/events?until=sealed"),
    }
}

pub(crate) async fn subscribe(server: Server, transport: Transport, base: &str, channel: &str) -> Feed {
    let url = subscribe_url(server, transport, base, channel);
    Feed::open(transport, &url, channel).await.expect("subscribes")
}
