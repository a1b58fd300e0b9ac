//! SIGTERM during a running turn, against the real binary: the turn ends `done{aborted}` and
//! `turn-sealed` for its watchers, streams end, the process exits, and the log and metrics are
//! in the database.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
    let mut child = Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"))
        .args(["--listen", "127.0.0.1:0", "--log-format", "json", "--shutdown-timeout-secs", "20"])
        .arg("--database")
        .arg(&db)
        .arg("--scripted-script")
        .arg(&script)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The address is in the first log line that names one.
    let stdout = child.stdout.take().unwrap();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<Value>(&line)
                && let Some(addr) = v["fields"]["addr"].as_str()
            {
                let _ = addr_tx.send(addr.to_owned());
            }
        }
    });
    let addr = addr_rx.recv_timeout(Duration::from_secs(30)).expect("the gateway logs its address");
    let base = format!("http://{addr}");
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

    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    while let Some(m) = watcher.next().await {
        events.push(m.json());
    }
    let n = events.len();
    assert_eq!(events[n - 2]["type"], "done");
    assert_eq!(events[n - 2]["reason"], "aborted");
    assert_eq!(events[n - 1], json!({"type": "turn-sealed", "conversationId": "sd", "turnId": turn_id}));

    let started = Instant::now();
    let exit = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "the gateway did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}");

    // The database holds the sealed turn: its partial text and its metrics.
    use sqlx::Connection;
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}?mode=ro", db.display())).await.unwrap();
    let (reason, metrics): (Option<String>, Option<String>) =
        sqlx::query_as("SELECT reason, metrics FROM turns WHERE turn_id = ?")
            .bind(&turn_id)
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(reason.as_deref(), Some("aborted"));
    let metrics: Value = serde_json::from_str(&metrics.unwrap()).unwrap();
    assert_eq!(metrics["turnId"], turn_id.as_str());
    let streamed: String =
        events.iter().filter(|e| e["type"] == "text-delta").map(|e| e["delta"].as_str().unwrap()).collect();
    let logged: Vec<(String, String)> =
        sqlx::query_as("SELECT role, chunk FROM chunks WHERE conversation_id = 'sd' ORDER BY seq")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    assert_eq!(logged.len(), 2);
    let text: Value = serde_json::from_str(&logged[1].1).unwrap();
    assert_eq!(text["text"].as_str().unwrap(), streamed, "the log holds exactly the text that was streamed");
    let status: String =
        sqlx::query_scalar("SELECT status FROM conversations WHERE id = 'sd'").fetch_one(&mut conn).await.unwrap();
    assert_eq!(status, "idle");
}
