//! Credentials that can be taken back: keys made at runtime, and every way of taking a
//! credential back (a revoked key, a sign-out, an administrator ending a subject's sessions, a
//! token past its `exp`, a configured key removed) ends what it opened, open streams included.

use super::*;
use futures_util::StreamExt;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// How long a stream may take to end after its credential is taken back on another gateway
/// (or expires): the gateways look again every two seconds; the rest is slack for a slow CI.
const BOUND: Duration = Duration::from_secs(6);

type Socket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A WebSocket session on `server` with these request headers and query.
async fn ws(server: &TestServer, query: &str, headers: &[(&'static str, String)]) -> Socket {
    let mut request = format!("ws://{}/ws{query}", server.addr).into_client_request().unwrap();
    for (name, value) in headers {
        let name = tokio_tungstenite::tungstenite::http::HeaderName::from_static(name);
        request.headers_mut().insert(name, value.parse().unwrap());
    }
    tokio_tungstenite::connect_async(request).await.expect("the session opens").0
}

/// The close frame the server sends within `BOUND` (code, reason), skipping other messages.
async fn closed(socket: &mut Socket) -> (u16, String) {
    let read = async {
        while let Some(message) = socket.next().await {
            match message {
                Ok(Message::Close(Some(frame))) => return (u16::from(frame.code), frame.reason.to_string()),
                Ok(Message::Close(None)) | Err(_) => return (0, String::new()),
                Ok(_) => {}
            }
        }
        (0, String::new())
    };
    tokio::time::timeout(BOUND, read).await.expect("the session was closed in time")
}

/// An SSE watch of `id` with these request headers, read line by line.
async fn watch(server: &TestServer, id: &str, headers: &[(&str, String)]) -> EventStream {
    let mut request = server.client.get(server.url(&format!("/conversations/{id}/events")));
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    let r = request.send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    EventStream::new(r)
}

/// The `error` event that ends a watch within `BOUND`; then the stream ends, cut (no
/// chunked end: a client cannot take it for whole).
async fn ended(stream: &mut EventStream) -> Value {
    let read = async {
        while let Some(line) = stream.try_next_line().await {
            let Some(data) = line.strip_prefix("data: ") else { continue };
            let event: Value = serde_json::from_str(data).unwrap();
            if event["type"] == "error" {
                return event;
            }
        }
        panic!("the stream ended without an error event");
    };
    let error = tokio::time::timeout(BOUND, read).await.expect("the stream was ended in time");
    let rest = async {
        while let Some(line) = stream.try_next_line().await {
            assert!(line.is_empty(), "nothing after the error: {line:?}");
        }
    };
    tokio::time::timeout(BOUND, rest).await.expect("the stream closed after its error");
    error
}

fn bearer(token: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {token}"))
}

/// Signs in with `token`: the session cookie's `name=value`.
async fn sign_in(server: &TestServer, token: &str) -> String {
    let r = server.client.post(server.url("/auth/session")).json(&json!({"token": token})).send().await.unwrap();
    assert_eq!(r.status(), 204);
    let cookie = r.headers()["set-cookie"].to_str().unwrap();
    cookie.split(';').next().unwrap().to_owned()
}

/// The headers of a page of the gateway's own origin that has the cookie.
fn own_page(server: &TestServer, cookie: &str) -> Vec<(&'static str, String)> {
    vec![("cookie", cookie.to_owned()), ("origin", format!("http://{}", server.addr))]
}

async fn with_cookie(server: &TestServer, cookie: &str, method: reqwest::Method, path: &str) -> u16 {
    let mut request = server.client.request(method, server.url(path));
    for (name, value) in own_page(server, cookie) {
        request = request.header(name, value);
    }
    request.send().await.unwrap().status().as_u16()
}

const ADMIN: &str = "the-operators-key";

fn keys_config(dir: &Path) -> dispatch_gateway::Config {
    let mut config = config_with_secret(dir);
    config.api_keys = vec![ADMIN.into()];
    config
}

/// Makes a key as the administrator: (secret, id).
async fn make_key(server: &TestServer, body: Value) -> (String, String) {
    let (status, made) = ask(server, ADMIN, "POST", "/keys", Some(&body)).await;
    assert_eq!(status, 201, "{made}");
    (made["secret"].as_str().unwrap().to_owned(), made["id"].as_str().unwrap().to_owned())
}

/// A made key works as its own subject within its own quotas, is listed without its secret,
/// and once revoked is refused, its session ends, and its open SSE watch and WebSocket session
/// end at once (an `unauthorized` error; close 1008 with the reason).
#[tokio::test]
async fn a_revoked_key_ends_its_requests_its_sessions_and_its_streams_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(keys_config(dir.path())).await;
    let (secret, id) = make_key(&server, json!({"name": "ci runner", "quotas": {"turns_per_minute": 1}})).await;
    assert!(secret.starts_with("dk_") && secret.len() == 3 + 43, "{secret}");
    let (status, listed) = ask(&server, ADMIN, "GET", "/keys", None).await;
    assert_eq!(status, 200);
    assert_eq!(listed["keys"][0]["id"], id.as_str(), "{listed}");
    assert_eq!(listed["keys"][0]["subject"], format!("key:{id}"));
    assert!(!listed.to_string().contains(&secret[3..]), "the secret is never listed");
    // Only its hash is at rest: no byte of the database's files holds the secret.
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap_or_default();
        assert!(!bytes.windows(secret.len()).any(|w| w == secret.as_bytes()), "the secret is stored");
    }
    let (status, who) = ask(&server, &secret, "GET", "/auth/session", None).await;
    assert_eq!(
        (status, who["subject"].as_str(), who["admin"].as_bool()),
        (200, Some(&*format!("key:{id}")), Some(false))
    );
    // A user key: not the administrators' routes; its quota replaces the configured (none).
    assert_eq!(ask(&server, &secret, "GET", "/keys", None).await.0, 403);
    let message = json!({"message": "hi"});
    assert_eq!(ask(&server, &secret, "POST", "/conversations/k1/messages", Some(&message)).await.0, 202);
    let (status, body) = ask(&server, &secret, "POST", "/conversations/k2/messages", Some(&message)).await;
    assert_eq!((status, body["limit"].as_str()), (429, Some("turns_per_minute")), "{body}");

    let cookie = sign_in(&server, &secret).await;
    let mut sse = watch(&server, "k1", &[bearer(&secret)]).await;
    let mut by_cookie = watch(&server, "k1", &own_page(&server, &cookie)).await;
    let mut socket = ws(&server, &format!("?access_token={secret}"), &[]).await;
    assert_eq!(ask(&server, ADMIN, "DELETE", &format!("/keys/{id}"), None).await.0, 204);
    assert_eq!(ask(&server, ADMIN, "DELETE", &format!("/keys/{id}"), None).await.0, 404);

    for stream in [&mut sse, &mut by_cookie] {
        let error = ended(stream).await;
        assert_eq!(error["code"], "unauthorized", "{error}");
        assert!(error["message"].as_str().unwrap().contains("revoked"), "{error}");
    }
    let (code, reason) = closed(&mut socket).await;
    assert_eq!(code, 1008, "{reason}");
    assert!(reason.contains("revoked"), "{reason}");
    let (status, body) = ask(&server, &secret, "GET", "/conversations", None).await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(with_cookie(&server, &cookie, reqwest::Method::GET, "/auth/session").await, 401);
    assert_eq!(with_cookie(&server, &cookie, reqwest::Method::POST, "/conversations/k1/stop").await, 401);
}

