//! Identities (docs/identity.md): signed tokens and their refusals, owned conversations on
//! every route, quotas, browser sessions.

mod browsers;
mod budgets;
#[path = "../common/mod.rs"]
mod common;
mod ownership;
mod revocation;
mod tokens;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use jsonwebtoken::{Algorithm, EncodingKey, Header, encode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SECRET: &str = "a-secret-of-at-least-thirty-two-bytes!!";

fn now() -> u64 {
    jsonwebtoken::get_current_timestamp()
}

fn hs256(claims: Value, secret: &[u8]) -> String {
    encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(secret).unwrap()).unwrap()
}

fn user(sub: &str) -> Value {
    json!({"sub": sub, "exp": now() + 3600})
}

fn config_with_secret(dir: &Path) -> dispatch_gateway::Config {
    let mut config = test_config(dir);
    let file = dir.join("secret");
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    config.jwt_secret_file = Some(file);
    config
}

/// `GET /auth/session` with `token`: (status, body, WWW-Authenticate).
async fn who(server: &TestServer, token: &str) -> (u16, Value, String) {
    let r = server.client.get(server.url("/auth/session")).bearer_auth(token).send().await.unwrap();
    let challenge = r.headers().get("www-authenticate").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
    let (status, body) = read_json(r).await;
    (status, body, challenge)
}

async fn refused(server: &TestServer, token: &str, says: &str) {
    let (status, body, challenge) = who(server, token).await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(challenge, r#"Bearer error="invalid_token""#);
    let error = body["error"].as_str().unwrap();
    assert!(error.contains(says), "{error:?} should say {says:?}");
}

fn openssl(args: &[&str]) {
    let status = std::process::Command::new("openssl")
        .args(args)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl runs");
    assert!(status.success(), "openssl {args:?}");
}

/// A key pair made by openssl: (private PEM, public PEM).
fn key_pair(dir: &Path, kind: &str) -> (Vec<u8>, Vec<u8>) {
    let private = dir.join(format!("{kind}.key"));
    let public = dir.join(format!("{kind}.pub"));
    let (p, q) = (private.to_str().unwrap(), public.to_str().unwrap());
    match kind {
        "rsa" => openssl(&["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", p]),
        _ => openssl(&["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", p]),
    }
    openssl(&["pkey", "-in", p, "-pubout", "-out", q]);
    (std::fs::read(&private).unwrap(), std::fs::read(&public).unwrap())
}

#[tokio::test]
async fn hs256_tokens_name_their_subject_and_bad_ones_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_with_secret(dir.path());
    config.jwt_issuer = Some("https://id.example".into());
    config.jwt_audience = Some("dispatch".into());
    let server = TestServer::start(config).await;
    let good = |extra: Value| {
        let mut claims = json!({"sub": "alice", "exp": now() + 600, "iss": "https://id.example", "aud": "dispatch"});
        claims.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        claims
    };
    let (status, body, _) = who(&server, &hs256(good(json!({})), SECRET.as_bytes())).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["subject"], "alice");
    assert_eq!(body["admin"], false);
    let (_, body, _) = who(&server, &hs256(good(json!({"scope": "read dispatch:admin"})), SECRET.as_bytes())).await;
    assert_eq!(body["admin"], true, "the admin scope makes an administrator");

    refused(&server, &hs256(good(json!({"exp": now() - 120})), SECRET.as_bytes()), "expired").await;
    refused(&server, &hs256(good(json!({"nbf": now() + 300})), SECRET.as_bytes()), "not valid yet").await;
    refused(&server, &hs256(good(json!({"iat": now() + 300})), SECRET.as_bytes()), "not valid yet").await;
    refused(&server, &hs256(good(json!({})), b"another-secret-of-at-least-thirty-two-b"), "signature").await;
    refused(&server, &hs256(good(json!({"iss": "https://evil.example"})), SECRET.as_bytes()), "issuer").await;
    refused(&server, &hs256(good(json!({"aud": "someone-else"})), SECRET.as_bytes()), "audience").await;
    let mut no_exp = good(json!({}));
    no_exp.as_object_mut().unwrap().remove("exp");
    refused(&server, &hs256(no_exp, SECRET.as_bytes()), "claim").await;
    let mut no_sub = good(json!({}));
    no_sub.as_object_mut().unwrap().remove("sub");
    refused(&server, &hs256(no_sub, SECRET.as_bytes()), "claim").await;
    // `alg: none`: no signature at all.
    use base64::Engine;
    let b64 = |v: Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
    let none = format!("{}.{}.", b64(json!({"alg": "none", "typ": "JWT"})), b64(good(json!({}))));
    refused(&server, &none, "").await;
    refused(&server, "not.a.token", "").await;
}

