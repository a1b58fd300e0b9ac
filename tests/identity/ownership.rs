//! Each conversation its owner's: every route walked as another subject, on both backends and
//! over a WebSocket session.

use super::*;

/// Every route that names a conversation, with a body where it takes one.
fn conversation_routes() -> Vec<(&'static str, &'static str, Option<Value>)> {
    vec![
        ("GET", "", None),
        ("DELETE", "", None),
        ("GET", "/metrics", None),
        ("PUT", "/title", Some(json!({"title": "mine now"}))),
        ("POST", "/stop", None),
        ("POST", "/close", None),
        ("GET", "/status", None),
        ("GET", "/last?timeoutMs=100", None),
        ("GET", "/model", None),
        ("GET", "/cwd", None),
        ("GET", "/reasoning-effort", None),
        ("DELETE", "/session", None),
        ("GET", "/lsp", None),
        // A live stream: its head is compared (the body goes on for as long as it is read).
        ("GET", "/events?format=ndjson", None),
        ("POST", "/queue", Some(json!({"text": "steer"}))),
        ("PUT", "/model", Some(json!({"model": "scripted"}))),
        ("PUT", "/cwd", Some(json!({"cwd": null}))),
        ("PUT", "/reasoning-effort", Some(json!({"reasoningEffort": "high"}))),
        ("POST", "/messages", Some(json!({"message": "hello"}))),
    ]
}

