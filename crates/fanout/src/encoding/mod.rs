//! The bytes of the wire, shared by the hub (which keeps each event encoded once for every
//! transport, [`EncodedEvent`]) and the transports (which write them): SSE messages, NDJSON
//! lines, server WebSocket frames, HTTP/1.1 chunk heads. Nothing here knows a socket, and the
//! hub frames nothing itself: a transport frames a batch ([`Transport::frame`]).

use bytes::{BufMut, BytesMut};

mod event;

pub use event::{EncodedEvent, Kind};

/// The live transports: how a stream's events are framed on its socket (the hub keeps each
/// event in each framing, `encoding/event.rs`), and how `/metrics` counts the streams open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// NDJSON lines (`Accept: application/x-ndjson`).
    Ndjson,
    /// Server-Sent Events, each with its id.
    Sse,
    /// `chat.delta` messages in WebSocket text frames.
    WebSocket,
}

impl Transport {
    pub const ALL: [Transport; 3] = [Transport::Ndjson, Transport::Sse, Transport::WebSocket];

    /// The `transport` label of the stream gauges.
    pub fn label(self) -> &'static str {
        match self {
            Transport::Ndjson => "ndjson",
            Transport::Sse => "sse",
            Transport::WebSocket => "websocket",
        }
    }
}

/// `<json>\n`.
#[inline]
pub fn put_ndjson(out: &mut BytesMut, json: &[u8]) {
    out.reserve(json.len() + 1);
    out.put_slice(json);
    out.put_u8(b'\n');
}

/// `id: <turnId>:<index>\ndata: <json>\n\n`: one event of a live SSE stream.
#[inline]
pub fn put_sse_event(out: &mut BytesMut, turn_id: &str, index: u32, json: &[u8]) {
    out.reserve(json.len() + turn_id.len() + 24);
    out.put_slice(b"id: ");
    out.put_slice(turn_id.as_bytes());
    out.put_u8(b':');
    out.put_slice(index.to_string().as_bytes());
    out.put_slice(b"\ndata: ");
    out.put_slice(json);
    out.put_slice(b"\n\n");
}

/// `event: <name>\ndata: <json>\n\n`: a named SSE message (`resync`).
pub fn sse_named(name: &str, json: &str) -> bytes::Bytes {
    bytes::Bytes::from(format!("event: {name}\ndata: {json}\n\n"))
}

/// What an idle SSE stream sends so that proxies keep it open.
pub const SSE_KEEPALIVE: &[u8] = b": keep-alive\n\n";

/// What an idle NDJSON stream sends: an empty line, which readers skip.
pub const NDJSON_KEEPALIVE: &[u8] = b"\n";

/// The WebSocket opcodes a server sends.
pub const WS_TEXT: u8 = 0x1;
pub const WS_BINARY: u8 = 0x2;
pub const WS_CLOSE: u8 = 0x8;
pub const WS_PING: u8 = 0x9;
pub const WS_PONG: u8 = 0xA;

/// The length of an unmasked (server) WebSocket frame with a payload of `payload` bytes.
#[inline]
pub fn ws_frame_len(payload: usize) -> usize {
    payload
        + match payload {
            0..126 => 2,
            126..65536 => 4,
            _ => 10,
        }
}

/// Appends one final, unmasked WebSocket frame (a server's frames are never masked).
#[inline]
pub fn put_ws_frame(out: &mut BytesMut, opcode: u8, payload: &[u8]) {
    out.reserve(ws_frame_len(payload.len()));
    out.put_u8(0x80 | opcode);
    match payload.len() {
        n @ 0..126 => out.put_u8(n as u8),
        n @ 126..65536 => {
            out.put_u8(126);
            out.put_u16(n as u16);
        }
        n => {
            out.put_u8(127);
            out.put_u64(n as u64);
        }
    }
    out.put_slice(payload);
}

/// The payload of a WebSocket `chat.delta` message for an event's JSON.
pub fn ws_chat_delta(json: &[u8]) -> Vec<u8> {
    const OPEN: &[u8] = br#"{"type":"chat.delta","event":"#;
    let mut out = Vec::with_capacity(OPEN.len() + json.len() + 1);
    out.extend_from_slice(OPEN);
    out.extend_from_slice(json);
    out.push(b'}');
    out
}

/// `<length in hex>\r\n`, the line that opens a chunk of a chunked HTTP/1.1 body.
#[inline]
pub fn chunk_size(buf: &mut [u8; 18], mut length: usize) -> &[u8] {
    let mut at = buf.len() - 2;
    buf[at..].copy_from_slice(b"\r\n");
    loop {
        at -= 1;
        buf[at] = b"0123456789abcdef"[length & 0xf];
        length >>= 4;
        if length == 0 {
            return &buf[at..];
        }
    }
}

/// Whether a comma-separated header value lists `token` (any case).
#[inline]
pub fn has_token(value: &[u8], token: &[u8]) -> bool {
    value.split(|b| *b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// What closes every chunk.
pub const CHUNK_END: &[u8] = b"\r\n";

/// The last chunk of a chunked body.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes_are_hex_lines() {
        let mut buf = [0u8; 18];
        assert_eq!(chunk_size(&mut buf, 0), b"0\r\n");
        assert_eq!(chunk_size(&mut buf, 10), b"a\r\n");
        assert_eq!(chunk_size(&mut buf, 0x1f2e), b"1f2e\r\n");
        assert_eq!(chunk_size(&mut buf, usize::MAX), b"ffffffffffffffff\r\n");
    }

    #[test]
    fn server_frames_carry_the_shortest_length_that_fits() {
        for (len, header) in [(0, 2), (125, 2), (126, 4), (65535, 4), (65536, 10)] {
            let mut out = BytesMut::new();
            put_ws_frame(&mut out, WS_TEXT, &vec![b'x'; len]);
            assert_eq!(out.len(), header + len);
            assert_eq!(ws_frame_len(len), header + len);
            assert_eq!(out[0], 0x81);
        }
    }

    #[test]
    fn an_sse_event_names_its_turn_and_index() {
        let mut out = BytesMut::new();
        put_sse_event(&mut out, "t:x", 7, b"{}");
        assert_eq!(&out[..], b"id: t:x:7\ndata: {}\n\n");
        assert_eq!(&ws_chat_delta(b"{}")[..], br#"{"type":"chat.delta","event":{}}"#);
    }
}
