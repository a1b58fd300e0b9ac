//! Upstreams through proxies: CONNECT tunnels, HTTP and HTTPS proxies, SOCKS5, NO_PROXY, and
//! proxies that fail.

use super::*;

/// The real binary, its credentials and proxies from the environment (as an operator sets them).
fn child_gateway(dir: &std::path::Path, env: &[(&str, String)]) -> ChildGateway {
    let args: Vec<std::ffi::OsString> = vec!["--database".into(), dir.join("gateway.db").into()];
    let mut env: Vec<(&str, String)> = env.to_vec();
    env.push(("DISPATCH_TEST_UPSTREAM_KEY", "sk-test".into()));
    let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    ChildGateway::spawn_with_env(&args, &pairs)
}

/// An `openai` credential `name` for `base_url`, as environment variables.
fn credential_env(name: &'static str, base_url: &str) -> Vec<(&'static str, String)> {
    let key = |field: &str| -> &'static str { format!("DISPATCH_CREDENTIALS__{name}__{field}").leak() };
    vec![
        (key("KIND"), "openai".into()),
        (key("BASE_URL"), base_url.into()),
        (key("MODELS"), r#"["m1"]"#.into()),
        (key("API_KEY_ENV"), "DISPATCH_TEST_UPSTREAM_KEY".into()),
    ]
}

async fn chat_on(gateway: &ChildGateway, conversation: &str, model: &str) -> Vec<Value> {
    gateway.chat_stream(json!({"conversationId": conversation, "message": "hi", "model": model})).await.collect().await
}

fn text(events: &[Value]) -> String {
    events.iter().filter(|e| e["type"] == "text-delta").map(|e| e["delta"].as_str().unwrap()).collect()
}

/// An HTTP proxy on a real socket. It records the first request head of each connection; a
/// plain request goes on to `upstream` as it came; a CONNECT is answered 200 and the tunnel's
/// TLS ended here with the certificate of the host it names, the plaintext going on to
/// `upstream`.
struct TestProxy {
    addr: std::net::SocketAddr,
    heads: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl TestProxy {
    async fn start(
        upstream: std::net::SocketAddr,
        hosts: BTreeMap<String, std::sync::Arc<rustls::ServerConfig>>,
    ) -> TestProxy {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (kept, hosts) = (heads.clone(), std::sync::Arc::new(hosts));
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (heads, hosts) = (kept.clone(), hosts.clone());
                tokio::spawn(async move {
                    let Some((buf, end)) = common::upstream::read_head(&mut socket).await else { return };
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    heads.lock().unwrap().push(head.clone());
                    let mut server = tokio::net::TcpStream::connect(upstream).await.unwrap();
                    if let Some(target) = head.strip_prefix("CONNECT ") {
                        let host = target.split(':').next().unwrap();
                        let Some(config) = hosts.get(host) else { return };
                        socket.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await.unwrap();
                        // The gateway ends the handshake when it rejects the certificate.
                        let Ok(mut tls) = tokio_rustls::TlsAcceptor::from(config.clone()).accept(socket).await else {
                            return;
                        };
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
                    } else {
                        server.write_all(&buf).await.unwrap();
                        let _ = tokio::io::copy_bidirectional(&mut socket, &mut server).await;
                    }
                });
            }
        });
        TestProxy { addr, heads }
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

/// A TLS server's configuration: this certificate and its key.
fn tls_server(cert: &rcgen::Certificate, key: &rcgen::KeyPair) -> std::sync::Arc<rustls::ServerConfig> {
    let key = rustls::pki_types::PrivatePkcs8KeyDer::from(key.serialize_der());
    let config =
        rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key.into())
            .unwrap();
    std::sync::Arc::new(config)
}

/// A test certificate authority, its certificate written to `ca.pem` in `dir` (for
/// `SSL_CERT_FILE`).
fn test_ca(dir: &std::path::Path) -> (TestCa, std::path::PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(rcgen::DnType::CommonName, "dispatch test CA");
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    (TestCa(ca), ca_file)
}

