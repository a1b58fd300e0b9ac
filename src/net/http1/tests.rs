//! The tests of `http1.rs`.

use super::*;

#[tokio::test]
async fn a_connection_task_stays_small() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stream = Arc::new(Connection::new(TcpStream::connect(listener.local_addr().unwrap()).await.unwrap()));
    let limits = ConnectionLimits {
        drain_timeout: Duration::from_secs(1),
        header_read_timeout: Duration::from_secs(1),
        max_head_bytes: 64 * 1024,
        max_headers: 100,
        max_body_bytes: 1024 * 1024,
        body_read_timeout: Duration::from_secs(1),
    };
    let token = tokio_util::sync::CancellationToken::new();
    let mut drained = Cancelled::new(&token);
    let router = Router::new();
    let metrics = Metrics::default();
    let connection = serve(&stream, &router, &limits, &metrics, &mut drained);
    // Every connection's task holds this state for its whole life, idle watchers included
    // (10,000 of them in W4): what a WebSocket session needs is boxed when one opens. About
    // 2 KiB in a test build (5 KiB with the session inline); less in a release build.
    let size = std::mem::size_of_val(&connection);
    assert!(size <= 3072, "a connection's state is {size} bytes");
}

#[test]
fn bodyless_gets_and_bodies_within_the_limit_are_taken() {
    let taken = |head: &str| matches!(parse(head.as_bytes(), 100, 1000), Parsed::Complete(..));
    assert!(taken("GET /conversations/a/events?until=sealed HTTP/1.1\r\nhost: x\r\n\r\n"));
    assert!(taken("GET /conversations/a HTTP/1.1\r\nhost: x\r\n\r\n"));
    assert!(!taken("GET /conversations/a/events HTTP/1.0\r\nhost: x\r\n\r\n"));
    assert!(!taken("HEAD /conversations/a HTTP/1.1\r\nhost: x\r\n\r\n"));
    assert!(!taken("CONNECT gateway:443 HTTP/1.1\r\nhost: x\r\n\r\n"));
    assert!(!taken("OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n"));
    assert!(!taken("POST http://gateway/conversations HTTP/1.1\r\nhost: x\r\n\r\n"));
    // A body with a length within the limit is read here; GET's is not.
    let length = |head: &str| match parse(head.as_bytes(), 100, 1000) {
        Parsed::Complete(request, _, _, body) => Some((request.method().clone(), body)),
        _ => None,
    };
    for method in ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"] {
        let bodyless = format!("{method} /conversations/a HTTP/1.1\r\nhost: x\r\n\r\n");
        assert_eq!(length(&bodyless), Some((Method::from_bytes(method.as_bytes()).unwrap(), 0)), "{method}");
        let full = format!("{method} /conversations/a HTTP/1.1\r\ncontent-length: 1000\r\n\r\n");
        assert_eq!(length(&full).map(|(_, n)| n), Some(1000), "{method}");
        let over = format!("{method} /conversations/a HTTP/1.1\r\ncontent-length: 1001\r\n\r\n");
        assert_eq!(length(&over), None, "{method}: past the limit, hyper's (and its 413)");
    }
    assert!(!taken("POST /conversations HTTP/1.1\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n"));
    assert!(!taken("POST /conversations HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"));
    assert!(!taken("POST /conversations HTTP/1.0\r\ncontent-length: 2\r\n\r\n"));
    assert!(!taken("GET /conversations/a/events HTTP/1.1\r\nupgrade: h2c\r\n\r\n"));
    // A WebSocket upgrade, on any path (the router answers it), is taken.
    for path in ["/ws", "/", "/conversations/a/events"] {
        match parse(
            format!("GET {path} HTTP/1.1\r\nupgrade: WebSocket\r\nconnection: upgrade\r\n\r\n").as_bytes(),
            100,
            1000,
        ) {
            Parsed::Complete(request, close, _, _) => {
                assert!(!close);
                assert_eq!(request.uri().path(), path);
            }
            _ => panic!("a WebSocket upgrade of {path} is taken"),
        }
    }
    assert!(!taken("GET /ws HTTP/1.1\r\nupgrade: websocket\r\nupgrade: h2c\r\n\r\n"));
    assert!(!taken("POST /ws HTTP/1.1\r\nupgrade: websocket\r\n\r\n"));
    assert!(!taken("GET /conversations/a/events HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc"));
    assert!(!taken("GET /conversations/a/events HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"));
    assert!(matches!(parse(b"GET /conversations/a/events HTTP/1.1\r\nhost", 100, 1000), Parsed::Partial));
    // Framing hyper would refuse is refused here (with a reason); what it reads is its.
    let refused = |head: &str| matches!(parse(head.as_bytes(), 100, 1000), Parsed::Malformed(_));
    for bad in [
        "content-length: 2\r\ncontent-length: 3",
        "content-length: 2, 2",
        "content-length: +2",
        "content-length: abc",
        "content-length: 99999999999999999999999",
        "transfer-encoding: gzip",
        "transfer-encoding: chunked, gzip",
        "transfer-encoding: chunked\r\ntransfer-encoding: gzip",
        "transfer-encoding: ",
    ] {
        assert!(refused(&format!("POST /conversations HTTP/1.1\r\n{bad}\r\n\r\n")), "{bad}");
    }
    assert!(refused("POST /conversations HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n"));
    for good in ["content-length: 2\r\ncontent-length: 2", "content-length: 02"] {
        let head = format!("POST /conversations HTTP/1.1\r\n{good}\r\n\r\n");
        assert!(matches!(parse(head.as_bytes(), 100, 1000), Parsed::Complete(_, _, _, 2)), "{good}");
    }
    for chunked in [
        "transfer-encoding: CHUNKED",
        "transfer-encoding: gzip, chunked",
        "transfer-encoding: gzip\r\ntransfer-encoding: chunked",
    ] {
        let head = format!("POST /conversations HTTP/1.1\r\n{chunked}\r\n\r\n");
        assert!(matches!(parse(head.as_bytes(), 100, 1000), Parsed::Other), "{chunked}");
    }
    let head = "GET /c/events HTTP/1.1\r\nConnection: keep-alive, Close\r\n\r\n";
    match parse(format!("{head}GET /next").as_bytes(), 100, 1000) {
        Parsed::Complete(request, close, length, 0) => {
            assert!(close);
            assert_eq!(length, head.len());
            assert_eq!(request.uri().path(), "/c/events");
        }
        _ => panic!("a complete head"),
    }
}