/// Keys are for administrators to make; hostile bodies get a clear 400.
#[tokio::test]
async fn only_administrators_make_keys_and_bad_requests_say_why() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(keys_config(dir.path())).await;
    let alice = hs256(user("alice"), SECRET.as_bytes());
    let (status, body) = ask(&server, &alice, "POST", "/keys", Some(&json!({"name": "mine"}))).await;
    assert_eq!(status, 403, "{body}");
    for (method, path) in
        [("GET", "/keys"), ("DELETE", "/keys/0123456789abcdef"), ("DELETE", "/auth/sessions?subject=bob")]
    {
        assert_eq!(ask(&server, &alice, method, path, None).await.0, 403, "{method} {path} as a user");
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let r = server.client.request(method, server.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path} with no credential");
    }
    let (status, body) = ask(&server, ADMIN, "DELETE", "/auth/sessions", None).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("subject"), "{body}");
    let (status, body) = ask(&server, ADMIN, "DELETE", "/keys/no%0Asuch%1Bkey", None).await;
    assert_eq!(status, 404, "{body}");
    assert!(!body["error"].as_str().unwrap().contains('\u{1b}'), "{body}");
    let r = server.client.post(server.url("/keys")).bearer_auth(ADMIN).header("content-type", "application/json");
    let (status, body) = read_json(r.body("{not json").send().await.unwrap()).await;
    assert_eq!((status, body["error"].as_str()), (400, Some("Invalid JSON body")));
    // An administrator signed in at the console: a page on another loopback port cannot make
    // a key with the cookie; the console's own origin can.
    let cookie = sign_in(&server, ADMIN).await;
    let elsewhere = format!("http://127.0.0.1:{}", server.addr.port() + 1);
    let r = server.client.post(server.url("/keys")).header("cookie", &cookie).header("origin", elsewhere);
    assert_eq!(r.json(&json!({"name": "stolen"})).send().await.unwrap().status(), 403);
    let mut r = server.client.post(server.url("/keys"));
    for (name, value) in own_page(&server, &cookie) {
        r = r.header(name, value);
    }
    assert_eq!(r.json(&json!({"name": "from the console"})).send().await.unwrap().status(), 201);
    let (_, listed) = ask(&server, ADMIN, "GET", "/keys", None).await;
    assert!(!listed.to_string().contains("stolen"), "{listed}");
    for (bad, says) in [
        (json!({}), "name"),
        (json!({"name": ""}), "name"),
        (json!({"name": "x".repeat(300)}), "name"),
        (json!({"name": "a", "admin": "yes"}), "admin"),
        (json!({"name": "a", "expiresAt": 5}), "expiresAt"),
        (json!({"name": "a", "quotas": {"turns": 1}}), "quotas"),
    ] {
        let (status, body) = ask(&server, ADMIN, "POST", "/keys", Some(&bad)).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body["error"].as_str().unwrap().contains(says), "{bad}: {body}");
    }
    // An expiring admin key works until its expiry.
    let soon = jsonwebtoken::get_current_timestamp() as i64 * 1000 + 60_000;
    let (secret, _) = make_key(&server, json!({"name": "admin for a minute", "admin": true, "expiresAt": soon})).await;
    let (status, who) = ask(&server, &secret, "GET", "/auth/session", None).await;
    assert_eq!(
        (status, who["admin"].as_bool(), who["expiresAt"].as_i64()),
        (200, Some(true), Some(soon / 1000 * 1000))
    );
}

