//! The bus restarted, lost or down under turns: followed through, heard whole, ended from the
//! database.

use super::*;

/// Reads `stream` until a turn's first words; false if none come within a minute (the held
/// turns hold for two).
async fn first_words(stream: &mut SseStream) -> bool {
    let words = async { while stream.next().await.expect("the stream goes on").json()["type"] != "text-delta" {} };
    tokio::time::timeout(std::time::Duration::from_secs(60), words).await.is_ok()
}

/// A turn on `a` that holds after its first words (the script's `hold` rule) is heard on `b`
/// live, while it still runs on `a` (not from the log once it ended), then stopped.
async fn heard_live(a: &ChildGateway, b: &ChildGateway, conversation: &str) {
    let mut on_b = b.sse(conversation, "").await;
    start_turn(a, conversation, "hold").await;
    assert!(first_words(&mut on_b).await, "B heard nothing of the turn in {conversation}");
    let (_, status) = a.get(&format!("/conversations/{conversation}/status")).await;
    assert_eq!(status["isActive"], true, "B heard the turn while it ran: {status}");
    let (status, stopped) = a.post(&format!("/conversations/{conversation}/stop"), json!({})).await;
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{stopped}");
    on_b.until_sealed().await;
}

/// A NATS server restarted (with its data) under a turn held on one gateway: the other hears
/// the turn's end once both are back. Then the bus's stream lost under them, removed by hand
/// and then with a NATS server that comes back without its data: a turn's events (or a
/// follower) create it again, and the turns after that are heard live across again, with no
/// restart: in a new conversation, and in one followed all along (read past the new stream's
/// end before: its reading starts over with the stream, where the client's own consumer would
/// go on from its old sequence and skip them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_and_a_lost_stream_are_followed_through() {
    let Some(database) = fresh_database().await else { return };
    let Some(mut nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = json!({"rules": [
        {"match": "hold", "steps": [{"text": "held here", "stallMs": 120_000}]},
        {"steps": [{"text": "a reply of a few words "}]},
    ]});
    let (a, b) = scripted_pair(&database.url, &nats.url, &write_script(dir.path(), script), &[]);
    // B follows the conversation all along; turns in it take its reading well past where the
    // new stream will be when the next one comes.
    let _follows = b.sse("kept", "").await;
    for _ in 0..3 {
        watched_across(&a, &b, "kept").await;
    }
    heard_live(&a, &b, "kept").await;
    let client = async_nats::connect(&nats.url).await.expect("a client of the test's NATS server");
    let js = async_nats::jetstream::new(client);

    // A turn held on A while the server restarts (with its data): B hears its end, and the
    // turns after it, live.
    let mut on_b = b.sse("across", "").await;
    start_turn(&a, "across", "hold").await;
    assert!(first_words(&mut on_b).await, "B heard the turn start");
    nats.restart();
    // Both gateways back on the bus before the turn ends.
    assert!(
        eventually(600, || async {
            logged(&a, "connected to the bus") >= 2 && logged(&b, "connected to the bus") >= 2
        })
        .await,
        "the gateways reconnected"
    );
    let (status, stopped) = a.post("/conversations/across/stop", json!({})).await;
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{stopped}");
    let end =
        tokio::time::timeout(std::time::Duration::from_secs(60), on_b.until_sealed()).await.expect("B hears the end");
    let done = read(&end).into_iter().find(|(_, e)| e["type"] == "done").expect("B hears the turn's done");
    assert_eq!(done.1["reason"], "aborted");
    heard_live(&a, &b, "kept").await;

    for (how, fresh) in [("removed by hand", "fresh-1"), ("the server back without its data", "fresh-2")] {
        if how == "removed by hand" {
            assert!(js.delete_stream("DISPATCH").await.expect("the stream is removed").success);
        } else {
            nats.restart_empty();
        }
        // A turn meanwhile: its first events find no stream, and bring it back.
        let mut on_a = a.sse("meanwhile", "").await;
        start_turn(&a, "meanwhile", how).await;
        on_a.until_sealed().await;
        let back = eventually(400, || async { js.get_stream("DISPATCH").await.is_ok() }).await;
        assert!(back, "{how}: the stream is created again");
        heard_live(&a, &b, "kept").await;
        heard_live(&b, &a, fresh).await;
    }
}