/// Every route of the API's description that names a conversation is in the walk: a route added
/// later fails here until the walk covers it.
#[test]
fn the_walk_covers_every_conversation_route_the_api_describes() {
    let doc: Value =
        serde_json::from_str(include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json"))).unwrap();
    let walked: Vec<(String, String)> = conversation_routes()
        .into_iter()
        .map(|(method, suffix, _)| {
            (method.to_lowercase(), format!("/conversations/{{id}}{}", suffix.split('?').next().unwrap()))
        })
        .collect();
    for (path, operations) in doc["paths"].as_object().unwrap() {
        if !path.starts_with("/conversations/{id}") {
            continue;
        }
        for method in operations.as_object().unwrap().keys() {
            assert!(walked.contains(&(method.clone(), path.clone())), "{method} {path} is not in the ownership walk");
        }
    }
}

/// Routes that create the conversation when nobody has used its id: for another subject's
/// they answer 404 (the id is taken, and it is not theirs).
const CREATING: &[&str] = &["/queue", "/model", "/cwd", "/reasoning-effort", "/messages"];

/// Alice's conversation, to everyone else, is a conversation that does not exist: on every
/// route it answers as an unused id does (or, where an unused id would be created, 404), and
/// nothing of it changes.
async fn walk_every_route(server: &TestServer) {
    let (alice, bob) = (hs256(user("alice"), SECRET.as_bytes()), hs256(user("bob"), SECRET.as_bytes()));
    let admin = hs256(json!({"sub": "root", "exp": now() + 600, "scope": "dispatch:admin"}), SECRET.as_bytes());
    let (status, _) = ask(server, &alice, "POST", "/conversations", Some(&json!({"id": "alices", "title": "A"}))).await;
    assert_eq!(status, 201);
    let (status, body) =
        ask(server, &alice, "POST", "/conversations/alices/messages", Some(&json!({"message": "hi"}))).await;
    assert_eq!(status, 202, "{body}");
    let mut history = Value::Null;
    for _ in 0..100 {
        let (_, h) = ask(server, &alice, "GET", "/conversations/alices", None).await;
        if h["chunks"].as_array().is_some_and(|c| c.len() > 1) {
            history = h;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(history["chunks"].as_array().is_some_and(|c| c.len() > 1), "alice's turn sealed: {history}");
    for (i, (method, suffix, body)) in conversation_routes().into_iter().enumerate() {
        let unused = format!("/conversations/unused-{i}{suffix}");
        let foreign = format!("/conversations/alices{suffix}");
        let path = suffix.split('?').next().unwrap();
        if path == "/events" {
            let head = |url: String| {
                let request = server.client.get(server.url(&url)).bearer_auth(&bob);
                async move {
                    let r = request.send().await.unwrap();
                    (r.status().as_u16(), r.headers().get("content-type").cloned())
                }
            };
            assert_eq!(head(foreign.clone()).await, head(unused.clone()).await, "{method} {foreign}");
            // An SSE resume opens the same way too: `resync` at 0 for both, so the cursor tells
            // nothing of whether the conversation exists or how long its log is.
            let opening = |id: String| {
                let url = server.url(&format!("/conversations/{id}/events"));
                let request = server.client.get(url).bearer_auth(&bob).header("last-event-id", "t0:5");
                async move {
                    let mut r = request.send().await.unwrap();
                    let first = tokio::time::timeout(Duration::from_secs(2), r.chunk()).await;
                    let text =
                        first.ok().and_then(|c| c.ok().flatten()).map(|b| String::from_utf8_lossy(&b).into_owned());
                    text.unwrap_or_default().replace(&id, "ID")
                }
            };
            let (foreign_opening, unused_opening) =
                (opening("alices".into()).await, opening(format!("fresh-{i}")).await);
            assert!(unused_opening.starts_with("event: resync"), "{unused_opening:?}");
            assert_eq!(foreign_opening, unused_opening, "a resume of {foreign}");
            continue;
        }
        let (foreign_status, foreign_body) = ask(server, &bob, method, &foreign, body.as_ref()).await;
        if method != "GET" && CREATING.contains(&path) {
            assert_eq!(foreign_status, 404, "{method} {foreign}: {foreign_body}");
            assert_eq!(foreign_body, json!({"error": "no conversation \"alices\""}), "{method} {foreign}");
            continue;
        }
        let (unused_status, unused_body) = ask(server, &bob, method, &unused, body.as_ref()).await;
        let unused_body: Value =
            serde_json::from_str(&unused_body.to_string().replace(&format!("unused-{i}"), "alices")).unwrap();
        assert_eq!((foreign_status, &foreign_body), (unused_status, &unused_body), "{method} {foreign}");
    }
    // Nothing of alice's changed; bob's list never shows it; an administrator sees it, with
    // its owner, and may filter by owner.
    let (_, after) = ask(server, &alice, "GET", "/conversations/alices", None).await;
    assert_eq!(after, history);
    let (_, meta) = ask(server, &alice, "GET", "/conversations", None).await;
    let listed: Vec<&str> =
        meta["conversations"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(listed, ["alices"], "alice lists her own only");
    assert_eq!(meta["conversations"][0]["title"], "A");
    assert_eq!(meta["conversations"][0]["status"], "idle", "bob's close did not close it");
    let (_, theirs) = ask(server, &bob, "GET", "/conversations", None).await;
    assert!(theirs["conversations"].as_array().unwrap().iter().all(|c| c["id"] != "alices"), "{theirs}");
    let (_, all) = ask(server, &admin, "GET", "/conversations?owner=alice", None).await;
    assert_eq!(all["conversations"][0]["owner"], "alice");
    assert_eq!(all["conversations"].as_array().unwrap().len(), 1);
    // Bob's watch of it hears nothing of alice's next turn; alice's own does.
    let watch = |token: &str| {
        let url = server.url("/conversations/alices/events?format=ndjson&until=sealed");
        server.client.get(url).bearer_auth(token).send()
    };
    let bob_events = watch(&bob).await.unwrap();
    let alice_events = watch(&alice).await.unwrap();
    let (status, _) =
        ask(server, &alice, "POST", "/conversations/alices/messages", Some(&json!({"message": "again"}))).await;
    assert_eq!(status, 202);
    let events = EventStream::new(alice_events).collect().await;
    assert_eq!(events.last().unwrap()["type"], "turn-sealed");
    let mut bob_stream = EventStream::new(bob_events);
    let heard = tokio::time::timeout(Duration::from_millis(500), bob_stream.next_event()).await;
    assert!(!matches!(heard, Ok(Some(_))), "bob heard alice's turn: {heard:?}");
    // An administrator may do anything: here, delete it.
    let (status, _) = ask(server, &admin, "DELETE", "/conversations/alices", None).await;
    assert_eq!(status, 204);
}

#[tokio::test]
async fn another_subjects_conversation_answers_as_an_unknown_id_on_every_route() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(config_with_secret(dir.path())).await;
    walk_every_route(&server).await;
}

#[cfg(feature = "cluster")]
#[tokio::test]
async fn another_subjects_conversation_answers_as_an_unknown_id_on_postgres() {
    let Some(database) = dispatch_testkit::postgres::fresh_database().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_with_secret(dir.path());
    config.database = Database::Postgres(database.url.clone());
    let server = TestServer::start(config).await;
    walk_every_route(&server).await;
}

#[tokio::test]
async fn a_websocket_session_hears_and_follows_only_its_subjects_conversations() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(config_with_secret(dir.path())).await;
    let (alice, bob) = (hs256(user("alice"), SECRET.as_bytes()), hs256(user("bob"), SECRET.as_bytes()));
    let (mut ws, _) =
        tokio_tungstenite::connect_async(format!("ws://{}/ws?access_token={bob}", server.addr)).await.unwrap();
    ws.send(Message::text(json!({"type": "chat.subscribe", "conversationId": "alices"}).to_string())).await.unwrap();
    ws.send(Message::text(json!({"type": "chat.send", "conversationId": "alices", "message": "x"}).to_string()))
        .await
        .unwrap();
    // Once bob's turn is under way (the session took his ops, in order), the id is his.
    let mut seen = Vec::new();
    while !seen.iter().any(|m: &Value| m["type"] == "chat.delta" && m["event"]["conversationId"] == "alices") {
        let Some(Ok(Message::Text(text))) = ws.next().await else { panic!("the socket ended: {seen:?}") };
        seen.push(serde_json::from_str::<Value>(&text).unwrap());
    }
    let (status, _) =
        ask(&server, &alice, "POST", "/conversations/alices/messages", Some(&json!({"message": "hi"}))).await;
    // Bob subscribed first and claimed the id: alice's message is refused, as for a taken id.
    assert_eq!(status, 404);
    let (status, body) =
        ask(&server, &alice, "POST", "/conversations/a2/messages", Some(&json!({"message": "hi"}))).await;
    assert_eq!(status, 202, "{body}");
    ws.send(Message::text(json!({"type": "chat.subscribe", "conversationId": "a2"}).to_string())).await.unwrap();
    ws.send(Message::text(json!({"type": "chat.send", "conversationId": "a2", "message": "x"}).to_string()))
        .await
        .unwrap();
    // Bob hears of his own conversation's turn (the chat.send on `alices`, his) and of nothing
    // of alice's: no delta, no status of a2.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while let Ok(Some(Ok(message))) = tokio::time::timeout_at(deadline, ws.next()).await {
        if let Message::Text(text) = message {
            seen.push(serde_json::from_str::<Value>(&text).unwrap());
        }
    }
    // (A delta names its conversation inside its event.)
    let of_a2 = |m: &&Value| m["conversationId"] == "a2" || m["event"]["conversationId"] == "a2";
    assert!(seen.iter().filter(of_a2).all(|m| m["type"] == "chat.error"), "bob heard of a2: {seen:?}");
    assert!(seen.iter().any(|m| m["type"] == "chat.delta" && m["event"]["type"] == "turn-sealed"), "{seen:?}");
    let errors: Vec<&Value> = seen.iter().filter(|m| m["type"] == "chat.error").collect();
    assert_eq!(errors.len(), 1, "{seen:?}");
    assert_eq!(errors[0]["message"], "no conversation \"a2\"");
    assert!(seen.iter().any(|m| m["type"] == "conversation.statusChanged" && m["conversationId"] == "alices"));
}
