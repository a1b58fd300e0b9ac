//! The tests of `websocket.rs`.

use super::*;

fn client(first: u8, payload: &[u8]) -> Vec<u8> {
    dispatch_testkit::client_frame(first, payload, [0x12, 0x34, 0x56, 0x78])
}

/// What a session takes from `bytes`: messages up to a close (the session reads no further)
/// or a refusal.
fn all(bytes: Vec<u8>, max: usize) -> Vec<Result<Incoming, u16>> {
    let mut frames = FrameDecoder::new(bytes, max);
    let mut got = Vec::new();
    loop {
        match frames.next() {
            Ok(Some(m @ Incoming::Close(_))) => {
                got.push(Ok(m));
                return got;
            }
            Ok(Some(m)) => got.push(Ok(m)),
            Ok(None) => return got,
            Err(code) => {
                got.push(Err(code));
                return got;
            }
        }
    }
}

#[test]
fn messages_fragments_and_control_frames_decode() {
    let mut bytes = client(0x81, b"hello");
    bytes.extend(client(0x01, b"frag"));
    bytes.extend(client(0x89, b"p")); // a ping between fragments
    bytes.extend(client(0x80, "mented \u{e9}".as_bytes()));
    bytes.extend(client(0x82, &[0xff, 0]));
    bytes.extend(client(0x8A, b""));
    bytes.extend(client(0x81, &vec![b'x'; 70_000]));
    bytes.extend(client(0x88, &[0x03, 0xe8, b'b', b'y', b'e']));
    assert_eq!(
        all(bytes, 100_000),
        vec![
            Ok(Incoming::Text("hello".into())),
            Ok(Incoming::Ping(b"p".to_vec())),
            Ok(Incoming::Text("fragmented \u{e9}".into())),
            Ok(Incoming::Binary(vec![0xff, 0])),
            Ok(Incoming::Pong),
            Ok(Incoming::Text("x".repeat(70_000))),
            Ok(Incoming::Close(Some(1000))),
        ]
    );
}

#[test]
fn a_frame_split_across_reads_waits_for_its_rest() {
    let whole = client(0x81, &vec![b'y'; 300]);
    for cut in [1, 2, 3, 5, 8, 100, whole.len() - 1] {
        let mut frames = FrameDecoder::new(whole[..cut].to_vec(), 1000);
        assert_eq!(frames.next(), Ok(None), "cut at {cut}");
        frames.buf.extend_from_slice(&whole[cut..]);
        assert_eq!(frames.next(), Ok(Some(Incoming::Text("y".repeat(300)))), "cut at {cut}");
        assert_eq!(frames.next(), Ok(None));
    }
}

#[test]
fn bad_frames_end_the_session_with_their_code() {
    let unmasked = vec![0x81, 0x02, b'h', b'i'];
    let rsv = client(0xC1, b"hi");
    let long_ping = client(0x89, &[0; 126]);
    let fragmented_close = client(0x08, b"");
    let stray_continuation = client(0x80, b"x");
    let mut interleaved = client(0x01, b"a");
    interleaved.extend(client(0x81, b"b"));
    let bad_opcode = client(0x83, b"");
    let not_utf8 = client(0x81, &[0xc3, 0x28]);
    let one_byte_close = client(0x88, &[3]);
    let mut too_big = client(0x01, &[b'a'; 60]);
    too_big.extend(client(0x80, &[b'a'; 60]));
    for (bytes, code) in [
        (unmasked, PROTOCOL_ERROR),
        (rsv, PROTOCOL_ERROR),
        (long_ping, PROTOCOL_ERROR),
        (fragmented_close, PROTOCOL_ERROR),
        (stray_continuation, PROTOCOL_ERROR),
        (interleaved, PROTOCOL_ERROR),
        (bad_opcode, PROTOCOL_ERROR),
        (not_utf8, INVALID_PAYLOAD),
        (one_byte_close, PROTOCOL_ERROR),
        (too_big, TOO_BIG),
        // Refused by its header alone, before its payload arrives.
        (client(0x81, &[b'a'; 101])[..4].to_vec(), TOO_BIG),
    ] {
        assert_eq!(all(bytes.clone(), 100).last(), Some(&Err(code)), "{bytes:02x?}");
    }
}

