#![cfg(feature = "cluster")]
//! Three gateways on one PostgreSQL database and one NATS server (JetStream), as separate
//! processes: a turn run by one is watched from the others (one joining mid-turn) with the same
//! events and ids, steered and stopped from another, and, when its gateway is killed, sealed as
//! interrupted by another for every watcher; every gateway then reads the same history and
//! metrics. Needs both servers: `DISPATCH_TEST_POSTGRES` (see `dispatch_testkit::postgres`) and a
//! `nats-server` binary (see `dispatch_testkit::nats`); skipped without them unless
//! `DISPATCH_REQUIRE_POSTGRES=1` / `DISPATCH_REQUIRE_NATS=1`. Then gateways on a bus that asks
//! for a password and verified TLS both ways.

mod common;

use common::*;
use dispatch_testkit::nats::{nats_server, nats_server_with};
use dispatch_testkit::postgres::fresh_database;
use serde_json::{Value, json};

/// What a watcher read: each message's id and event.
fn read(messages: &[SseMessage]) -> Vec<(Option<String>, Value)> {
    messages.iter().map(|m| (m.id.clone(), m.json())).collect()
}

/// Reads `n` events off a stream (so its turn is known to be under way).
async fn skip(stream: &mut SseStream, n: usize) -> Vec<SseMessage> {
    let mut got = Vec::new();
    while got.len() < n {
        got.push(stream.next().await.expect("the turn streams"));
    }
    got
}

/// The next `conversation.statusChanged` for `conversation_id` a session hears.
async fn status_change(ws: &mut WsClient, conversation_id: &str) -> String {
    loop {
        let m = ws.next().await.expect("the session stays open");
        if m["type"] == "conversation.statusChanged" && m["conversationId"] == conversation_id {
            return m["status"].as_str().unwrap().to_owned();
        }
    }
}

