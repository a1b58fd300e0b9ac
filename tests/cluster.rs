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

mod common;

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

/// A NATS credentials file, as `nsc` writes one: the user's JWT and seed.
fn creds_file(jwt: &str, seed: &str) -> String {
    format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n"
    )
}

/// A NATS JWT (`ed25519-nkey`, as nats-io/jwt v2 encodes one): `claims` about `subject`,
/// signed by `issuer`, valid until `expires` (seconds since the epoch) when given.
fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: Value, expires: Option<u64>) -> String {
    use base64::Engine as _;
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let mut claims = json!({
        "jti": format!("{subject}{now}{expires:?}"), "iat": now, "iss": issuer.public_key(), "name": name,
        "sub": subject, "nats": nats,
    });
    if let Some(expires) = expires {
        claims["exp"] = json!(expires);
    }
    let input = format!("{}.{}", b64(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#), b64(claims.to_string().as_bytes()));
    let signature = issuer.sign(input.as_bytes()).expect("a seed signs");
    format!("{input}.{}", b64(&signature))
}

/// NATS in operator mode: the server trusts an operator, which signed an account with
/// JetStream on (and the system account JetStream needs), which signs its users' JWTs.
struct Operator {
    /// The server's configuration.
    config: String,
    account: nkeys::KeyPair,
}

impl Operator {
    fn new() -> Operator {
        let operator = nkeys::KeyPair::new_operator();
        let account = nkeys::KeyPair::new_account();
        let operator_jwt =
            nats_jwt(&operator, &operator.public_key(), "op", json!({"type": "operator", "version": 2}), None);
        let unlimited = json!({
            "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": true, "conn": -1,
            "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
        });
        let claims = json!({"limits": unlimited, "type": "account", "version": 2});
        let account_jwt = nats_jwt(&operator, &account.public_key(), "dispatch", claims, None);
        let system = nkeys::KeyPair::new_account();
        let system_jwt =
            nats_jwt(&operator, &system.public_key(), "SYS", json!({"type": "account", "version": 2}), None);
        let config = format!(
            "operator: {operator_jwt}\nsystem_account: {system}\nresolver: MEMORY\n\
             resolver_preload: {{ {system}: {system_jwt}, {account}: {account_jwt} }}\n",
            system = system.public_key(),
            account = account.public_key(),
        );
        Operator { config, account }
    }

    /// A `.creds` file for a new user of `account`, valid until `expires` when given.
    fn user_creds(account: &nkeys::KeyPair, expires: Option<u64>) -> (String, String) {
        let claims = json!({"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2});
        let user = nkeys::KeyPair::new_user();
        let seed = user.seed().unwrap();
        (creds_file(&nats_jwt(account, &user.public_key(), "gw", claims, expires), &seed), seed)
    }
}

/// A NATS configuration that knows one user, by its NKEY, with only the permissions
/// docs/cluster.md lists for a gateway.
fn listing(user: &nkeys::KeyPair) -> String {
    let permissions = r#"permissions: {
        publish: ["dispatch.>", "$JS.API.>", "_INBOX.>"],
        subscribe: ["dispatch.>", "_INBOX.>", "$JS.EVENT.ADVISORY.STREAM.CREATED.DISPATCH"]
    }"#;
    format!("authorization {{ users = [ {{ nkey: \"{}\", {permissions} }} ] }}\n", user.public_key())
}

/// Whether `gateway` was refused something its permissions do not allow.
fn violated(gateway: &ChildGateway) -> bool {
    gateway.logs.lock().unwrap().iter().any(|l| l.to_string().to_lowercase().contains("permissions violation"))
}

/// A folder of files a test writes, named by their paths.
struct Files(tempfile::TempDir);

impl Files {
    fn new() -> Files {
        Files(tempfile::tempdir().unwrap())
    }

    fn write(&self, name: &str, text: &str) -> String {
        let path = self.0.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    }
}

/// The arguments of a gateway on `database` that joins `bus` with the key file `file` (`flag`).
fn keyed(database: &str, bus: &str, flag: &str, file: &str) -> Vec<std::ffi::OsString> {
    ["--database", database, "--bus-timeout-ms", "3000", "--bus", bus, flag, file].map(Into::into).to_vec()
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

/// A NATS server that knows its clients by NKEY, and one in operator mode that knows them by
/// the JWTs in their `.creds` files: gateways with the right key file join each and watch each
/// other's turns; a key the server does not know or a file that holds no user seed stop a
/// gateway at start with an error that shows no seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_join_a_bus_by_nkey_and_by_a_creds_file() {
    let Some(database) = fresh_database().await else { return };
    let files = Files::new();
    let with = |bus: &str, flag: &str, file: &str| keyed(&database.url, bus, flag, file);
    let both = |args: Vec<std::ffi::OsString>| (ChildGateway::spawn(&args), ChildGateway::spawn(&args));
    let refused = |args: Vec<std::ffi::OsString>| async move {
        let args: Vec<String> = args.into_iter().map(|a| a.into_string().unwrap()).collect();
        tokio::task::spawn_blocking(move || refused_start(&args)).await.unwrap()
    };

    // NKEY: the server lists the user's public key.
    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().unwrap();
    let Some(nats) = nats_server_configured(&listing(&user)) else { return };
    let (a, b) = both(with(&nats.url, "--bus-nkey", &files.write("gw.nk", &format!("{seed}\n"))));
    watched_across(&a, &b, "by-nkey").await;
    assert!(!violated(&a) && !violated(&b), "the documented permissions are enough");

    let stranger = nkeys::KeyPair::new_user().seed().unwrap();
    let account = nkeys::KeyPair::new_account().seed().unwrap();
    for (file, why, says) in [
        (files.write("stranger.nk", &stranger), "a key the server does not list", "cannot connect to NATS at"),
        (files.write("account.nk", &account), "an account's seed", "holds a seed, but not a user's"),
        (files.write("garbage.nk", "SUnot-a-seed"), "no seed", "does not hold an NKEY seed"),
    ] {
        let said = refused(with(&nats.url, "--bus-nkey", &file)).await;
        assert!(said.contains(says), "{why}: {said}");
        for secret in [&stranger, &account, "SUnot-a-seed"] {
            assert!(!said.contains(secret), "{why}: a seed is out: {said}");
        }
    }

    // Operator mode: the user's JWT in the `.creds` file, signed by the account.
    let operator = Operator::new();
    let Some(nats) = nats_server_configured(&operator.config) else { return };
    let (creds, _) = Operator::user_creds(&operator.account, None);
    let (a, b) = both(with(&nats.url, "--bus-creds", &files.write("gw.creds", &creds)));
    watched_across(&a, &b, "by-creds").await;

    // A user signed by an account the operator never signed.
    let (stranger, stranger_seed) = Operator::user_creds(&nkeys::KeyPair::new_account(), None);
    let said = refused(with(&nats.url, "--bus-creds", &files.write("stranger.creds", &stranger))).await;
    assert!(said.contains("cannot connect to NATS at"), "{said}");
    assert!(!said.contains(&stranger_seed), "the seed is out: {said}");
    let said = refused(with(&nats.url, "--bus-creds", &files.write("empty.creds", ""))).await;
    assert!(said.contains("cannot connect to NATS at") && said.contains("JWT"), "{said}");
}

/// How many times `gateway` has logged `message`.
fn logged(gateway: &ChildGateway, message: &str) -> usize {
    let logs = gateway.logs.lock().unwrap();
    logs.iter().filter(|l| l["fields"]["message"] == message).count()
}

/// How many times `gateway` has lost the bus.
fn losses(gateway: &ChildGateway) -> usize {
    logged(gateway, "lost the bus: reconnecting")
}

/// Once the server has dropped both gateways: they come back, each watching the other's turns
/// (within a minute), on connections that hold.
async fn back_on_the_bus(a: &ChildGateway, b: &ChildGateway, conversation: &str) {
    assert!(eventually(600, || async { losses(a) >= 1 && losses(b) >= 1 }).await, "the server dropped the gateways");
    let both_ways = async {
        watched_across(a, b, &format!("{conversation}-a")).await;
        watched_across(b, a, &format!("{conversation}-b")).await;
    };
    let back = tokio::time::timeout(std::time::Duration::from_secs(60), both_ways).await;
    assert!(back.is_ok(), "the gateways are back on the bus");
    assert_eq!((losses(a), losses(b)), (1, 1), "the connections signed in with the new key held");
}

/// A key file replaced on disk is what the gateway signs in with when it reconnects, with no
/// restart: an NKEY the server stopped listing (its configuration reloaded, which disconnects
/// the gateways), and a `.creds` file whose JWT expired (the server disconnects them at the
/// expiry). Without reading the file again, the gateways would sign in with the old key for as
/// long as they run, refused every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_replaced_on_disk_signs_the_gateway_in_when_it_reconnects() {
    let Some(database) = fresh_database().await else { return };
    let files = Files::new();

    let (old, new) = (nkeys::KeyPair::new_user(), nkeys::KeyPair::new_user());
    let Some(nats) = nats_server_configured(&listing(&old)) else { return };
    let key = files.write("gw.nk", &old.seed().unwrap());
    let args = keyed(&database.url, &nats.url, "--bus-nkey", &key);
    let (a, b) = (ChildGateway::spawn(&args), ChildGateway::spawn(&args));
    watched_across(&a, &b, "nkey-before").await;
    files.write("gw.nk", &new.seed().unwrap());
    nats.reconfigure(&listing(&new));
    back_on_the_bus(&a, &b, "nkey-after").await;
    assert!(!violated(&a) && !violated(&b), "the documented permissions are enough");

    let operator = Operator::new();
    let Some(nats) = nats_server_configured(&operator.config) else { return };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let (expiring, _) = Operator::user_creds(&operator.account, Some(now + 6));
    let creds = files.write("gw.creds", &expiring);
    let args = keyed(&database.url, &nats.url, "--bus-creds", &creds);
    let (a, b) = (ChildGateway::spawn(&args), ChildGateway::spawn(&args));
    files.write("gw.creds", &Operator::user_creds(&operator.account, None).0);
    back_on_the_bus(&a, &b, "creds-after").await;
}

/// Reads `stream` until a turn's first words; false if none come within a minute (the held
/// turns hold for two).
async fn first_words(stream: &mut SseStream) -> bool {
    let words = async { while stream.next().await.expect("the stream goes on").json()["type"] != "text-delta" {} };
    tokio::time::timeout(std::time::Duration::from_secs(60), words).await.is_ok()
}

/// A turn on `a` that holds after its first words (the script's `hold` rule) is heard on `b`
/// live, while it still runs on `a` (not from the log once it ended), then stopped.
async fn heard_live(a: &ChildGateway, b: &ChildGateway, conversation: &str) {
    let mut on_b = b.sse(conversation, "").await;
    start_turn(a, conversation, "hold").await;
    assert!(first_words(&mut on_b).await, "B heard nothing of the turn in {conversation}");
    let (_, status) = a.get(&format!("/conversations/{conversation}/status")).await;
    assert_eq!(status["isActive"], true, "B heard the turn while it ran: {status}");
    let (status, stopped) = a.post(&format!("/conversations/{conversation}/stop"), json!({})).await;
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{stopped}");
    on_b.until_sealed().await;
}

/// Two gateways on `database` and `bus` whose scripted runtime plays `script`, with `extra` flags.
fn scripted_pair(database: &str, bus: &str, script: &std::path::Path, extra: &[&str]) -> (ChildGateway, ChildGateway) {
    let script = script.to_str().unwrap();
    let args = ["--database", database, "--bus", bus, "--bus-timeout-ms", "3000", "--scripted-script", script];
    let args: Vec<std::ffi::OsString> = args.iter().chain(extra).map(Into::into).collect();
    (ChildGateway::spawn(&args), ChildGateway::spawn(&args))
}

/// A NATS server restarted (with its data) under a turn held on one gateway: the other hears
/// the turn's end once both are back. Then the bus's stream lost under them, removed by hand
/// and then with a NATS server that comes back without its data: a turn's events (or a
/// follower) create it again, and the turns after that are heard live across again, with no
/// restart: in a new conversation, and in one followed all along (read past the new stream's
/// end before: its reading starts over with the stream, where the client's own consumer would
/// go on from its old sequence and skip them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_and_a_lost_stream_are_followed_through() {
    let Some(database) = fresh_database().await else { return };
    let Some(mut nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = json!({"rules": [
        {"match": "hold", "steps": [{"text": "held here", "stallMs": 120_000}]},
        {"steps": [{"text": "a reply of a few words "}]},
    ]});
    let (a, b) = scripted_pair(&database.url, &nats.url, &write_script(dir.path(), script), &[]);
    // B follows the conversation all along; turns in it take its reading well past where the
    // new stream will be when the next one comes.
    let _follows = b.sse("kept", "").await;
    for _ in 0..3 {
        watched_across(&a, &b, "kept").await;
    }
    heard_live(&a, &b, "kept").await;
    let client = async_nats::connect(&nats.url).await.expect("a client of the test's NATS server");
    let js = async_nats::jetstream::new(client);

    // A turn held on A while the server restarts (with its data): B hears its end, and the
    // turns after it, live.
    let mut on_b = b.sse("across", "").await;
    start_turn(&a, "across", "hold").await;
    assert!(first_words(&mut on_b).await, "B heard the turn start");
    nats.restart();
    // Both gateways back on the bus before the turn ends.
    assert!(
        eventually(600, || async {
            logged(&a, "connected to the bus") >= 2 && logged(&b, "connected to the bus") >= 2
        })
        .await,
        "the gateways reconnected"
    );
    let (status, stopped) = a.post("/conversations/across/stop", json!({})).await;
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{stopped}");
    let end =
        tokio::time::timeout(std::time::Duration::from_secs(60), on_b.until_sealed()).await.expect("B hears the end");
    let done = read(&end).into_iter().find(|(_, e)| e["type"] == "done").expect("B hears the turn's done");
    assert_eq!(done.1["reason"], "aborted");
    heard_live(&a, &b, "kept").await;

    for (how, fresh) in [("removed by hand", "fresh-1"), ("the server back without its data", "fresh-2")] {
        if how == "removed by hand" {
            assert!(js.delete_stream("DISPATCH").await.expect("the stream is removed").success);
        } else {
            nats.restart_empty();
        }
        // A turn meanwhile: its first events find no stream, and bring it back.
        let mut on_a = a.sse("meanwhile", "").await;
        start_turn(&a, "meanwhile", how).await;
        on_a.until_sealed().await;
        let back = eventually(400, || async { js.get_stream("DISPATCH").await.is_ok() }).await;
        assert!(back, "{how}: the stream is created again");
        heard_live(&a, &b, "kept").await;
        heard_live(&b, &a, fresh).await;
    }
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

/// Whether `gateway`'s `/metrics` says it is on the bus (1) or off it (0).
async fn on_bus(gateway: &Api, connected: f64) -> bool {
    metric(&gateway.metrics().await, "dispatch_bus_connected") == connected
}

/// A turn streaming while the NATS server is down for a while and comes back, with its data
/// and then without it: the other gateway's watcher hears the whole turn live, each event once
/// and in order, as the turn's own gateway's watcher does. What the bus lost meanwhile is sent
/// again once it is back (from the turn's start into a stream created again, else from what
/// the stream did not acknowledge), and the watcher elsewhere waits on the gap until then
/// (without that it got `turn-sealed` at the gap, while the turn went on). Each
/// gateway's `/metrics` says when it is off the bus, and counts the turns sent again and cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_streaming_through_an_outage_of_the_bus_is_heard_whole_on_another_gateway() {
    let Some(database) = fresh_database().await else { return };
    let Some(mut nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), steady());
    // Leases long enough that a watcher elsewhere does not learn of a turn's end from the
    // database (the next test) before the bus carries it.
    let (a, b) = scripted_pair(&database.url, &nats.url, &script, &["--lease-ttl-ms", "120000"]);
    // Where A sent its turn again from, in the log since `since`.
    let resent_from = |since: usize| -> Vec<u64> {
        let logs = a.logs.lock().unwrap();
        let again = logs[since..]
            .iter()
            .filter(|l| l["fields"]["message"] == "sending a turn again: the bus may have lost part of it");
        again.map(|l| l["fields"]["from"].as_u64().unwrap()).collect()
    };
    for (how, conversation) in [("with its data", "through-restart"), ("without its data", "through-loss")] {
        let since = a.logs.lock().unwrap().len();
        let on_a = Heard::start(a.sse(conversation, "").await);
        let on_b = Heard::start(b.sse(conversation, "").await);
        start_turn(&a, conversation, "steady").await;
        assert!(eventually(1200, || async { on_b.count() > 5 }).await, "{how}: B hears the turn");
        stop_the_bus(&mut nats, &[&a, &b]).await;
        // The turn streams on while the bus is down.
        let heard = on_a.count();
        assert!(eventually(1200, || async { on_a.count() > heard + 20 }).await, "{how}: the turn goes on");
        if how == "without its data" {
            nats.wipe();
        }
        nats.start();
        let back = eventually(1200, || async { on_bus(&a, 1.0).await && on_bus(&b, 1.0).await }).await;
        assert!(back, "{how}: the gateways reconnected");
        // B hears the turn go on past where A had heard it when the bus came back.
        let heard = on_a.count();
        assert!(eventually(1200, || async { on_b.count() > heard + 20 }).await, "{how}: B hears the turn go on");
        let (status, stopped) = a.post(&format!("/conversations/{conversation}/stop"), json!({})).await;
        assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{how}: {stopped}");
        let everything = on_a.end().await;
        assert!(everything.len() > heard + 20, "{how}: A heard the whole turn");
        assert_eq!(on_b.end().await, everything, "{how}: B heard A's turn whole, each event once, in order");
        // Sent again only from what the stream did not hold: its start into a new one.
        let from = resent_from(since);
        if how == "with its data" {
            assert!(!from.contains(&0), "{how}: the stream kept the turn's start: {from:?}");
        } else {
            assert!(from.contains(&0), "{how}: {from:?}");
        }
    }
    let (on_a, on_b) = (a.metrics().await, b.metrics().await);
    assert!(metric(&on_a, "dispatch_bus_messages_missed_total") >= 1.0, "without its data: {on_a}");
    assert!(metric(&on_a, "dispatch_bus_turns_resent_total") >= 1.0, "{on_a}");
    assert_eq!(metric(&on_b, "dispatch_bus_turns_cut_total"), 0.0, "{on_b}");

    // A turn that ends while the bus stays down: its gateway keeps only its end after the bus
    // timeout, and sends it when the bus is back, with its data or without: the watcher on
    // the other gateway gets `turn-sealed` (without it, it waited for the next turn).
    let trimmed =
        || logged(&a, "the bus did not take the end of a turn in time: it goes out alone when the bus is back");
    for (round, (how, conversation)) in
        [("with its data", "ended-offline"), ("without its data", "ended-lost")].into_iter().enumerate()
    {
        let on_b = Heard::start(b.sse(conversation, "").await);
        start_turn(&a, conversation, "steady").await;
        assert!(eventually(1200, || async { on_b.count() > 5 }).await, "{how}: B hears the turn");
        stop_the_bus(&mut nats, &[&a, &b]).await;
        let (status, stopped) = a.post(&format!("/conversations/{conversation}/stop"), json!({})).await;
        assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{how}: {stopped}");
        assert!(eventually(1200, || async { trimmed() == round + 1 }).await, "{how}: A kept only the turn's end");
        if how == "without its data" {
            nats.wipe();
        }
        nats.start();
        let heard = on_b.end().await;
        assert_eq!(heard.last().unwrap().1["type"], "turn-sealed", "{how}: B's watcher got the turn's end");
        assert_eq!(logged(&b, FROM_THE_DATABASE), 0, "{how}: over the bus");
    }
    let gave_up = "the bus did not take the end of a turn: its watchers elsewhere read it from history";
    assert_eq!(logged(&a, gave_up), 0, "the ends went out");

    // An end waits for the bus as long as the stream would keep it (--bus-max-age-secs), not
    // for as long as the outage lasts.
    let args = ["--database", &database.url, "--bus", &nats.url, "--bus-timeout-ms", "3000", "--bus-max-age-secs", "5"];
    let args: Vec<std::ffi::OsString> =
        args.into_iter().chain(["--scripted-script", script.to_str().unwrap()]).map(Into::into).collect();
    let c = ChildGateway::spawn(&args);
    start_turn(&c, "ended-for-good", "steady").await;
    stop_the_bus(&mut nats, &[&c]).await;
    let (status, stopped) = c.post("/conversations/ended-for-good/stop", json!({})).await;
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{stopped}");
    assert!(eventually(1200, || async { logged(&c, gave_up) == 1 }).await, "C gave the turn's end up");
    nats.start();
}

/// What a gateway says when the database tells it a turn it follows has ended.
const FROM_THE_DATABASE: &str = "a turn followed here ended without its end on the bus; ending it here";

/// A turn that ends while the bus is down, and stays down: its watcher on another gateway gets
/// `turn-sealed` once that gateway has not heard of the turn for a lease's time (2 s here) and
/// the database says it no longer runs, without the bus (before, it waited for the bus, and for
/// ever if the turn's gateway died meanwhile). While the turn runs, the same check says so and
/// the watcher waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_that_ends_while_the_bus_is_down_ends_elsewhere_from_the_database() {
    let Some(database) = fresh_database().await else { return };
    let Some(mut nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), steady());
    let (a, b) = scripted_pair(&database.url, &nats.url, &script, &["--lease-ttl-ms", "2000"]);
    let on_b = Heard::start(b.sse("ends-offline", "").await);
    start_turn(&a, "ends-offline", "steady").await;
    assert!(eventually(1200, || async { on_b.count() > 5 }).await, "B hears the turn");
    stop_the_bus(&mut nats, &[&a, &b]).await;
    // Past a few leases' time, the turn still runs: B's watcher is still in it.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    assert!(!on_b.task.is_finished(), "B's watcher waits while the turn runs");
    let (status, stopped) = a.post("/conversations/ends-offline/stop", json!({})).await;
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{stopped}");
    let heard = on_b.end().await;
    assert_eq!(heard.last().unwrap().1["type"], "turn-sealed", "B's watcher got the turn's end");
    // (Its log comes through a pipe, which the watcher's stream may beat.)
    assert!(eventually(1200, || async { logged(&b, FROM_THE_DATABASE) == 1 }).await, "from the database");
    assert!(on_bus(&b, 0.0).await, "the bus is still down");
    assert_eq!(metric(&b.metrics().await, "dispatch_bus_turns_cut_total"), 1.0);
    nats.start();
}

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
    assert!(warned(&second), "the second gateway says its limits do not apply");
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

