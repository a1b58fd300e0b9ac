//! Operating the gateway: the OpenAPI document, API keys, CORS, limits, metrics, readiness.

#[path = "../common/mod.rs"]
mod common;
mod connections;
mod limits;
mod metrics;

use std::time::Duration;

use common::raw::{exchange, get_kept_alive, read_until};
use common::*;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn the_served_document_is_the_one_in_the_repository() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let r = server.client.get(server.url("/openapi.json")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    let served = r.text().await.unwrap();
    let kept = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json")).unwrap();
    assert!(served == kept, "the served document is not openapi/openapi.json");
    let doc: Value = serde_json::from_str(&served).unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    // OpenAPI 3.1 requires a description on every response; the key check's 401 is on every
    // route but the public ones, a storage failure's 500 on every route that reads or writes.
    for (path, operations) in doc["paths"].as_object().unwrap() {
        for (method, operation) in operations.as_object().unwrap() {
            let responses = operation["responses"].as_object().unwrap();
            for (status, response) in responses {
                assert!(response["description"].is_string(), "{method} {path} {status}: no description");
            }
            let public = ["/health", "/ready", "/openapi.json", "/", "/console/{asset}"].contains(&path.as_str());
            // Signing in and out need no credential; who is signed in answers 401 for nobody.
            if path != "/auth/session" {
                assert_eq!(responses.contains_key("401"), !public, "{method} {path}: 401");
            }
        }
    }
    for (method, path) in [("delete", "/conversations/{id}"), ("get", "/conversations/{id}/metrics"), ("post", "/chat")]
    {
        let error = &doc["paths"][path][method]["responses"]["500"];
        assert_eq!(
            error["content"]["application/json"]["schema"]["$ref"], "#/components/schemas/ErrorBody",
            "{method} {path}"
        );
    }
    let events = &doc["components"]["schemas"]["AgentEvent"];
    assert_eq!(events["discriminator"]["propertyName"], "type");
    assert_eq!(events["oneOf"].as_array().unwrap().len(), 13);
    assert_eq!(events["discriminator"]["mapping"]["turn-sealed"], "#/components/schemas/TurnSealedEvent");
    let paths: Vec<&str> = doc["paths"].as_object().unwrap().keys().map(String::as_str).collect();
    for route in [
        "/health",
        "/ready",
        "/metrics",
        "/openapi.json",
        "/chat",
        "/models",
        "/conversations",
        "/conversations/{id}",
        "/conversations/{id}/metrics",
        "/conversations/{id}/status",
        "/conversations/{id}/last",
        "/conversations/{id}/stop",
        "/conversations/{id}/close",
        "/conversations/{id}/queue",
        "/conversations/{id}/title",
        "/conversations/{id}/model",
        "/conversations/{id}/messages",
        "/conversations/{id}/session",
        "/conversations/{id}/events",
        "/metrics/throughput",
        "/ws",
    ] {
        assert!(paths.contains(&route), "{route} is documented");
    }
}

/// A request to every route, and whether it is public.
fn every_route() -> Vec<(&'static str, &'static str, bool)> {
    vec![
        ("GET", "/health", true),
        ("GET", "/ready", true),
        ("GET", "/openapi.json", true),
        ("GET", "/metrics", false),
        ("GET", "/models", false),
        ("POST", "/chat", false),
        ("GET", "/conversations", false),
        ("POST", "/conversations", false),
        ("GET", "/conversations/a", false),
        ("DELETE", "/conversations/a", false),
        ("GET", "/conversations/a/metrics", false),
        ("GET", "/conversations/a/status", false),
        ("GET", "/conversations/a/last", false),
        ("POST", "/conversations/a/stop", false),
        ("POST", "/conversations/a/close", false),
        ("POST", "/conversations/a/queue", false),
        ("PUT", "/conversations/a/title", false),
        ("GET", "/conversations/a/model", false),
        ("PUT", "/conversations/a/model", false),
        ("DELETE", "/conversations/a/session", false),
        ("POST", "/conversations/a/messages", false),
        ("GET", "/conversations/a/events?until=sealed", false),
        ("GET", "/metrics/throughput", false),
        ("GET", "/ws", false),
        ("GET", "/no/such/route", false),
    ]
}

