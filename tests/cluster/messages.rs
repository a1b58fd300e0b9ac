//! What crosses the bus and what it refuses: events past a message's size, retention, a
//! process that missed a turn, forged messages, a stall, control through an outage, paused turns.

use super::*;

/// The parts of a large event follow the server's own `max_payload` (8 KiB here): a 10 KB
/// event crosses in two and is heard whole on another gateway while its turn runs on, and no
/// turn is cut. (Before parts, such an event left a gap the bus could not fill.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_past_the_servers_max_payload_crosses_in_parts() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server_configured("max_payload: 8192") else { return };
    let dir = tempfile::tempdir().unwrap();
    let big = "x".repeat(10_000);
    let script = json!({"rules": [{"steps": [
        {"text": "small first "},
        {"text": format!("{big} after"), "stallMs": 120_000},
    ]}]});
    let (a, b) = scripted_pair(&database.url, &nats.url, &write_script(dir.path(), script), &[]);
    let on_b = Heard::start(b.sse("too-big", "").await);
    start_turn(&a, "too-big", "anything").await;
    let whole = || on_b.events().iter().any(|(_, e)| e["delta"].as_str().is_some_and(|d| d.len() >= 10_000));
    assert!(eventually(1200, || async { whole() }).await, "B heard the large event whole");
    let (_, status) = a.get("/conversations/too-big/status").await;
    assert_eq!(status["isActive"], true, "the turn still runs on A: {status}");
    assert_eq!(metric(&b.metrics().await, "dispatch_bus_turns_cut_total"), 0.0);
    let (status, stopped) = a.post("/conversations/too-big/stop", json!({})).await;
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{stopped}");
    assert_eq!(on_b.end().await.last().unwrap().1["type"], "turn-sealed");
}

/// The stream keeps the configuration it was created with, or an operator gave it: a gateway
/// started with other retention limits leaves it as it is, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_with_other_retention_limits_says_the_stream_keeps_its_own() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server() else { return };
    let gateway = |limits: &[&str]| {
        let common = ["--database", database.url.as_str(), "--bus", nats.url.as_str()];
        ChildGateway::spawn(&common.iter().chain(limits).map(Into::into).collect::<Vec<std::ffi::OsString>>())
    };
    let js =
        async_nats::jetstream::new(async_nats::connect(&nats.url).await.expect("a client of the test's NATS server"));
    let config = || async { js.get_stream("DISPATCH").await.expect("the stream").cached_info().config.clone() };
    let warned = |gateway: &ChildGateway| {
        let logs = gateway.logs.lock().unwrap();
        logs.iter()
            .any(|l| l["fields"]["message"].as_str().is_some_and(|m| m.starts_with("the bus's stream keeps its own")))
    };

    let first = gateway(&[]);
    let created = config().await;
    assert_eq!((created.max_age.as_secs(), created.max_bytes), (3600, 1 << 30), "the defaults");
    assert!(!warned(&first), "the stream has the first gateway's limits");
    assert!(first.terminate().success());

    let second = gateway(&["--bus-max-age-secs", "120", "--bus-max-bytes", "10000000"]);
    assert_eq!(config().await, created, "the stream is as it was");
    assert!(warned(&second), "the second gateway says its limits do not apply: {:?}", second.logs.lock().unwrap());
}

/// An agent program (the gateway's NDJSON protocol) that logs each start with the session it
/// resumes, begins a session of its own when it has none, and says which session it is in.
const SESSION_AGENT: &str = r#"
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
session = os.environ.get("DISPATCH_SESSION_ID")
with open(os.path.join(here, "starts.log"), "a") as f:
    f.write((session or "-") + "\n")
for line in sys.stdin:
    if json.loads(line).get("type") != "user":
        continue
    if session is None:
        session = "s-%d" % os.getpid()
        print(json.dumps({"type": "session", "id": session}), flush=True)
    print(json.dumps({"type": "text", "delta": "in " + session}), flush=True)
    print(json.dumps({"type": "done", "reason": "stop"}), flush=True)
"#;

