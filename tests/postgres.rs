#![cfg(feature = "cluster")]
//! The gateway on PostgreSQL: the same answers as on SQLite for the same requests, the log's
//! contract (seq 1..N without gaps) under writers in two processes' worth of stores, a turn
//! cut off by a crash marked once, and two gateways on one database: one turn at a time per
//! conversation across both, a killed gateway's turn marked interrupted by the other. Needs a
//! server: `DISPATCH_TEST_POSTGRES` (see `dispatch_testkit::postgres`); skipped without one
//! unless `DISPATCH_REQUIRE_POSTGRES=1`.

mod common;

use common::*;
use dispatch_gateway::store::{NewChunk, Store, StoreOptions};
use dispatch_gateway::wire::{Chunk, Role, TextChunk};
use dispatch_testkit::postgres::{FreshDatabase, fresh_database};
use serde_json::{Value, json};

/// A test server on the given database.
async fn server_on(dir: &std::path::Path, database: Database) -> TestServer {
    let mut config = test_config(dir);
    config.scripted_script = Some(write_script(dir, tool_script()));
    config.database = database;
    // History reads of more than two chunks go out in pages, on both backends.
    config.history_page_chunks = 2;
    config.metrics_page_turns = 2;
    // And pages that end at their bytes first: every page one chunk.
    config.history_page_bytes = 1;
    TestServer::start(config).await
}

async fn postgres() -> Option<FreshDatabase> {
    fresh_database().await
}

/// Drops what differs between two runs of the same requests: times, durations, minted ids,
/// and the time in a list's cursor (`<lastActivityAt>:<id>`: the id is kept).
fn normalized(mut v: Value) -> Value {
    match &mut v {
        Value::Object(map) => {
            if let Some(Value::String(cursor)) = map.get_mut("nextCursor")
                && let Some((_, id)) = cursor.split_once(':')
            {
                *cursor = id.to_owned();
            }
            map.retain(|k, _| {
                !(k.ends_with("At")
                    || k.ends_with("Ms")
                    || k == "turnId"
                    || k == "stepId"
                    || k == "tokensPerSecond"
                    || k == "outputTokensPerSecond"
                    || k == "at"
                    || k == "totalGenMs")
            });
            for value in map.values_mut() {
                *value = normalized(value.take());
            }
        }
        Value::Array(items) => {
            for item in items.iter_mut() {
                *item = normalized(item.take());
            }
        }
        _ => {}
    }
    v
}