#[tokio::test]
async fn quotas_refuse_past_their_limit_with_429_and_leave_others_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_with_secret(dir.path());
    config.quotas.turns_per_minute = Some(2);
    config.quotas.streams = Some(1);
    config.quotas.tokens_per_day = Some(1_000_000);
    let server = TestServer::start(config).await;
    let (alice, bob) = (hs256(user("alice"), SECRET.as_bytes()), hs256(user("bob"), SECRET.as_bytes()));
    let key = |token: &str| token.to_owned();
    for i in 0..2 {
        let r = server
            .client
            .post(server.url("/chat"))
            .bearer_auth(key(&alice))
            .json(&json!({"conversationId": format!("a{i}"), "message": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        EventStream::new(r).collect().await;
    }
    let r = server
        .client
        .post(server.url("/conversations/a0/messages"))
        .bearer_auth(&alice)
        .json(&json!({"message": "third"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=61).contains(&retry), "{retry}");
    let (_, body) = read_json(r).await;
    assert_eq!(body["limit"], "turns_per_minute");
    assert!(body["error"].as_str().unwrap().contains("turns_per_minute"));
    // Bob's budget is his own.
    let (status, _) = ask(&server, &bob, "POST", "/conversations/b0/messages", Some(&json!({"message": "hi"}))).await;
    assert_eq!(status, 202);
    // One stream at a time for alice; a second is refused until the first ends.
    let first = server.client.get(server.url("/conversations/a0/events")).bearer_auth(&alice).send().await.unwrap();
    assert_eq!(first.status(), 200);
    let (status, body) = ask(&server, &alice, "GET", "/conversations/a1/events", None).await;
    assert_eq!((status, body["limit"].as_str()), (429, Some("streams")), "{body}");
    let bobs = server.client.get(server.url("/conversations/b0/events")).bearer_auth(&bob).send().await.unwrap();
    assert_eq!(bobs.status(), 200, "bob's stream is not alice's");
    drop(first);
    let mut again = 0;
    for _ in 0..50 {
        let r = server.client.get(server.url("/conversations/a1/events")).bearer_auth(&alice).send().await.unwrap();
        again = r.status().as_u16();
        if again == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(again, 200, "the place came back when the stream ended");
    // Tokens per day: the turns' usage counts.
    let tokens = server.state.store.tokens_since("alice", 0).await.unwrap();
    assert!(tokens > 0, "alice's turns' tokens were counted");
}

/// Quotas are counted in the database: two gateways on one PostgreSQL enforce one budget.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_are_shared_by_the_gateways_of_a_cluster() {
    let Some(database) = dispatch_testkit::postgres::fresh_database().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let start = |name: &str| {
        let config = {
            let mut c = config_with_secret(&dir.path().join(name));
            c.database = Database::Postgres(database.url.clone());
            c.scripted_script = Some(write_script(
                &dir.path().join(name),
                json!({"rules": [{"match": "long", "steps": [{"text": "working", "stallMs": 120000}]}]}),
            ));
            c.quotas.concurrent_turns = Some(1);
            c.quotas.turns_per_minute = Some(3);
            c.quotas.streams = Some(1);
            c
        };
        TestServer::start(config)
    };
    std::fs::create_dir_all(dir.path().join("a")).unwrap();
    std::fs::create_dir_all(dir.path().join("b")).unwrap();
    let a = start("a").await;
    let b = start("b").await;
    let (alice, bob) = (hs256(user("alice"), SECRET.as_bytes()), hs256(user("bob"), SECRET.as_bytes()));
    let message = |text: &str| json!({"message": text});
    let sealed = |server: &TestServer, id: &str| {
        let url = server.url(&format!("/conversations/{id}/last?timeoutMs=30000"));
        let request = server.client.get(url).bearer_auth(&alice);
        async move { assert_eq!(request.send().await.unwrap().status(), 200) }
    };

    // One turn at a time for alice, whichever gateway runs it.
    assert_eq!(ask(&a, &alice, "POST", "/conversations/c1/messages", Some(&message("long"))).await.0, 202);
    let (status, body) = ask(&b, &alice, "POST", "/conversations/c2/messages", Some(&message("hi"))).await;
    assert_eq!((status, body["limit"].as_str()), (429, Some("concurrent_turns")), "{body}");
    assert_eq!(ask(&b, &bob, "POST", "/conversations/b1/messages", Some(&message("hi"))).await.0, 202, "bob's own");
    // A stream of alice's on one gateway takes her one place on the other too.
    let watching = a.client.get(a.url("/conversations/c1/events")).bearer_auth(&alice).send().await.unwrap();
    assert_eq!(watching.status(), 200);
    let (status, body) = ask(&b, &alice, "GET", "/conversations/c2/events", None).await;
    assert_eq!((status, body["limit"].as_str()), (429, Some("streams")), "{body}");
    drop(watching);

    assert_eq!(ask(&a, &alice, "POST", "/conversations/c1/stop", None).await.0, 200);
    sealed(&a, "c1").await;
    assert_eq!(ask(&b, &alice, "POST", "/conversations/c2/messages", Some(&message("hi"))).await.0, 202);
    sealed(&b, "c2").await;
    assert_eq!(ask(&a, &alice, "POST", "/conversations/c3/messages", Some(&message("hi"))).await.0, 202);
    sealed(&a, "c3").await;
    // Three turns in the last minute, over both gateways: the fourth waits.
    let r = b
        .client
        .post(b.url("/conversations/c4/messages"))
        .bearer_auth(&alice)
        .json(&message("hi"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(read_json(r).await.1["limit"], "turns_per_minute");
    // Their tokens were counted for the day, on the shared database.
    assert!(b.state.store.tokens_since("alice", 0).await.unwrap() > 0);
}

#[tokio::test]
async fn the_counters_are_the_administrators_and_throughput_counts_a_users_own_turns() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_with_secret(dir.path());
    let script = json!({"rules": [
        {"match": "broken", "pace": 0, "steps": [{"text": "half"}], "error": {"message": "bob's upstream went away"}},
        {"pace": 0, "steps": [{"text": "fine"}]}
    ]});
    config.scripted_script = Some(write_script(dir.path(), script));
    let server = TestServer::start(config).await;
    let (alice, bob) = (hs256(user("alice"), SECRET.as_bytes()), hs256(user("bob"), SECRET.as_bytes()));
    let admin = hs256(json!({"sub": "root", "exp": now() + 600, "scope": "dispatch:admin"}), SECRET.as_bytes());
    for (token, id, message) in [(&alice, "a1", "hi"), (&alice, "a2", "hi"), (&bob, "b1", "broken")] {
        let r = server
            .client
            .post(server.url("/chat"))
            .bearer_auth(token)
            .json(&json!({"conversationId": id, "message": message}))
            .send()
            .await
            .unwrap();
        EventStream::new(r).collect().await;
    }
    let turns =
        |body: &Value| body["models"].as_array().unwrap().iter().map(|m| m["turns"].as_i64().unwrap()).sum::<i64>();
    let (_, mine) = ask(&server, &alice, "GET", "/metrics/throughput", None).await;
    assert_eq!(turns(&mine), 2, "{mine}");
    let (_, his) = ask(&server, &bob, "GET", "/metrics/throughput", None).await;
    assert_eq!(turns(&his), 1, "{his}");
    let (_, all) = ask(&server, &admin, "GET", "/metrics/throughput", None).await;
    assert_eq!(turns(&all), 3, "{all}");
    // So do the figures over time and the recent errors: bob's failed turn is his and the
    // administrator's to see, never alice's.
    let series = |body: &Value| -> (i64, i64) {
        let points = body["models"].as_array().unwrap().iter().flat_map(|m| m["points"].as_array().unwrap().clone());
        points.fold((0, 0), |(t, f), p| (t + p["turns"].as_i64().unwrap(), f + p["failed"].as_i64().unwrap()))
    };
    assert_eq!(series(&ask(&server, &alice, "GET", "/metrics/series", None).await.1), (2, 0));
    assert_eq!(series(&ask(&server, &bob, "GET", "/metrics/series", None).await.1), (1, 1));
    assert_eq!(series(&ask(&server, &admin, "GET", "/metrics/series", None).await.1), (3, 1));
    let errors =
        |body: Value| body["errors"].as_array().unwrap().iter().map(|e| e["message"].clone()).collect::<Vec<_>>();
    assert_eq!(errors(ask(&server, &alice, "GET", "/metrics/errors", None).await.1), Vec::<Value>::new());
    assert_eq!(errors(ask(&server, &bob, "GET", "/metrics/errors", None).await.1), [json!("bob's upstream went away")]);
    assert_eq!(
        errors(ask(&server, &admin, "GET", "/metrics/errors", None).await.1),
        [json!("bob's upstream went away")]
    );
    let (status, body) = ask(&server, &alice, "GET", "/metrics", None).await;
    assert_eq!(status, 403, "{body}");
    let r = server.client.get(server.url("/metrics")).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

/// Every state change is logged with its subject, the gateway's own binary writing its log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_state_change_is_logged_with_its_subject() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let child = ChildGateway::spawn(&[
        "--database".into(),
        dir.path().join("g.db").into(),
        "--jwt-secret-file".into(),
        secret.into(),
    ]);
    let alice = hs256(user("alice"), SECRET.as_bytes());
    let url = |path: &str| format!("http://{}{path}", child.addr);
    let client = reqwest::Client::new();
    let r = client.post(url("/conversations")).bearer_auth(&alice).json(&json!({"id": "logged"})).send().await.unwrap();
    assert_eq!(r.status(), 201);
    let r = client.get(url("/conversations/logged")).bearer_auth(&alice).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = client.delete(url("/conversations/logged")).bearer_auth(&alice).send().await.unwrap();
    assert_eq!(r.status(), 204);
    let audit = |logs: &[Value]| -> Vec<(String, String, u64)> {
        logs.iter()
            .filter(|l| l["target"] == "dispatch::audit")
            .map(|l| {
                let f = &l["fields"];
                (
                    f["subject"].as_str().unwrap_or("").to_owned(),
                    format!("{} {}", f["method"].as_str().unwrap_or(""), f["path"].as_str().unwrap_or("")),
                    f["status"].as_u64().unwrap_or(0),
                )
            })
            .collect()
    };
    let mut seen = Vec::new();
    for _ in 0..100 {
        seen = audit(&child.logs.lock().unwrap());
        if seen.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        seen,
        [
            ("alice".to_owned(), "POST /conversations".to_owned(), 201),
            ("alice".to_owned(), "DELETE /conversations/logged".to_owned(), 204)
        ],
        "the two changes, not the read"
    );
    assert!(child.terminate().success());
}

/// A session the database cannot look up: a probe is served anyway, and other routes fail as a
/// read would, never telling the browser its session has ended.
#[tokio::test]
async fn a_session_the_database_cannot_read_fails_as_a_read_and_spares_the_probes() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(config_with_secret(dir.path())).await;
    let token = hs256(user("alice"), SECRET.as_bytes());
    let r = server.client.post(server.url("/auth/session")).json(&json!({"token": token})).send().await.unwrap();
    let cookie = r.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_owned();
    // The sessions go from under the gateway (the table a broken migration or a hand lost).
    let db = rusqlite::Connection::open(sqlite_file(&server.config)).unwrap();
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    db.execute_batch("DROP TABLE sessions").unwrap();
    let get = |path: &str| server.client.get(server.url(path)).header("cookie", &cookie).send();
    assert_eq!(get("/health").await.unwrap().status(), 200, "a probe is served");
    let (status, body) = read_json(get("/conversations").await.unwrap()).await;
    assert_eq!(status, 500, "{body}");
    assert!(!body["error"].as_str().unwrap().contains("sign in"), "{body}");
}

/// The day's tokens: a user past them waits (429, `tokens_per_day`); another does not.
#[tokio::test]
async fn a_users_tokens_for_the_day_end_their_turns_until_the_day_moves_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_with_secret(dir.path());
    config.quotas.tokens_per_day = Some(1);
    let server = TestServer::start(config).await;
    let (alice, bob) = (hs256(user("alice"), SECRET.as_bytes()), hs256(user("bob"), SECRET.as_bytes()));
    let chat = |token: &str, id: &str| {
        server
            .client
            .post(server.url("/chat"))
            .bearer_auth(token)
            .json(&json!({"conversationId": id, "message": "hi"}))
            .send()
    };
    let first = chat(&alice, "a1").await.unwrap();
    assert_eq!(first.status(), 200);
    let events = EventStream::new(first).collect().await;
    let done = events.iter().find(|e| e["type"] == "done").unwrap();
    assert!(done["usage"]["outputTokens"].as_u64().unwrap() > 0, "{done}");
    let r = chat(&alice, "a2").await.unwrap();
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=90_000).contains(&retry), "{retry}");
    let (_, body) = read_json(r).await;
    assert_eq!(body["limit"], "tokens_per_day", "{body}");
    assert_eq!(chat(&bob, "b1").await.unwrap().status(), 200, "bob's day is his own");
}

