//! HTTP/1.1 on a raw socket, for what a client library would hide or refuse to send: duplicate
//! headers, kept-alive connections counted by the gateway, upgrades after other requests.

use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A raw HTTP/1.1 response: status, lowercased head, and the bytes after the head.
pub struct Raw {
    pub status: u16,
    pub head: String,
    pub rest: Vec<u8>,
}

/// Sends `request` and reads one response head (and whatever followed it in the same reads).
pub async fn exchange(socket: &mut TcpStream, request: &[u8]) -> Raw {
    socket.write_all(request).await.unwrap();
    read_response(socket).await
}

pub async fn read_response(socket: &mut TcpStream) -> Raw {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        let n = tokio::time::timeout(Duration::from_secs(10), socket.read(&mut chunk))
            .await
            .expect("a response in time")
            .unwrap();
        assert!(n > 0, "the connection closed before a response: {:?}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
    assert!(head.starts_with("http/1.1 ") || head.starts_with("http/1.0 "), "{head}");
    Raw { status: head[9..12].parse().unwrap(), head, rest: buf[end..].to_vec() }
}

/// The body of a response with a content-length.
pub async fn body(socket: &mut TcpStream, raw: &Raw) -> Vec<u8> {
    let length: usize = raw
        .head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .unwrap_or_else(|| panic!("a content-length: {}", raw.head))
        .trim()
        .parse()
        .unwrap();
    let mut body = raw.rest.clone();
    while body.len() < length {
        let mut chunk = [0u8; 4096];
        let n = socket.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the answer ends before its body");
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    body
}

/// The JSON body of a response with a content-length.
pub async fn json_body(socket: &mut TcpStream, raw: &Raw) -> Value {
    assert!(raw.head.contains("content-type: application/json"), "{}", raw.head);
    serde_json::from_slice(&body(socket, raw).await).unwrap()
}

/// `GET path` on a connection kept alive after it: the body, as text.
pub async fn get_kept_alive(socket: &mut TcpStream, path: &str) -> String {
    let raw = exchange(socket, format!("GET {path} HTTP/1.1\r\nhost: localhost\r\n\r\n").as_bytes()).await;
    assert_eq!(raw.status, 200, "{}", raw.head);
    String::from_utf8(body(socket, &raw).await).unwrap()
}

/// Reads on after `buf` until what arrived holds `needle`.
pub async fn read_until(socket: &mut TcpStream, mut buf: Vec<u8>, needle: &[u8]) -> Vec<u8> {
    while !buf.windows(needle.len()).any(|w| w == needle) {
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), socket.read(&mut chunk))
            .await
            .expect("the awaited bytes in time")
            .unwrap();
        assert!(
            n > 0,
            "the connection ended before {:?}: {}",
            String::from_utf8_lossy(needle),
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
    buf
}