#[tokio::test]
async fn api_keys_guard_every_route_but_the_public_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.api_keys = vec!["key-one".into(), "key-two".into()];
    let server = TestServer::start(config).await;
    let request = |method: &str, path: &str| {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        server.client.request(method, server.url(path)).timeout(Duration::from_secs(5))
    };
    for (method, path, public) in every_route() {
        let none = request(method, path).send().await.unwrap();
        let wrong = request(method, path).bearer_auth("key-three").send().await.unwrap();
        let sep = if path.contains('?') { '&' } else { '?' };
        let wrong_query = request(method, &format!("{path}{sep}access_token=key-on")).send().await.unwrap();
        for (i, r) in [none, wrong, wrong_query].into_iter().enumerate() {
            if public {
                assert_eq!(r.status(), 200, "{method} {path} is public");
            } else {
                assert_eq!(r.status(), 401, "{method} {path} without a valid key");
                // No credential: a plain challenge; a wrong one: `invalid_token` (RFC 6750).
                let challenge = if i == 0 { "Bearer" } else { "Bearer error=\"invalid_token\"" };
                assert_eq!(r.headers()["www-authenticate"], challenge, "{method} {path}");
                let (_, body) = read_json(r).await;
                let error = body["error"].as_str().unwrap();
                assert!(error.contains("API key or a token") || error.contains("not valid"), "{error}");
            }
        }
        // A valid key, by header or by query, gets past the gate (whatever the route says then).
        let by_header = request(method, path).bearer_auth("key-two").send().await.unwrap();
        let by_query = request(method, &format!("{path}{sep}access_token=key-one")).send().await.unwrap();
        for r in [by_header, by_query] {
            assert_ne!(r.status(), 401, "{method} {path} with a valid key");
        }
    }
    // A WebSocket client passes its key in the query.
    let url = format!("ws://{}/ws?access_token=key-one", server.addr);
    assert!(tokio_tungstenite::connect_async(url).await.is_ok());
    let url = format!("ws://{}/ws", server.addr);
    assert!(tokio_tungstenite::connect_async(url).await.is_err());
}

#[tokio::test]
async fn cors_answers_preflights_and_exposes_the_conversation_id() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    // By default a page on this machine (a web client's dev server) is let in, on any port.
    let preflight = server
        .client
        .request(reqwest::Method::OPTIONS, server.url("/chat"))
        .header("origin", "http://localhost:5173")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "content-type, authorization, last-event-id, idempotency-key")
        .send()
        .await
        .unwrap();
    assert_eq!(preflight.status(), 200);
    assert_eq!(preflight.headers()["access-control-allow-origin"], "http://localhost:5173");
    let methods = preflight.headers()["access-control-allow-methods"].to_str().unwrap().to_lowercase();
    for m in ["get", "post", "put", "delete", "options"] {
        assert!(methods.contains(m), "{methods}");
    }
    let r = server
        .client
        .post(server.url("/chat"))
        .header("origin", "http://localhost:5173")
        .json(&json!({"message": "hi"}))
        .send()
        .await
        .unwrap();
    let exposed = r.headers()["access-control-expose-headers"].to_str().unwrap().to_lowercase();
    assert!(exposed.contains("x-conversation-id") && exposed.contains("retry-after"), "{exposed}");
    EventStream::new(r).collect().await;

    // With an allow-list, other origins get no CORS headers.
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.cors_origins = vec!["http://allowed.example".into()];
    let server = TestServer::start(config).await;
    let allowed =
        server.client.get(server.url("/health")).header("origin", "http://allowed.example").send().await.unwrap();
    assert_eq!(allowed.headers()["access-control-allow-origin"], "http://allowed.example");
    let other = server.client.get(server.url("/health")).header("origin", "http://evil.example").send().await.unwrap();
    assert!(other.headers().get("access-control-allow-origin").is_none());
}