/// Two gateways on one PostgreSQL, each configured by `config` in a folder of its own.
#[cfg(feature = "cluster")]
async fn two_gateways(dir: &Path, url: &str, config: fn(&Path) -> dispatch_gateway::Config) -> Vec<TestServer> {
    let mut servers = Vec::new();
    for name in ["a", "b"] {
        let home = dir.join(name);
        std::fs::create_dir_all(&home).unwrap();
        let mut config = config(&home);
        config.database = Database::Postgres(url.to_owned());
        servers.push(TestServer::start(config).await);
    }
    servers
}

async fn ask(server: &TestServer, token: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut request =
        server.client.request(method, server.url(path)).bearer_auth(token).timeout(Duration::from_secs(5));
    if let Some(body) = body {
        request = request.json(body);
    }
    read_json(request.send().await.unwrap()).await
}

/// Subjects are namespaced by kind: a token cannot speak for an API key's subject (`key:...`),
/// so it neither lists nor reads that key's conversations.
#[tokio::test]
async fn a_token_cannot_name_a_keys_subject() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_with_secret(dir.path());
    config.api_keys = vec!["the-admin-key".into()];
    let server = TestServer::start(config).await;
    let (status, body) = ask(&server, "the-admin-key", "GET", "/auth/session", None).await;
    assert_eq!(status, 200, "{body}");
    let key_subject = body["subject"].as_str().unwrap().to_owned();
    assert!(key_subject.starts_with("key:"), "{body}");
    let (status, _) = ask(&server, "the-admin-key", "POST", "/conversations", Some(&json!({"id": "keys-own"}))).await;
    assert_eq!(status, 201);
    let forged = hs256(user(&key_subject), SECRET.as_bytes());
    let (status, body, challenge) = who(&server, &forged).await;
    assert_eq!(status, 401, "{body}");
    assert!(body["error"].as_str().unwrap().contains("names API keys"), "{body}");
    assert!(challenge.contains("invalid_token"), "{challenge}");
    let (status, _) = ask(&server, &forged, "GET", "/conversations/keys-own", None).await;
    assert_eq!(status, 401, "refused, not read");
}