struct TestCa(rcgen::CertifiedIssuer<'static, rcgen::KeyPair>);

impl TestCa {
    /// A TLS server's configuration with a certificate for `host` this authority signed.
    fn server(&self, host: &str) -> std::sync::Arc<rustls::ServerConfig> {
        let (params, key) = server_params(host);
        tls_server(&params.signed_by(&key, &self.0).unwrap(), &key)
    }
}

/// A server certificate's parameters for `host`, and its key.
fn server_params(host: &str) -> (rcgen::CertificateParams, rcgen::KeyPair) {
    let mut params = rcgen::CertificateParams::new(vec![host.to_owned()]).unwrap();
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    (params, rcgen::KeyPair::generate().unwrap())
}

/// A TLS server on a real socket in front of `upstream`: each connection's TLS ends here (with
/// `config`'s certificate) and its plaintext goes on to `upstream`.
async fn tls_front(
    upstream: std::net::SocketAddr,
    config: std::sync::Arc<rustls::ServerConfig>,
) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let acceptor = tokio_rustls::TlsAcceptor::from(config.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(socket).await else { return };
                let mut server = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
            });
        }
    });
    addr
}

/// An HTTPS upstream goes through `HTTPS_PROXY`'s CONNECT tunnel, with the proxy's credentials,
/// and its certificate is checked against the roots (here `SSL_CERT_FILE`'s test CA): a host
/// whose certificate no root signed is never sent the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_is_reached_through_a_connect_tunnel_and_its_certificate_checked() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, ca_file) = test_ca(dir.path());
    let trusted = ca.server("upstream.test");
    let (params, key) = server_params("rogue.test");
    let rogue = tls_server(&params.self_signed(&key).unwrap(), &key);

    let upstream =
        FakeUpstream::start(vec![Reply::Stream(vec![delta(json!({"content": "through the tunnel"})), finish("stop")])])
            .await;
    let hosts = BTreeMap::from([("upstream.test".to_owned(), trusted), ("rogue.test".to_owned(), rogue)]);
    let proxy = TestProxy::start(upstream.addr, hosts).await;
    let mut env = vec![
        ("HTTPS_PROXY", format!("http://tunnel:s3cret@{}", proxy.addr)),
        ("SSL_CERT_FILE", ca_file.to_string_lossy().into_owned()),
    ];
    env.extend(credential_env("UP", "https://upstream.test/v1"));
    env.extend(credential_env("ROGUE", "https://rogue.test/v1"));
    let gateway = child_gateway(dir.path(), &env);

    let events = chat_on(&gateway, "c1", "up/m1").await;
    assert_eq!(text(&events), "through the tunnel", "{events:?}");
    assert_eq!(events.last().unwrap()["type"], "turn-sealed");
    let head = proxy.heads()[0].to_lowercase();
    assert!(head.starts_with("connect upstream.test:443 http/1.1\r\n"), "{head}");
    // base64("tunnel:s3cret")
    assert!(head.contains("proxy-authorization: basic dhvubmvsonmzy3jlda==\r\n"), "{head}");
    let requests = upstream.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].authorization.as_deref(), Some("Bearer sk-test"));

    let events = chat_on(&gateway, "c2", "rogue/m1").await;
    turn_error(&events, "unavailable", "certificate");
    assert!(proxy.heads().iter().any(|h| h.starts_with("CONNECT rogue.test:443 ")));
    assert_eq!(upstream.requests().len(), 1, "the request never went out");
    gateway.terminate();
}

