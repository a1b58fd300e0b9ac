//! Turns end to end: the event order of a turn, its log, its metrics.

mod common;

use common::*;
use serde_json::{Value, json};

async fn scripted_server(dir: &std::path::Path) -> TestServer {
    let mut config = test_config(dir);
    config.scripted_script = Some(write_script(dir, tool_script()));
    TestServer::start(config).await
}

/// Checks the fields every event of the turn shares and strips them for comparison.
fn strip_ids(events: &[Value], conversation_id: &str, turn_id: &str) -> Vec<Value> {
    events
        .iter()
        .map(|e| {
            let mut e = e.as_object().unwrap().clone();
            assert_eq!(e.remove("conversationId").unwrap(), conversation_id, "{e:?}");
            assert_eq!(e.remove("turnId").unwrap(), turn_id, "{e:?}");
            Value::Object(e)
        })
        .collect()
}

#[tokio::test]
async fn multi_step_turn_with_tools_emits_the_exact_sequence_and_log() {
    let dir = tempfile::tempdir().unwrap();
    let server = scripted_server(dir.path()).await;
    let events = server.chat("conv-tools", "  what is the weather?  ").await;
    let turn_id = events[0]["turnId"].as_str().unwrap().to_owned();
    let s0 = format!("{turn_id}#0");
    let s1 = format!("{turn_id}#1");
    let ev = strip_ids(&events, "conv-tools", &turn_id);

    // Timing fields vary; check them apart and compare the rest exactly.
    let mut timing = Vec::new();
    let ev: Vec<Value> = ev
        .into_iter()
        .map(|mut e| {
            if e["type"] == "step-complete" || e["type"] == "done" {
                let o = e.as_object_mut().unwrap();
                let t: Vec<Option<u64>> = ["ttftMs", "decodeMs", "genTotalMs", "durationMs"]
                    .iter()
                    .map(|k| o.remove(*k).map(|v| v.as_u64().unwrap()))
                    .collect();
                timing.push(t);
            }
            e
        })
        .collect();
    let expected = vec![
        json!({"type": "user-message", "text": "what is the weather?"}),
        json!({"type": "turn-start"}),
        json!({"type": "reasoning-delta", "delta": "Let "}),
        json!({"type": "reasoning-delta", "delta": "me "}),
        json!({"type": "reasoning-delta", "delta": "check."}),
        json!({"type": "text-delta", "delta": "Checking "}),
        json!({"type": "text-delta", "delta": "the "}),
        json!({"type": "text-delta", "delta": "weather."}),
        json!({"type": "tool-call", "stepId": s0, "toolCallId": "call_w", "toolName": "weather", "input": {"city": "Paris"}}),
        json!({"type": "tool-output", "toolCallId": "call_w", "data": "fetching", "stream": "stdout"}),
        json!({"type": "usage", "stepId": s0, "usage": {"inputTokens": 100, "outputTokens": 20}}),
        json!({"type": "step-complete", "stepId": s0}),
        json!({"type": "tool-result", "stepId": s0, "toolCallId": "call_w", "toolName": "weather", "content": "sunny", "isError": false, "durationMs": 7}),
        json!({"type": "text-delta", "delta": "It "}),
        json!({"type": "text-delta", "delta": "is "}),
        json!({"type": "text-delta", "delta": "sunny "}),
        json!({"type": "text-delta", "delta": "in "}),
        json!({"type": "text-delta", "delta": "Paris."}),
        json!({"type": "usage", "stepId": s1, "usage": {"inputTokens": 150, "outputTokens": 8, "cacheReadTokens": 90}}),
        json!({"type": "step-complete", "stepId": s1}),
        json!({"type": "done", "reason": "stop", "usage": {"inputTokens": 250, "outputTokens": 28, "cacheReadTokens": 90}, "contextSize": 158}),
        json!({"type": "turn-sealed"}),
    ];
    assert_eq!(ev, expected);

    // step-complete: all three timings, genTotalMs == ttftMs + decodeMs; done: durationMs only.
    assert_eq!(timing.len(), 3);
    for t in &timing[..2] {
        let (ttft, decode, total) = (t[0].unwrap(), t[1].unwrap(), t[2].unwrap());
        assert_eq!(total, ttft + decode);
        assert_eq!(t[3], None);
    }
    assert_eq!(&timing[2][..3], &[None, None, None]);
    let duration = timing[2][3].expect("done.durationMs");

    // The log: user text, then the steps' chunks, tool chunks carrying their stepId.
    let history = server.history("conv-tools").await;
    assert_eq!(
        history,
        vec![
            json!({"seq": 1, "role": "user", "chunk": {"type": "text", "text": "what is the weather?"}}),
            json!({"seq": 2, "role": "assistant", "chunk": {"type": "thinking", "text": "Let me check."}}),
            json!({"seq": 3, "role": "assistant", "chunk": {"type": "text", "text": "Checking the weather."}}),
            json!({"seq": 4, "role": "assistant", "chunk": {"type": "tool-call", "toolCallId": "call_w", "toolName": "weather", "input": {"city": "Paris"}, "stepId": s0}}),
            json!({"seq": 5, "role": "tool", "chunk": {"type": "tool-result", "toolCallId": "call_w", "toolName": "weather", "content": "sunny", "isError": false, "stepId": s0, "durationMs": 7, "output": "fetching"}}),
            json!({"seq": 6, "role": "assistant", "chunk": {"type": "text", "text": "It is sunny in Paris."}}),
        ]
    );

    // The persisted metrics equal what the live events carried.
    let (status, metrics) = server.get("/conversations/conv-tools/metrics").await;
    assert_eq!(status, 200);
    let step_complete: Vec<&Value> = events.iter().filter(|e| e["type"] == "step-complete").collect();
    let done = events.iter().find(|e| e["type"] == "done").unwrap();
    let steps: Vec<Value> = step_complete
        .iter()
        .zip([json!({"inputTokens": 100, "outputTokens": 20}), json!({"inputTokens": 150, "outputTokens": 8, "cacheReadTokens": 90})])
        .map(|(sc, usage)| {
            json!({"stepId": sc["stepId"], "usage": usage, "ttftMs": sc["ttftMs"], "decodeMs": sc["decodeMs"], "genTotalMs": sc["genTotalMs"]})
        })
        .collect();
    assert_eq!(
        metrics,
        json!({"turns": [{
            "turnId": turn_id,
            "usage": done["usage"],
            "durationMs": duration,
            "steps": steps,
            "contextSize": done["contextSize"],
            "reason": "stop",
            "firstSeq": 1,
        }]})
    );
}