/// A subject with a newline and an escape sequence cannot forge a log line or reach the
/// operator's terminal: the text log writes them escaped.
#[tokio::test]
async fn a_subject_cannot_forge_a_log_line() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"))
        .args(["--listen", "127.0.0.1:0", "--log-format", "text", "--database"])
        .arg(dir.path().join("g.db"))
        .arg("--jwt-secret-file")
        .arg(&secret)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let first = lines.recv_timeout(Duration::from_secs(30)).expect("the gateway logs its address");
    let at = first.rfind("127.0.0.1:").unwrap_or_else(|| panic!("an address: {first:?}"));
    let addr: String = first[at..].chars().take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':').collect();
    let forger = "eve\n2026-01-01T00:00:00Z  INFO dispatch::audit: forged subject=root\u{1b}]0;pwned\u{7}";
    let token = hs256(user(forger), SECRET.as_bytes());
    let client = reqwest::Client::new();
    let r = client
        .post(format!("http://{addr}/conversations"))
        .bearer_auth(&token)
        .json(&json!({"id": "forging"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let mut logged = Vec::new();
    while let Ok(line) = lines.recv_timeout(Duration::from_secs(2)) {
        let audit = line.contains("state change");
        logged.push(line);
        if audit {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let text = logged.join("\n");
    assert!(text.contains("eve\\n2026-01-01"), "the subject, escaped: {text:?}");
    assert!(!logged.iter().any(|l| l.starts_with("2026-01-01")), "no forged line: {text:?}");
    assert!(!text.contains("\u{1b}]0;pwned"), "no escape sequence reaches the terminal: {text:?}");
}