/// A plain-HTTP upstream goes through `HTTP_PROXY`, the request in absolute form with the
/// proxy's credentials, unless `NO_PROXY` names its host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_upstream_is_asked_through_the_proxy_unless_no_proxy_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let reply = || Reply::Stream(vec![delta(json!({"content": "hello"})), finish("stop")]);
    let upstream = FakeUpstream::start(vec![reply(), reply()]).await;
    let proxy = TestProxy::start(upstream.addr, BTreeMap::new()).await;
    let mut env = vec![
        ("HTTP_PROXY", format!("http://someone:pw@{}", proxy.addr)),
        ("NO_PROXY", "localhost,127.0.0.1".to_owned()),
    ];
    // Only the proxy knows the first host.
    env.extend(credential_env("VIA", "http://upstream.test/v1"));
    env.extend(credential_env("DIRECT", &upstream.base_url()));
    let gateway = child_gateway(dir.path(), &env);

    let events = chat_on(&gateway, "c1", "via/m1").await;
    assert_eq!(text(&events), "hello", "{events:?}");
    let heads = proxy.heads();
    assert_eq!(heads.len(), 1);
    let head = heads[0].to_lowercase();
    assert!(head.starts_with("post http://upstream.test/v1/chat/completions http/1.1\r\n"), "{head}");
    // base64("someone:pw")
    assert!(head.contains("proxy-authorization: basic c29tzw9uztpwdw==\r\n"), "{head}");

    let events = chat_on(&gateway, "c2", "direct/m1").await;
    assert_eq!(text(&events), "hello", "{events:?}");
    assert_eq!(proxy.heads().len(), 1, "NO_PROXY's host was asked directly");
    assert_eq!(upstream.requests().len(), 2);
    gateway.terminate();
}

/// An `https://` proxy is spoken to over TLS, its certificate checked against the roots (here
/// `SSL_CERT_FILE`'s test CA): a plain-HTTP upstream is asked through it in absolute form, an
/// HTTPS one through a CONNECT tunnel inside that TLS, both with the proxy's credentials; a
/// proxy whose certificate no root signed fails the turn `unavailable`, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_proxy_is_spoken_to_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, ca_file) = test_ca(dir.path());
    let reply = || Reply::Stream(vec![delta(json!({"content": "over tls"})), finish("stop")]);
    let upstream = FakeUpstream::start(vec![reply(), reply()]).await;
    let hosts = BTreeMap::from([("upstream.test".to_owned(), ca.server("upstream.test"))]);
    let proxy = TestProxy::start(upstream.addr, hosts).await;
    // The proxy's own TLS ends in front of it.
    let front = tls_front(proxy.addr, ca.server("localhost")).await.port();
    let (params, key) = server_params("localhost");
    let rogue = tls_front(proxy.addr, tls_server(&params.self_signed(&key).unwrap(), &key)).await.port();
    let gateway_through = |front: u16, name: &str| {
        let mut env = vec![
            ("HTTPS_PROXY", format!("https://tunnel:s3cret@localhost:{front}")),
            ("HTTP_PROXY", format!("https://someone:pw@localhost:{front}")),
            ("SSL_CERT_FILE", ca_file.to_string_lossy().into_owned()),
        ];
        env.extend(credential_env("PLAIN", "http://upstream.test/v1"));
        env.extend(credential_env("TLS", "https://upstream.test/v1"));
        child_gateway(&dir.path().join(name), &env)
    };
    let gateway = gateway_through(front, "a");
    for (conversation, model) in [("c1", "plain/m1"), ("c2", "tls/m1")] {
        let events = chat_on(&gateway, conversation, model).await;
        assert_eq!(text(&events), "over tls", "{model}: {events:?}");
    }
    let heads: Vec<String> = proxy.heads().iter().map(|h| h.to_lowercase()).collect();
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert!(heads[0].starts_with("post http://upstream.test/v1/chat/completions http/1.1\r\n"), "{}", heads[0]);
    // base64("someone:pw"), base64("tunnel:s3cret")
    assert!(heads[0].contains("proxy-authorization: basic c29tzw9uztpwdw==\r\n"), "{}", heads[0]);
    assert!(heads[1].starts_with("connect upstream.test:443 http/1.1\r\n"), "{}", heads[1]);
    assert!(heads[1].contains("proxy-authorization: basic dhvubmvsonmzy3jlda==\r\n"), "{}", heads[1]);

    let untrusted = gateway_through(rogue, "b");
    for (conversation, model) in [("c3", "plain/m1"), ("c4", "tls/m1")] {
        let events = chat_on(&untrusted, conversation, model).await;
        let error = turn_error(&events, "unavailable", &format!("the proxy https://localhost:{rogue}/: "));
        assert!(error["message"].as_str().unwrap().contains("certificate"), "{error}");
    }
    assert_eq!(proxy.heads().len(), 2, "nothing was asked through the untrusted proxy");
    gateway.terminate();
    untrusted.terminate();
}

