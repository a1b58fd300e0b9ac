//! Live streams: late joiners, resume, fan-out to many watchers, stalled watchers, the memory
//! cap, and stopping a turn, over SSE, NDJSON and WebSocket.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

const SLOW_TEXT: &str = "This reply streams slowly enough that watchers can join it in the middle \
    and still see every event of the turn from its first one, in order and exactly once, \
    whichever transport they use to follow the conversation while it runs.";

fn script() -> Value {
    // 16 KiB deltas: 300 of them are more than a socket's buffers hold (4 MiB at most here).
    let big = format!("{} ", "0123456789abcdef".repeat(1024));
    json!({"rules": [
        {"match": "slow", "pace": 150, "steps": [
            {"reasoning": "Thinking about it for a little while.", "text": SLOW_TEXT,
             "toolCalls": [{"id": "c1", "name": "lookup", "input": {"q": "x"}, "result": "found", "durationMs": 3}]},
            {"text": "And that is the end of the slow reply."}
        ]},
        {"match": "stall", "pace": 0, "steps": [{"text": "partial text before the stall", "stallMs": 600000}]},
        {"match": "steer", "pace": 0, "steps": [{"text": "first step", "stallMs": 1000}, {"text": "second step"}]},
        {"match": "burst", "pace": 0, "steps": [{"text": "w ", "repeat": 300}]},
        {"match": "big", "pace": 400, "steps": [{"text": big, "repeat": 300}]},
        {"match": "huge", "pace": 0, "steps": [{"text": "tok ", "repeat": 60000}]},
        {"match": "stamped", "pace": 0, "steps": [{"text": "a b ", "repeat": 3, "stamp": true}]}
    ]})
}

async fn server_with(dir: &std::path::Path, tweak: impl FnOnce(&mut dispatch_gateway::Config)) -> TestServer {
    let mut config = test_config(dir);
    config.scripted_script = Some(write_script(dir, script()));
    tweak(&mut config);
    TestServer::start(config).await
}

async fn start_turn(server: &TestServer, conversation_id: &str, message: &str) -> String {
    let (status, body) =
        server.post(&format!("/conversations/{conversation_id}/messages"), json!({"message": message})).await;
    assert_eq!(status, 202, "{body}");
    body["turnId"].as_str().unwrap().to_owned()
}

