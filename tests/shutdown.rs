//! SIGTERM during a running turn, against the real binary: the turn ends `done{aborted}` and
//! `turn-sealed` for its watchers, streams end, the process exits, and the log and metrics are
//! in the database.

mod common;

use common::*;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_aborts_and_seals_the_running_turn_then_exits() {
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        dir.path(),
        json!({"rules": [{"match": "slow", "pace": 20, "steps": [{"text": "word ".repeat(400)}]}]}),
    );
    let db = dir.path().join("gateway.db");
    let args: Vec<std::ffi::OsString> = vec![
        "--shutdown-timeout-secs".into(),
        "20".into(),
        "--database".into(),
        db.clone().into(),
        "--scripted-script".into(),
        script.into(),
    ];
    let gateway = ChildGateway::spawn(&args);
    let base = format!("http://{}", gateway.addr);
    let client = reqwest::Client::new();

    let r = client.get(format!("{base}/conversations/sd/events")).send().await.unwrap();
    let mut watcher = SseStream::new(r);
    let r = client
        .post(format!("{base}/conversations/sd/messages"))
        .json(&json!({"message": "slow"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let turn_id = read_json(r).await.1["turnId"].as_str().unwrap().to_owned();
    let mut events = Vec::new();
    while events.iter().filter(|e: &&Value| e["type"] == "text-delta").count() < 3 {
        events.push(watcher.next().await.unwrap().json());
    }

    let (terminated, _) = tokio::join!(tokio::task::spawn_blocking(move || gateway.terminate()), async {
        while let Some(m) = watcher.next().await {
            events.push(m.json());
        }
    });
    let n = events.len();
    assert_eq!(events[n - 2]["type"], "done");
    assert_eq!(events[n - 2]["reason"], "aborted");
    assert_eq!(events[n - 1], json!({"type": "turn-sealed", "conversationId": "sd", "turnId": turn_id}));

    let exit = terminated.unwrap();
    assert!(exit.success(), "{exit:?}");

    // The database holds the sealed turn: its partial text and its metrics.
    let conn = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let (reason, metrics): (Option<String>, Option<String>) = conn
        .query_row("SELECT reason, metrics FROM turns WHERE turn_id = ?", [&turn_id], |row| {
            Ok((row.get(0)?, row.get(1)?))
        })
        .unwrap();
    assert_eq!(reason.as_deref(), Some("aborted"));
    let metrics: Value = serde_json::from_str(&metrics.unwrap()).unwrap();
    assert_eq!(metrics["turnId"], turn_id.as_str());
    let streamed: String =
        events.iter().filter(|e| e["type"] == "text-delta").map(|e| e["delta"].as_str().unwrap()).collect();
    let logged: Vec<(String, String)> = conn
        .prepare("SELECT role, chunk FROM chunks WHERE conversation_id = 'sd' ORDER BY seq")
        .unwrap()
        .query_map((), |row| Ok((row.get(0)?, row.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(logged.len(), 2);
    let text: Value = serde_json::from_str(&logged[1].1).unwrap();
    assert_eq!(text["text"].as_str().unwrap(), streamed, "the log holds exactly the text that was streamed");
    let status: String =
        conn.query_row("SELECT status FROM conversations WHERE id = 'sd'", (), |row| row.get(0)).unwrap();
    assert_eq!(status, "idle");
}