/// A proxy that is not there fails the turn `unavailable`, naming the proxy (not the upstream,
/// which was never asked), for a plain-HTTP upstream and for a tunnel alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_cannot_be_reached_fails_the_turn_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut env = vec![
        ("HTTP_PROXY", format!("http://someone:pw@{nobody}")),
        ("HTTPS_PROXY", format!("http://someone:pw@{nobody}")),
    ];
    env.extend(credential_env("PLAIN", "http://upstream.test/v1"));
    env.extend(credential_env("TLS", "https://upstream.test/v1"));
    let gateway = child_gateway(dir.path(), &env);
    for (conversation, model) in [("c1", "plain/m1"), ("c2", "tls/m1")] {
        let events = chat_on(&gateway, conversation, model).await;
        let error = turn_error(&events, "unavailable", &format!("the proxy http://{nobody}/: "));
        assert!(error["message"].as_str().unwrap().contains("refused"), "{error}");
    }
    gateway.terminate();
}

/// A proxy that takes the connection and never answers (a CONNECT tunnel, a SOCKS5 handshake)
/// is given up within the credential's connect timeout: the turn fails `unavailable` naming
/// the proxy, not later as an upstream that took the request and went quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_never_answers_is_given_up_within_the_connect_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let mut env = vec![
        ("HTTPS_PROXY", format!("http://{silent}")),
        ("HTTP_PROXY", format!("socks5h://{silent}")),
        ("DISPATCH_CREDENTIALS__TLS__CONNECT_TIMEOUT_SECS", "1".to_owned()),
        ("DISPATCH_CREDENTIALS__SOCKS__CONNECT_TIMEOUT_SECS", "1".to_owned()),
        // Past the connect timeout and its retries (about 5 s): an idle timeout ends it otherwise.
        ("DISPATCH_CREDENTIALS__TLS__IDLE_TIMEOUT_SECS", "30".to_owned()),
        ("DISPATCH_CREDENTIALS__SOCKS__IDLE_TIMEOUT_SECS", "30".to_owned()),
    ];
    env.extend(credential_env("TLS", "https://upstream.test/v1"));
    env.extend(credential_env("SOCKS", "http://upstream.test/v1"));
    let gateway = child_gateway(dir.path(), &env);
    for (conversation, model, scheme) in [("c1", "tls/m1", "http"), ("c2", "socks/m1", "socks5h")] {
        let events = chat_on(&gateway, conversation, model).await;
        let error = turn_error(&events, "unavailable", &format!("the proxy {scheme}://{silent}/: "));
        assert!(error["message"].as_str().unwrap().contains("no way through within 1 s"), "{error}");
    }
    gateway.terminate();
}