/// A gateway's watchers reading turns, those it counts elsewhere, and its flush window.
async fn gauges(gateway: &Api) -> (f64, f64, f64) {
    let text = gateway.metrics().await;
    (
        metric(&text, "dispatch_watchers_reading"),
        metric(&text, "dispatch_watchers_reading_elsewhere"),
        metric(&text, "dispatch_flush_window_seconds"),
    )
}

/// The flush window is the cluster's: a gateway with no watchers of its own, while another has
/// four reading a turn, counts them (`dispatch_watchers_reading_elsewhere`) and opens the window
/// it would open for four of its own; once they leave, it closes again. (Sized by its own
/// watchers alone, watchers spread over three gateways got a third of the window, and the
/// cluster wrote twice as often per delivery as one gateway: BENCHMARKS.md, W2.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_size_their_flush_window_by_the_clusters_watchers() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), steady());
    // Enough sweeps that four watchers open a window (at the first write cost, 4 us).
    let (a, b) = scripted_pair(&database.url, &nats.url, &script, &["--flush-sweeps", "1000"]);
    // A stranger on the bus says it has a million watchers, unsigned and signed with another
    // key: B counts none of them, and says it refused them.
    let raw = async_nats::connect(&nats.url).await.expect("a plain client of the test's NATS server");
    let forged = serde_json::to_vec(&json!({"node": "stranger", "readers": 1_000_000})).unwrap();
    for signature in [None, Some("00".repeat(32))] {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Dispatch-Sent", dispatch_gateway::store::now_ms().to_string().as_str());
        if let Some(signature) = &signature {
            headers.insert("Dispatch-Signature", signature.as_str());
        }
        raw.publish_with_headers("dispatch.readers", headers, forged.clone().into()).await.unwrap();
    }
    raw.flush().await.unwrap();
    let refused = |text: &str| metric(text, "dispatch_bus_rejected_total");
    assert!(
        eventually(200, || async { refused(&b.api.metrics().await) >= 2.0 }).await,
        "B refused the forged counts: {}",
        b.api.metrics().await
    );
    assert_eq!(gauges(&b.api).await, (0.0, 0.0, 0.0), "B alone has no watchers and no window");
    let mut watchers = Vec::new();
    for _ in 0..4 {
        watchers.push(a.sse("spread", "").await);
    }
    start_turn(&a, "spread", "steady").await;
    assert!(
        eventually(400, || async { gauges(&a.api).await.0 == 4.0 }).await,
        "A counts its four: {:?}",
        gauges(&a.api).await
    );
    assert!(
        eventually(200, || async {
            let (here, elsewhere, window) = gauges(&b.api).await;
            here == 0.0 && elsewhere == 4.0 && window > 0.0
        })
        .await,
        "B counts A's four and opens its window: {:?}",
        gauges(&b.api).await
    );
    let (status, _) = a.post("/conversations/spread/stop", json!({})).await;
    assert_eq!(status, 200);
    drop(watchers);
    assert!(
        eventually(200, || async { gauges(&b.api).await == (0.0, 0.0, 0.0) }).await,
        "B's window closes when A's watchers are gone: {:?}",
        gauges(&b.api).await
    );
}

