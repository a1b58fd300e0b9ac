//! Browsers: the session cookie, its origin, and a web root served from the gateway's own origin.

use super::*;

#[tokio::test]
async fn the_session_cookie_signs_a_browser_in_and_needs_its_own_origin_to_change_state() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(config_with_secret(dir.path())).await;
    let token = hs256(user("alice"), SECRET.as_bytes());
    let r = server.client.post(server.url("/auth/session")).json(&json!({"token": token})).send().await.unwrap();
    assert_eq!(r.status(), 204);
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_owned();
    for part in ["dispatch_session=", "HttpOnly", "SameSite=Strict", "Path=/", "Max-Age="] {
        assert!(cookie.contains(part), "{cookie}");
    }
    assert!(!cookie.contains("Secure"), "not over TLS");
    let pair = cookie.split(';').next().unwrap().to_owned();
    let with_cookie = |method: reqwest::Method, path: &str| {
        server.client.request(method, server.url(path)).header("cookie", &pair).timeout(Duration::from_secs(5))
    };
    let (status, body) = read_json(with_cookie(reqwest::Method::GET, "/auth/session").send().await.unwrap()).await;
    assert_eq!((status, body["subject"].as_str(), body["admin"].as_bool()), (200, Some("alice"), Some(false)));
    assert!(body["expiresAt"].as_i64().unwrap() > 0);
    // Reads with the cookie alone.
    let r = with_cookie(reqwest::Method::GET, "/conversations").send().await.unwrap();
    assert_eq!(r.status(), 200);
    // A state change with the cookie alone: refused without an Origin or from another one.
    let send = |origin: Option<&str>| {
        let mut request =
            with_cookie(reqwest::Method::POST, "/conversations").json(&json!({"id": format!("c{}", origin.is_some())}));
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        request.send()
    };
    let (status, body) = read_json(send(None).await.unwrap()).await;
    assert_eq!(status, 403, "{body}");
    let (status, _) = read_json(send(Some("http://evil.test")).await.unwrap()).await;
    assert_eq!(status, 403);
    let own = format!("http://{}", server.addr);
    let (status, body) = read_json(send(Some(&own)).await.unwrap()).await;
    assert_eq!(status, 201, "from the gateway's own origin: {body}");
    assert_eq!(body["owner"], "alice");
    // Signing out ends the session everywhere: the cookie no longer works.
    let r = with_cookie(reqwest::Method::DELETE, "/auth/session").header("origin", &own).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert!(r.headers()["set-cookie"].to_str().unwrap().contains("Max-Age=0"));
    let (status, _) = read_json(with_cookie(reqwest::Method::GET, "/conversations").send().await.unwrap()).await;
    assert_eq!(status, 401);
    // A bad token signs nobody in.
    let r = server.client.post(server.url("/auth/session")).json(&json!({"token": "nope"})).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.headers().get("set-cookie").is_none());
}

