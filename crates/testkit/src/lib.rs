//! The client side of the gateway's wire, as its tests and its load generator speak it on raw
//! sockets: WebSocket frames a client sends (masked) and the frames the server sends back
//! (never masked). The gateway itself decodes client frames in `net::websocket`; this is the
//! other direction, so the server's public API carries no client code.

/// A client's frame: `first` is the frame's first byte (FIN, RSV and opcode); the payload is
/// masked with `mask`.
pub fn client_frame(first: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(payload.len() + 14);
    frame.push(first);
    match payload.len() {
        n if n < 126 => frame.push(0x80 | n as u8),
        n if n < 65536 => {
            frame.push(0x80 | 126);
            frame.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            frame.push(0x80 | 127);
            frame.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    frame.extend_from_slice(&mask);
    frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    frame
}

/// One frame the server sent, read in place.
#[derive(Debug, PartialEq, Eq)]
pub struct ServerFrame<'a> {
    /// The first byte: FIN, RSV and opcode.
    pub first: u8,
    pub payload: &'a [u8],
    /// Bytes of `buf` the frame took, header included.
    pub len: usize,
}

impl ServerFrame<'_> {
    pub fn opcode(&self) -> u8 {
        self.first & 0x0f
    }
}

/// The whole server frame at the start of `buf`, or `None` while it is incomplete.
pub fn server_frame(buf: &[u8]) -> Option<ServerFrame<'_>> {
    let (len, header): (usize, usize) = match *buf.get(1)? & 0x7f {
        126 => (u16::from_be_bytes(buf.get(2..4)?.try_into().ok()?) as usize, 4),
        127 => (usize::try_from(u64::from_be_bytes(buf.get(2..10)?.try_into().ok()?)).ok()?, 10),
        n => (n as usize, 2),
    };
    let payload = buf.get(header..header.checked_add(len)?)?;
    Some(ServerFrame { first: buf[0], payload, len: header + len })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server frame is a client frame without the mask bit and key.
    fn unmasked(first: u8, payload: &[u8]) -> Vec<u8> {
        let mut frame = client_frame(first, payload, [0; 4]);
        frame[1] &= 0x7f;
        let header = frame.len() - payload.len() - 4;
        frame.drain(header..header + 4);
        frame
    }

    #[test]
    fn frames_of_every_length_form_read_back_whole_and_only_whole() {
        for size in [0, 1, 125, 126, 65535, 65536] {
            let payload: Vec<u8> = (0..size).map(|i| i as u8).collect();
            let bytes = unmasked(0x81, &payload);
            let frame = server_frame(&bytes).unwrap();
            assert_eq!((frame.opcode(), frame.payload, frame.len), (1, &payload[..], bytes.len()));
            assert_eq!(server_frame(&bytes[..bytes.len() - 1]), None, "{size}: an incomplete frame");
        }
    }

    #[test]
    fn a_client_frame_is_masked_with_its_key() {
        let frame = client_frame(0x81, b"abcd", [1, 2, 3, 4]);
        assert_eq!(frame, [0x81, 0x84, 1, 2, 3, 4, b'a' ^ 1, b'b' ^ 2, b'c' ^ 3, b'd' ^ 4]);
    }
}

#[cfg(feature = "postgres")]
pub mod postgres;

/// A NATS server for tests that need the bus (no dependency: it starts Debian's binary).
pub mod nats;