#[tokio::test]
async fn turn_sealed_comes_only_after_history_and_metrics_hold_the_turn() {
    let dir = tempfile::tempdir().unwrap();
    let server = scripted_server(dir.path()).await;
    for round in 0..5 {
        let mut stream = server.chat_stream(json!({"conversationId": "conv-seal", "message": "hello"})).await;
        let mut turn_id = None;
        let mut seen = 0;
        while let Some(event) = stream.next_event().await {
            seen += 1;
            turn_id.get_or_insert_with(|| event["turnId"].as_str().unwrap().to_owned());
            if event["type"] != "turn-sealed" {
                continue;
            }
            // At the moment turn-sealed arrives, both reads already return the turn.
            let turn_id = turn_id.clone().unwrap();
            let (_, metrics) = server.get("/conversations/conv-seal/metrics").await;
            let turns = metrics["turns"].as_array().unwrap();
            assert_eq!(turns.len(), round + 1);
            assert_eq!(turns[round]["turnId"], turn_id);
            let history = server.history("conv-seal").await;
            assert_eq!(history.len(), 3 * (round + 1), "user, thinking and text chunks of every turn");
            let (_, list) = server.get("/conversations").await;
            assert_eq!(list["conversations"][0]["status"], "idle");
        }
        assert!(seen > 5);
    }
}

#[tokio::test]
async fn a_runtime_error_ends_with_error_done_and_sealed_and_logs_an_error_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let server = scripted_server(dir.path()).await;
    let events = server.chat("conv-fail", "please fail").await;
    let tail: Vec<&str> = types(&events).into_iter().rev().take(4).collect();
    assert_eq!(tail, vec!["turn-sealed", "done", "error", "step-complete"]);
    let error = &events[events.len() - 3];
    assert_eq!(error["message"], "model exploded");
    assert_eq!(error["code"], "upstream");
    assert_eq!(events[events.len() - 2]["reason"], "error");

    let history = server.history("conv-fail").await;
    assert_eq!(history.len(), 3);
    assert_eq!(history[1]["chunk"], json!({"type": "text", "text": "partial answer"}));
    assert_eq!(history[2]["role"], "assistant");
    assert_eq!(history[2]["chunk"], json!({"type": "error", "message": "model exploded", "code": "upstream"}));
    let (_, metrics) = server.get("/conversations/conv-fail/metrics").await;
    assert_eq!(metrics["turns"].as_array().unwrap().len(), 1);
}

/// A turn that runs past --max-turn-secs (a runtime that hangs) ends with
/// `error{code:"timeout"}` and `done{reason:"error"}`, keeps what it streamed, and frees the
/// conversation for the next turn.
#[tokio::test]
async fn a_turn_past_its_longest_time_ends_with_a_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    config.max_turn_secs = 1;
    config.scripted_script = Some(write_script(
        dir.path(),
        json!({"rules": [{"match": "hang", "steps": [{"text": "before ", "stallMs": 120000}, {"text": "never"}]}]}),
    ));
    let server = TestServer::start(config).await;
    let events = server.chat("hung", "hang").await;
    let tail: Vec<&str> = types(&events).into_iter().rev().take(3).collect();
    assert_eq!(tail, vec!["turn-sealed", "done", "error"], "{events:?}");
    turn_error(&events, "timeout", "max-turn-secs");
    assert_eq!(events[events.len() - 2]["reason"], "error");
    let history = server.history("hung").await;
    assert_eq!(history[1]["chunk"], json!({"type": "text", "text": "before "}));
    assert_eq!(history.last().unwrap()["chunk"]["code"], "timeout");
    assert!(!history.iter().any(|c| c.to_string().contains("never")));
    assert_eq!(metric(&server.metrics().await, "dispatch_runtime_errors_total{kind=\"timeout\"}"), 1.0);
    assert_eq!(server.chat("hung", "hello").await.last().unwrap()["type"], "turn-sealed", "the next turn runs");
}