/// A SOCKS5 proxy (Debian's microsocks, asking for a user and password, its connections out
/// made from 127.0.0.2) in `ALL_PROXY`: plain and HTTPS upstreams (TLS end to end, checked for
/// the upstream's name) are reached through it whether the proxy resolves the host
/// (`socks5h://`: it is sent the name) or the gateway does (`socks5://`: the address); wrong
/// credentials, or no proxy there, fail the turn `unavailable`, naming the proxy and never its
/// password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_is_reached_through_a_socks5_proxy() {
    let install = "apt-get install microsocks";
    let Some(microsocks) = program("DISPATCH_TEST_MICROSOCKS", "microsocks", "DISPATCH_REQUIRE_MICROSOCKS", install)
    else {
        return;
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    // It logs each connection's target as the client named it.
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut proxy = std::process::Command::new(microsocks)
        .args(["-i", "127.0.0.1", "-p", &port, "-u", "socks", "-P", "s3cret", "-b", "127.0.0.2"])
        .stdout(std::process::Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .expect("microsocks starts");
    let up = eventually(100, || async { tokio::net::TcpStream::connect(format!("127.0.0.1:{port}")).await.is_ok() });
    assert!(up.await, "microsocks listens");

    let reply = || Reply::Stream(vec![delta(json!({"content": "through socks"})), finish("stop")]);
    let upstream = FakeUpstream::start((0..4).map(|_| reply()).collect()).await;
    // HTTPS as well: TLS runs end to end through the tunnel, checked for the upstream's name
    // (`SSL_CERT_FILE`'s test CA signed a certificate for `localhost`).
    let dir = tempfile::tempdir().unwrap();
    let (ca, ca_file) = test_ca(dir.path());
    let tls_port = tls_front(upstream.addr, ca.server("localhost")).await.port();
    // A name, not an address: the socks5h proxy resolves it.
    let plain_url = format!("http://localhost:{}/v1", upstream.addr.port());
    let tls_url = format!("https://localhost:{tls_port}/v1");
    let through = |scheme: &str, password: &str, name: &str| {
        let mut env = vec![
            ("ALL_PROXY", format!("{scheme}://socks:{password}@127.0.0.1:{port}")),
            ("SSL_CERT_FILE", ca_file.to_string_lossy().into_owned()),
        ];
        env.extend(credential_env("UP", &plain_url));
        env.extend(credential_env("TLS", &tls_url));
        child_gateway(&dir.path().join(name), &env)
    };
    let remote_dns = through("socks5h", "s3cret", "a");
    let local_dns = through("socks5", "s3cret", "b");
    for (gateway, conversation) in [(&remote_dns, "c1"), (&local_dns, "c2")] {
        for model in ["up/m1", "tls/m1"] {
            let events = chat_on(gateway, conversation, model).await;
            assert_eq!(text(&events), "through socks", "{model}: {events:?}");
        }
    }
    // The plain requests came from the proxy (the TLS ones from the test's TLS front).
    let peers: Vec<_> = upstream.requests().iter().map(|r| r.peer.unwrap().ip().to_string()).collect();
    assert_eq!(peers.iter().filter(|p| *p == "127.0.0.2").count(), 2, "{peers:?}");
    let targets: Vec<String> = std::fs::read_to_string(log.path())
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once("connected to ").map(|(_, target)| target.to_owned()))
        .collect();
    let (plain, tls) = (upstream.addr.port(), tls_port);
    let expected = [
        format!("localhost:{plain}"),
        format!("localhost:{tls}"),
        format!("127.0.0.1:{plain}"),
        format!("127.0.0.1:{tls}"),
    ];
    assert_eq!(targets, expected, "socks5h sent the name, socks5 the address the gateway resolved");

    let refused = through("socks5h", "wrong", "c");
    let error = turn_error(&chat_on(&refused, "c3", "up/m1").await, "unavailable", "credentials not accepted").clone();
    let _ = proxy.kill();
    let _ = proxy.wait();
    let gone = turn_error(&chat_on(&remote_dns, "c4", "up/m1").await, "unavailable", "refused").clone();
    for error in [error, gone] {
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(&format!("the proxy socks5h://127.0.0.1:{port}/")), "{message}");
        assert!(!message.contains("s3cret") && !message.contains("wrong"), "{message}");
    }
    assert_eq!(upstream.requests().len(), 4, "no request went out without the proxy");
    for gateway in [remote_dns, local_dns, refused] {
        gateway.terminate();
    }
}
