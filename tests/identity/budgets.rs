//! Quotas that hold against an outsider: many parallel requests of one subject start at most
//! the limit (on one gateway, and on two sharing PostgreSQL), and a turn stopped before its
//! usage came is charged its estimate.

use super::*;

/// "long": a turn that streams a line, then stalls for two minutes (until stopped); "short":
/// one that lasts two seconds (longer than a wave of requests takes to arrive).
fn stalling(dir: &Path) -> std::path::PathBuf {
    let words = "estimate ".repeat(400);
    write_script(
        dir,
        json!({"rules": [
            {"match": "long", "steps": [{"text": words, "stallMs": 120000}]},
            {"match": "short", "steps": [{"text": "ok", "stallMs": 2000}]},
        ]}),
    )
}

/// `n` requests of `token`, each to a conversation of its own, released together on the
/// gateways given in turn: the conversations answered 202, and the limits the others named.
async fn release_together(servers: &[&TestServer], token: &str, n: usize, message: &str) -> (Vec<String>, Vec<String>) {
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let server = servers[i % servers.len()];
        let id = format!("race-{}", uuid::Uuid::new_v4());
        let request = server
            .client
            .post(server.url(&format!("/conversations/{id}/messages")))
            .bearer_auth(token)
            .json(&json!({"message": message}));
        let barrier = barrier.clone();
        tasks.spawn(async move {
            barrier.wait().await;
            (id, read_json(request.send().await.unwrap()).await)
        });
    }
    let answers = tasks.join_all().await;
    let mut started = Vec::new();
    let mut limits = Vec::new();
    for (id, (status, body)) in answers {
        match status {
            202 => started.push(id),
            429 => limits.push(body["limit"].as_str().unwrap_or_default().to_owned()),
            other => panic!("answered {other}: {body}"),
        }
    }
    (started, limits)
}

/// Thirty requests of one user at once against `concurrent_turns = 2` (turns that stall): two
/// start. Then another user's waves of thirty, each after the last wave's turns ended, against
/// `turns_per_minute = 5` too: two, two, one, none.
async fn parallel_requests_start_at_most_the_limit(servers: &[&TestServer]) {
    let alice = hs256(user("alice"), SECRET.as_bytes());
    let (started, limits) = release_together(servers, &alice, 30, "long").await;
    assert_eq!(started.len(), 2, "concurrent_turns = 2; refused: {limits:?}");
    assert!(limits.iter().all(|l| l == "concurrent_turns"), "{limits:?}");
    let (_, listed) = ask(servers[0], &alice, "GET", "/conversations", None).await;
    let listed = listed["conversations"].as_array().map_or(0, Vec::len);
    assert_eq!(listed, 2, "as many conversations as turns admitted: a refused request wrote nothing");

    let carol = hs256(user("carol"), SECRET.as_bytes());
    let mut waves = Vec::new();
    loop {
        let (started, limits) = release_together(servers, &carol, 30, "short").await;
        waves.push(started.len());
        for id in &started {
            let (status, _) =
                ask(servers[0], &carol, "GET", &format!("/conversations/{id}/last?timeoutMs=20000"), None).await;
            assert_eq!(status, 200);
        }
        if started.is_empty() {
            assert!(limits.iter().all(|l| l == "turns_per_minute"), "{limits:?}");
            break;
        }
        assert!(waves.len() < 10, "{waves:?}");
    }
    assert_eq!(waves, [2, 2, 1, 0], "turns started per wave of thirty");
}

fn budget_config(dir: &Path) -> dispatch_gateway::Config {
    let mut config = config_with_secret(dir);
    config.quotas.concurrent_turns = Some(2);
    config.quotas.turns_per_minute = Some(5);
    config.scripted_script = Some(stalling(dir));
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_parallel_requests_start_at_most_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(budget_config(dir.path())).await;
    parallel_requests_start_at_most_the_limit(&[&server]).await;
}

/// The same race spread over two gateways sharing one PostgreSQL.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_parallel_requests_over_two_gateways_start_at_most_the_limit() {
    let Some(database) = dispatch_testkit::postgres::fresh_database().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let servers = two_gateways(dir.path(), &database.url, budget_config).await;
    parallel_requests_start_at_most_the_limit(&[&servers[0], &servers[1]]).await;
}

/// A turn stopped before its usage came is charged what the gateway sent and what it
/// streamed; `/metrics` counts it as estimated; a day's budget ends after a few such turns.
#[tokio::test]
async fn a_stopped_turn_is_charged_its_estimate() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_with_secret(dir.path());
    config.scripted_script = Some(stalling(dir.path()));
    config.quotas.tokens_per_day = Some(2_000);
    config.api_keys = vec!["operator-key".into()];
    let server = TestServer::start(config).await;
    let alice = hs256(user("alice"), SECRET.as_bytes());
    let mut charged = Vec::new();
    for i in 0..10 {
        let id = format!("stopped-{i}");
        let r = server
            .client
            .post(server.url("/chat"))
            .bearer_auth(&alice)
            .json(&json!({"conversationId": id, "message": "long"}))
            .send()
            .await
            .unwrap();
        if r.status() == 429 {
            assert_eq!(read_json(r).await.1["limit"], "tokens_per_day");
            break;
        }
        assert_eq!(r.status(), 200);
        // Stop once the text is out (the turn then waits two minutes before its usage).
        let mut events = EventStream::new(r);
        while let Some(event) = events.next_event().await {
            if event["type"] == "text-delta" {
                break;
            }
        }
        assert_eq!(ask(&server, &alice, "POST", &format!("/conversations/{id}/stop"), None).await.0, 200);
        let rest = events.collect().await;
        let done = rest.iter().find(|e| e["type"] == "done").expect("the turn ended");
        assert_eq!(done["reason"], "aborted", "{done}");
        assert!(done.get("usage").is_none_or(Value::is_null), "no usage was reported: {done}");
        charged.push(server.state.store.tokens_since("alice", 0).await.unwrap());
    }
    // Each stopped turn: its prompt and the 3,600 bytes of text it streamed (~900 tokens), not 0.
    assert!(charged.len() >= 2, "{charged:?}");
    assert!((900..1_000).contains(&charged[0]), "the first stopped turn was charged {}", charged[0]);
    assert!(charged.len() < 10, "the day's budget ended the stopped turns: {charged:?}");
    let metrics = server.client.get(server.url("/metrics")).bearer_auth("operator-key").send().await.unwrap();
    let text = metrics.text().await.unwrap();
    let estimated: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("dispatch_quota_estimated_turns_total "))
        .unwrap_or_else(|| panic!("no estimated-turns counter in {text}"))
        .trim()
        .parse()
        .unwrap();
    assert_eq!(estimated, charged.len() as u64, "{text}");
}