/// Decodes `bytes` fed in pieces cut at `cuts`, as reads would deliver them.
fn in_pieces(bytes: &[u8], cuts: &[usize], max: usize) -> Vec<Result<Incoming, u16>> {
    let mut frames = FrameDecoder::new(Vec::new(), max);
    let mut got = Vec::new();
    let mut at = 0;
    let mut ends: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    ends.sort_unstable();
    ends.push(bytes.len());
    for end in ends {
        frames.buf.extend_from_slice(&bytes[at..end.max(at)]);
        at = end.max(at);
        loop {
            match frames.next() {
                // Nothing after a close is read, as in `all` and on a connection.
                Ok(Some(m @ Incoming::Close(_))) => {
                    got.push(Ok(m));
                    return got;
                }
                Ok(Some(m)) => got.push(Ok(m)),
                Ok(None) => break,
                Err(code) => {
                    got.push(Err(code));
                    return got;
                }
            }
        }
    }
    got
}

fn arbitrary_frames() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
    use proptest::prelude::*;
    // Mostly well-formed client frames (any opcode, FIN, length), some raw noise between.
    let one = (any::<u8>(), proptest::collection::vec(any::<u8>(), 0..300), any::<bool>(), any::<[u8; 8]>())
        .prop_map(|(first, payload, noise, raw)| if noise { raw.to_vec() } else { client(first, &payload) });
    proptest::collection::vec(one, 0..8).prop_map(|frames| frames.concat())
}

proptest::proptest! {
    /// Whatever arrives, the decoder never panics, and how the bytes are split across reads
    /// changes nothing it decides.
    #[test]
    fn any_bytes_decode_the_same_however_they_are_split(
        bytes in arbitrary_frames(),
        cuts in proptest::collection::vec(proptest::prelude::any::<usize>(), 0..6),
        max in 0usize..400,
    ) {
        let whole = all(bytes.clone(), max);
        proptest::prop_assert_eq!(in_pieces(&bytes, &cuts, max), whole);
    }

    /// Pure noise, including 64-bit lengths of any value, never panics either.
    #[test]
    fn noise_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64), max in proptest::prelude::any::<usize>()) {
        let _ = all(bytes, max);
    }
}