/// A turn streaming while the NATS server is down for a while and comes back, with its data
/// and then without it: the other gateway's watcher hears the whole turn live, each event once
/// and in order, as the turn's own gateway's watcher does. What the bus lost meanwhile is sent
/// again once it is back (from the turn's start into a stream created again, else from what
/// the stream did not acknowledge), and the watcher elsewhere waits on the gap until then
/// (without that it got `turn-sealed` at the gap, while the turn went on). Each
/// gateway's `/metrics` says when it is off the bus, and counts the turns sent again and cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_streaming_through_an_outage_of_the_bus_is_heard_whole_on_another_gateway() {
    let Some(database) = fresh_database().await else { return };
    let Some(mut nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), steady());
    // Leases long enough that a watcher elsewhere does not learn of a turn's end from the
    // database (the next test) before the bus carries it.
    let (a, b) = scripted_pair(&database.url, &nats.url, &script, &["--lease-ttl-ms", "120000"]);
    // Where A sent its turn again from, in the log since `since`.
    let resent_from = |since: usize| -> Vec<u64> {
        let logs = a.logs.lock().unwrap();
        let again = logs[since..]
            .iter()
            .filter(|l| l["fields"]["message"] == "sending a turn again: the bus may have lost part of it");
        again.map(|l| l["fields"]["from"].as_u64().unwrap()).collect()
    };
    for (how, conversation) in [("with its data", "through-restart"), ("without its data", "through-loss")] {
        let since = a.logs.lock().unwrap().len();
        let on_a = Heard::start(a.sse(conversation, "").await);
        let on_b = Heard::start(b.sse(conversation, "").await);
        start_turn(&a, conversation, "steady").await;
        assert!(eventually(1200, || async { on_b.count() > 5 }).await, "{how}: B hears the turn");
        stop_the_bus(&mut nats, &[&a, &b]).await;
        // The turn streams on while the bus is down.
        let heard = on_a.count();
        assert!(eventually(1200, || async { on_a.count() > heard + 20 }).await, "{how}: the turn goes on");
        if how == "without its data" {
            nats.wipe();
        }
        nats.start();
        let back = eventually(1200, || async { on_bus(&a, 1.0).await && on_bus(&b, 1.0).await }).await;
        assert!(back, "{how}: the gateways reconnected");
        // B hears the turn go on past where A had heard it when the bus came back.
        let heard = on_a.count();
        assert!(eventually(1200, || async { on_b.count() > heard + 20 }).await, "{how}: B hears the turn go on");
        let (status, stopped) = a.post(&format!("/conversations/{conversation}/stop"), json!({})).await;
        assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{how}: {stopped}");
        let everything = on_a.end().await;
        assert!(everything.len() > heard + 20, "{how}: A heard the whole turn");
        assert_eq!(on_b.end().await, everything, "{how}: B heard A's turn whole, each event once, in order");
        // Sent again only from what the stream did not hold: its start into a new one.
        let from = resent_from(since);
        if how == "with its data" {
            assert!(!from.contains(&0), "{how}: the stream kept the turn's start: {from:?}");
        } else {
            assert!(from.contains(&0), "{how}: {from:?}");
        }
    }
    let (on_a, on_b) = (a.metrics().await, b.metrics().await);
    assert!(metric(&on_a, "dispatch_bus_messages_missed_total") >= 1.0, "without its data: {on_a}");
    assert!(metric(&on_a, "dispatch_bus_turns_resent_total") >= 1.0, "{on_a}");
    assert_eq!(metric(&on_b, "dispatch_bus_turns_cut_total"), 0.0, "{on_b}");

    // A turn that ends while the bus stays down: its gateway keeps only its end after the bus
    // timeout, and sends it when the bus is back, with its data or without: the watcher on
    // the other gateway gets `turn-sealed` (without it, it waited for the next turn).
    let trimmed =
        || logged(&a, "the bus did not take the end of a turn in time: it goes out alone when the bus is back");
    for (round, (how, conversation)) in
        [("with its data", "ended-offline"), ("without its data", "ended-lost")].into_iter().enumerate()
    {
        let on_b = Heard::start(b.sse(conversation, "").await);
        start_turn(&a, conversation, "steady").await;
        assert!(eventually(1200, || async { on_b.count() > 5 }).await, "{how}: B hears the turn");
        stop_the_bus(&mut nats, &[&a, &b]).await;
        let (status, stopped) = a.post(&format!("/conversations/{conversation}/stop"), json!({})).await;
        assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{how}: {stopped}");
        assert!(eventually(1200, || async { trimmed() == round + 1 }).await, "{how}: A kept only the turn's end");
        if how == "without its data" {
            nats.wipe();
        }
        nats.start();
        let heard = on_b.end().await;
        assert_eq!(heard.last().unwrap().1["type"], "turn-sealed", "{how}: B's watcher got the turn's end");
        assert_eq!(logged(&b, FROM_THE_DATABASE), 0, "{how}: over the bus");
    }
    let gave_up = "the bus did not take the end of a turn: its watchers elsewhere read it from history";
    assert_eq!(logged(&a, gave_up), 0, "the ends went out");

    // An end waits for the bus as long as the stream would keep it (--bus-max-age-secs), not
    // for as long as the outage lasts.
    let args = ["--database", &database.url, "--bus", &nats.url, "--bus-timeout-ms", "3000", "--bus-max-age-secs", "5"];
    let args: Vec<std::ffi::OsString> =
        args.into_iter().chain(["--scripted-script", script.to_str().unwrap()]).map(Into::into).collect();
    let c = ChildGateway::spawn(&args);
    start_turn(&c, "ended-for-good", "steady").await;
    stop_the_bus(&mut nats, &[&c]).await;
    let (status, stopped) = c.post("/conversations/ended-for-good/stop", json!({})).await;
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{stopped}");
    assert!(eventually(1200, || async { logged(&c, gave_up) == 1 }).await, "C gave the turn's end up");
    nats.start();
}

