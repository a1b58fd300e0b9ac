//! Malformed requests get 400/413 with `{error}` and change nothing in the database.

mod common;

use common::*;
use serde_json::{Value, json};

fn assert_error(status: u16, body: &Value, expected_status: u16, context: &str) {
    assert_eq!(status, expected_status, "{context}: {body}");
    assert!(body["error"].as_str().is_some_and(|e| !e.is_empty()), "{context}: {body}");
    assert_eq!(body.as_object().unwrap().len(), 1, "{context}: only `error`");
}

#[tokio::test]
async fn malformed_bodies_are_rejected_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;

    let raw_cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("not json", b"hello".to_vec(), "Invalid JSON body"),
        ("truncated", br#"{"message": "hi""#.to_vec(), "Invalid JSON body"),
        ("empty body", Vec::new(), "Invalid JSON body"),
        ("invalid utf-8", b"{\"message\": \"\xff\xfe\"}".to_vec(), "Invalid JSON body"),
        ("array", b"[1, 2]".to_vec(), "Request body must be a JSON object"),
        ("string", br#""message""#.to_vec(), "Request body must be a JSON object"),
        ("null", b"null".to_vec(), "Request body must be a JSON object"),
    ];
    for path in ["/chat", "/conversations"] {
        for (name, body, message) in &raw_cases {
            let (status, got) = server.post_raw(path, body.clone()).await;
            assert_error(status, &got, 400, &format!("{path} {name}"));
            assert_eq!(got["error"], *message, "{path} {name}");
        }
    }
    let (status, got) = server
        .client
        .put(server.url("/conversations/x/title"))
        .header("content-type", "application/json")
        .body("nope")
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map(|s| (s, ()))
        .unwrap();
    assert_eq!((status, got), (400, ()));
    // A body not typed as JSON is refused for its type (docs/security.md), whatever it holds: a page's
    // form or `no-cors` fetch cannot send a JSON type without asking first.
    for untyped in [None, Some("text/plain"), Some("application/x-www-form-urlencoded"), Some("multipart/form-data")] {
        let mut request = server.client.put(server.url("/conversations/x/title")).body(r#"{"title": "t"}"#);
        if let Some(kind) = untyped {
            request = request.header("content-type", kind);
        }
        let (status, got) = read_json(request.send().await.unwrap()).await;
        assert_error(status, &got, 415, &format!("{untyped:?}"));
    }

    let field_cases: Vec<(Value, &str)> = vec![
        (json!({}), "message"),
        (json!({"message": null}), "message"),
        (json!({"message": ""}), "message"),
        (json!({"message": "   \n\t "}), "message"),
        (json!({"message": 5}), "message"),
        (json!({"message": ["hi"]}), "message"),
        (json!({"message": "hi", "conversationId": 7}), "conversationId"),
        (json!({"message": "hi", "conversationId": ""}), "conversationId"),
        (json!({"message": "hi", "conversationId": "has space"}), "conversationId"),
        (json!({"message": "hi", "conversationId": "a\r\nb"}), "conversationId"),
        (json!({"message": "hi", "conversationId": "x".repeat(129)}), "conversationId"),
        (json!({"message": "hi", "conversationId": "ünïcode"}), "conversationId"),
        (json!({"message": "hi", "model": 3}), "model"),
        (json!({"message": "hi", "model": "no/such"}), "no/such"),
        (json!({"message": "hi", "cwd": false}), "cwd"),
        (json!({"message": "hi", "cwd": "/srv/a\u{0}b"}), "cwd"),
        (json!({"message": "hi", "cwd": format!("/{}", "d".repeat(4096))}), "cwd"),
        (json!({"message": "hi", "reasoningEffort": {}}), "reasoningEffort"),
    ];
    for (body, field) in field_cases {
        let (status, got) = server.post("/chat", body.clone()).await;
        assert_error(status, &got, 400, &body.to_string());
        assert!(got["error"].as_str().unwrap().contains(field), "{body}: {got} names {field}");
    }

    // The same bounds where the conversation's cwd is set.
    for cwd in ["/srv/a\u{0}b".to_owned(), format!("/{}", "d".repeat(4096))] {
        let (status, got) = server.put("/conversations/cwd-bounds/cwd", json!({ "cwd": cwd })).await;
        assert_error(status, &got, 400, "PUT cwd");
        assert!(got["error"].as_str().unwrap().contains("cwd"), "{got}");
    }

    let create_cases: Vec<(Value, &str)> = vec![
        (json!({"id": 5}), "id"),
        (json!({"id": "bad id"}), "id"),
        (json!({"id": ""}), "id"),
        (json!({"title": 5}), "title"),
        (json!({"title": "t".repeat(513)}), "title"),
        (json!({"title": "nul \u{0} inside"}), "U+0000"),
        (json!({"model": true}), "model"),
        (json!({"model": "no/such"}), "no/such"),
    ];
    for (body, field) in create_cases {
        let (status, got) = server.post("/conversations", body.clone()).await;
        assert_error(status, &got, 400, &body.to_string());
        assert!(got["error"].as_str().unwrap().contains(field), "{body}: {got} names {field}");
    }

    // Oversized bodies: 413, whether the length is declared up front or not.
    let big = format!(r#"{{"message": "{}"}}"#, "x".repeat(2 * 1024 * 1024));
    let (status, got) = server.post_raw("/chat", big.clone()).await;
    assert_error(status, &got, 413, "declared length");
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        big.as_bytes().chunks(64 * 1024).map(|c| Ok(c.to_vec())).collect();
    let streamed = reqwest::Body::wrap_stream(futures_util::stream::iter(chunks));
    let (status, got) = server.post_raw("/chat", streamed).await;
    assert_error(status, &got, 413, "chunked body");

    // Bad ids in paths.
    for path in [
        "/conversations/bad%20id",
        "/conversations/a%0D%0Ab",
        &format!("/conversations/{}", "x".repeat(129)),
        "/conversations/%C3%BC",
    ] {
        let (status, got) = server.get(path).await;
        assert_error(status, &got, 400, path);
        let (status, got) = server.delete(path).await;
        assert_error(status, &got, 400, path);
        let (status, got) = server.delete(&format!("{path}/session")).await;
        assert_error(status, &got, 400, path);
    }

    // Unknown routes and methods.
    let (status, got) = server.get("/nope").await;
    assert_error(status, &got, 404, "unknown route");
    let (status, got) = server.put("/chat", json!({})).await;
    assert_error(status, &got, 405, "wrong method");

    // None of it reached the database.
    let (_, list) = server.get("/conversations").await;
    assert_eq!(list, json!({"conversations": []}));
    let db = sqlite_file(&server.config);
    server.stop().await;
    let counts = table_counts(&db).await;
    assert!(counts.iter().all(|(_, n)| *n == 0), "{counts:?}");
}

#[tokio::test]
async fn conversation_crud() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;

    let (status, created) =
        server.post("/conversations", json!({"id": "c.1:a-b_c", "title": "First", "model": "demo/scripted"})).await;
    assert_eq!(status, 201);
    assert_eq!(created["id"], "c.1:a-b_c");
    assert_eq!(created["title"], "First");
    assert_eq!(created["status"], "idle");
    assert_eq!(created["model"], "demo/scripted");
    assert_eq!(created["createdAt"], created["lastActivityAt"]);
    let (status, again) = server.post("/conversations", json!({"id": "c.1:a-b_c"})).await;
    assert_eq!(status, 409, "{again}");

    let (status, minted) = server.post("/conversations", json!({})).await;
    assert_eq!(status, 201);
    assert!(uuid::Uuid::parse_str(minted["id"].as_str().unwrap()).is_ok());
    assert_eq!(minted["title"], "");
    assert!(minted.get("model").is_none(), "absent optional is omitted");

    // A turn makes a conversation the newest; a conversation's first message titles it.
    server.chat("other", "Plan the trip\nwith details").await;
    let (_, list) = server.get("/conversations").await;
    let ids: Vec<&str> = list["conversations"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids[0], "other");
    assert_eq!(list["conversations"][0]["title"], "Plan the trip");
    assert_eq!(ids.len(), 3);
    // A title made from a first message keeps no control characters (U+0000 included, which
    // PostgreSQL's text cannot hold).
    server.chat("controls", "tab\there\u{0}nul").await;
    let (_, meta) = server.get("/conversations?q=controls").await;
    assert_eq!(meta["conversations"][0]["title"], "tabherenul");

    let (_, list) = server.get("/conversations?q=c.1").await;
    assert_eq!(list["conversations"].as_array().unwrap().len(), 1);
    let (_, list) = server.get("/conversations?limit=1").await;
    assert_eq!(list["conversations"].as_array().unwrap().len(), 1);
    let (_, list) = server.get("/conversations?status=active,closed").await;
    assert_eq!(list["conversations"].as_array().unwrap().len(), 0);
    // `q` is an id prefix: characters no id has (U+0000 among them) are refused, not searched.
    let long = format!("?q={}", "a".repeat(129));
    for bad in ["?status=busy", "?limit=0", "?limit=x", "?limit=1001", "?q=a%00b", "?q=two%20words", long.as_str()] {
        let (status, body) = server.get(&format!("/conversations{bad}")).await;
        assert_error(status, &body, 400, bad);
    }

    let (status, body) = server.put("/conversations/other/title", json!({"title": "Renamed"})).await;
    assert_eq!((status, body), (200, json!({"conversationId": "other", "title": "Renamed"})));
    let (status, body) = server.put("/conversations/missing/title", json!({"title": "x"})).await;
    assert_error(status, &body, 404, "title of unknown");
    let (status, body) = server.put("/conversations/other/title", json!({})).await;
    assert_error(status, &body, 400, "title missing");

    let (status, _) = server.delete("/conversations/other").await;
    assert_eq!(status, 204);
    assert_eq!(server.history("other").await, Vec::<Value>::new());
    let (_, metrics) = server.get("/conversations/other/metrics").await;
    assert_eq!(metrics, json!({"turns": []}));
    let (status, body) = server.delete("/conversations/other").await;
    assert_error(status, &body, 404, "deleted twice");

    // A deleted id can be used again and its seq starts over at 1.
    server.chat("other", "new life").await;
    assert_eq!(server.history("other").await[0]["seq"], 1);

    assert_eq!(server.get("/health").await, (200, json!({"ok": true})));
    assert_eq!(
        server.get("/models").await,
        (
            200,
            json!({"models": ["demo/scripted"], "defaultModel": "demo/scripted", "modelInfo": {"demo/scripted": {"contextWindow": 32768}}})
        )
    );
}

/// A search too long, or holding U+0000 (which PostgreSQL's text cannot), is refused before it
/// reaches the database; a search of LIKE's own characters finds only what it says.
#[tokio::test]
async fn a_hostile_search_is_refused_or_taken_literally() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(test_config(dir.path())).await;
    assert_eq!(server.post("/conversations", json!({"id": "plain", "title": "plain"})).await.0, 201);
    let long = "a".repeat(513);
    for (search, says) in [(long.as_str(), "at most 512"), ("a\u{0}b", "U+0000")] {
        let query = form_urlencoded::Serializer::new(String::new()).append_pair("search", search).finish();
        let (status, body) = server.get(&format!("/conversations?{query}")).await;
        assert_error(status, &body, 400, search);
        assert!(body["error"].as_str().unwrap().contains(says), "{body}");
    }
    for wildcard in ["%", "_", "%25%25", "\\"] {
        let (status, body) = server.get(&format!("/conversations?search={wildcard}")).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["conversations"], json!([]), "{wildcard} matches itself only");
    }
}
