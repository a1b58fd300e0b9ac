//! Signed tokens: public keys without key confusion, and JWKS that rotate, fail, grow or stall.

use super::*;

#[tokio::test]
async fn public_key_tokens_and_no_key_confusion() {
    let dir = tempfile::tempdir().unwrap();
    for kind in ["rsa", "ec"] {
        let (private, public) = key_pair(dir.path(), kind);
        let file = dir.path().join(format!("{kind}-public.pem"));
        std::fs::write(&file, &public).unwrap();
        // The secret too: an HS256 token signed with the public key's bytes is checked
        // against the secret, never against the public key.
        let mut config = config_with_secret(dir.path());
        config.jwt_public_key_file = Some(file);
        let server = TestServer::start(config).await;
        let (alg, key) = match kind {
            "rsa" => (Algorithm::RS256, EncodingKey::from_rsa_pem(&private).unwrap()),
            _ => (Algorithm::ES256, EncodingKey::from_ec_pem(&private).unwrap()),
        };
        let token = encode(&Header::new(alg), &user("bob"), &key).unwrap();
        let (status, body, _) = who(&server, &token).await;
        assert_eq!((status, body["subject"].as_str()), (200, Some("bob")), "{kind}: {body}");
        refused(&server, &hs256(user("mallory"), &public), "signature").await;
        // The other public algorithm is not this key's.
        let other = if alg == Algorithm::RS256 { Algorithm::ES256 } else { Algorithm::RS256 };
        let mut header = Header::new(other);
        header.alg = other;
        let forged = format!(
            "{}.x",
            token.rsplit_once('.').unwrap().0.replacen(
                token.split('.').next().unwrap(),
                &base64_url(&serde_json::to_vec(&header).unwrap()),
                1,
            )
        );
        refused(&server, &forged, "").await;
        server.stop().await;
    }
    // With no secret, HS256 is not taken at all.
    let (_, public) = key_pair(dir.path(), "rsa");
    let file = dir.path().join("only-public.pem");
    std::fs::write(&file, &public).unwrap();
    let mut config = test_config(dir.path());
    config.jwt_public_key_file = Some(file);
    let server = TestServer::start(config).await;
    refused(&server, &hs256(user("mallory"), &public), "HS256").await;
}

fn base64_url(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// What the test's JWKS endpoint does.
#[derive(Clone)]
pub(super) enum Jwks {
    Serve(String),
    Huge,
    Silent,
}

/// A JWKS endpoint on an ephemeral port, answering as `mode` says at each request; counts them.
pub(super) async fn jwks_server(mode: Arc<Mutex<Jwks>>) -> (String, Arc<Mutex<u32>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/jwks.json", listener.local_addr().unwrap());
    let fetches = Arc::new(Mutex::new(0));
    let counted = fetches.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else { return };
            let mode = mode.lock().unwrap().clone();
            *counted.lock().unwrap() += 1;
            tokio::spawn(async move {
                let mut head = vec![0; 4096];
                let _ = socket.read(&mut head).await;
                let body = match mode {
                    Jwks::Serve(body) => body,
                    Jwks::Huge => format!(r#"{{"keys":[],"pad":"{}"}}"#, "x".repeat(3 * 1024 * 1024)),
                    Jwks::Silent => {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        return;
                    }
                };
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(body.as_bytes()).await;
            });
        }
    });
    (url, fetches)
}

/// An RS256 token for `sub` naming the JWKS key `kid`, signed with `key`.
pub(super) fn rs256(kid: &str, key: &EncodingKey, sub: &str) -> String {
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some(kid.to_owned());
    encode(&header, &user(sub), key).unwrap()
}

pub(super) fn jwk_set(keys: &[(&str, &EncodingKey)]) -> String {
    let keys: Vec<Value> = keys
        .iter()
        .map(|(kid, key)| {
            let mut jwk =
                serde_json::to_value(jsonwebtoken::jwk::Jwk::from_encoding_key(key, Algorithm::RS256).unwrap())
                    .unwrap();
            jwk["kid"] = json!(kid);
            jwk
        })
        .collect();
    json!({ "keys": keys }).to_string()
}

#[tokio::test]
async fn jwks_keys_rotate_and_a_jwks_that_is_down_huge_or_slow_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let (one, _) = key_pair(dir.path(), "rsa");
    let (two, _) = key_pair(dir.path(), "rsa");
    let (one, two) = (EncodingKey::from_rsa_pem(&one).unwrap(), EncodingKey::from_rsa_pem(&two).unwrap());
    let signed = rs256;
    let mode = Arc::new(Mutex::new(Jwks::Serve(jwk_set(&[("k1", &one)]))));
    let (url, fetches) = jwks_server(mode.clone()).await;
    let mut config = test_config(dir.path());
    config.jwks_url = Some(url.clone());
    config.jwks_refetch_secs = 1;
    let server = TestServer::start(config).await;
    let (status, body, _) = who(&server, &signed("k1", &one, "carol")).await;
    assert_eq!((status, body["subject"].as_str()), (200, Some("carol")), "{body}");
    // Rotation: the provider publishes k2; a token naming it makes the gateway fetch again.
    *mode.lock().unwrap() = Jwks::Serve(jwk_set(&[("k2", &two)]));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, body, _) = who(&server, &signed("k2", &two, "dave")).await;
    assert_eq!((status, body["subject"].as_str()), (200, Some("dave")), "{body}");
    // Made-up kids do not make a fetch each: at most one per refetch period.
    let before = *fetches.lock().unwrap();
    for i in 0..20 {
        refused(&server, &signed(&format!("nope-{i}"), &one, "eve"), "key").await;
    }
    assert!(*fetches.lock().unwrap() - before <= 2, "unknown kids were rate-limited");
    // A key signed with k1's private key but naming k2 does not verify.
    refused(&server, &signed("k2", &one, "eve"), "signature").await;
    server.stop().await;

    // Down, huge, silent: tokens are refused, saying why, and the gateway serves on.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/jwks.json", listener.local_addr().unwrap())
    };
    for (jwks, says) in [
        (closed, "cannot reach"),
        (jwks_server(Arc::new(Mutex::new(Jwks::Huge))).await.0, "jwks-max-bytes"),
        (jwks_server(Arc::new(Mutex::new(Jwks::Silent))).await.0, "no answer"),
    ] {
        let mut config = test_config(dir.path());
        config.jwks_url = Some(jwks);
        config.jwks_refetch_secs = 1;
        let server = TestServer::start(config).await;
        refused(&server, &signed("k1", &one, "carol"), says).await;
        let (status, _) = read_json(server.client.get(server.url("/health")).send().await.unwrap()).await;
        assert_eq!(status, 200);
        server.stop().await;
    }
}