/// A metrics read longer than `--metrics-page-turns` goes out in pages, as they are read (no
/// length), and says what one read says: every sealed turn, in turn order.
#[tokio::test]
async fn a_metrics_read_in_pages_is_every_sealed_turn_in_order() {
    for page in [1000, 2, 1] {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(dir.path());
        config.metrics_page_turns = page;
        let server = TestServer::start(config).await;
        let url = server.url("/conversations/paged/metrics");
        let response = server.client.get(url.clone()).send().await.unwrap();
        assert!(response.content_length().is_some());
        assert_eq!(response.json::<Value>().await.unwrap(), json!({"turns": []}));
        let mut turn_ids = Vec::new();
        for i in 0..5 {
            let events = server.chat("paged", &format!("message {i}")).await;
            turn_ids.push(events.iter().find(|e| e["type"] == "done").unwrap()["turnId"].clone());
        }
        let response = server.client.get(url).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.content_length().is_none(), 5u64.div_ceil(page) > 1, "pages of {page}");
        let metrics: Value = response.json().await.unwrap();
        let turns = metrics["turns"].as_array().unwrap();
        let ids: Vec<Value> = turns.iter().map(|t| t["turnId"].clone()).collect();
        assert_eq!(ids, turn_ids, "pages of {page}");
        assert!(turns.iter().all(|t| t["steps"].as_array().is_some_and(|s| !s.is_empty())), "{metrics}");
    }
}

#[tokio::test]
async fn a_second_turn_while_one_runs_is_409_and_the_conversation_stays_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let server = scripted_server(dir.path()).await;
    let mut stream = server.chat_stream(json!({"conversationId": "conv-busy", "message": "stall please"})).await;
    assert_eq!(stream.next_event().await.unwrap()["type"], "user-message");

    let (status, body) = server.post("/chat", json!({"conversationId": "conv-busy", "message": "me too"})).await;
    assert_eq!((status, body), (409, json!({"error": "a turn is already generating for this conversation"})));
    let (status, body) = server.delete("/conversations/conv-busy").await;
    assert_eq!(status, 409);
    assert!(body["error"].is_string());
    let (_, list) = server.get("/conversations?status=active").await;
    assert_eq!(list["conversations"][0]["id"], "conv-busy");

    let rest = stream.collect().await;
    assert_eq!(rest.last().unwrap()["type"], "turn-sealed");
    // Sealed means idle: the next turn starts at once.
    let events = server.chat("conv-busy", "again").await;
    assert_eq!(events.last().unwrap()["type"], "turn-sealed");
    let history = server.history("conv-busy").await;
    let seqs: Vec<u64> = history.iter().map(|c| c["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    assert_eq!(history[0]["chunk"]["text"], "stall please");
}

#[tokio::test]
async fn chat_mints_ids_names_the_conversation_and_checks_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let server = scripted_server(dir.path()).await;
    let stream = server.chat_stream(json!({"message": "hi"})).await;
    let id = stream.headers["x-conversation-id"].to_str().unwrap().to_owned();
    let events = stream.collect().await;
    assert_eq!(events[0]["conversationId"], id);
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "minted id {id} is a UUID");

    let (status, body) =
        server.post("/chat", json!({"conversationId": "c-model", "message": "hi", "model": "nope/none"})).await;
    assert_eq!(status, 400);
    assert!(body["error"].as_str().unwrap().contains("nope/none"));
    assert_eq!(server.history("c-model").await, Vec::<Value>::new());

    let events = server
        .chat_stream(json!({"conversationId": "c-model", "message": "hi", "model": "demo/scripted"}))
        .await
        .collect()
        .await;
    assert_eq!(events.last().unwrap()["type"], "turn-sealed");
    let (_, meta) = server.get("/conversations?q=c-model").await;
    assert_eq!(meta["conversations"][0]["title"], "hi");
}

#[tokio::test]
async fn chat_streams_sse_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let server = scripted_server(dir.path()).await;
    let r = server
        .client
        .post(server.url("/chat"))
        .header("accept", "text/event-stream")
        .json(&json!({"conversationId": "conv-sse", "message": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    let messages: Vec<&str> = text.split("\n\n").filter(|m| !m.is_empty()).collect();
    let ndjson = server.chat("conv-sse-2", "hello").await;
    assert_eq!(messages.len(), ndjson.len());
    for (n, message) in messages.iter().enumerate() {
        let mut lines = message.lines();
        let id = lines.next().unwrap().strip_prefix("id: ").unwrap();
        let data: Value = serde_json::from_str(lines.next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(id, format!("{}:{n}", data["turnId"].as_str().unwrap()));
        assert_eq!(data["type"], ndjson[n]["type"]);
    }
}