#[tokio::test]
async fn a_web_root_is_served_from_the_gateways_own_origin() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("web");
    std::fs::create_dir_all(root.join("assets")).unwrap();
    std::fs::write(root.join("index.html"), "<!doctype html><title>client</title>").unwrap();
    std::fs::write(root.join("assets/app.js"), "console.log(1)").unwrap();
    std::fs::write(dir.path().join("outside.txt"), "secret").unwrap();
    let mut config = config_with_secret(dir.path());
    config.web_root = Some(root.clone());
    std::fs::write(root.join(".env"), "SECRET=hidden").unwrap();
    std::fs::create_dir_all(root.join(".git")).unwrap();
    std::fs::write(root.join(".git/config"), "hidden").unwrap();
    std::os::unix::fs::symlink(root.join(".env"), root.join("env.txt")).unwrap();
    let server = TestServer::start(config).await;
    // Not signed in: every path is sent to the console's sign-in, with the way back.
    let anonymous = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    for (path, next) in [("/app/", "%2Fapp%2F"), ("/app/assets/app.js?v=1", "%2Fapp%2Fassets%2Fapp%2Ejs%3Fv%3D1")] {
        let r = anonymous.get(server.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 303, "{path}");
        assert_eq!(r.headers()["location"], format!("/?next={next}").as_str(), "{path}");
    }
    let token = hs256(user("alice"), SECRET.as_bytes());
    let get = |path: &str| server.client.get(server.url(path)).bearer_auth(&token).send();
    // Hidden names are never served, nor through a link to one.
    for path in ["/app/.env", "/app/.git/config", "/app/%2eenv"] {
        let r = get(path).await.unwrap();
        let status = r.status();
        let body = r.text().await.unwrap();
        assert!(!body.contains("hidden"), "{path}: {status} {body}");
        assert_eq!(status, 404, "{path}: {body}");
        assert!(serde_json::from_str::<Value>(&body).unwrap()["error"].is_string(), "{path}: {body}");
    }
    let r = get("/app/env.txt").await.unwrap();
    assert!(!r.text().await.unwrap().contains("hidden"), "a link to a hidden name is not followed");
    let r = get("/app/assets/app.js").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/javascript; charset=utf-8");
    assert!(r.headers()["content-security-policy"].to_str().unwrap().contains("frame-ancestors 'none'"));
    assert_eq!(r.text().await.unwrap(), "console.log(1)");
    for path in ["/app/", "/app/some/route"] {
        let r = get(path).await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert!(r.text().await.unwrap().contains("<title>client</title>"), "{path}: index.html");
    }
    let r = get("/app/%2e%2e/outside.txt").await.unwrap();
    assert!(!r.text().await.unwrap().contains("secret"), "nothing outside the root");
    // Nor through a link inside it that points out.
    std::os::unix::fs::symlink(dir.path().join("outside.txt"), dir.path().join("web/link.txt")).unwrap();
    let r = get("/app/link.txt").await.unwrap();
    assert!(!r.text().await.unwrap().contains("secret"), "a link out of the root is not followed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_signs_in_once_and_works_with_the_cookie_alone_and_another_site_cannot() {
    let Some((chromium, playwright)) = browser() else { return };
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("web");
    std::fs::create_dir_all(&root).unwrap();
    let here = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/identity");
    std::fs::copy(here.join("client.js"), root.join("client.js")).unwrap();
    std::fs::write(
        root.join("index.html"),
        "<!doctype html><title>web client</title><script src=\"client.js\"></script>",
    )
    .unwrap();
    let mut config = config_with_secret(dir.path());
    config.web_root = Some(root);
    let server = TestServer::start(config).await;
    let token = hs256(user("alice"), SECRET.as_bytes());
    let env = [("GATEWAY", server.url("")), ("TOKEN", token.clone())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let report = browser_report("identity/drive.mjs", &chromium, &playwright, &env).await;
    // The page: sent to sign in, then back, and everything with the cookie alone.
    let client = &report["client"];
    assert_eq!(report["redirected"], "/?next=%2Fapp%2F", "sent to the console's sign-in with a way back");
    assert_eq!(report["nextElsewhere"], json!(["stayed", "stayed", "stayed"]), "the way back never leaves the gateway");
    assert_eq!(client["who"]["subject"], "alice", "{client}");
    assert_eq!(client["list"], 200, "{client}");
    assert_eq!(client["sent"], 202, "{client}");
    assert_eq!(client["sse"].as_array().unwrap().last().unwrap(), "turn-sealed", "{client}");
    assert!(client["sse"].as_array().unwrap().iter().any(|t| t == "text-delta"), "{client}");
    assert_eq!(client["ws"].as_array().unwrap().last().unwrap(), "turn-sealed", "{client}");
    assert!(client["history"].as_u64().unwrap() >= 2, "{client}");
    assert_eq!(report["cookies"], json!([{"name": "dispatch_session", "httpOnly": true, "sameSite": "Strict"}]));
    assert_eq!(report["scriptSeesCookie"], "", "HttpOnly: the page's scripts never see it");
    assert_eq!(report["errors"], json!([]));
    // Another site: reads nothing, sends nothing, opens no session.
    let evil = &report["evil"];
    assert_eq!(evil["read"], "threw", "{evil}");
    assert_eq!(evil["sendJson"], "threw", "{evil}");
    assert_eq!(evil["websocket"], "refused", "{evil}");
    // A page on another loopback port, which the browser sends the cookie: no WebSocket, no
    // read, no state change (the bodyless close included).
    let other = &report["otherPort"];
    assert_eq!(other["read"], "threw", "{other}");
    assert_eq!(other["sendJson"], "threw", "{other}");
    assert_eq!(other["websocket"], "refused", "{other}");
    let (_, closed) = ask(&server, &token, "GET", "/conversations?status=closed", None).await;
    assert_eq!(closed["conversations"], json!([]), "nothing was closed: {closed}");
    let (_, history) =
        read_json(server.client.get(server.url("/conversations/web-sse")).bearer_auth(&token).send().await.unwrap())
            .await;
    let users: Vec<&Value> = history["chunks"].as_array().unwrap().iter().filter(|c| c["role"] == "user").collect();
    assert_eq!(users.len(), 1, "only the page's own message: {history}");
    let (_, list) = ask(&server, &token, "GET", "/conversations", None).await;
    let ids: Vec<&str> = list["conversations"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 2, "web-sse and web-ws, alice's: {ids:?}");
}