/// `--backup` copies the database while a gateway writes to it: the copy holds every turn
/// sealed before it, and a gateway started on it serves them as the original did (a turn that
/// was running is marked interrupted there, as after a crash). A backup never overwrites a
/// file, and a source that is not a gateway's SQLite database is refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_taken_while_a_turn_runs_restores_what_was_sealed() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gateway.db");
    let database = |db: &std::path::Path| -> Vec<std::ffi::OsString> {
        vec!["--database".into(), db.into(), "--scripted-pace".into(), "200".into()]
    };
    let backup = |from: &std::ffi::OsStr, to: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"))
            .arg("--database")
            .arg(from)
            .arg("--backup")
            .arg(to)
            .output()
            .expect("the binary runs")
    };
    let gateway = ChildGateway::spawn(&database(&db));
    for k in 0..2 {
        assert_eq!(gateway.chat("kept", &format!("turn {k}")).await.last().unwrap()["type"], "turn-sealed");
    }
    let kept = gateway.history("kept").await;
    let mut running = gateway.chat_stream(json!({"conversationId": "running", "message": "a long answer"})).await;
    while running.next_event().await.expect("the turn streams")["type"] != "text-delta" {}

    let copy = dir.path().join("copy.db");
    let made = backup(db.as_os_str(), &copy);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let said: Value = serde_json::from_slice(&made.stdout).expect("a JSON line");
    let bytes = std::fs::read(&copy).unwrap();
    assert_eq!(said, json!({"backup": copy, "bytes": bytes.len()}));

    // Refused, with the reason, leaving nothing behind.
    let not_a_database = dir.path().join("notes.txt");
    std::fs::write(&not_a_database, "not a database").unwrap();
    let other = dir.path().join("other.db");
    for (from, to, reason) in [
        (db.as_os_str(), &copy, "exists: a backup goes to a new file"),
        (dir.path().join("missing.db").as_os_str(), &other, "there is no database at"),
        (not_a_database.as_os_str(), &other, "is not a dispatch-gateway database"),
        ("postgres://gateway@127.0.0.1:1/db".as_ref(), &other, "back up a PostgreSQL one with pg_dump"),
        (db.as_os_str(), &dir.path().join("no/such/folder.db"), "its folder does not exist"),
    ] {
        let refused = backup(from, to);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(1), "{from:?}: {stderr}");
        assert!(stderr.contains(reason), "{from:?}: {stderr}");
    }
    assert_eq!(std::fs::read(&copy).unwrap(), bytes, "the backup is as it was");
    let mut files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    files.retain(|f| !f.to_string_lossy().starts_with("gateway.db"));
    files.sort();
    assert_eq!(files, ["copy.db", "notes.txt"], "no partial copy left");

    // The original goes on: the turn ends there.
    assert_eq!(running.collect().await.last().unwrap()["type"], "turn-sealed");
    let whole = gateway.history("running").await;
    assert!(gateway.terminate().success());

    let restored = ChildGateway::spawn(&database(&copy));
    assert_eq!(restored.history("kept").await, kept);
    let cut = restored.history("running").await;
    assert!(cut.len() < whole.len(), "the copy has the running turn as it was then");
    assert!(
        eventually(100, || async {
            let (_, status) = restored.get("/conversations/running/status").await;
            status["isActive"] == false
        })
        .await,
        "the running turn is ended in the copy"
    );
    let marked = restored.history("running").await;
    assert!(marked.iter().any(|c| c["chunk"]["code"] == "interrupted"), "marked interrupted: {marked:?}");
    assert_eq!(marked[..cut.len()], cut[..], "what the copy held is kept");
}