/// Under a flush window a turn's deltas go to the bus as its rounds carry them, several to a
/// message, not a message each (each one costs nats-server its own work: as much again as the
/// following gateways' deliveries, BENCHMARKS.md W2). A plain client on the conversation's
/// subjects counts the messages; the watchers still read every event, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turns_deltas_go_to_the_bus_as_its_rounds_carry_them() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = json!({"rules": [{"pace": 500, "steps": [{"text": "word ", "repeat": 300}]}]});
    let script = write_script(dir.path(), script);
    // A window of 15 ms (the cap) for four watchers, over deltas 2 ms apart.
    let (a, b) = scripted_pair(&database.url, &nats.url, &script, &["--flush-sweeps", "100000"]);
    let raw = async_nats::connect(&nats.url).await.expect("a plain client of the test's NATS server");
    let hex: String = "rounds".bytes().map(|b| format!("{b:02x}")).collect();
    let mut messages = raw.subscribe(format!("dispatch.events.*.{hex}")).await.unwrap();
    raw.flush().await.unwrap();
    let mut watchers = Vec::new();
    for _ in 0..4 {
        watchers.push(a.sse("rounds", "").await);
    }
    let mut on_b = b.sse("rounds", "").await;
    start_turn(&a, "rounds", "go").await;
    let on_b = read(&on_b.until_sealed().await);
    let on_a = read(&watchers[0].until_sealed().await);
    assert_eq!(on_b, on_a, "B's watcher read what A's did");
    let deltas = on_a.iter().filter(|(_, e)| e["type"] == "text-delta").count();
    assert!(deltas >= 300, "{deltas}");
    let mut count = 0;
    while let Ok(Some(_)) =
        tokio::time::timeout(std::time::Duration::from_millis(500), futures_util::StreamExt::next(&mut messages)).await
    {
        count += 1;
    }
    assert!(count * 3 < on_a.len(), "{count} messages on the bus for {} events", on_a.len());
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