/// What tungstenite (whose decoder passes the Autobahn suite) makes of `bytes`, as ours
/// reports it: the messages, then `Err(0)` when it refused the stream (any error of the
/// protocol, of UTF-8 or of size; the close code is not compared).
fn reference(bytes: &[u8], max: usize) -> Vec<Result<Incoming, u16>> {
    use tungstenite::protocol::{Role, WebSocket, WebSocketConfig};
    struct Input(std::io::Cursor<Vec<u8>>);
    impl std::io::Read for Input {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            match self.0.read(buf)? {
                0 => Err(std::io::ErrorKind::WouldBlock.into()),
                n => Ok(n),
            }
        }
    }
    impl std::io::Write for Input {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let config = WebSocketConfig::default().max_message_size(Some(max)).max_frame_size(Some(max));
    let mut socket =
        WebSocket::from_raw_socket(Input(std::io::Cursor::new(bytes.to_vec())), Role::Server, Some(config));
    let mut got = Vec::new();
    loop {
        match socket.read() {
            Ok(tungstenite::Message::Text(t)) => got.push(Ok(Incoming::Text(t.as_str().to_owned()))),
            Ok(tungstenite::Message::Binary(b)) => got.push(Ok(Incoming::Binary(b.to_vec()))),
            Ok(tungstenite::Message::Ping(p)) => got.push(Ok(Incoming::Ping(p.to_vec()))),
            Ok(tungstenite::Message::Pong(_)) => got.push(Ok(Incoming::Pong)),
            Ok(tungstenite::Message::Close(frame)) => {
                got.push(Ok(Incoming::Close(frame.map(|f| u16::from(f.code)))));
                return got;
            }
            Ok(tungstenite::Message::Frame(_)) => {}
            Err(tungstenite::Error::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => return got,
            Err(_) => {
                got.push(Err(0));
                return got;
            }
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
    /// Differential: on arbitrary client frames (any opcode, FIN and RSV bits, masked or not,
    /// fragments, control frames, bad UTF-8, bad close codes, sizes around the limit) the
    /// gateway's decoder takes the same messages as an Autobahn-tested one, and refuses
    /// exactly where it does.
    #[test]
    fn decodes_as_an_autobahn_tested_decoder_does(
        frames in proptest::collection::vec(
            (proptest::prelude::any::<u8>(), proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200), proptest::prelude::any::<bool>()),
            0..6,
        ),
        max in 16usize..300,
    ) {
        let mut bytes = Vec::new();
        for (first, payload, masked) in &frames {
            let mut frame = client(*first, payload);
            if !masked {
                // The same frame unmasked: the mask bit cleared, the key gone.
                let at = match frame[1] & 0x7f { 126 => 4, 127 => 10, _ => 2 };
                frame[1] &= 0x7f;
                frame.drain(at..at + 4);
                frame[at..].copy_from_slice(payload);
            }
            bytes.extend(frame);
        }
        let ours: Vec<Result<Incoming, u16>> =
            all(bytes.clone(), max).into_iter().map(|r| r.map_err(|_| 0)).collect();
        let mut theirs = reference(&bytes, max);
        // A close frame with a code no peer may send: tungstenite reports the 1002 it
        // answers with as the close, ours refuses the frame with 1002; the peer sees the same.
        if matches!(ours.last(), Some(Err(_))) && theirs.last() == Some(&Ok(Incoming::Close(Some(PROTOCOL_ERROR)))) {
            *theirs.last_mut().unwrap() = Err(0);
        }
        proptest::prop_assert_eq!(ours, theirs, "{:02x?}", bytes);
    }
}

#[test]
fn lengths_that_would_wrap_are_refused() {
    let mut bytes = client(0x01, b"a");
    bytes.extend_from_slice(&[0x80, 0x80 | 127]);
    bytes.extend_from_slice(&(u64::MAX - 1).to_be_bytes());
    assert_eq!(all(bytes, usize::MAX).last(), Some(&Err(PROTOCOL_ERROR)));
    let mut bytes = client(0x01, b"a");
    bytes.extend_from_slice(&[0x80, 0x80 | 127]);
    bytes.extend_from_slice(&(u64::MAX >> 1).to_be_bytes());
    assert_eq!(all(bytes.clone(), 1000).last(), Some(&Err(TOO_BIG)));
    // With no limit to speak of, such a frame just waits for its (never coming) bytes.
    assert_eq!(all(bytes, usize::MAX), vec![]);
}

#[test]
fn close_codes_a_peer_may_not_send_are_protocol_errors() {
    for code in [0u16, 999, 1004, 1005, 1006, 1015, 1016, 2999, 5000, 65535] {
        assert_eq!(all(client(0x88, &code.to_be_bytes()), 100), vec![Err(PROTOCOL_ERROR)], "{code}");
    }
    for code in [1000u16, 1001, 1002, 1003, 1007, 1011, 3000, 4999] {
        assert_eq!(all(client(0x88, &code.to_be_bytes()), 100), vec![Ok(Incoming::Close(Some(code)))]);
    }
}

#[test]
fn a_close_frame_carries_its_code() {
    let mut out = BytesMut::new();
    put_close(&mut out, Some(1001), "");
    assert_eq!(&out[..], &[0x88, 2, 0x03, 0xe9]);
}
