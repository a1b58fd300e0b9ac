//! The log's contract: seq 1..N without gaps per conversation, under concurrent turns, across
//! restarts, and after a turn was cut off.

mod common;

use common::*;
use dispatch_gateway::store::Store;
use serde_json::Value;

async fn assert_gap_free(server: &TestServer, conversation_id: &str, expected_len: usize) -> Vec<Value> {
    let history = server.history(conversation_id).await;
    let seqs: Vec<u64> = history.iter().map(|c| c["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=expected_len as u64).collect::<Vec<_>>(), "{conversation_id}");
    history
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seq_is_gap_free_across_concurrent_turns_and_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    let conversations: Vec<String> = (0..10).map(|i| format!("conv-{i}")).collect();

    // 10 conversations driven at once, 5 turns each, one after another within a conversation.
    let mut tasks = Vec::new();
    for id in conversations.clone() {
        let client = server.client.clone();
        let url = server.url("/chat");
        tasks.push(tokio::spawn(async move {
            for turn in 0..5 {
                let body = serde_json::json!({"conversationId": id, "message": format!("turn {turn} of {id}")});
                let r = client.post(&url).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200);
                let events = EventStream::new(r).collect().await;
                assert_eq!(events.last().unwrap()["type"], "turn-sealed");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Each default turn logs three chunks: the user's text, thinking, the reply's text.
    for id in &conversations {
        let history = assert_gap_free(&server, id, 15).await;
        for turn in 0..5 {
            assert_eq!(history[turn * 3]["chunk"]["text"], format!("turn {turn} of {id}"));
        }
        let (_, metrics) = server.get(&format!("/conversations/{id}/metrics")).await;
        assert_eq!(metrics["turns"].as_array().unwrap().len(), 5);
    }

    let server = server.restart().await;
    for id in &conversations {
        assert_gap_free(&server, id, 15).await;
        let events = server.chat(id, "after the restart").await;
        assert_eq!(events.last().unwrap()["type"], "turn-sealed");
        assert_gap_free(&server, id, 18).await;
    }
    let (_, list) = server.get("/conversations?limit=1000").await;
    assert_eq!(list["conversations"].as_array().unwrap().len(), 10);
    assert!(list["conversations"].as_array().unwrap().iter().all(|c| c["status"] == "idle"));
    server.stop().await;
}

#[tokio::test]
async fn a_turn_cut_off_by_a_crash_gets_one_interrupted_marker() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("gateway.db");
    {
        // A process that opened a turn and died before sealing it.
        let store = Store::open(&Database::Sqlite(db.clone()), Default::default()).await.unwrap();
        store.begin_turn(opening("cut", "turn-1", "hello")).await.unwrap();
        store.close().await;
    }
    // Two restarts: the marker is written once.
    for _ in 0..2 {
        let server = TestServer::start(test_config(dir.path())).await;
        let history = assert_gap_free(&server, "cut", 2).await;
        assert_eq!(
            history[1],
            serde_json::json!({"seq": 2, "role": "assistant",
                "chunk": {"type": "error", "message": "turn interrupted: server restarted", "code": "interrupted"}})
        );
        let (_, list) = server.get("/conversations").await;
        assert_eq!(list["conversations"][0]["status"], "idle");
        server.stop().await;
    }
    // The conversation goes on normally.
    let server = TestServer::start(test_config(dir.path())).await;
    server.chat("cut", "again").await;
    assert_gap_free(&server, "cut", 5).await;
    server.stop().await;
}