/// A sign-out ends the session's open WebSocket (1008) and watch at once; an administrator's
/// `DELETE /auth/sessions?subject=` ends all of a subject's; a token past its `exp` ends the
/// streams it opened within the bound.
#[tokio::test]
async fn sign_out_an_administrator_and_expiry_end_open_streams() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(keys_config(dir.path())).await;
    let alice = hs256(user("alice"), SECRET.as_bytes());
    let cookie = sign_in(&server, &alice).await;
    let mut socket = ws(&server, "", &own_page(&server, &cookie)).await;
    let mut sse = watch(&server, "a1", &own_page(&server, &cookie)).await;
    assert_eq!(with_cookie(&server, &cookie, reqwest::Method::DELETE, "/auth/session").await, 204);
    // A frame the page sends after the sign-out (before it has read the close) starts nothing.
    use futures_util::SinkExt;
    let late = json!({"type": "chat.send", "conversationId": "after-sign-out", "message": "hi"});
    let _ = socket.send(Message::text(late.to_string())).await;
    let (code, reason) = closed(&mut socket).await;
    assert_eq!((code, reason.as_str()), (1008, "credential taken back: signed out"));
    let (status, _) = ask(&server, ADMIN, "GET", "/conversations/after-sign-out/status", None).await;
    let (_, listed) = ask(&server, ADMIN, "GET", "/conversations", None).await;
    assert!(!listed.to_string().contains("after-sign-out"), "a turn started after the sign-out ({status}): {listed}");
    assert!(ended(&mut sse).await["message"].as_str().unwrap().contains("signed out"));
    assert_eq!(with_cookie(&server, &cookie, reqwest::Method::POST, "/conversations/a1/messages").await, 401);

    // Two sessions of bob, ended by an administrator.
    let bob = hs256(user("bob"), SECRET.as_bytes());
    let (one, two) = (sign_in(&server, &bob).await, sign_in(&server, &bob).await);
    let mut socket = ws(&server, "", &own_page(&server, &two)).await;
    let (status, body) = ask(&server, ADMIN, "DELETE", "/auth/sessions?subject=bob", None).await;
    assert_eq!((status, body["ended"].as_u64()), (200, Some(2)), "{body}");
    assert_eq!(closed(&mut socket).await.0, 1008);
    for cookie in [&one, &two] {
        assert_eq!(with_cookie(&server, cookie, reqwest::Method::GET, "/conversations").await, 401);
    }
    assert_eq!(ask(&server, &bob, "GET", "/conversations", None).await.0, 200, "bob's token itself stands");

    // A token that expires in three seconds: its socket and its watch end soon after.
    let brief = hs256(json!({"sub": "carol", "exp": now() + 3}), SECRET.as_bytes());
    let mut socket = ws(&server, &format!("?access_token={brief}"), &[]).await;
    let mut sse = watch(&server, "c1", &[bearer(&brief)]).await;
    let (code, reason) = closed(&mut socket).await;
    assert_eq!(code, 1008);
    assert!(reason.contains("expired"), "{reason}");
    assert!(ended(&mut sse).await["message"].as_str().unwrap().contains("expired"));
}