async fn start_turn(gateway: &Api, conversation_id: &str, message: &str) {
    let (status, body) =
        gateway.post(&format!("/conversations/{conversation_id}/messages"), json!({"message": message})).await;
    assert_eq!(status, 202, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_is_watched_steered_and_stopped_from_any_gateway_and_a_dead_gateways_turn_is_sealed_by_another() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server() else { return };
    // A watcher that never gets its end would wait for ever: a failure, not a hang.
    let within = std::time::Duration::from_secs(180);
    tokio::time::timeout(within, scenario(&database.url, &nats.url)).await.expect("the scenario finishes");
}

async fn scenario(database: &str, bus: &str) {
    let args: Vec<std::ffi::OsString> =
        ["--database", database, "--bus", bus, "--lease-ttl-ms", "2000", "--scripted-pace", "30"]
            .into_iter()
            .map(Into::into)
            .collect();
    let mut a = ChildGateway::spawn(&args);
    let b = ChildGateway::spawn(&args);
    let c = ChildGateway::spawn(&args);

    // A turn runs on A. B watches from before it starts, over SSE and WebSocket, and C joins
    // mid-turn (so C catches up from the stream): all read the same events with the same ids
    // as A's own watcher.
    let mut on_a = a.sse("watched", "").await;
    let mut on_b = b.sse("watched", "").await;
    let mut ws_b = b.ws().await;
    ws_b.send(json!({"type": "chat.subscribe", "conversationId": "watched"})).await;
    start_turn(&a, "watched", "hello from A").await;
    let mut seen_on_a = skip(&mut on_a, 6).await;
    let mut late_on_c = c.sse("watched", "").await;
    seen_on_a.extend(on_a.until_sealed().await);
    let everything = read(&seen_on_a);
    assert_eq!(everything.last().unwrap().1["type"], "turn-sealed");
    assert!(everything.iter().any(|(_, e)| e["type"] == "text-delta"));
    assert_eq!(read(&on_b.until_sealed().await), everything, "B's watcher from the start");
    assert_eq!(read(&late_on_c.until_sealed().await), everything, "C's watcher joined mid-turn");
    let (over_ws, other) = ws_b.deltas_until_sealed("watched").await;
    assert_eq!(over_ws, everything.iter().map(|(_, e)| e.clone()).collect::<Vec<_>>(), "B's WebSocket");
    // Status changes made on A reach the sessions of B (the end's may come after the events).
    let heard: Vec<&Value> = other
        .iter()
        .filter(|m| m["type"] == "conversation.statusChanged" && m["conversationId"] == "watched")
        .map(|m| &m["status"])
        .collect();
    assert_eq!(heard.first(), Some(&&json!("active")), "B's session heard the turn start on A: {other:?}");
    if heard.len() < 2 {
        assert_eq!(status_change(&mut ws_b, "watched").await, "idle");
    } else {
        assert_eq!(heard[1], "idle");
    }

    // A resume on C from an event of a turn running on A continues right after it.
    start_turn(&a, "resumed", "again").await;
    let mut first = b.sse("resumed", "").await;
    let head = skip(&mut first, 5).await;
    let cursor = head[4].id.clone().unwrap();
    let resumed = c.events("resumed", "", &[("last-event-id", cursor.as_str())]).await;
    let rest = first.until_sealed().await;
    assert_eq!(read(&SseStream::new(resumed).until_sealed().await), read(&rest), "resumed after {cursor}");

    // A turn on A is steered through B and stopped through C.
    let mut on_b = b.sse("stopped", "").await;
    start_turn(&a, "stopped", "a long one").await;
    skip(&mut on_b, 4).await;
    let (status, queued) = b.post("/conversations/stopped/queue", json!({"text": "and then"})).await;
    assert_eq!(status, 200, "{queued}");
    assert_eq!((&queued["startedTurn"], queued["queue"].as_array().map(Vec::len)), (&json!(false), Some(1)));
    let (status, stopped) = c.post("/conversations/stopped/stop", json!({})).await;
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{stopped}");
    let end = read(&on_b.until_sealed().await);
    let done = end.iter().find(|(_, e)| e["type"] == "done").expect("the stopped turn has its done");
    assert_eq!(done.1["reason"], "aborted");
    let (_, status) = c.get("/conversations/stopped/status").await;
    assert_eq!(status["isActive"], false, "{status}");

    // `/last` through C waits for a turn running on A and answers its text, as A does.
    start_turn(&a, "lasted", "tell me").await;
    let (status, last) = c.get("/conversations/lasted/last?timeoutMs=60000").await;
    assert_eq!(status, 200, "{last}");
    assert!(last["content"].as_str().is_some_and(|t| t.contains("tell me")), "{last}");
    assert_eq!(a.get("/conversations/lasted/last").await, (200, last));

    // `/close` through B stops A's turn and closes the conversation for every gateway.
    let mut on_c = c.sse("closed", "").await;
    start_turn(&a, "closed", "a long one").await;
    skip(&mut on_c, 4).await;
    let (status, closed) = b.post("/conversations/closed/close", json!({})).await;
    assert_eq!((status, &closed["abortedTurn"]), (200, &json!(true)), "{closed}");
    let end = read(&on_c.until_sealed().await);
    assert_eq!(end.iter().find(|(_, e)| e["type"] == "done").expect("its done").1["reason"], "aborted");
    for gateway in [&a, &b, &c] {
        let (_, status) = gateway.get("/conversations/closed/status").await;
        assert_eq!((&status["isActive"], &status["status"]), (&json!(false), &json!("closed")), "{status}");
    }

    // Every gateway reads the same history and metrics.
    for id in ["watched", "resumed", "stopped", "lasted", "closed"] {
        let history = a.get(&format!("/conversations/{id}")).await;
        let metrics = a.get(&format!("/conversations/{id}/metrics")).await;
        assert_eq!(history.0, 200);
        for other in [&b, &c] {
            assert_eq!(other.get(&format!("/conversations/{id}")).await, history, "{id} on {}", other.addr);
            assert_eq!(other.get(&format!("/conversations/{id}/metrics")).await, metrics, "{id} on {}", other.addr);
        }
    }

    // A dies mid-turn. Its lease ends, another gateway marks the turn interrupted, and the
    // watchers on B and C get the turn's end from the bus.
    let mut on_b = b.sse("killed", "").await;
    let mut on_c = c.sse("killed", "").await;
    start_turn(&a, "killed", "you will not finish").await;
    let mut seen_on_b = skip(&mut on_b, 6).await;
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    seen_on_b.extend(on_b.until_sealed().await);
    let seen = read(&seen_on_b);
    let ending: Vec<&Value> = seen.iter().rev().take(3).rev().map(|(_, e)| e).collect();
    assert_eq!(
        ending.iter().map(|e| e["type"].as_str().unwrap()).collect::<Vec<_>>(),
        ["error", "done", "turn-sealed"],
        "{seen:?}"
    );
    assert_eq!(ending[0]["code"], "interrupted");
    assert_eq!(read(&on_c.until_sealed().await), seen, "C's watcher got the same end");
    // Each event's id is its index: the end is numbered on from A's last event.
    let turn_id = seen[0].1["turnId"].as_str().unwrap().to_owned();
    let ids: Vec<String> = seen.iter().map(|(id, _)| id.clone().unwrap()).collect();
    assert_eq!(ids, (0..seen.len()).map(|i| format!("{turn_id}:{i}")).collect::<Vec<_>>());
    let history = b.history("killed").await;
    let seqs: Vec<u64> = history.iter().map(|c| c["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=history.len() as u64).collect::<Vec<_>>(), "seq without gaps");
    assert_eq!(history.iter().filter(|c| c["chunk"]["code"] == "interrupted").count(), 1, "{history:?}");
    assert_eq!(c.history("killed").await, history);
    assert_eq!(c.get("/conversations/killed/metrics").await, b.get("/conversations/killed/metrics").await);
    let (_, status) = c.get("/conversations/killed/status").await;
    assert_eq!((&status["isActive"], &status["status"]), (&json!(false), &json!("idle")), "{status}");
}

/// The output of a gateway that must refuse to start with `args`.
fn refused_start(args: &[String]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .output()
        .expect("the gateway binary runs");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "started with {args:?}: {said}");
    said
}

/// A NATS server that asks for a user and password over TLS and checks its clients'
/// certificates: gateways with all three join it and watch each other's turns; a wrong
/// password, a server certificate they cannot check, or no client certificate stop a gateway
/// at start with an error that names the bus without its secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_join_a_bus_that_asks_for_a_password_and_verified_tls() {
    let Some(database) = fresh_database().await else { return };
    let file = |name: &str| format!("{}/tests/fixtures/bus-tls/{name}", env!("CARGO_MANIFEST_DIR"));
    let (ca, cert, key) = (file("ca.pem"), file("client.pem"), file("client-key.pem"));
    let server = ["--user", "gw", "--pass", "s3cret", "--tls", "--tlsverify"];
    let server_tls = ["--tlscert", &file("server.pem"), "--tlskey", &file("server-key.pem"), "--tlscacert", &ca];
    let Some(nats) = nats_server_with(&[&server[..], &server_tls[..]].concat()) else { return };
    let host = nats.url.strip_prefix("tls://").expect("a server that requires TLS");
    let bus = |password: &str| format!("tls://gw:{password}@{host}");
    let (good, wrong) = (bus("s3cret"), bus("wrong"));
    let common = ["--database", database.url.as_str(), "--bus-timeout-ms", "3000"];
    let with = |url: &str, tls: &[&str]| -> Vec<String> {
        common.iter().copied().chain(["--bus", url]).chain(tls.iter().copied()).map(str::to_owned).collect()
    };
    let all = ["--bus-ca-file", ca.as_str(), "--bus-client-cert", cert.as_str(), "--bus-client-key", key.as_str()];

    let args: Vec<std::ffi::OsString> = with(&good, &all).into_iter().map(Into::into).collect();
    let a = ChildGateway::spawn(&args);
    let b = ChildGateway::spawn(&args);
    let mut on_a = a.sse("secured", "").await;
    let mut on_b = b.sse("secured", "").await;
    start_turn(&a, "secured", "over TLS").await;
    let everything = read(&on_a.until_sealed().await);
    assert!(everything.iter().any(|(_, e)| e["type"] == "text-delta"));
    assert_eq!(read(&on_b.until_sealed().await), everything, "B watched A's turn over the bus");

    for (args, why) in [
        (with(&wrong, &all), "a wrong password"),
        (with(&good, &all[2..]), "no authority for the server's certificate"),
        (with(&good, &all[..2]), "no client certificate"),
    ] {
        let said = tokio::task::spawn_blocking(move || refused_start(&args)).await.unwrap();
        assert!(said.contains(&format!("cannot connect to NATS at tls://gw:***@{host}")), "{why}: {said}");
        assert!(!said.contains("s3cret") && !said.contains("wrong"), "{why}: the password is out: {said}");
    }
}
