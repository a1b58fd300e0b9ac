//! Database faults: full, locked by another writer, read-only. A turn that cannot be written
//! still ends `error` + `done{error}` + `turn-sealed` for its watchers, nothing half-written is
//! visible, reads go on, `/ready` says so, and the gateway recovers when the fault clears.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::{Value, json};

fn script(dir: &Path) -> std::path::PathBuf {
    write_script(
        dir,
        json!({"rules": [
            {"match": "big", "pace": 0, "steps": [{"text": "word ", "repeat": 3000}]},
            {"match": "slow", "pace": 0, "steps": [{"text": "slow step", "stallMs": 1500}]},
        ]}),
    )
}

fn seqs(history: &[Value]) -> Vec<u64> {
    history.iter().map(|c| c["seq"].as_u64().unwrap()).collect()
}

async fn ready_again(server: &TestServer) {
    assert!(eventually(200, || async { server.get("/ready").await.0 == 200 }).await, "/ready did not recover");
}

/// Waits until the conversation's pending seal has committed.
async fn sealed_eventually(server: &TestServer, id: &str) {
    let path = format!("/conversations/{id}/status");
    let done = eventually(100, || async { server.get(&path).await.1["isActive"] == false }).await;
    assert!(done, "the pending seal of {id} committed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_database_fails_turns_cleanly_and_recovers_when_space_is_freed() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.scripted_script = Some(script(dir.path()));
    config.sqlite_max_pages = 60;
    let server = TestServer::start(config).await;

    let mut failed = None;
    for i in 0..60 {
        let id = format!("full-{i}");
        let r = server
            .client
            .post(server.url("/chat"))
            .json(&json!({"conversationId": id, "message": "big"}))
            .send()
            .await
            .unwrap();
        if r.status() == 503 {
            let (_, body) = read_json(r).await;
            assert!(body["error"].as_str().unwrap().contains("full"), "{body}");
            failed = Some((id, Vec::new()));
            break;
        }
        assert_eq!(r.status(), 200);
        let events = EventStream::new(r).collect().await;
        if events.iter().any(|e| e["type"] == "error") {
            let n = events.len();
            assert_eq!(types(&events[n - 3..]), vec!["error", "done", "turn-sealed"]);
            assert_eq!(events[n - 3]["code"], "storage");
            assert_eq!(events[n - 2]["reason"], "error");
            failed = Some((id, events));
            break;
        }
    }
    let (failed_id, events) = failed.expect("the database filled up");

    // Reads keep working; /ready says why writes fail; nothing half-written is visible.
    assert_eq!(server.get("/conversations/full-0").await.0, 200);
    assert_eq!(server.get("/conversations?limit=1000").await.0, 200);
    let (status, body) = server.get("/ready").await;
    assert_eq!(status, 503);
    assert!(body["error"].as_str().unwrap().contains("full"), "{body}");
    let partial = server.history(&failed_id).await;
    assert!(partial.len() <= 1, "at most the user's chunk: {partial:?}");
    assert_eq!(seqs(&partial), (1..=partial.len() as u64).collect::<Vec<_>>());

    // Free space: the pending seal commits, the gateway is ready, turns run again.
    for i in 0..5 {
        let (status, _) = server.delete(&format!("/conversations/full-{i}")).await;
        assert_eq!(status, 204);
    }
    ready_again(&server).await;
    if !events.is_empty() {
        sealed_eventually(&server, &failed_id).await;
        let history = server.history(&failed_id).await;
        assert_eq!(seqs(&history), (1..=history.len() as u64).collect::<Vec<_>>());
        assert_eq!(history.last().unwrap()["chunk"]["type"], "error");
        let (_, status) = server.get(&format!("/conversations/{failed_id}/status")).await;
        assert_eq!(status["isActive"], false);
        assert_eq!(status["status"], "idle");
    }
    let events = server.chat("after-full", "hello").await;
    assert_eq!(events[events.len() - 2]["reason"], "stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_locked_by_another_writer_fails_writes_then_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.scripted_script = Some(script(dir.path()));
    config.sqlite_busy_timeout_ms = 200;
    let server = TestServer::start(config).await;
    server.chat("before", "hello").await;

    // A turn is in its stalled step when another process takes the write lock.
    let mut watcher = server.ndjson("locked", "?until=sealed").await;
    let (status, _) = server.post("/conversations/locked/messages", json!({"message": "slow"})).await;
    assert_eq!(status, 202);
    loop {
        if watcher.next_event().await.unwrap()["type"] == "text-delta" {
            break;
        }
    }
    let db = sqlite_file(&server.config);
    let other = rusqlite::Connection::open(&db).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();

    let events = watcher.collect().await;
    let n = events.len();
    assert_eq!(types(&events[n - 3..]), vec!["error", "done", "turn-sealed"], "{events:?}");
    assert_eq!(events[n - 3]["code"], "storage");
    // The conversation waits for its seal; new turns are refused meanwhile; reads go on.
    assert_eq!(server.get("/conversations/locked/status").await.1["isActive"], true);
    let (status, body) = server.post("/chat", json!({"conversationId": "other", "message": "hi"})).await;
    assert_eq!(status, 503, "{body}");
    assert!(body["error"].as_str().unwrap().contains("locked"), "{body}");
    assert_eq!(server.history("before").await.len(), 3);
    let (status, body) = server.get("/ready").await;
    assert_eq!(status, 503, "{body}");

    other.execute_batch("ROLLBACK").unwrap();
    drop(other);
    ready_again(&server).await;
    sealed_eventually(&server, "locked").await;
    // Everything the watchers saw is in the log, in order: user, the step's text, the error.
    let history = server.history("locked").await;
    assert_eq!(seqs(&history), vec![1, 2, 3]);
    assert_eq!(history[1]["chunk"], json!({"type": "text", "text": "slow step"}));
    assert_eq!(history[2]["chunk"]["code"], "storage");
    assert_eq!(server.get("/conversations/locked/metrics").await.1["turns"].as_array().unwrap().len(), 1);
    let events = server.chat("locked", "hello").await;
    assert_eq!(events[events.len() - 2]["reason"], "stop");
}

fn chattr(flag: &str, path: &Path) {
    let status = Command::new("chattr").arg(flag).arg(path).status().expect("chattr runs");
    assert!(status.success(), "chattr {flag} {}", path.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_database_file_refuses_turns_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    server.chat("before", "hello").await;
    let db = sqlite_file(&server.config);
    let wal = db.with_extension("db-wal");
    // Immutable even for root: every write to the files fails.
    chattr("+i", &db);
    chattr("+i", &wal);
    let (status, body) = server.post("/chat", json!({"conversationId": "ro", "message": "hi"})).await;
    let (ready, _) = server.get("/ready").await;
    chattr("-i", &wal);
    chattr("-i", &db);
    assert_eq!(ready, 503, "while the fault lasts");
    assert_eq!(status, 503, "{body}");
    assert!(body["error"].as_str().unwrap().contains("database"), "{body}");
    assert_eq!(server.history("ro").await, Vec::<Value>::new(), "nothing half-written");
    assert_eq!(server.history("before").await.len(), 3);
    // `/ready` says what is true now: the fault cleared, it is ready again without any other
    // write having to come first (a load balancer that took the gateway out sends none).
    ready_again(&server).await;

    let r = server
        .client
        .post(server.url("/chat"))
        .json(&json!({"conversationId": "ro", "message": "again"}))
        .send()
        .await
        .unwrap();
    if r.status() != 200 {
        panic!("after the fault cleared: {:?}", read_json(r).await);
    }
    let events = EventStream::new(r).collect().await;
    assert_eq!(events[events.len() - 2]["reason"], "stop");
    assert_eq!(server.get("/ready").await, (200, json!({"ready": true})));
}
