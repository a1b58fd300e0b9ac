//! A turn's spans over OTLP (the `otlp` feature): the real binary posts them to a receiver that
//! decodes them with OpenTelemetry's own protobuf definitions (`tests/otlp/receiver.py`, the
//! `opentelemetry-proto` package from PyPI, in the Python `$DISPATCH_TEST_OTLP_PYTHON`; without
//! it the test says so and passes, unless `DISPATCH_REQUIRE_OTLP` is set, as `.ci/run` does).
#![cfg(feature = "otlp")]

mod common;

use std::io::{BufRead, BufReader};
use std::sync::{Arc, Mutex};

use common::*;
use serde_json::{Value, json};

fn otlp_python() -> Option<String> {
    let python = std::env::var("DISPATCH_TEST_OTLP_PYTHON").ok().filter(|p| !p.is_empty());
    if python.is_none() {
        assert!(std::env::var_os("DISPATCH_REQUIRE_OTLP").is_none(), "a Python with opentelemetry-proto is required");
        eprintln!("skipped: DISPATCH_TEST_OTLP_PYTHON names no Python with opentelemetry-proto");
    }
    python
}

/// The receiver, its port, and the spans it has decoded so far.
struct Receiver {
    child: std::process::Child,
    port: u16,
    spans: Arc<Mutex<Vec<Value>>>,
}

impl Receiver {
    fn start(python: &str) -> Receiver {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/otlp/receiver.py");
        let mut child = std::process::Command::new(python)
            .arg(script)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("the receiver starts");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let port = lines.next().expect("the receiver prints its port").unwrap().parse().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = spans.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                kept.lock().unwrap().push(serde_json::from_str::<Value>(&line).unwrap());
            }
        });
        Receiver { child, port, spans }
    }

    /// The spans of one turn.
    fn of_turn(&self, turn_id: &str) -> Vec<Value> {
        self.spans.lock().unwrap().iter().filter(|s| s["attributes"]["turn.id"] == turn_id).cloned().collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn named<'a>(spans: &'a [Value], name: &str) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["name"] == name).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turns_spans_reach_an_otlp_receiver_with_its_ids_and_their_parents() {
    let Some(python) = otlp_python() else { return };
    let receiver = Receiver::start(&python);
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        dir.path(),
        json!({"rules": [
            {"match": "tools", "pace": 0, "steps": [
                {"text": "Reading both.", "toolCalls": [
                    {"id": "call_a", "name": "read", "input": {"path": "a"}, "result": "alpha"},
                    {"id": "call_b", "name": "read", "input": {"path": "b"}, "result": "missing", "isError": true}
                ]},
                {"text": "Done."}
            ]},
            {"match": "stall", "pace": 0, "steps": [{"text": "partial", "stallMs": 600000}]}
        ]}),
    );
    let args: Vec<std::ffi::OsString> = vec![
        "--database".into(),
        dir.path().join("gateway.db").into(),
        "--scripted-script".into(),
        script.into(),
        "--otlp-endpoint".into(),
        format!("http://127.0.0.1:{}", receiver.port).into(),
    ];
    // The batch goes out every 100 ms instead of every 5 s (the SDK reads its variable).
    let gateway = ChildGateway::spawn_with_env(&args, &[("OTEL_BSP_SCHEDULE_DELAY", "100")]);

    let events = gateway.chat("traced", "tools please").await;
    let turn_id = events[0]["turnId"].as_str().unwrap().to_owned();
    // Exported while the gateway runs, not only at its stop.
    let exported = eventually(200, || async { named(&receiver.of_turn(&turn_id), "seal").len() == 1 }).await;
    assert!(exported, "the turn's spans reached the receiver: {:?}", receiver.of_turn(&turn_id));

    let stream = gateway.chat_stream(json!({"conversationId": "traced", "message": "stall"})).await;
    eventually(100, || async { gateway.get("/conversations/traced/status").await.1["isActive"] == true }).await;
    assert_eq!(gateway.post("/conversations/traced/stop", json!({})).await.1["abortedTurn"], true);
    let stopped = stream.collect().await;
    let stopped_id = stopped[0]["turnId"].as_str().unwrap().to_owned();
    // A graceful stop exports what is still queued.
    assert!(gateway.terminate().success());

    let spans = receiver.of_turn(&turn_id);
    let [turn] = named(&spans, "turn")[..] else { panic!("one turn span: {spans:?}") };
    assert_eq!(turn["service"], "dispatch-gateway");
    assert_eq!(turn["parent"], "", "the turn is its trace's root");
    assert_eq!(turn["attributes"]["reason"], "stop");
    assert_eq!(turn["attributes"]["model"], "demo/scripted");
    for span in &spans {
        assert_eq!(span["trace"], turn["trace"], "one trace: {span}");
        assert_eq!(span["attributes"]["conversation.id"], "traced", "{span}");
        assert!(span["start"].as_u64() <= span["end"].as_u64(), "{span}");
    }
    let [attempt] = named(&spans, "runtime attempt")[..] else { panic!("one attempt: {spans:?}") };
    assert_eq!(attempt["parent"], turn["id"]);
    let steps = named(&spans, "step");
    assert_eq!(steps.len(), 2, "{spans:?}");
    assert!(steps.iter().all(|s| s["parent"] == attempt["id"]), "{steps:?}");
    let step_ids: Vec<&Value> = steps.iter().map(|s| &s["attributes"]["step.id"]).collect();
    assert_eq!(step_ids, [&json!(format!("{turn_id}#0")), &json!(format!("{turn_id}#1"))]);
    let mut calls: Vec<(&Value, &Value, &Value)> = named(&spans, "tool call")
        .into_iter()
        .map(|c| (&c["attributes"]["tool.call_id"], &c["attributes"]["tool.error"], &c["parent"]))
        .collect();
    calls.sort_by_key(|c| c.0.to_string());
    let first_step = steps.iter().find(|s| s["attributes"]["step.id"] == format!("{turn_id}#0")).unwrap();
    assert_eq!(
        calls,
        [(&json!("call_a"), &json!(false), &first_step["id"]), (&json!("call_b"), &json!(true), &first_step["id"])]
    );
    let [seal] = named(&spans, "seal")[..] else { panic!("one seal: {spans:?}") };
    assert_eq!(seal["parent"], turn["id"]);

    let stopped = receiver.of_turn(&stopped_id);
    let [stopped_turn] = named(&stopped, "turn")[..] else { panic!("the stopped turn's span: {stopped:?}") };
    assert_eq!(stopped_turn["attributes"]["reason"], "aborted");
    assert_ne!(stopped_turn["trace"], turn["trace"], "a trace a turn");
}
