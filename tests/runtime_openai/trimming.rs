//! Trimming to the context window: the estimate calibrated, the tail read, a refused request
//! trimmed again.

use super::*;

#[tokio::test]
async fn the_trimming_estimate_is_calibrated_by_the_last_requests_prompt_tokens() {
    set_key();
    // The upstream counts about three times the estimate (four bytes a token): a 400-byte
    // request estimated as 104 tokens was 300.
    let upstream = FakeUpstream::start(vec![
        Reply::Stream(vec![delta(json!({"content": "a".repeat(40)})), finish("stop"), usage(300, 60)]),
        Reply::Stream(vec![delta(json!({"content": "ok"})), finish("stop")]),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let server = gateway_with(dir.path(), &upstream, |c| {
        c.context_window = Some(1000);
        c.params.max_tokens = Some(100);
    })
    .await;
    turn(&server, "cal", &"q".repeat(400)).await;
    let (_, metrics) = server.get("/conversations/cal/metrics").await;
    assert_eq!(metrics["turns"][0]["contextSize"], 360);
    // 118 + 304 estimated tokens fit 900 as they are, but not at three real tokens each.
    let new = "n".repeat(1200);
    turn(&server, "cal", &new).await;
    assert_eq!(
        upstream.requests()[1].body["messages"],
        json!([{"role": "user", "content": new}]),
        "the first turn was left out"
    );
}

/// The `Counted` model's context window in the tests below, with `max_tokens` 100 and answers
/// of 300 bytes: a message is 79 estimated tokens and 158 counted.
const WINDOW: u64 = 1200;

/// The `Counted` model's reply to one request.
fn counted(says_count: bool) -> Reply {
    Reply::Counted { window: WINDOW, answer: "a".repeat(300), says_count }
}

/// The `n`th question of a conversation: 300 bytes, numbered.
fn question(n: u32) -> String {
    format!("{n:03}{}", "q".repeat(297))
}

/// A gateway in front of the `Counted` model, with its context window configured.
async fn counted_gateway(dir: &std::path::Path) -> (FakeUpstream, TestServer) {
    let upstream = FakeUpstream::start(Vec::new()).await;
    let server = gateway_with(dir, &upstream, |c| {
        c.context_window = Some(WINDOW);
        c.params.max_tokens = Some(100);
    })
    .await;
    (upstream, server)
}

/// Turns `turns` of `conversation` on the `Counted` model, each of which must end `stop`.
async fn counted_turns(
    server: &TestServer,
    upstream: &FakeUpstream,
    conversation: &str,
    turns: std::ops::RangeInclusive<u32>,
) {
    for n in turns {
        upstream.push(counted(true));
        let events = turn(server, conversation, &question(n)).await;
        assert_eq!(events[events.len() - 2]["reason"], "stop", "turn {n}: {events:?}");
    }
}

/// Once older turns are left out, the last turn's `contextSize` counts only what was kept:
/// the calibration must come from the request the estimate was made for, or the trimming
/// keeps too much and the upstream refuses the conversation a few turns on.
#[tokio::test]
async fn a_long_conversation_keeps_fitting_the_context_window_once_older_turns_are_left_out() {
    set_key();
    let dir = tempfile::tempdir().unwrap();
    let (upstream, server) = counted_gateway(dir.path()).await;
    counted_turns(&server, &upstream, "long", 1..=12).await;
    // 1100 counted tokens of room keep
    // the new message and the two turns before it (790), not a third (1106).
    let last = &upstream.requests()[11].body["messages"];
    assert_eq!(last.as_array().unwrap().len(), 5, "{last}");
    assert!(last[0]["content"].as_str().unwrap().starts_with("010"), "{last}");
    assert!(counted_tokens(last) + 100 <= WINDOW);
}

/// A turn reads the log from its end only as far back as the context window needs: the
/// oldest chunk, made unreadable, is never read once the conversation outgrew the window,
/// and the request is the one trimming the whole log would make.
#[tokio::test]
async fn a_trimmed_request_reads_only_the_tail_of_a_long_conversation() {
    set_key();
    let dir = tempfile::tempdir().unwrap();
    let (upstream, server) = counted_gateway(dir.path()).await;
    // 40 turns: 80 chunks, more than the first tail read's 64.
    counted_turns(&server, &upstream, "tail", 1..=40).await;
    let db = dir.path().join("gateway.db");
    let conn = rusqlite::Connection::open(&db).unwrap();
    let changed = conn
        .execute(r#"UPDATE chunks SET chunk = '{"not":"a chunk"}' WHERE conversation_id = 'tail' AND seq = 1"#, ())
        .unwrap();
    assert_eq!(changed, 1);
    counted_turns(&server, &upstream, "tail", 41..=41).await;
    let sent = &upstream.requests()[40].body["messages"];
    assert_eq!(sent.as_array().unwrap().len(), 5, "{sent}");
    assert!(sent[0]["content"].as_str().unwrap().starts_with("039"), "{sent}");
    // A conversation that fits is read whole, so the same damage in it is a storage error.
    upstream.push(counted(true));
    turn(&server, "short", "hi").await;
    conn.execute(r#"UPDATE chunks SET chunk = '{"not":"a chunk"}' WHERE conversation_id = 'short' AND seq = 1"#, ())
        .unwrap();
    let events = turn(&server, "short", "again").await;
    turn_error(&events, "storage", "could not be read");
}

/// Without a `context_window` a request is still bounded by `--max-runtime-request-bytes`:
/// the oldest turns are left out past it, and the log is read from its end only as far back
/// as that needs (the oldest chunk, made unreadable, is never read), however long it grew.
#[tokio::test]
async fn without_a_context_window_the_request_size_bound_trims_and_reads_only_the_tail() {
    set_key();
    let upstream = FakeUpstream::start(Vec::new()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_with(dir.path(), &upstream, |c| c.context_window = None);
    // 2000 bytes are 500 estimated tokens; each 300-byte message is 79: the new message and
    // the two turns before it (395), not a third (553).
    config.max_runtime_request_bytes = 2000;
    let server = TestServer::start(config).await;
    let answer = || Reply::Stream(vec![delta(json!({"content": "a".repeat(300)})), finish("stop")]);
    for n in 1..=40 {
        upstream.push(answer());
        turn(&server, "bounded", &question(n)).await;
    }
    let conn = rusqlite::Connection::open(dir.path().join("gateway.db")).unwrap();
    let changed = conn
        .execute(r#"UPDATE chunks SET chunk = '{"not":"a chunk"}' WHERE conversation_id = 'bounded' AND seq = 1"#, ())
        .unwrap();
    assert_eq!(changed, 1);
    upstream.push(answer());
    let events = turn(&server, "bounded", &question(41)).await;
    assert_eq!(events[events.len() - 2]["reason"], "stop", "{events:?}");
    let sent = &upstream.requests()[40].body["messages"];
    assert_eq!(sent.as_array().unwrap().len(), 5, "{sent}");
    assert!(sent[0]["content"].as_str().unwrap().starts_with("039"), "{sent}");
    assert_eq!(sent[4]["content"], question(41));
}

/// An upstream that refuses a request as too long for its context is asked again within the
/// turn with older turns left out, as if tokens were as dear as it says it counted (or twice
/// the last guess when it does not say): a conversation whose calibration is unknown or wrong
/// does not fail turn after turn. A message that cannot fit alone still fails.
#[tokio::test]
async fn a_request_refused_as_too_long_is_trimmed_again_within_the_turn() {
    set_key();
    for says_count in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (upstream, server) = counted_gateway(dir.path()).await;
        // Ten turns from an upstream that reports no usage: nothing calibrates the estimate.
        for n in 1..=10 {
            upstream.push(Reply::Stream(vec![delta(json!({"content": "a".repeat(300)})), finish("stop")]));
            turn(&server, "refit", &question(n)).await;
        }
        // At one real token an estimated one, 13 messages (1027 estimated tokens) fit 1100,
        // but the model counts twice as many: refused, then sent again with 5.
        upstream.push(counted(says_count));
        let events = turn(&server, "refit", &question(11)).await;
        assert_eq!(events[events.len() - 2]["reason"], "stop", "says_count {says_count}: {events:?}");
        let requests = upstream.requests();
        assert_eq!(requests.len(), 12, "says_count {says_count}: one refused request, one taken");
        assert_eq!(requests[10].body["messages"].as_array().unwrap().len(), 13);
        assert_eq!(requests[11].body["messages"].as_array().unwrap().len(), 5);
        // The next turn starts calibrated: one request.
        upstream.push(counted(says_count));
        let events = turn(&server, "refit", &question(12)).await;
        assert_eq!(events[events.len() - 2]["reason"], "stop");
        assert_eq!(upstream.requests().len(), 13);
        // A message longer than the window alone: sent alone and refused, with nothing more to
        // leave out, the turn fails without another try.
        upstream.push(counted(says_count));
        let events = turn(&server, "refit", &"x".repeat(3000)).await;
        turn_error(&events, "context_length", "does not fit the model's context");
        let tries = upstream.requests().len() - 13;
        assert_eq!(upstream.requests().last().unwrap().body["messages"].as_array().unwrap().len(), 1);
        assert_eq!(tries, 1, "says_count {says_count}");
    }
}