/// A conversation whose turns move between gateways gets, on a gateway that ran an earlier
/// turn of it, a new agent process resuming the session rather than the idle one there that
/// missed the turn run elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_process_that_missed_a_turn_run_on_another_gateway_is_not_used_again() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let agent = dir.path().join("agent.py");
    std::fs::write(&agent, SESSION_AGENT).unwrap();
    let config = dir.path().join("gateway.toml");
    let credential = format!(
        "default_model = \"agent/echo\"\n[credentials.agent]\nkind = \"command\"\nprogram = \"python3\"\nargs = [\"-u\", {:?}]\nmodels = [\"echo\"]\n",
        agent.display().to_string()
    );
    std::fs::write(&config, credential).unwrap();
    let args: Vec<std::ffi::OsString> =
        ["--database", &database.url, "--bus", &nats.url, "--config", config.to_str().unwrap()]
            .into_iter()
            .map(Into::into)
            .collect();
    let (a, b) = (ChildGateway::spawn(&args), ChildGateway::spawn(&args));
    let said = |events: Vec<Value>| events.iter().find(|e| e["type"] == "text-delta").map(|e| e["delta"].clone());
    let starts = || std::fs::read_to_string(dir.path().join("starts.log")).unwrap_or_default();

    let first = said(a.chat("moving", "one").await).expect("A's agent answers");
    let session = first.as_str().unwrap().trim_start_matches("in ").to_owned();
    assert_eq!(said(b.chat("moving", "two").await), Some(json!(format!("in {session}"))), "B resumes it");
    assert_eq!(said(a.chat("moving", "three").await), Some(json!(format!("in {session}"))));
    assert_eq!(starts(), format!("-\n{session}\n{session}\n"), "A started a new process for the third turn");
    assert_eq!(said(a.chat("moving", "four").await), Some(json!(format!("in {session}"))));
    assert_eq!(starts().lines().count(), 3, "and kept it for the fourth");
}

/// Messages on the bus are taken only when signed with the cluster's key (made by the first
/// gateway, kept in the database): a plain NATS client with publish rights publishes a whole
/// turn on a conversation's subject, a status change closing it, and a control request stopping
/// a running turn, each unsigned and again signed with another key. The watchers render none of
/// it, no session hears the status, the turn runs on, and the gateways count and log what they
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_bus_messages_are_refused_and_logged() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server() else { return };
    let args: Vec<std::ffi::OsString> = ["--database", &database.url, "--bus", &nats.url, "--scripted-pace", "30"]
        .into_iter()
        .map(Into::into)
        .collect();
    let (a, b) = (ChildGateway::spawn(&args), ChildGateway::spawn(&args));
    let raw = async_nats::connect(&nats.url).await.expect("a plain client of the test's NATS server");
    let hex = |id: &str| id.bytes().map(|b| format!("{b:02x}")).collect::<String>();
    // Headers as a gateway's, with no signature or a signature of another key.
    let forged_headers = |turn: &str, signature: Option<&str>| {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Dispatch-Node", "stranger");
        headers.insert("Dispatch-Turn", turn);
        headers.insert("Dispatch-Index", "0");
        headers.insert("Dispatch-Sent", dispatch_gateway::store::now_ms().to_string().as_str());
        if let Some(signature) = signature {
            headers.insert("Dispatch-Signature", signature);
        }
        headers
    };
    let signatures = [None, Some("00".repeat(32))];

    // B watches a conversation and listens to its status; the stranger publishes a whole turn
    // and a status change closing it; then A runs a real turn there.
    let mut on_b = b.sse("forged", "").await;
    let mut ws_b = b.ws().await;
    ws_b.send(json!({"type": "chat.subscribe", "conversationId": "forged"})).await;
    for (i, signature) in signatures.iter().enumerate() {
        let turn = format!("stranger-{i}");
        let events: String = [
            json!({"type": "turn-start", "conversationId": "forged", "turnId": turn}),
            json!({"type": "text-delta", "conversationId": "forged", "turnId": turn, "delta": "FORGED"}),
            json!({"type": "done", "conversationId": "forged", "turnId": turn, "reason": "stop"}),
            json!({"type": "turn-sealed", "conversationId": "forged", "turnId": turn}),
        ]
        .iter()
        .map(|e| format!("{e}\n"))
        .collect();
        let subject = format!("dispatch.events.open.{}", hex("forged"));
        raw.publish_with_headers(subject, forged_headers(&turn, signature.as_deref()), events.into()).await.unwrap();
        let change = json!({"node": "stranger", "conversationId": "forged", "status": "closed"});
        let headers = forged_headers(&turn, signature.as_deref());
        raw.publish_with_headers("dispatch.status", headers, change.to_string().into()).await.unwrap();
    }
    raw.flush().await.unwrap();
    start_turn(&a, "forged", "the real one").await;
    let seen = read(&on_b.until_sealed().await);
    assert!(seen.iter().all(|(_, e)| e["delta"] != "FORGED"), "B rendered the stranger's turn: {seen:?}");
    assert!(seen.iter().any(|(_, e)| e["type"] == "text-delta"), "B heard the real turn: {seen:?}");
    let (_, other) = ws_b.deltas_until_sealed("forged").await;
    let heard: Vec<&Value> = other
        .iter()
        .filter(|m| m["type"] == "conversation.statusChanged" && m["conversationId"] == "forged")
        .map(|m| &m["status"])
        .collect();
    assert!(!heard.contains(&&json!("closed")), "B's session heard the forged close: {heard:?}");
    let (_, status) = b.get("/conversations/forged/status").await;
    assert_ne!(status["status"], "closed", "{status}");

    // A turn runs on A; the stranger asks every gateway to stop it.
    let mut on_a = a.sse("stopme", "").await;
    start_turn(&a, "stopme", "a long one").await;
    skip(&mut on_a, 4).await;
    for signature in &signatures {
        let request = json!({"op": "stop", "conversation_id": "stopme"});
        let headers = forged_headers("", signature.as_deref());
        let subject = format!("dispatch.control.{}", hex("stopme"));
        let answer = raw.request_with_headers(subject, headers, request.to_string().into());
        let answer = tokio::time::timeout(std::time::Duration::from_secs(3), answer).await;
        assert!(!matches!(answer, Ok(Ok(_))), "a gateway answered a forged stop");
    }
    let end = read(&on_a.until_sealed().await);
    assert_eq!(end.iter().find(|(_, e)| e["type"] == "done").expect("its done").1["reason"], "stop", "the turn ran on");

    // Both said what they refused, and count it.
    let refused = "refused a bus message: not signed with the cluster's key, stale, or not what its subject says";
    assert!(logged(&b, refused) >= 1, "B said it refused the forged turn and status");
    assert!(logged(&a, refused) >= 1, "A said it refused the forged stop");
    assert!(metric(&b.metrics().await, "dispatch_bus_rejected_total") >= 4.0);
    assert!(metric(&a.metrics().await, "dispatch_bus_rejected_total") >= 2.0);
}

