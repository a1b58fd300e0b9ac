//! `GET /conversations/:id` windows, exactly as the history contract says, and the rejected parameters.

mod common;

use common::*;
use serde_json::{Value, json};

fn seqs(body: &Value) -> Vec<u64> {
    body["chunks"].as_array().unwrap().iter().map(|c| c["seq"].as_u64().unwrap()).collect()
}

#[tokio::test]
async fn history_windows_and_parameter_rules() {
    // Read whole (one page of up to 1000 chunks) and in pages of 2 and of 1: the same answers.
    for page in [1000, 2, 1] {
        history_windows(page, 4 * 1024 * 1024).await;
    }
    // Pages that end at their bytes (`--history-page-bytes`) before their chunks: the same
    // answers again, whether a read has a `limit` or not.
    history_windows(1000, 1).await;
}

async fn history_windows(page: u64, page_bytes: u64) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.history_page_chunks = page;
    config.history_page_bytes = page_bytes;
    // A page of one chunk when a page ends at its first chunk's bytes.
    let page = if page_bytes < 1024 { 1 } else { page };
    let server = TestServer::start(config).await;
    for i in 0..3 {
        server.chat("hist", &format!("message {i}")).await;
    }
    // 3 turns x (user, thinking, text) = seq 1..=9.
    let accepted: Vec<(&str, Vec<u64>, u64)> = vec![
        ("", (1..=9).collect(), 9),
        ("?sinceSeq=0", (1..=9).collect(), 9),
        ("?sinceSeq=3", (4..=9).collect(), 9),
        ("?beforeSeq=5", (1..=4).collect(), 4),
        ("?sinceSeq=2&beforeSeq=6", (3..=5).collect(), 5),
        ("?limit=2", vec![8, 9], 9),
        ("?limit=100", (1..=9).collect(), 9),
        ("?sinceSeq=2&beforeSeq=8&limit=3", vec![5, 6, 7], 7),
        ("?beforeSeq=4&limit=1", vec![3], 3),
        ("?sinceSeq=9", vec![], 9),
        ("?sinceSeq=100", vec![], 100),
        ("?beforeSeq=1", vec![], 0),
        ("?sinceSeq=5&beforeSeq=6", vec![], 5),
        ("?sinceSeq=6&beforeSeq=3", vec![], 6),
        ("?sinceSeq=007", (8..=9).collect(), 9),
        ("?limit=1&limit=2", vec![8, 9], 9),
        ("?limit=18446744073709551615", (1..=9).collect(), 9),
        ("?sinceSeq=4&limit=18446744073709551615", (5..=9).collect(), 9),
        ("?beforeSeq=18446744073709551615&limit=1", vec![9], 9),
    ];
    for (query, expected, latest) in accepted {
        let response = server.client.get(server.url(&format!("/conversations/hist{query}"))).send().await.unwrap();
        assert_eq!(response.status(), 200, "{query}");
        // Several pages go out as they are read (no length); one is one body.
        let pages = (expected.len() as u64).div_ceil(page);
        assert_eq!(response.content_length().is_none(), pages > 1, "{query}, pages of {page}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(seqs(&body), expected, "{query}, pages of {page}");
        assert_eq!(body["latestSeq"], latest, "{query}, pages of {page}");
    }
    // Every chunk is the full envelope.
    let (_, body) = server.get("/conversations/hist?limit=1").await;
    assert_eq!(body["chunks"][0]["role"], "assistant");
    assert_eq!(body["chunks"][0]["chunk"]["type"], "text");

    // An unknown conversation is an empty log, not an error.
    assert_eq!(server.get("/conversations/never-seen").await, (200, json!({"chunks": [], "latestSeq": 0})));
    assert_eq!(server.get("/conversations/never-seen?sinceSeq=5").await, (200, json!({"chunks": [], "latestSeq": 5})));

    let rejected = [
        ("sinceSeq", "-1"),
        ("sinceSeq", "abc"),
        ("sinceSeq", "1.5"),
        ("sinceSeq", ""),
        ("sinceSeq", "1e3"),
        ("sinceSeq", "99999999999999999999999"),
        ("beforeSeq", "0"),
        ("beforeSeq", "-1"),
        ("beforeSeq", "abc"),
        ("beforeSeq", "1.5"),
        ("limit", "0"),
        ("limit", "-3"),
        ("limit", "abc"),
        ("limit", "1.5"),
        ("limit", " 2"),
    ];
    for (name, value) in rejected {
        let query = format!("{name}={}", value.replace(' ', "%20"));
        for path in ["/conversations/hist", "/conversations/never-seen"] {
            let (status, body) = server.get(&format!("{path}?{query}")).await;
            assert_eq!(status, 400, "{path}?{query}");
            let error = body["error"].as_str().unwrap();
            assert!(error.contains(name), "{query}: {error:?} names the parameter");
        }
    }
    // A number too large says what the most is, not that it is no integer; where a route has a
    // lower ceiling, that one.
    let (_, body) = server.get("/conversations/hist?limit=99999999999999999999").await;
    assert_eq!(body["error"], "`limit` must be at most 18446744073709551615, got \"99999999999999999999\"");
    for query in ["1001", "99999999999999999999"] {
        let (status, body) = server.get(&format!("/conversations?limit={query}")).await;
        assert_eq!((status, &body["error"]), (400, &json!(format!("`limit` must be at most 1000, got \"{query}\""))));
    }
}

#[tokio::test]
async fn the_database_refuses_a_chunk_that_would_break_a_history_window() {
    let dir = tempfile::tempdir().unwrap();
    let config = test_config(dir.path());
    let database = sqlite_file(&config);
    let server = TestServer::start(config).await;
    server.chat("damaged", "hello").await;
    let (status, before) = server.get("/conversations/damaged").await;
    assert_eq!(status, 200, "{before}");
    // Windows are joined from the stored text unparsed; any connection that writes a row that
    // is not JSON (or a role that would need escaping) is refused.
    let conn = rusqlite::Connection::open(&database).unwrap();
    for statement in [
        r#"UPDATE chunks SET chunk = '{"type":"text","text":' WHERE conversation_id = 'damaged' AND seq = 2"#,
        r#"UPDATE chunks SET chunk = '{type:"text"}' WHERE conversation_id = 'damaged' AND seq = 2"#,
        r#"UPDATE chunks SET role = 'user","x":"' WHERE conversation_id = 'damaged' AND seq = 2"#,
        r#"INSERT INTO chunks (conversation_id, seq, message_id, turn_id, role, chunk)
           VALUES ('damaged', 99, 9, 't', 'user', 'not json')"#,
    ] {
        let refused = conn.execute(statement, ()).expect_err(statement);
        assert!(refused.to_string().contains("must be JSON"), "{statement}: {refused}");
    }
    // A valid rewrite is still possible for tools (the gateway itself never rewrites).
    conn.execute(r#"UPDATE chunks SET chunk = chunk WHERE conversation_id = 'damaged' AND seq = 2"#, ()).unwrap();
    let (status, after) = server.get("/conversations/damaged").await;
    assert_eq!(status, 200, "{after}");
    assert_eq!(after, before, "nothing stored changed");
}