/// What a gateway says when the database tells it a turn it follows has ended.
const FROM_THE_DATABASE: &str = "a turn followed here ended without its end on the bus; ending it here";

/// A turn that ends while the bus is down, and stays down: its watcher on another gateway gets
/// `turn-sealed` once that gateway has not heard of the turn for a lease's time (2 s here) and
/// the database says it no longer runs, without the bus (before, it waited for the bus, and for
/// ever if the turn's gateway died meanwhile). While the turn runs, the same check says so and
/// the watcher waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_that_ends_while_the_bus_is_down_ends_elsewhere_from_the_database() {
    let Some(database) = fresh_database().await else { return };
    let Some(mut nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), steady());
    let (a, b) = scripted_pair(&database.url, &nats.url, &script, &["--lease-ttl-ms", "2000"]);
    let on_b = Heard::start(b.sse("ends-offline", "").await);
    start_turn(&a, "ends-offline", "steady").await;
    assert!(eventually(1200, || async { on_b.count() > 5 }).await, "B hears the turn");
    stop_the_bus(&mut nats, &[&a, &b]).await;
    // Past a few leases' time, the turn still runs: B's watcher is still in it.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    assert!(!on_b.task.is_finished(), "B's watcher waits while the turn runs");
    let (status, stopped) = a.post("/conversations/ends-offline/stop", json!({})).await;
    assert_eq!((status, &stopped["abortedTurn"]), (200, &json!(true)), "{stopped}");
    let heard = on_b.end().await;
    assert_eq!(heard.last().unwrap().1["type"], "turn-sealed", "B's watcher got the turn's end");
    // (Its log comes through a pipe, which the watcher's stream may beat.)
    assert!(eventually(1200, || async { logged(&b, FROM_THE_DATABASE) == 1 }).await, "from the database");
    assert!(on_bus(&b, 0.0).await, "the bus is still down");
    assert_eq!(metric(&b.metrics().await, "dispatch_bus_turns_cut_total"), 1.0);
    nats.start();
}