/// A gateway paused for longer than two leases (SIGSTOP: a VM pause, `docker pause`, CPU
/// throttling) while another gateway's turn ends: once it runs again, its watchers of that turn
/// get the whole turn, `done` included, as the stream holds it, not a bare `turn-sealed`
/// because its quiet-turn check asked the database before it read what waited on the bus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_resumed_after_a_stall_hears_the_end_of_the_turns_that_ended_meanwhile() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server() else { return };
    let args: Vec<std::ffi::OsString> =
        ["--database", &database.url, "--bus", &nats.url, "--lease-ttl-ms", "1000", "--scripted-pace", "20"]
            .into_iter()
            .map(Into::into)
            .collect();
    let (a, b) = (ChildGateway::spawn(&args), ChildGateway::spawn(&args));
    for round in 0..3 {
        let id = format!("stalled-{round}");
        let mut on_a = a.sse(&id, "").await;
        let mut on_b = b.sse(&id, "").await;
        start_turn(&a, &id, "a long one").await;
        let mut heard_on_b = skip(&mut on_b, 4).await;
        // SAFETY: kill(2) with a child's pid and a stop/continue signal.
        unsafe { libc::kill(b.child.id() as i32, libc::SIGSTOP) };
        let on_a_all = read(&on_a.until_sealed().await);
        // Past two quiet periods (a lease each) after the end.
        tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
        unsafe { libc::kill(b.child.id() as i32, libc::SIGCONT) };
        heard_on_b.extend(on_b.until_sealed().await);
        let heard_on_b = read(&heard_on_b);
        assert_eq!(heard_on_b, on_a_all, "round {round}: B's watcher heard the whole turn");
        assert!(heard_on_b.iter().any(|(_, e)| e["type"] == "done"), "round {round}: with its done");
    }
}

/// An event larger than a NATS message (a 3 MiB tool result; the server's limit is 1 MiB) crosses
/// the bus in parts and is joined again: a watcher on another gateway reads the whole turn, the
/// result whole, as the turn's own gateway's watcher does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_larger_than_a_bus_message_crosses_whole() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let big = "x".repeat(3 * 1024 * 1024);
    let script = json!({"rules": [{"match": "big", "steps": [
        {"text": "Reading.", "toolCalls": [{"id": "call_big", "name": "read", "input": {}, "result": big}]},
        {"text": "Done."}
    ]}]});
    let script = write_script(dir.path(), script);
    let args: Vec<std::ffi::OsString> = ["--database", &database.url, "--bus", &nats.url]
        .into_iter()
        .map(Into::into)
        .chain(["--scripted-script".into(), script.into_os_string()])
        .collect();
    let (a, b) = (ChildGateway::spawn(&args), ChildGateway::spawn(&args));
    let mut on_a = a.sse("big", "").await;
    let mut on_b = b.sse("big", "").await;
    start_turn(&a, "big", "big").await;
    let on_a = read(&on_a.until_sealed().await);
    let on_b = read(&on_b.until_sealed().await);
    let result = on_b.iter().find(|(_, e)| e["type"] == "tool-result").expect("B heard the result");
    assert_eq!(result.1["content"].as_str().map(str::len), Some(big.len()), "the result whole");
    assert!(on_b.iter().any(|(_, e)| e["type"] == "done"), "and the turn's end: {:?}", on_b.len());
    assert_eq!(on_b, on_a, "B's watcher read what A's did");
}

