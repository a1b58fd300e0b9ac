//! Gateways joining a bus that asks who they are: a password and verified TLS, an NKEY, a
//! `.creds` file, a key file replaced on disk.

use super::*;

/// The output of a gateway that must refuse to start with `args`.
fn refused_start(args: &[String]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .output()
        .expect("the gateway binary runs");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "started with {args:?}: {said}");
    said
}

/// A NATS server that asks for a user and password over TLS and checks its clients'
/// certificates: gateways with all three join it and watch each other's turns; a wrong
/// password, a server certificate they cannot check, or no client certificate stop a gateway
/// at start with an error that names the bus without its secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_join_a_bus_that_asks_for_a_password_and_verified_tls() {
    let Some(database) = fresh_database().await else { return };
    let file = |name: &str| format!("{}/tests/fixtures/bus-tls/{name}", env!("CARGO_MANIFEST_DIR"));
    let (ca, cert, key) = (file("ca.pem"), file("client.pem"), file("client-key.pem"));
    let server = ["--user", "gw", "--pass", "s3cret", "--tls", "--tlsverify"];
    let server_tls = ["--tlscert", &file("server.pem"), "--tlskey", &file("server-key.pem"), "--tlscacert", &ca];
    let Some(nats) = nats_server_with(&[&server[..], &server_tls[..]].concat()) else { return };
    let host = nats.url.strip_prefix("tls://").expect("a server that requires TLS");
    let bus = |password: &str| format!("tls://gw:{password}@{host}");
    let (good, wrong) = (bus("s3cret"), bus("wrong"));
    let common = ["--database", database.url.as_str(), "--bus-timeout-ms", "3000"];
    let with = |url: &str, tls: &[&str]| -> Vec<String> {
        common.iter().copied().chain(["--bus", url]).chain(tls.iter().copied()).map(str::to_owned).collect()
    };
    let all = ["--bus-ca-file", ca.as_str(), "--bus-client-cert", cert.as_str(), "--bus-client-key", key.as_str()];

    let args: Vec<std::ffi::OsString> = with(&good, &all).into_iter().map(Into::into).collect();
    let a = ChildGateway::spawn(&args);
    let b = ChildGateway::spawn(&args);
    let mut on_a = a.sse("secured", "").await;
    let mut on_b = b.sse("secured", "").await;
    start_turn(&a, "secured", "over TLS").await;
    let everything = read(&on_a.until_sealed().await);
    assert!(everything.iter().any(|(_, e)| e["type"] == "text-delta"));
    assert_eq!(read(&on_b.until_sealed().await), everything, "B watched A's turn over the bus");

    for (args, why) in [
        (with(&wrong, &all), "a wrong password"),
        (with(&good, &all[2..]), "no authority for the server's certificate"),
        (with(&good, &all[..2]), "no client certificate"),
    ] {
        let said = tokio::task::spawn_blocking(move || refused_start(&args)).await.unwrap();
        assert!(said.contains(&format!("cannot connect to NATS at tls://gw:***@{host}")), "{why}: {said}");
        assert!(!said.contains("s3cret") && !said.contains("wrong"), "{why}: the password is out: {said}");
    }
}

/// A NATS credentials file, as `nsc` writes one: the user's JWT and seed.
fn creds_file(jwt: &str, seed: &str) -> String {
    format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n"
    )
}

