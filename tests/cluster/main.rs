#![cfg(feature = "cluster")]
//! Three gateways on one PostgreSQL database and one NATS server (JetStream), as separate
//! processes: a turn run by one is watched from the others (one joining mid-turn) with the same
//! events and ids, steered and stopped from another, and, when its gateway is killed, sealed as
//! interrupted by another for every watcher; every gateway then reads the same history and
//! metrics. Needs both servers: `DISPATCH_TEST_POSTGRES` (see `dispatch_testkit::postgres`) and a
//! `nats-server` binary (see `dispatch_testkit::nats`); skipped without them unless
//! `DISPATCH_REQUIRE_POSTGRES=1` / `DISPATCH_REQUIRE_NATS=1`. Then gateways on a bus that asks
//! for a password and verified TLS both ways, and on buses that know them by NKEY and by a
//! `.creds` file, replaced on disk while they run.

#[path = "../common/mod.rs"]
mod common;
mod credentials;
mod messages;
mod outages;
mod pacing;

use common::*;
use dispatch_testkit::nats::{NatsServer, nats_server, nats_server_configured, nats_server_with};
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

    // What does not parse on the bus is skipped: after a status change, a control request and
    // a turn's stream message of garbage, the gateways still hear each other's changes and
    // answer each other's control requests.
    let raw = async_nats::connect(bus).await.expect("a client of the test's NATS server");
    let subject = |kind: &str, id: &str| {
        format!("dispatch.{kind}.{}", id.bytes().map(|b| format!("{b:02x}")).collect::<String>())
    };
    raw.publish("dispatch.status", "not a change".into()).await.unwrap();
    let reply = raw.new_inbox();
    raw.publish_with_reply(subject("control", "stopped"), reply, r#"{"not":"a request"}"#.into()).await.unwrap();
    raw.publish(subject("events.open", "stopped"), "not events".into()).await.unwrap();
    raw.flush().await.unwrap();

    // A turn on A is steered through B and stopped through C.
    let mut on_b = b.sse("stopped", "").await;
    start_turn(&a, "stopped", "a long one").await;
    assert_eq!(status_change(&mut ws_b, "stopped").await, "active", "B's session hears A's turn start");
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

/// The project's own chaos drill: three gateways on one PostgreSQL and one NATS under a stream
/// of turns, each round's turn on a random live gateway with watchers on every gateway that
/// stays up, while a random gateway is killed (and started again) or paused past its lease, or
/// nats-server restarts. Then: every watcher got its turn's end once (`done`, then
/// `turn-sealed`); a turn that ended normally reads in history as its watchers read it live;
/// each conversation's seq is gap-free; every turn is sealed once (one metrics entry).
/// Seeded (`DISPATCH_CHAOS_SEED`, else the clock), the seed printed and in every failure, and
/// bounded in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_under_a_stream_of_turns() {
    let Some(database) = fresh_database().await else { return };
    let Some(mut nats) = nats_server() else { return };
    let seed: u64 = std::env::var("DISPATCH_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("chaos seed {seed} (DISPATCH_CHAOS_SEED={seed} runs this drill again)");
    let mut state = seed;
    let mut random = move |n: usize| {
        // splitmix64: every seed, even a small one, draws evenly from the first call.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n as u64) as usize
    };
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), json!({"rules": [{"pace": 40, "steps": [{"text": "w ", "repeat": 80}]}]}));
    let args: Vec<std::ffi::OsString> = [
        "--database",
        &database.url,
        "--bus",
        &nats.url,
        "--bus-timeout-ms",
        "3000",
        "--lease-ttl-ms",
        "1000",
        "--scripted-script",
        script.to_str().unwrap(),
    ]
    .into_iter()
    .map(Into::into)
    .collect();
    let mut gateways: Vec<ChildGateway> = (0..3).map(|_| ChildGateway::spawn(&args)).collect();
    let drill = async {
        let mut conversations = Vec::new();
        for round in 0..8 {
            let chaos = match random(4) {
                0 => Chaos::Nothing,
                1 => Chaos::Kill(random(3)),
                2 => Chaos::Pause(random(3)),
                _ => Chaos::RestartBus,
            };
            let owner = match chaos {
                // The killed gateway is the turn's own half the time.
                Chaos::Kill(k) if random(2) == 0 => k,
                _ => random(3),
            };
            let id = format!("chaos-{round}");
            let said = format!("seed {seed}, round {round}, {chaos:?}, turn on {owner}");
            eprintln!("{said}");
            let killed = match chaos {
                Chaos::Kill(k) => Some(k),
                _ => None,
            };
            let mut watchers = Vec::new();
            for (i, gateway) in gateways.iter().enumerate().filter(|(i, _)| Some(*i) != killed) {
                watchers.push((i, Heard::start(gateway.sse(&id, "").await)));
            }
            start_turn(&gateways[owner], &id, "chaos").await;
            let started = eventually(1200, || async { watchers.iter().all(|(_, w)| w.count() > 4) }).await;
            assert!(started, "{said}: every watcher hears the turn");
            match chaos {
                Chaos::Nothing => {}
                Chaos::Kill(k) => {
                    let _ = gateways[k].child.kill();
                    let _ = gateways[k].child.wait();
                }
                Chaos::Pause(p) => {
                    // SAFETY: kill(2) with a child's pid and a stop/continue signal.
                    unsafe { libc::kill(gateways[p].child.id() as i32, libc::SIGSTOP) };
                    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
                    unsafe { libc::kill(gateways[p].child.id() as i32, libc::SIGCONT) };
                }
                Chaos::RestartBus => nats.restart(),
            }
            let mut heard = Vec::new();
            for (i, watcher) in watchers {
                heard.push((i, watcher.end().await));
            }
            if let Some(k) = killed {
                gateways[k] = ChildGateway::spawn(&args);
            }
            conversations.push((id, said, heard));
        }
        conversations
    };
    let conversations = tokio::time::timeout(std::time::Duration::from_secs(600), drill)
        .await
        .unwrap_or_else(|_| panic!("seed {seed}: the drill did not finish in time"));

    let reader = &gateways[0];
    for (id, said, heard) in conversations {
        let history = reader.history(&id).await;
        let seqs: Vec<u64> = history.iter().map(|c| c["seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>(), "{said}: seq gap-free");
        // A turn cut off (its gateway killed, or paused past its lease) is marked interrupted
        // once; any other is sealed once, with its metrics.
        let (_, metrics) = reader.get(&format!("/conversations/{id}/metrics")).await;
        let markers = history.iter().filter(|c| c["chunk"]["code"] == "interrupted").count();
        let cut = heard.iter().flat_map(|(_, events)| events).any(|(_, e)| e["code"] == "interrupted");
        if cut {
            assert_eq!(markers, 1, "{said}: one interrupted marker in the history");
        } else {
            assert_eq!(markers, 0, "{said}");
            assert_eq!(metrics["turns"].as_array().map(Vec::len), Some(1), "{said}: the turn sealed once: {metrics}");
        }
        let logged: String = history
            .iter()
            .filter(|c| c["role"] == "assistant" && c["chunk"]["type"] == "text")
            .map(|c| c["chunk"]["text"].as_str().unwrap())
            .collect();
        for (gateway, events) in heard {
            let kinds: Vec<&str> = events.iter().map(|(_, e)| e["type"].as_str().unwrap()).collect();
            assert_eq!(
                kinds.iter().filter(|k| **k == "turn-sealed").count(),
                1,
                "{said}: watcher on {gateway}: {kinds:?}"
            );
            assert_eq!(kinds.last(), Some(&"turn-sealed"), "{said}: watcher on {gateway}");
            let done = events.iter().find(|(_, e)| e["type"] == "done");
            let done = done.unwrap_or_else(|| panic!("{said}: watcher on {gateway} got no done: {kinds:?}"));
            if done.1["reason"] == "stop" {
                let text: String = events
                    .iter()
                    .filter_map(|(_, e)| e["delta"].as_str().filter(|_| e["type"] == "text-delta"))
                    .collect();
                assert_eq!(text, logged, "{said}: watcher on {gateway} read the history's text live");
            }
        }
    }
}

/// Two gateways on `database` and `bus` whose scripted runtime plays `script`, with `extra` flags.
fn scripted_pair(database: &str, bus: &str, script: &std::path::Path, extra: &[&str]) -> (ChildGateway, ChildGateway) {
    let script = script.to_str().unwrap();
    let args = ["--database", database, "--bus", bus, "--bus-timeout-ms", "3000", "--scripted-script", script];
    let args: Vec<std::ffi::OsString> = args.iter().chain(extra).map(Into::into).collect();
    (ChildGateway::spawn(&args), ChildGateway::spawn(&args))
}

/// What a watcher heard of a turn so far, read in the background until `turn-sealed`.
struct Heard {
    read: std::sync::Arc<std::sync::Mutex<Vec<SseMessage>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Heard {
    fn start(mut stream: SseStream) -> Heard {
        let read = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let into = read.clone();
        let task = tokio::spawn(async move {
            while let Some(m) = stream.next().await {
                let sealed = m.event.is_none() && m.json()["type"] == "turn-sealed";
                into.lock().unwrap().push(m);
                if sealed {
                    break;
                }
            }
        });
        Heard { read, task }
    }

    fn count(&self) -> usize {
        self.read.lock().unwrap().len()
    }

    /// What was heard so far.
    fn events(&self) -> Vec<(Option<String>, Value)> {
        read(&self.read.lock().unwrap())
    }

    /// Everything heard, once the turn ended (within a minute).
    async fn end(self) -> Vec<(Option<String>, Value)> {
        tokio::time::timeout(std::time::Duration::from_secs(60), self.task).await.expect("the turn ends").unwrap();
        read(&self.read.lock().unwrap())
    }
}

/// How many times `gateway` has logged `message`.
fn logged(gateway: &ChildGateway, message: &str) -> usize {
    let logs = gateway.logs.lock().unwrap();
    logs.iter().filter(|l| l["fields"]["message"] == message).count()
}

/// A script of words at a steady pace, for longer than a test waits (it stops the turn).
fn steady() -> Value {
    json!({"rules": [{"pace": 50, "steps": [{"text": "word ", "repeat": 100_000}]}]})
}

/// Stops the NATS server, and waits until each of `gateways` says it is off the bus.
async fn stop_the_bus(nats: &mut NatsServer, gateways: &[&ChildGateway]) {
    nats.stop();
    for gateway in gateways {
        assert!(eventually(1200, || async { on_bus(gateway, 0.0).await }).await, "a gateway says it is off the bus");
    }
}

/// A turn started on `a`, watched on `b` over the bus: both read the same events.
async fn watched_across(a: &ChildGateway, b: &ChildGateway, conversation: &str) {
    let mut on_a = a.sse(conversation, "").await;
    let mut on_b = b.sse(conversation, "").await;
    start_turn(a, conversation, "signed in").await;
    let everything = read(&on_a.until_sealed().await);
    assert!(everything.iter().any(|(_, e)| e["type"] == "text-delta"));
    assert_eq!(read(&on_b.until_sealed().await), everything, "B watched A's turn over the bus");
}

/// What a chaos round does to the cluster while its turn streams.
#[derive(Debug, Clone, Copy)]
enum Chaos {
    Nothing,
    /// SIGKILL a gateway (maybe the turn's own), started again after the round.
    Kill(usize),
    /// SIGSTOP a gateway for two and a half leases, then SIGCONT.
    Pause(usize),
    /// Restart nats-server (with its data).
    RestartBus,
}

/// Whether `gateway`'s `/metrics` says it is on the bus (1) or off it (0).
async fn on_bus(gateway: &Api, connected: f64) -> bool {
    metric(&gateway.metrics().await, "dispatch_bus_connected") == connected
}