/// Control and status through an outage of the bus: a `/stop` sent through B while NATS is down
/// waits for the bus and stops A's turn once it is back (it answered `abortedTurn: false` at
/// once), and a status change made on A while the bus was down reaches B's session once it is
/// back (it was lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_and_status_changes_wait_out_an_outage_of_the_bus() {
    let Some(database) = fresh_database().await else { return };
    let Some(mut nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), steady());
    // Leases long enough that nothing is learnt from the database meanwhile.
    let (a, b) = scripted_pair(&database.url, &nats.url, &script, &["--lease-ttl-ms", "120000"]);
    let mut ws_b = b.ws().await;
    let on_b = Heard::start(b.sse("outage-stop", "").await);
    start_turn(&a, "outage-stop", "steady").await;
    assert!(eventually(1200, || async { on_b.count() > 5 }).await, "B hears the turn");
    stop_the_bus(&mut nats, &[&a, &b]).await;

    // While the bus is down: a turn starts and is stopped on A (its status changes), and B is
    // asked to stop A's other turn.
    start_turn(&a, "offline", "steady").await;
    let (status, stopped) = a.post("/conversations/offline/stop", json!({})).await;
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{stopped}");
    let stop_through_b = {
        let api = Api::new(b.addr.clone());
        tokio::spawn(async move { api.post("/conversations/outage-stop/stop", json!({})).await })
    };
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert!(!stop_through_b.is_finished(), "the stop waits for the bus");
    nats.start();

    let (status, stopped) = stop_through_b.await.unwrap();
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "the stop reached A's turn: {stopped}");
    let everything = on_b.end().await;
    let done = everything.iter().find(|(_, e)| e["type"] == "done").expect("the stopped turn's done");
    assert_eq!(done.1["reason"], "aborted");
    // The change made on A during the outage reaches B's session (the last one: idle).
    let heard = tokio::time::timeout(std::time::Duration::from_secs(30), status_change(&mut ws_b, "offline")).await;
    assert_eq!(heard.ok().as_deref(), Some("idle"), "B's session heard the change made during the outage");
}

/// The turn's own gateway paused past its lease (SIGSTOP) while another gateway marks the turn
/// interrupted: once it runs again, its own watcher may read the rest of the step it had
/// streamed, but then an `error` (code `lease`) saying that what it streamed since its last
/// write is not in the history, before `done`; the history (read anywhere) holds the turn
/// as interrupted, and the other gateway's watcher got the interrupted end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_turns_own_watchers_are_told_what_history_will_not_hold() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), steady());
    let (a, b) = scripted_pair(&database.url, &nats.url, &script, &["--lease-ttl-ms", "1000"]);
    let on_a = Heard::start(a.sse("paused", "").await);
    let on_b = Heard::start(b.sse("paused", "").await);
    start_turn(&a, "paused", "steady").await;
    assert!(eventually(1200, || async { on_a.count() > 5 && on_b.count() > 5 }).await, "both hear the turn");
    // SAFETY: kill(2) with a child's pid and a stop/continue signal.
    unsafe { libc::kill(a.child.id() as i32, libc::SIGSTOP) };
    let heard_on_b = on_b.end().await;
    let interrupted = heard_on_b.iter().find(|(_, e)| e["type"] == "error").expect("B's watcher got the end");
    assert_eq!(interrupted.1["code"], "interrupted", "{interrupted:?}");
    unsafe { libc::kill(a.child.id() as i32, libc::SIGCONT) };
    let heard_on_a = on_a.end().await;
    let types: Vec<&str> = heard_on_a.iter().map(|(_, e)| e["type"].as_str().unwrap()).collect();
    let error = heard_on_a
        .iter()
        .position(|(_, e)| e["type"] == "error")
        .unwrap_or_else(|| panic!("A's watcher got no error: {types:?}"));
    let said = &heard_on_a[error].1;
    assert_eq!(said["code"], "lease", "{said}");
    assert!(said["message"].as_str().unwrap().contains("is not in the history"), "{said}");
    let done = heard_on_a.iter().position(|(_, e)| e["type"] == "done").expect("A's watcher got done");
    assert!(error < done, "the error comes before the turn's end: {types:?}");
    // The history holds the turn as interrupted, once.
    let (_, history) = b.get("/conversations/paused").await;
    let errors: Vec<&Value> =
        history["chunks"].as_array().unwrap().iter().filter(|c| c["chunk"]["type"] == "error").collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0]["chunk"]["code"], "interrupted");
}