fn sse_events(messages: &[SseMessage]) -> Vec<Value> {
    messages.iter().filter(|m| m.event.is_none()).map(SseMessage::json).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stamped_deltas_carry_their_send_time_and_index_for_latency_and_order_checks() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with(dir.path(), |_| {}).await;
    let mut watcher = server.sse("conv-stamped", "?until=sealed").await;
    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64;
    start_turn(&server, "conv-stamped", "stamped please").await;
    let events = sse_events(&watcher.until_sealed().await);
    let after = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64;
    let deltas: Vec<&str> =
        events.iter().filter(|e| e["type"] == "text-delta").map(|e| e["delta"].as_str().unwrap()).collect();
    assert_eq!(deltas.len(), 6, "{deltas:?}");
    for (i, delta) in deltas.iter().enumerate() {
        let mut parts = delta.splitn(3, ':');
        let micros: u64 = parts.next().unwrap().parse().unwrap();
        assert!((before..=after).contains(&micros), "{delta}");
        assert_eq!(parts.next().unwrap(), i.to_string(), "{delta}");
        assert_eq!(parts.next().unwrap(), ["a ", "b "][i % 2]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_joining_mid_turn_gets_exactly_the_events_of_one_there_from_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with(dir.path(), |_| {}).await;
    let mut early = server.sse("conv-join", "?until=sealed").await;
    let turn_id = start_turn(&server, "conv-join", "slow please").await;

    let mut early_messages = Vec::new();
    for _ in 0..10 {
        early_messages.push(early.next().await.unwrap());
    }
    // Join in the middle, over every transport.
    let late_sse = server.sse("conv-join", "?until=sealed").await;
    let late_ndjson = server.ndjson("conv-join", "?until=sealed").await;
    let mut ws = server.ws().await;
    assert_eq!(ws.next().await.unwrap(), json!({"type": "catalog", "catalog": []}));
    ws.send(json!({"type": "chat.subscribe", "conversationId": "conv-join"})).await;

    let late_sse = tokio::spawn(async move {
        let mut s = late_sse;
        s.until_sealed().await
    });
    let late_ndjson = tokio::spawn(late_ndjson.collect());
    early_messages.extend(early.until_sealed().await);
    let reference = sse_events(&early_messages);
    let (ws_events, _) = ws.deltas_until_sealed("conv-join").await;

    assert_eq!(reference[0]["type"], "user-message");
    assert_eq!(reference.last().unwrap()["type"], "turn-sealed");
    assert!(reference.len() > 60, "a long turn: {}", reference.len());
    // Every SSE id is <turnId>:<n>, n counting from 0 without gaps.
    for (n, m) in early_messages.iter().enumerate() {
        assert_eq!(m.id.as_deref(), Some(format!("{turn_id}:{n}").as_str()));
    }
    let late_sse = late_sse.await.unwrap();
    assert_eq!(sse_events(&late_sse), reference, "late SSE watcher");
    assert_eq!(
        late_sse.iter().map(|m| m.id.clone()).collect::<Vec<_>>(),
        early_messages.iter().map(|m| m.id.clone()).collect::<Vec<_>>()
    );
    assert_eq!(late_ndjson.await.unwrap(), reference, "late NDJSON watcher");
    assert_eq!(ws_events, reference, "late WebSocket watcher");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnecting_with_the_last_id_loses_and_duplicates_nothing_and_a_stale_cursor_gets_resync() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with(dir.path(), |_| {}).await;
    let mut reference = server.sse("conv-resume", "?until=sealed").await;
    let mut first = server.sse("conv-resume", "?until=sealed").await;
    let turn_id = start_turn(&server, "conv-resume", "slow please").await;

    let mut got = Vec::new();
    for _ in 0..15 {
        got.push(first.next().await.unwrap());
    }
    drop(first);
    let last_id = got.last().unwrap().id.clone().unwrap();
    assert_eq!(last_id, format!("{turn_id}:14"));
    let r = server.events("conv-resume", "?until=sealed", &[("last-event-id", &last_id)]).await;
    let mut second = SseStream::new(r);
    got.extend(second.until_sealed().await);
    let reference = reference.until_sealed().await;
    assert!(got.iter().all(|m| m.event.is_none()), "no resync while the turn is in flight");
    assert_eq!(got, reference);

    // The turn has sealed: its cursor cannot be resumed, so the watcher is told to refetch.
    let latest = server.history("conv-resume").await.last().unwrap()["seq"].as_u64().unwrap();
    let mut stale = server.sse("conv-resume", &format!("?lastEventId={turn_id}:3")).await;
    let resync = stale.next().await.unwrap();
    assert_eq!(resync.event.as_deref(), Some("resync"));
    assert_eq!(resync.json(), json!({"conversationId": "conv-resume", "latestSeq": latest}));
    // ... and then goes on live: the next turn arrives on the same stream from its start.
    let next_turn = start_turn(&server, "conv-resume", "burst").await;
    let first_of_next = stale.next().await.unwrap();
    assert_eq!(first_of_next.id, Some(format!("{next_turn}:0")));
    assert_eq!(first_of_next.json()["type"], "user-message");

    for bad in ["nonsense", "turn:x", ":3"] {
        let r = server
            .client
            .get(server.url("/conversations/conv-resume/events"))
            .header("last-event-id", bad)
            .send()
            .await
            .unwrap();
        let (status, body) = read_json(r).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body["error"].as_str().unwrap().contains("Last-Event-ID"));
    }
    for bad in ["?format=xml", "?until=done"] {
        let (status, _) = server.get(&format!("/conversations/conv-resume/events{bad}")).await;
        assert_eq!(status, 400, "{bad}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_watchers_all_get_every_event_in_order_beside_one_that_never_reads() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with(dir.path(), |_| {}).await;

    // One connection that asks for the stream and never reads a byte of it.
    let mut stalled = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    stalled
        .write_all(b"GET /conversations/fan/events HTTP/1.1\r\nhost: localhost\r\naccept: text/event-stream\r\n\r\n")
        .await
        .unwrap();

    let mut watchers = Vec::new();
    for _ in 0..1000 {
        let r = server.events("fan", "?until=sealed", &[]).await;
        watchers.push(tokio::spawn(async move { SseStream::new(r).until_sealed().await }));
    }
    let turn_id = start_turn(&server, "fan", "burst").await;
    let mut reference: Option<Vec<SseMessage>> = None;
    for w in watchers {
        let got = w.await.unwrap();
        for (n, m) in got.iter().enumerate() {
            assert_eq!(m.id.as_deref(), Some(format!("{turn_id}:{n}").as_str()));
        }
        match &reference {
            None => reference = Some(got),
            Some(r) => assert_eq!(&got, r),
        }
    }
    let reference = reference.unwrap();
    // user-message, turn-start, 300 deltas, usage, step-complete, done, turn-sealed.
    assert_eq!(reference.len(), 306);
    assert_eq!(reference[304].json()["reason"], "stop");
    // Rounds this large are shared out among the workers; they wrote for the parked watchers.
    assert!(metric(&server.metrics().await, "dispatch_round_writes_total") > 1000.0);
    drop(stalled);
}

/// The body of a chunked response read to its last chunk, de-chunked.
async fn read_chunked_body(stream: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut raw = Vec::new();
    while !raw.ends_with(b"\r\n0\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(30), stream.read_buf(&mut raw)).await.unwrap().unwrap();
        assert!(n > 0, "the stream ended before its last chunk");
    }
    let text = String::from_utf8(raw).unwrap();
    let (head, mut rest) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 ") && head.contains("transfer-encoding: chunked"), "{head}");
    let mut body = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n").unwrap();
        let size = usize::from_str_radix(size, 16).unwrap();
        if size == 0 {
            return body;
        }
        body.push_str(&after[..size]);
        assert_eq!(&after[size..size + 2], "\r\n");
        rest = &after[size + 2..];
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_that_read_late_get_every_byte_in_order_while_rounds_write_for_the_others() {
    let dir = tempfile::tempdir().unwrap();
    // A window of as many sweeps as there are, up to 4 ms: the rounds are paced and the
    // watchers park.
    let server = server_with(dir.path(), |c| {
        c.turn_buffer_bytes = 256 << 20;
        c.flush_sweeps = u32::MAX;
        c.flush_max_ms = 4;
    })
    .await;
    let path = "/conversations/late/events?until=sealed";
    let mut late_sse = raw_get(&server, path, "text/event-stream").await;
    let mut late_ndjson = raw_get(&server, path, "application/x-ndjson").await;
    let mut sse = server.sse("late", "?until=sealed").await;
    let mut ndjson = server.ndjson("late", "?until=sealed").await;
    let prompt = tokio::spawn(async move {
        let messages = sse.until_sealed().await;
        let mut events = Vec::new();
        while let Some(event) = ndjson.next_event().await {
            events.push(event);
        }
        (messages, events)
    });
    start_turn(&server, "late", "big").await;
    // The late readers' sockets fill while the turn streams; then they read it all.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let late_sse = read_chunked_body(&mut late_sse).await;
    let late_ndjson = read_chunked_body(&mut late_ndjson).await;
    let (messages, events) = prompt.await.unwrap();
    assert_eq!(messages.len(), 306);
    let expected: String =
        messages.iter().map(|m| format!("id: {}\ndata: {}\n\n", m.id.as_deref().unwrap(), m.data)).collect();
    assert!(
        late_sse == expected,
        "the late SSE watcher's body differs ({} vs {} bytes)",
        late_sse.len(),
        expected.len()
    );
    let late_events: Vec<Value> = late_ndjson.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(late_events.len(), 306);
    assert!(late_events == events, "the late NDJSON watcher's events differ");
    // The prompt watchers were written to by the turn's rounds, and the late ones' sockets
    // took only part of some writes (their tasks wrote the rest).
    let metrics = server.metrics().await;
    assert!(metric(&metrics, "dispatch_round_writes_total") > 300.0);
    assert!(metric(&metrics, "dispatch_round_short_writes_total") > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_with_one_subscription_is_written_by_the_rounds_and_misses_nothing() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let dir = tempfile::tempdir().unwrap();
    // A 2 ms window (as many sweeps as there are, up to that): deltas are paced, so the socket
    // with one subscription parks; the one with two is written by its session.
    let server = server_with(dir.path(), |c| {
        c.flush_sweeps = u32::MAX;
        c.flush_max_ms = 2;
    })
    .await;
    let mut parked = server.ws().await;
    let mut reference = server.ws().await;
    parked.next().await.unwrap();
    reference.next().await.unwrap();
    parked.send(json!({"type": "chat.subscribe", "conversationId": "wsp"})).await;
    reference.send(json!({"type": "chat.subscribe", "conversationId": "elsewhere"})).await;
    reference.send(json!({"type": "chat.subscribe", "conversationId": "wsp"})).await;
    let before = metric(&server.metrics().await, "dispatch_round_writes_total");
    start_turn(&server, "wsp", "slow").await;
    // Midway, the parked socket still answers: a ping gets its pong among the deltas.
    let mut first = Vec::new();
    while first.len() < 20 {
        let m = parked.next().await.unwrap();
        if m["type"] == "chat.delta" {
            first.push(m["event"].clone());
        }
    }
    parked.socket.send(Message::Ping(b"still there".to_vec().into())).await.unwrap();
    let mut rest = Vec::new();
    let mut ponged = false;
    while let Some(Ok(m)) = parked.socket.next().await {
        match m {
            Message::Pong(p) => ponged = &p[..] == b"still there",
            Message::Text(t) => {
                let m: Value = serde_json::from_str(t.as_str()).unwrap();
                if m["type"] == "chat.delta" {
                    rest.push(m["event"].clone());
                    if m["event"]["type"] == "turn-sealed" {
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    assert!(ponged, "no pong while parked");
    first.extend(rest);
    let (expected, _) = reference.deltas_until_sealed("wsp").await;
    assert_eq!(types(&expected)[..2], ["user-message", "turn-start"]);
    assert!(first == expected, "the parked socket's events differ: {:?}", types(&first));
    let writes = metric(&server.metrics().await, "dispatch_round_writes_total") - before;
    assert!(writes > 20.0, "the rounds wrote to the parked socket {writes} times");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_watcher_gets_keep_alives_and_the_end_of_the_turn_at_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    // One watcher opens a 1 ms window (as many sweeps as there are, up to that): deltas are
    // paced, so the idle watcher parks.
    let server = server_with(dir.path(), |c| {
        c.keepalive_secs = 1;
        c.flush_sweeps = u32::MAX;
        c.flush_max_ms = 1;
    })
    .await;
    let mut watcher = server.sse("parked", "").await;
    start_turn(&server, "parked", "stall").await;
    while watcher.next().await.expect("the turn's events").json()["type"] != "text-delta" {}
    let reading = tokio::spawn(async move {
        let rest = watcher.until_sealed().await;
        (sse_events(&rest), watcher.comments)
    });
    // The turn stalls: two keep-alive periods of silence.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    server.stop().await;
    let (rest, comments) = reading.await.unwrap();
    assert!(comments >= 1, "no keep-alive while parked");
    // The rest of the text, then the turn's end, in order.
    assert!(types(&rest).ends_with(&["step-complete", "done", "turn-sealed"]), "{:?}", types(&rest));
    assert_eq!(rest[rest.len() - 2]["reason"], "aborted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replay_buffer_stays_within_its_cap_and_late_joiners_still_rebuild_the_text() {
    let dir = tempfile::tempdir().unwrap();
    let cap = 512 * 1024;
    let server = server_with(dir.path(), |c| c.turn_buffer_bytes = cap).await;
    let hub = server.state.hub.clone();
    let sampler = tokio::spawn(async move {
        let (mut max_bytes, mut max_published, mut max_gauge) = (0, 0, 0);
        for _ in 0..20_000 {
            if let Some(b) = hub.current("huge").await {
                // The hub-wide gauge counts this buffer (the only one) as it grows and coalesces.
                max_gauge = max_gauge.max(hub.buffered_bytes());
                max_bytes = max_bytes.max(b.bytes()).max(max_gauge);
                max_published = max_published.max(b.published());
            } else if max_published > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        (max_bytes, max_published, max_gauge)
    });
    let mut watcher = server.sse("huge", "?until=sealed").await;
    start_turn(&server, "huge", "huge").await;
    let messages = watcher.until_sealed().await;
    // A watcher whose position was coalesced away gets `resync` and the turn again from its
    // start: the text after the last resync is exact.
    let from = messages.iter().rposition(|m| m.event.as_deref() == Some("resync")).map_or(0, |i| i + 1);
    let text: String = sse_events(&messages[from..])
        .iter()
        .filter(|e| e["type"] == "text-delta")
        .map(|e| e["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, "tok ".repeat(60_000));
    let (max_bytes, max_published, max_gauge) = sampler.await.unwrap();
    assert!(max_gauge > cap / 4, "the gauge counted the buffer: {max_gauge}");
    assert!(max_published > 60_000, "sampled the turn: {max_published}");
    // Uncoalesced, 60,000 framed deltas would hold tens of MiB.
    assert!(max_bytes <= 2 * cap, "buffer peaked at {max_bytes} bytes, cap {cap}");

    // The log holds the whole text too.
    let history = server.history("huge").await;
    assert_eq!(history[1]["chunk"]["text"], "tok ".repeat(60_000));

    // Sealed and no longer read: the buffer is gone, and /metrics says so.
    drop(watcher);
    let metrics = || server.metrics();
    let released = eventually(100, || async { metrics().await.contains("\ndispatch_hub_buffer_bytes 0\n") }).await;
    let text = metrics().await;
    assert!(released, "{text}");
    assert!(text.contains("# TYPE dispatch_hub_buffer_bytes gauge"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_whose_socket_does_not_drain_is_closed_and_does_not_hold_the_turn() {
    let dir = tempfile::tempdir().unwrap();
    // A cap large enough that nothing is coalesced: the healthy NDJSON watcher reads it all.
    let server = server_with(dir.path(), |c| {
        c.drain_timeout_secs = 1;
        c.turn_buffer_bytes = 256 << 20;
    })
    .await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(server.addr).await.unwrap();
    stalled.write_all(b"GET /conversations/drain/events HTTP/1.1\r\nhost: localhost\r\n\r\n").await.unwrap();
    let mut healthy = server.ndjson("drain", "?until=sealed").await;
    let sse_open = "dispatch_open_streams{transport=\"sse\"}";
    let open = eventually(100, || async { server.metrics().await.contains(&format!("{sse_open} 1")) }).await;
    assert!(open, "the stalled watcher's stream is open");

    start_turn(&server, "drain", "huge").await;
    let mut count = 0;
    while let Some(event) = healthy.next_event().await {
        count += 1;
        if event["type"] == "turn-sealed" {
            break;
        }
    }
    assert_eq!(count, 60_006);
    // The server gives up on the stalled socket: its stream is gone (the healthy one ended at
    // `turn-sealed`) ...
    let gone = eventually(600, || async { server.metrics().await.contains(&format!("{sse_open} 0")) }).await;
    assert!(gone, "the stalled stream is still open:\n{}", server.metrics().await);
    // ... and reading its socket now reaches the end. With the 4 KiB window it was opened with,
    // the megabytes the server's kernel still holds for it would trickle in; a wide one takes
    // them at once.
    use std::os::fd::AsRawFd;
    let wide: libc::c_int = 4 << 20;
    // SAFETY: a plain setsockopt on a socket this test owns.
    let set = unsafe {
        libc::setsockopt(
            stalled.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            std::ptr::from_ref(&wide).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(set, 0);
    assert!(closed_by_peer(&mut stalled, Duration::from_secs(60)).await, "the stalled connection was not closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_mid_turn_ends_aborted_and_sealed_on_every_transport_and_keeps_the_partial_text() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with(dir.path(), |_| {}).await;
    let mut sse = server.sse("conv-stop", "?until=sealed").await;
    let ndjson = server.ndjson("conv-stop", "?until=sealed").await;
    let mut ws = server.ws().await;
    ws.next().await.unwrap();
    ws.send(json!({"type": "chat.send", "conversationId": "conv-stop", "message": "stall now"})).await;

    // Wait for the text to stream, then stop. The runtime stalls for ten minutes: the turn
    // can only end if stopping cancels it.
    let mut seen = Vec::new();
    loop {
        let m = sse.next().await.unwrap();
        let done_streaming = m.json()["delta"] == "stall";
        seen.push(m);
        if done_streaming {
            break;
        }
    }
    assert_eq!(server.get("/conversations/conv-stop/status").await.1["isActive"], true);
    let (status, body) = server.post("/conversations/conv-stop/stop", json!({})).await;
    assert_eq!((status, body), (200, json!({"conversationId": "conv-stop", "abortedTurn": true})));

    seen.extend(sse.until_sealed().await);
    let sse_events = sse_events(&seen);
    let ndjson_events = ndjson.collect().await;
    let (ws_events, _) = ws.deltas_until_sealed("conv-stop").await;
    for events in [&sse_events, &ndjson_events, &ws_events] {
        let n = events.len();
        assert_eq!(events[n - 2]["type"], "done");
        assert_eq!(events[n - 2]["reason"], "aborted");
        assert_eq!(events[n - 1]["type"], "turn-sealed");
        assert_eq!(events[n - 3]["type"], "step-complete", "the aborted step still completes");
    }
    assert_eq!(sse_events, ndjson_events);
    assert_eq!(sse_events, ws_events);

    let history = server.history("conv-stop").await;
    assert_eq!(history[1]["chunk"], json!({"type": "text", "text": "partial text before the stall"}));
    let (_, metrics) = server.get("/conversations/conv-stop/metrics").await;
    assert_eq!(metrics["turns"][0]["steps"].as_array().unwrap().len(), 1);
    let (_, status) = server.get("/conversations/conv-stop/status").await;
    assert_eq!(status, json!({"conversationId": "conv-stop", "isActive": false, "status": "idle"}));
    let (_, again) = server.post("/conversations/conv-stop/stop", json!({})).await;
    assert_eq!(again["abortedTurn"], false);
    let (_, unknown) = server.post("/conversations/never/stop", json!({})).await;
    assert_eq!(unknown, json!({"conversationId": "never", "abortedTurn": false}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steering_message_reaches_the_runtime_at_the_next_step_and_is_logged() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with(dir.path(), |_| {}).await;
    let mut watcher = server.ndjson("conv-steer", "?until=sealed").await;
    start_turn(&server, "conv-steer", "steer me").await;
    // Queue while step 0 stalls.
    loop {
        if watcher.next_event().await.unwrap()["type"] == "text-delta" {
            break;
        }
    }
    let (status, body) = server.post("/conversations/conv-steer/queue", json!({"text": "use metric units"})).await;
    assert_eq!(status, 200);
    assert_eq!(body["startedTurn"], false);
    assert_eq!(body["queue"][0]["text"], "use metric units");
    let rest = watcher.collect().await;
    let step1_text: String = rest
        .iter()
        .skip_while(|e| e["type"] != "step-complete")
        .filter(|e| e["type"] == "text-delta")
        .map(|e| e["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(step1_text, "Noted: use metric units. second step");

    let history = server.history("conv-steer").await;
    let summary: Vec<(String, String)> = history
        .iter()
        .map(|c| (c["role"].as_str().unwrap().to_owned(), c["chunk"]["text"].as_str().unwrap_or("").to_owned()))
        .collect();
    assert_eq!(
        summary,
        vec![
            ("user".into(), "steer me".into()),
            ("assistant".into(), "first step".into()),
            ("user".into(), "use metric units".into()),
            ("assistant".into(), "Noted: use metric units. second step".into()),
        ]
    );

    // With no turn running, queueing starts one.
    let (status, body) = server.post("/conversations/conv-steer/queue", json!({"text": "burst"})).await;
    assert_eq!((status, body["startedTurn"].clone(), body["queue"].clone()), (200, json!(true), json!([])));
    let (status, body) = server.post("/conversations/conv-steer/queue", json!({"text": "  "})).await;
    assert_eq!(status, 400, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_idempotency_key_starts_one_turn_even_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with(dir.path(), |_| {}).await;
    let send = |server: &TestServer, key: &str, message: &str| {
        server
            .client
            .post(server.url("/conversations/conv-idem/messages"))
            .header("idempotency-key", key)
            .json(&json!({"message": message}))
            .send()
    };
    let first = send(&server, "key-1", "burst").await.unwrap();
    let (status, first) = read_json(first).await;
    assert_eq!(status, 202);
    let (status, again) = read_json(send(&server, "key-1", "burst").await.unwrap()).await;
    assert_eq!((status, &again), (200, &first));
    let (status, other) = read_json(send(&server, "key-1", "different").await.unwrap()).await;
    assert_eq!(status, 409, "{other}");

    let (status, _) = server.get("/conversations/conv-idem/last?timeoutMs=30000").await;
    assert_eq!(status, 200);
    let server = server.restart().await;
    let (status, after) = read_json(send(&server, "key-1", "burst").await.unwrap()).await;
    assert_eq!((status, &after), (200, &first));
    let (_, metrics) = server.get("/conversations/conv-idem/metrics").await;
    assert_eq!(metrics["turns"].as_array().unwrap().len(), 1);
    assert_eq!(metrics["turns"][0]["turnId"], first["turnId"]);
    let users = server.history("conv-idem").await.iter().filter(|c| c["role"] == "user").count();
    assert_eq!(users, 1);

    let (status, _) = read_json(send(&server, "key-2", "burst").await.unwrap()).await;
    assert_eq!(status, 202, "a new key starts a new turn");
    for bad in ["", "has space", &"k".repeat(256)] {
        let (status, _) = read_json(send(&server, bad, "burst").await.unwrap()).await;
        assert_eq!(status, 400, "{bad:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flush_flags_set_the_window_and_only_a_burst_under_a_closed_one_keeps_watchers_off_the_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        dir.path(),
        json!({"rules": [
            {"match": "slow", "pace": 200, "steps": [{"text": "word ".repeat(60)}]},
            {"match": "fast", "pace": 0, "steps": [{"text": "word ".repeat(600)}]},
        ]}),
    );
    // Two watchers: as many sweeps as there are, up to 2 ms, is a 2 ms window, open; no sweeps,
    // or a longest window of 0 ms, closes it. Deltas 5 ms apart reach parked watchers through
    // the rounds either way (one round per delta under a closed window); a burst under a closed
    // window goes to the watchers' tasks (a round per delta would be a write per delta: 1,200;
    // a stall of the machine between the first deltas may look spaced for a few).
    let runs: [(&[&str], &str); 4] = [
        (&["--flush-sweeps", "4294967295", "--flush-max-ms", "2"], "slow"),
        (&["--flush-sweeps", "0"], "slow"),
        (&["--flush-sweeps", "4294967295", "--flush-max-ms", "0"], "slow"),
        (&["--flush-sweeps", "0"], "fast"),
    ];
    let (mut writes, mut windows) = (Vec::new(), Vec::new());
    for (i, (flags, message)) in runs.into_iter().enumerate() {
        let mut args: Vec<std::ffi::OsString> = vec![
            "--database".into(),
            dir.path().join(format!("flush{i}.db")).into(),
            "--scripted-script".into(),
            script.clone().into(),
        ];
        args.extend(flags.iter().map(Into::into));
        let gateway = ChildGateway::spawn(&args);
        let base = format!("http://{}", gateway.addr);
        let client = reqwest::Client::new();
        let mut watchers = Vec::new();
        for _ in 0..2 {
            let r = client.get(format!("{base}/conversations/f/events?until=sealed")).send().await.unwrap();
            watchers.push(SseStream::new(r));
        }
        let r = client.post(format!("{base}/conversations/f/messages")).json(&json!({"message": message})).send().await;
        assert_eq!(r.unwrap().status(), 202);
        let mut deltas = [0, 0];
        for (watcher, deltas) in watchers.iter_mut().zip(&mut deltas) {
            while *deltas == 0 {
                *deltas += usize::from(watcher.next().await.unwrap().json()["type"] == "text-delta");
            }
        }
        // Mid-turn (60 deltas at 200 a second, for the slow ones): the window the gateway keeps now.
        let text = client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
        windows.push(metric(&text, "dispatch_flush_window_seconds"));
        for (watcher, deltas) in watchers.iter_mut().zip(&mut deltas) {
            while let Some(m) = watcher.next().await {
                *deltas += usize::from(m.json()["type"] == "text-delta");
            }
        }
        assert_eq!(deltas, if message == "slow" { [60, 60] } else { [600, 600] }, "{flags:?}");
        let text = client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
        writes.push(metric(&text, "dispatch_round_writes_total"));
        assert!(gateway.terminate().success());
    }
    assert_eq!(windows, [0.002, 0.0, 0.0, 0.0], "the window while the turn ran, as /metrics shows it");
    assert!(writes[..3].iter().all(|w| *w > 0.0), "spaced deltas: the rounds wrote to parked watchers ({writes:?})");
    assert!(writes[3] < 100.0, "a burst under a closed window: the watchers' tasks wrote it ({writes:?})");
}