/// A NATS JWT (`ed25519-nkey`, as nats-io/jwt v2 encodes one): `claims` about `subject`,
/// signed by `issuer`, valid until `expires` (seconds since the epoch) when given.
fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: Value, expires: Option<u64>) -> String {
    use base64::Engine as _;
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let mut claims = json!({
        "jti": format!("{subject}{now}{expires:?}"), "iat": now, "iss": issuer.public_key(), "name": name,
        "sub": subject, "nats": nats,
    });
    if let Some(expires) = expires {
        claims["exp"] = json!(expires);
    }
    let input = format!("{}.{}", b64(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#), b64(claims.to_string().as_bytes()));
    let signature = issuer.sign(input.as_bytes()).expect("a seed signs");
    format!("{input}.{}", b64(&signature))
}

/// NATS in operator mode: the server trusts an operator, which signed an account with
/// JetStream on (and the system account JetStream needs), which signs its users' JWTs.
struct Operator {
    /// The server's configuration.
    config: String,
    account: nkeys::KeyPair,
}

impl Operator {
    fn new() -> Operator {
        let operator = nkeys::KeyPair::new_operator();
        let account = nkeys::KeyPair::new_account();
        let operator_jwt =
            nats_jwt(&operator, &operator.public_key(), "op", json!({"type": "operator", "version": 2}), None);
        let unlimited = json!({
            "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": true, "conn": -1,
            "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
        });
        let claims = json!({"limits": unlimited, "type": "account", "version": 2});
        let account_jwt = nats_jwt(&operator, &account.public_key(), "dispatch", claims, None);
        let system = nkeys::KeyPair::new_account();
        let system_jwt =
            nats_jwt(&operator, &system.public_key(), "SYS", json!({"type": "account", "version": 2}), None);
        let config = format!(
            "operator: {operator_jwt}\nsystem_account: {system}\nresolver: MEMORY\n\
             resolver_preload: {{ {system}: {system_jwt}, {account}: {account_jwt} }}\n",
            system = system.public_key(),
            account = account.public_key(),
        );
        Operator { config, account }
    }

    /// A `.creds` file for a new user of `account`, valid until `expires` when given.
    fn user_creds(account: &nkeys::KeyPair, expires: Option<u64>) -> (String, String) {
        let claims = json!({"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2});
        let user = nkeys::KeyPair::new_user();
        let seed = user.seed().unwrap();
        (creds_file(&nats_jwt(account, &user.public_key(), "gw", claims, expires), &seed), seed)
    }
}

/// A NATS configuration that knows one user, by its NKEY, with only the permissions
/// docs/cluster.md lists for a gateway.
fn listing(user: &nkeys::KeyPair) -> String {
    let permissions = r#"permissions: {
        publish: ["dispatch.>", "$JS.API.>", "_INBOX.>"],
        subscribe: ["dispatch.>", "_INBOX.>", "$JS.EVENT.ADVISORY.STREAM.CREATED.DISPATCH"]
    }"#;
    format!("authorization {{ users = [ {{ nkey: \"{}\", {permissions} }} ] }}\n", user.public_key())
}

/// Whether `gateway` was refused something its permissions do not allow.
fn violated(gateway: &ChildGateway) -> bool {
    gateway.logs.lock().unwrap().iter().any(|l| l.to_string().to_lowercase().contains("permissions violation"))
}

/// A folder of files a test writes, named by their paths.
struct Files(tempfile::TempDir);

impl Files {
    fn new() -> Files {
        Files(tempfile::tempdir().unwrap())
    }

    fn write(&self, name: &str, text: &str) -> String {
        let path = self.0.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    }
}

/// The arguments of a gateway on `database` that joins `bus` with the key file `file` (`flag`).
fn keyed(database: &str, bus: &str, flag: &str, file: &str) -> Vec<std::ffi::OsString> {
    ["--database", database, "--bus-timeout-ms", "3000", "--bus", bus, flag, file].map(Into::into).to_vec()
}

/// A NATS server that knows its clients by NKEY, and one in operator mode that knows them by
/// the JWTs in their `.creds` files: gateways with the right key file join each and watch each
/// other's turns; a key the server does not know or a file that holds no user seed stop a
/// gateway at start with an error that shows no seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_join_a_bus_by_nkey_and_by_a_creds_file() {
    let Some(database) = fresh_database().await else { return };
    let files = Files::new();
    let with = |bus: &str, flag: &str, file: &str| keyed(&database.url, bus, flag, file);
    let both = |args: Vec<std::ffi::OsString>| (ChildGateway::spawn(&args), ChildGateway::spawn(&args));
    let refused = |args: Vec<std::ffi::OsString>| async move {
        let args: Vec<String> = args.into_iter().map(|a| a.into_string().unwrap()).collect();
        tokio::task::spawn_blocking(move || refused_start(&args)).await.unwrap()
    };

    // NKEY: the server lists the user's public key.
    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().unwrap();
    let Some(nats) = nats_server_configured(&listing(&user)) else { return };
    let (a, b) = both(with(&nats.url, "--bus-nkey", &files.write("gw.nk", &format!("{seed}\n"))));
    watched_across(&a, &b, "by-nkey").await;
    assert!(!violated(&a) && !violated(&b), "the documented permissions are enough");

    let stranger = nkeys::KeyPair::new_user().seed().unwrap();
    let account = nkeys::KeyPair::new_account().seed().unwrap();
    for (file, why, says) in [
        (files.write("stranger.nk", &stranger), "a key the server does not list", "cannot connect to NATS at"),
        (files.write("account.nk", &account), "an account's seed", "holds a seed, but not a user's"),
        (files.write("garbage.nk", "SUnot-a-seed"), "no seed", "does not hold an NKEY seed"),
    ] {
        let said = refused(with(&nats.url, "--bus-nkey", &file)).await;
        assert!(said.contains(says), "{why}: {said}");
        for secret in [&stranger, &account, "SUnot-a-seed"] {
            assert!(!said.contains(secret), "{why}: a seed is out: {said}");
        }
    }

    // Operator mode: the user's JWT in the `.creds` file, signed by the account.
    let operator = Operator::new();
    let Some(nats) = nats_server_configured(&operator.config) else { return };
    let (creds, _) = Operator::user_creds(&operator.account, None);
    let (a, b) = both(with(&nats.url, "--bus-creds", &files.write("gw.creds", &creds)));
    watched_across(&a, &b, "by-creds").await;

    // A user signed by an account the operator never signed.
    let (stranger, stranger_seed) = Operator::user_creds(&nkeys::KeyPair::new_account(), None);
    let said = refused(with(&nats.url, "--bus-creds", &files.write("stranger.creds", &stranger))).await;
    assert!(said.contains("cannot connect to NATS at"), "{said}");
    assert!(!said.contains(&stranger_seed), "the seed is out: {said}");
    let said = refused(with(&nats.url, "--bus-creds", &files.write("empty.creds", ""))).await;
    assert!(said.contains("cannot connect to NATS at") && said.contains("JWT"), "{said}");
}

/// How many times `gateway` has lost the bus.
fn losses(gateway: &ChildGateway) -> usize {
    logged(gateway, "lost the bus: reconnecting")
}

/// Once the server has dropped both gateways: they come back, each watching the other's turns
/// (within a minute), on connections that hold.
async fn back_on_the_bus(a: &ChildGateway, b: &ChildGateway, conversation: &str) {
    assert!(eventually(600, || async { losses(a) >= 1 && losses(b) >= 1 }).await, "the server dropped the gateways");
    let both_ways = async {
        watched_across(a, b, &format!("{conversation}-a")).await;
        watched_across(b, a, &format!("{conversation}-b")).await;
    };
    let back = tokio::time::timeout(std::time::Duration::from_secs(60), both_ways).await;
    assert!(back.is_ok(), "the gateways are back on the bus");
    assert_eq!((losses(a), losses(b)), (1, 1), "the connections signed in with the new key held");
}

/// A key file replaced on disk is what the gateway signs in with when it reconnects, with no
/// restart: an NKEY the server stopped listing (its configuration reloaded, which disconnects
/// the gateways), and a `.creds` file whose JWT expired (the server disconnects them at the
/// expiry). Without reading the file again, the gateways would sign in with the old key for as
/// long as they run, refused every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_replaced_on_disk_signs_the_gateway_in_when_it_reconnects() {
    let Some(database) = fresh_database().await else { return };
    let files = Files::new();

    let (old, new) = (nkeys::KeyPair::new_user(), nkeys::KeyPair::new_user());
    let Some(nats) = nats_server_configured(&listing(&old)) else { return };
    let key = files.write("gw.nk", &old.seed().unwrap());
    let args = keyed(&database.url, &nats.url, "--bus-nkey", &key);
    let (a, b) = (ChildGateway::spawn(&args), ChildGateway::spawn(&args));
    watched_across(&a, &b, "nkey-before").await;
    files.write("gw.nk", &new.seed().unwrap());
    nats.reconfigure(&listing(&new));
    back_on_the_bus(&a, &b, "nkey-after").await;
    assert!(!violated(&a) && !violated(&b), "the documented permissions are enough");

    let operator = Operator::new();
    let Some(nats) = nats_server_configured(&operator.config) else { return };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let (expiring, _) = Operator::user_creds(&operator.account, Some(now + 6));
    let creds = files.write("gw.creds", &expiring);
    let args = keyed(&database.url, &nats.url, "--bus-creds", &creds);
    let (a, b) = (ChildGateway::spawn(&args), ChildGateway::spawn(&args));
    files.write("gw.creds", &Operator::user_creds(&operator.account, None).0);
    back_on_the_bus(&a, &b, "creds-after").await;
}