/// A session remembers the configured key that made it: restarted without that key, the
/// gateway refuses the cookie.
#[tokio::test]
async fn a_session_ends_with_the_configured_key_that_made_it() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(keys_config(dir.path())).await;
    let cookie = sign_in(&server, ADMIN).await;
    assert_eq!(with_cookie(&server, &cookie, reqwest::Method::GET, "/metrics").await, 200);
    server.stop().await;
    let mut config = keys_config(dir.path());
    config.api_keys = vec!["the-new-operators-key".into()];
    let server = TestServer::start(config).await;
    assert_eq!(with_cookie(&server, &cookie, reqwest::Method::GET, "/metrics").await, 401);
    assert_eq!(with_cookie(&server, &cookie, reqwest::Method::GET, "/conversations").await, 401);
}

/// On two gateways sharing PostgreSQL: a key revoked and a session ended on one end the
/// streams they opened on the other within the bound.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn taking_back_on_one_gateway_ends_streams_on_another() {
    let Some(database) = dispatch_testkit::postgres::fresh_database().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let servers = two_gateways(dir.path(), &database.url, keys_config).await;
    let (a, b) = (&servers[0], &servers[1]);
    let (secret, id) = make_key(a, json!({"name": "shared"})).await;
    let mut sse = watch(b, "x1", &[bearer(&secret)]).await;
    let mut socket = ws(b, &format!("?access_token={secret}"), &[]).await;
    let alice = hs256(user("alice"), SECRET.as_bytes());
    let cookie = sign_in(a, &alice).await;
    let mut by_cookie = ws(b, "", &own_page(b, &cookie)).await;

    assert_eq!(ask(a, ADMIN, "DELETE", &format!("/keys/{id}"), None).await.0, 204);
    assert_eq!(ended(&mut sse).await["code"], "unauthorized");
    assert_eq!(closed(&mut socket).await.0, 1008);
    assert_eq!(ask(b, &secret, "GET", "/conversations", None).await.0, 401);
    assert_eq!(with_cookie(a, &cookie, reqwest::Method::DELETE, "/auth/session").await, 204);
    let (code, reason) = closed(&mut by_cookie).await;
    assert_eq!(code, 1008, "{reason}");
}

/// A key withdrawn from the JWKS: refused from the set's next read on (`--jwks-refresh-secs`),
/// and the streams its tokens opened end then; a token of a key still in the set stands.
#[tokio::test]
async fn a_key_withdrawn_from_the_jwks_is_refused_from_the_next_read_and_ends_its_streams() {
    use super::tokens::{Jwks, jwk_set, jwks_server, rs256 as signed};
    let dir = tempfile::tempdir().unwrap();
    let (one, _) = key_pair(dir.path(), "rsa");
    let (two, _) = key_pair(dir.path(), "rsa");
    let (one, two) = (EncodingKey::from_rsa_pem(&one).unwrap(), EncodingKey::from_rsa_pem(&two).unwrap());
    let mode = Arc::new(Mutex::new(Jwks::Serve(jwk_set(&[("k1", &one), ("k2", &two)]))));
    let (url, _) = jwks_server(mode.clone()).await;
    let mut config = test_config(dir.path());
    config.jwks_url = Some(url);
    config.jwks_refresh_secs = 1;
    let server = TestServer::start(config).await;
    let (frank, grace) = (signed("k1", &one, "frank"), signed("k2", &two, "grace"));
    assert_eq!(who(&server, &frank).await.0, 200);
    let mut sse = watch(&server, "f1", &[bearer(&frank)]).await;
    let mut kept = watch(&server, "g1", &[bearer(&grace)]).await;
    *mode.lock().unwrap() = Jwks::Serve(jwk_set(&[("k2", &two)]));
    let error = ended(&mut sse).await;
    assert_eq!(error["code"], "unauthorized", "{error}");
    refused(&server, &frank, "key").await;
    assert_eq!(who(&server, &grace).await.0, 200, "k2 stands");
    let still = tokio::time::timeout(Duration::from_millis(500), kept.try_next_line()).await;
    assert!(still.is_err() || still.unwrap().is_some_and(|l| !l.contains("unauthorized")), "grace's stream is open");
}