/// Requests of every kind the store answers, and what each read answered.
async fn scenario(server: &TestServer) -> Vec<(String, u16, Value)> {
    let mut answers = Vec::new();
    let (status, body) = server.post("/conversations", json!({"id": "alpha", "title": "First"})).await;
    answers.push(("create".to_owned(), status, body));
    let (status, body) = server.post("/conversations", json!({"id": "alpha"})).await;
    answers.push(("create again".to_owned(), status, body));
    let turns =
        [("alpha", "weather please"), ("alpha", "now fail"), ("beta", "hello"), ("alpha", "hi"), ("zeta", "a\0b")];
    for (id, message) in turns {
        let events = server.chat(id, message).await;
        assert_eq!(events.last().unwrap()["type"], "turn-sealed", "{events:?}");
    }
    for (path, body) in [
        ("/conversations/beta/title", json!({"title": "Renamed"})),
        ("/conversations/beta/title", json!({"title": "nul \u{0} inside"})),
        ("/conversations/gamma/model", json!({"model": "demo/scripted"})),
        ("/conversations/gamma/cwd", json!({"cwd": "/srv/project"})),
        ("/conversations/gamma/reasoning-effort", json!({"reasoningEffort": "high"})),
    ] {
        let (status, body) = server.put(path, body).await;
        answers.push((format!("PUT {path}"), status, body));
    }
    let (status, body) = server.post("/conversations/beta/close", json!({})).await;
    answers.push(("close beta".to_owned(), status, body));
    // The same key twice answers the same; with another body it is a conflict.
    let send = |key: &'static str, message: &'static str| async move {
        let r = server
            .client
            .post(server.url("/conversations/delta/messages"))
            .header("idempotency-key", key)
            .json(&json!({"message": message}))
            .send()
            .await
            .unwrap();
        read_json(r).await
    };
    let first = send("key-1", "hello").await;
    assert_eq!(first.0, 202, "{}", first.1);
    let again = send("key-1", "hello").await;
    assert_eq!(again, (200, first.1.clone()));
    answers.push(("idempotent other body".to_owned(), send("key-1", "other").await.0, json!(null)));
    let (status, _) = server.get("/conversations/delta/last?timeoutMs=30000").await;
    assert_eq!(status, 200);
    let (status, body) = server.post("/conversations", json!({"id": "epsilon"})).await;
    answers.push(("create epsilon".to_owned(), status, body));
    let (status, body) = server.delete("/conversations/epsilon").await;
    answers.push(("delete epsilon".to_owned(), status, body));

    let mut reads = vec![
        "/conversations?limit=100".to_owned(),
        "/conversations?q=al".to_owned(),
        "/conversations?q=a%00b".to_owned(),
        "/conversations?owner=a%00b".to_owned(),
        "/conversations?search=a%00b".to_owned(),
        "/conversations?q=al%20pha".to_owned(),
        "/conversations?status=closed".to_owned(),
        "/conversations?status=idle,closed&limit=2".to_owned(),
        "/conversations/epsilon".to_owned(),
        "/metrics/throughput".to_owned(),
        "/conversations?limit=2&count=true".to_owned(),
        "/metrics/series?period=month".to_owned(),
        "/metrics/errors".to_owned(),
    ];
    for id in ["alpha", "beta", "gamma", "delta", "zeta", "nobody"] {
        for path in [
            "",
            "?limit=2",
            "?beforeSeq=5&limit=2",
            "?sinceSeq=3",
            "?sinceSeq=2&beforeSeq=9",
            "?include=inflight",
            "/metrics",
            "/last",
            "/status",
            "/model",
            "/cwd",
            "/reasoning-effort",
        ] {
            reads.push(format!("/conversations/{id}{path}"));
        }
    }
    for path in reads {
        let (status, body) = server.get(&path).await;
        answers.push((path, status, body));
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_on_postgres_is_the_answer_on_sqlite() {
    let Some(database) = postgres().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let sqlite = server_on(dir.path(), Database::Sqlite(dir.path().join("gateway.db"))).await;
    let on_sqlite = scenario(&sqlite).await;
    sqlite.stop().await;
    let dir = tempfile::tempdir().unwrap();
    let pg = server_on(dir.path(), Database::Postgres(database.url.clone())).await;
    let on_postgres = scenario(&pg).await;
    pg.stop().await;
    assert!(on_sqlite.iter().any(|(path, _, body)| path == "/conversations/alpha" && body["chunks"][8].is_object()));
    for (a, b) in on_sqlite.iter().zip(&on_postgres) {
        assert_eq!(
            (a.0.as_str(), a.1, normalized(a.2.clone())),
            (b.0.as_str(), b.1, normalized(b.2.clone())),
            "{}",
            a.0
        );
    }
    assert_eq!(on_sqlite.len(), on_postgres.len());
}

fn text(t: &str) -> NewChunk {
    NewChunk { role: Role::Assistant, chunk: Chunk::Text(TextChunk { text: t.to_owned() }), new_message: false }
}

/// Two stores on one database, as two gateway processes would hold them, append to one
/// conversation at once: every chunk gets its own seq, 1..N without a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_on_two_stores_share_one_gap_free_seq() {
    let Some(database) = postgres().await else { return };
    let db = Database::Postgres(database.url.clone());
    let (a, b) =
        (Store::open(&db, Default::default()).await.unwrap(), Store::open(&db, Default::default()).await.unwrap());
    assert_eq!(a.begin_turn(opening("shared", "turn-1", "hi")).await.unwrap(), 1);
    let writers = [a.clone(), b.clone()].into_iter().enumerate().map(|(w, store)| {
        tokio::spawn(async move {
            let mut last = Vec::new();
            for i in 0..60 {
                let chunks: Vec<NewChunk> = (0..=i % 3).map(|k| text(&format!("w{w}-{i}-{k}"))).collect();
                last.push(store.append_chunks("shared", "turn-1", &chunks).await.unwrap());
            }
            last
        })
    });
    let mut answered = Vec::new();
    for writer in writers.collect::<Vec<_>>() {
        answered.extend(writer.await.unwrap());
    }
    let log = dispatch_gateway::store::History::new(a.clone(), "shared", 241).range(1, 241).await.unwrap();
    // 1 user chunk + 2 writers x (20 x (1 + 2 + 3)) chunks.
    assert_eq!(log.len(), 1 + 2 * 120);
    let window = dispatch_gateway::store::HistoryWindow { since_seq: 0, before_seq: None, limit: None, inflight: true };
    let page = b.history("shared", window).await.unwrap();
    let items: Value = serde_json::from_slice(&[b"[", page.items.as_slice(), b"]"].concat()).unwrap();
    let seqs: Vec<u64> = items.as_array().unwrap().iter().map(|c| c["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=241).collect::<Vec<_>>());
    // Each append answered a distinct seq: its last chunk's.
    answered.sort_unstable();
    answered.dedup();
    assert_eq!(answered.len(), 120);
    // An append's chunks are consecutive: no other writer's chunk lands between them.
    for pair in items.as_array().unwrap()[1..].windows(2) {
        let (x, y) = (pair[0]["chunk"]["text"].as_str().unwrap(), pair[1]["chunk"]["text"].as_str().unwrap());
        let (xw, yw) = (x.rsplit_once('-').unwrap().0, y.rsplit_once('-').unwrap().0);
        if xw != yw {
            assert!(y.ends_with("-0"), "{x} then {y}");
        }
    }
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_on_postgres_stay_gap_free_across_concurrent_turns_and_a_restart_and_a_crash() {
    let Some(database) = postgres().await else { return };
    let dir = tempfile::tempdir().unwrap();
    // A process that opened a turn and died before sealing it. Its lease ends a moment later;
    // the next gateway's sweeper marks the turn.
    {
        let options = StoreOptions { lease_ttl: std::time::Duration::from_millis(1000), ..Default::default() };
        let db = Database::Postgres(database.url.clone());
        let store = Store::open_with(&db, Default::default(), options).await.unwrap();
        store.begin_turn(opening("cut", "turn-1", "hello")).await.unwrap();
        store.append_chunks("cut", "turn-1", &[text("half an ans")]).await.unwrap();
    }
    let mut config = test_config(dir.path());
    config.database = Database::Postgres(database.url.clone());
    config.lease_ttl_ms = 1000;
    let server = TestServer::start(config).await;
    assert!(eventually(200, || async { server.history("cut").await.len() == 3 }).await, "the cut turn is marked");
    let history = server.history("cut").await;
    let kinds: Vec<&str> = history.iter().map(|c| c["chunk"]["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["text", "text", "error"], "{history:?}");
    assert_eq!(history[2]["chunk"]["code"], "interrupted");

    let conversations: Vec<String> = (0..8).map(|i| format!("conv-{i}")).collect();
    let tasks: Vec<_> = conversations
        .iter()
        .map(|id| {
            let (client, url, id) = (server.client.clone(), server.url("/chat"), id.clone());
            tokio::spawn(async move {
                for turn in 0..3 {
                    let body = json!({"conversationId": id, "message": format!("turn {turn}")});
                    let events = EventStream::new(client.post(&url).json(&body).send().await.unwrap()).collect().await;
                    assert_eq!(events.last().unwrap()["type"], "turn-sealed");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let server = server.restart().await;
    // The cut turn keeps its one marker across the restart.
    assert_eq!(server.history("cut").await.len(), 3);
    for id in &conversations {
        server.chat(id, "after the restart").await;
        let history = server.history(id).await;
        let seqs: Vec<u64> = history.iter().map(|c| c["seq"].as_u64().unwrap()).collect();
        // Each turn logs the user's text, thinking and the reply's text.
        assert_eq!(seqs, (1..=12).collect::<Vec<_>>(), "{id}: {history:?}");
    }
    server.stop().await;
}

/// The turn of gateway A, watched from A; B is another gateway on the same database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_run_one_turn_at_a_time_and_a_killed_ones_turn_is_marked_by_the_other() {
    let Some(database) = postgres().await else { return };
    let args: Vec<std::ffi::OsString> = ["--database", &database.url, "--lease-ttl-ms", "600", "--scripted-pace", "10"]
        .into_iter()
        .map(Into::into)
        .collect();
    let mut a = ChildGateway::spawn(&args);
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.database = Database::Postgres(database.url.clone());
    config.lease_ttl_ms = 600;
    let b = TestServer::start(config).await;

    // A turn on A, a few deltas in (its lease renewed meanwhile: a turn of seconds outlives
    // several leases).
    let body = json!({"conversationId": "shared", "message": "hello"});
    let r = b.client.post(format!("http://{}/chat", a.addr)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut stream = EventStream::new(r);
    let mut deltas = 0;
    while deltas < 5 {
        let event = stream.next_event().await.expect("A streams its turn");
        deltas += usize::from(event["type"] == "text-delta");
    }
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    // B answers as A would: a turn runs, the conversation is busy, and cannot be deleted.
    let (_, status) = b.get("/conversations/shared/status").await;
    assert_eq!((&status["isActive"], &status["status"]), (&json!(true), &json!("active")), "{status}");
    let (status, body) = b.post("/chat", json!({"conversationId": "shared", "message": "me too"})).await;
    assert_eq!(status, 409, "{body}");
    let (status, body) = b.delete("/conversations/shared").await;
    assert_eq!(status, 409, "{body}");
    // An Idempotency-Key is one turn whichever gateway a retry reaches.
    let send = |base: String, message: &'static str| {
        let client = b.client.clone();
        async move {
            let r = client
                .post(format!("{base}/conversations/keyed/messages"))
                .header("idempotency-key", "key-1")
                .json(&json!({"message": message}))
                .send()
                .await
                .unwrap();
            read_json(r).await
        }
    };
    let (status, first) = send(b.url(""), "once").await;
    assert_eq!(status, 202, "{first}");
    assert_eq!(send(format!("http://{}", a.addr), "once").await, (200, first.clone()));
    assert_eq!(send(format!("http://{}", a.addr), "other").await.0, 409);

    // A dies mid-turn. Its lease ends; B marks the turn interrupted, once.
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let marked = eventually(400, || async {
        b.history("shared").await.last().is_some_and(|c| c["chunk"]["code"] == "interrupted")
    })
    .await;
    assert!(marked, "B marks A's turn: {:?}", b.history("shared").await);
    let history = b.history("shared").await;
    let seqs: Vec<u64> = history.iter().map(|c| c["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=history.len() as u64).collect::<Vec<_>>());
    assert_eq!(history.iter().filter(|c| c["chunk"]["type"] == "error").count(), 1);
    let (_, status) = b.get("/conversations/shared/status").await;
    assert_eq!((&status["isActive"], &status["status"]), (&json!(false), &json!("idle")), "{status}");
    // The conversation is free again, on B, after the marker.
    let events = b.chat("shared", "again").await;
    assert_eq!(events.last().unwrap()["type"], "turn-sealed");
    let after = b.history("shared").await;
    assert_eq!(after[history.len()]["chunk"]["text"], "again");
    assert_eq!(
        after.iter().map(|c| c["seq"].as_u64().unwrap()).collect::<Vec<_>>(),
        (1..=after.len() as u64).collect::<Vec<_>>()
    );
    b.stop().await;
}

/// A PostgreSQL database that refuses writes (made read-only, the gateway's connections cut)
/// fails each write with 503 and a reason, `/ready` says it, reads go on, and the gateway
/// recovers when the database takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_postgres_database_refuses_writes_with_503_and_the_gateway_recovers() {
    use sqlx::{Connection, Executor};
    let Some(database) = postgres().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let server = server_on(dir.path(), Database::Postgres(database.url.clone())).await;
    server.chat("before", "hello").await;
    let mut admin = sqlx::PgConnection::connect(&database.admin).await.unwrap();
    let set = |read_only: bool| {
        let name = &database.name;
        [
            format!("ALTER DATABASE {name} SET default_transaction_read_only = {read_only}"),
            format!("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"),
        ]
    };
    for statement in set(true) {
        admin.execute(sqlx::AssertSqlSafe(statement)).await.unwrap();
    }
    // A request that meets a cut connection is refused too (503); then every write says why.
    let refused = eventually(100, || async {
        let (status, body) = server.post("/conversations", json!({"id": "during"})).await;
        assert_eq!(status, 503, "{body}");
        body["error"].as_str().unwrap().contains("read-only")
    })
    .await;
    assert!(refused, "writes are refused as read-only");
    let r = server.client.post(server.url("/chat")).json(&json!({"conversationId": "c", "message": "hi"})).send();
    let (status, body) = read_json(r.await.unwrap()).await;
    assert_eq!(status, 503, "{body}");
    let (status, body) = server.get("/ready").await;
    assert_eq!(status, 503, "{body}");
    assert!(body["error"].as_str().unwrap().contains("read-only"), "{body}");
    // Reads go on.
    assert_eq!(server.history("before").await.len(), 3);
    // Writable again: the next writes commit and /ready recovers.
    for statement in set(false) {
        admin.execute(sqlx::AssertSqlSafe(statement)).await.unwrap();
    }
    let created = eventually(100, || async { server.post("/conversations", json!({"id": "after"})).await.0 == 201 });
    assert!(created.await, "writes commit again");
    assert_eq!(server.get("/ready").await.0, 200);
    assert_eq!(server.chat("after", "hello again").await.last().unwrap()["type"], "turn-sealed");
    server.stop().await;
}

/// A database the gateway cannot connect to stops it at start with the reason PostgreSQL gave
/// (not the pool's "timed out"), and the URL named without its password.
#[tokio::test]
async fn a_database_it_cannot_connect_to_is_named_with_the_reason_and_without_its_password() {
    let Some(database) = postgres().await else { return };
    let host = database.url.split_once("://").map(|(_, rest)| rest.rsplit_once('@').map_or(rest, |(_, h)| h)).unwrap();
    let url = format!("postgres://dispatch_nobody:hunter2@{host}");
    let metrics = std::sync::Arc::new(dispatch_gateway::metrics::Metrics::default());
    let refused = Store::open(&Database::Postgres(url), metrics).await.err().expect("no such role");
    let said = refused.to_string();
    assert!(
        said.starts_with(&format!("cannot connect to PostgreSQL at postgres://dispatch_nobody:***@{host}: ")),
        "{said}"
    );
    assert!(said.contains("dispatch_nobody"), "PostgreSQL's reason: {said}");
    assert!(!said.contains("hunter2") && !said.contains("timed out"), "{said}");
}
