//! What an upstream says when it is not a stream: keep-alives, unreachable upstreams, a 200 of
//! another type, an HTML error page.

use super::*;

/// The idle timeout runs between the upstream's bytes: an upstream that keeps a queued request
/// open with keep-alive comments (which the event parser swallows) is waited for, past the
/// timeout, and once it falls silent the turn ends after it.
#[tokio::test]
async fn keep_alive_comments_hold_the_idle_timeout_off_and_silence_does_not() {
    set_key();
    let pause = Duration::from_millis(400);
    let comments = |n: usize| (0..n).map(|_| (pause, ": PROCESSING\n\n".to_owned())).collect::<Vec<_>>();
    let data = |payload: Value| (Duration::ZERO, format!("data: {payload}\n\n"));
    let head = (Duration::ZERO, "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n".to_owned());
    // Six comments 0.4 s apart: 2.4 s with no event, under a timeout of 1 s.
    let mut queued = vec![head.clone()];
    queued.extend(comments(6));
    queued.extend([
        data(delta(json!({"content": "late"}))),
        data(finish("stop")),
        (Duration::ZERO, "data: [DONE]\n\n".into()),
    ]);
    // Content, comments, then nothing at all.
    let mut silent = vec![head, data(delta(json!({"content": "partial"})))];
    silent.extend(comments(3));
    let upstream = FakeUpstream::start(vec![Reply::Drip(queued), Reply::Drip(silent)]).await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway_with(dir.path(), &upstream, |c| c.idle_timeout_secs = 1).await;

    let events = turn(&server, "keep", "hi").await;
    assert_eq!(
        events.iter().find(|e| e["type"] == "text-delta").map(|e| &e["delta"]),
        Some(&json!("late")),
        "{events:?}"
    );
    assert_eq!(events[events.len() - 2]["reason"], "stop", "{events:?}");

    let events = turn(&server, "keep", "again").await;
    let error = events.iter().find(|e| e["type"] == "error").expect("the silence ended the turn");
    assert_eq!(error["code"], "upstream", "{error}");
    assert!(error["message"].as_str().unwrap().contains("the upstream sent nothing for 1s"), "{error}");
    assert_eq!(server.history("keep").await.last().unwrap()["chunk"]["type"], "error");
    assert_eq!(upstream.requests().len(), 2, "one request per turn");
}

/// An upstream nobody listens on never took the request: the turn retries it with backoff,
/// then ends `unavailable`, saying it cannot reach it. An upstream that answers the stream with
/// an event that is not JSON (a proxy's page, say) ends the turn `upstream`, not retried.
#[tokio::test]
async fn an_unreachable_upstream_is_retried_then_unavailable_and_an_event_that_is_not_json_ends_the_turn() {
    set_key();
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let page = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
        data: <html>upstream busy</html>\n\n";
    let upstream = FakeUpstream::start(vec![Reply::Raw(page.into())]).await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let events = turn(&server, "page", "hi").await;
    turn_error(&events, "upstream", "the upstream sent an event that is not JSON");
    assert_eq!(upstream.requests().len(), 1, "not retried");

    let other = tempfile::tempdir().unwrap();
    // The listener is gone: connecting to its port is refused.
    let server = gateway_with(other.path(), &upstream, |c| c.base_url = format!("http://{nobody}/v1")).await;
    let events = turn(&server, "gone", "hi").await;
    turn_error(&events, "unavailable", "cannot reach the upstream");
    let metrics = server.metrics().await;
    assert_eq!(metric(&metrics, "dispatch_runtime_errors_total{kind=\"retried\"}"), 3.0, "{metrics}");
    assert_eq!(server.history("gone").await.last().unwrap()["chunk"]["type"], "error");
}

/// A 200 that is not an event stream (a server that ignored `stream: true`, a proxy's 200 with
/// an error or a login page) ends the turn `upstream` saying what came, its first bytes
/// included, and is not retried: the upstream took the request.
#[tokio::test]
async fn a_200_that_is_not_an_event_stream_says_what_came_and_is_not_retried() {
    set_key();
    let json_error = r#"{"error":{"message":"quota exceeded for this key"}}"#;
    let page = "<html><body>Sign in to continue</body></html>";
    let upstream =
        FakeUpstream::start(vec![raw("200 OK", "", json_error), html("200 OK", "text/html; charset=utf-8", page)])
            .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let events = turn(&server, "json", "hi").await;
    let error = turn_error(&events, "upstream", "application/json, not an event stream");
    assert!(error["message"].as_str().unwrap().contains("quota exceeded for this key"), "{error}");
    assert_eq!(upstream.requests().len(), 1, "not retried");
    let events = turn(&server, "html", "hi").await;
    let error = turn_error(&events, "upstream", "text/html; charset=utf-8, not an event stream");
    assert!(error["message"].as_str().unwrap().contains("Sign in to continue"), "{error}");
    assert_eq!(upstream.requests().len(), 2, "not retried");
}

/// A proxy's HTML error page in front of the upstream ends the turn saying the page's title,
/// not its markup (what the console and the reference client show the user).
#[tokio::test]
async fn an_html_error_page_is_said_by_its_title_not_its_markup() {
    set_key();
    let page = "<html>\r\n<head><title>403 Forbidden</title></head>\r\n<body>\r\n<center><h1>403 Forbidden</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";
    let upstream = FakeUpstream::start(vec![html("403 Forbidden", "text/html", page)]).await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway(dir.path(), &upstream).await;
    let events = turn(&server, "proxied", "hi").await;
    let error = turn_error(&events, "upstream", "the upstream answered 403 Forbidden: an HTML page: 403 Forbidden");
    assert!(!error["message"].as_str().unwrap().contains('<'), "{error}");
    let history = server.history("proxied").await;
    assert!(!history.last().unwrap()["chunk"]["message"].as_str().unwrap().contains('<'), "{history:?}");
}
