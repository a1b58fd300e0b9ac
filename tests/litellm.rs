//! The `openai` runtime against a real LiteLLM proxy (PyPI `litellm[proxy]`), offline: its
//! `mock_response` models stream text, or fail with a 429 or a 500, with no provider behind
//! them. The proxy is `$DISPATCH_TEST_LITELLM`, else `litellm` on the PATH; without it the test
//! says so and passes, unless `DISPATCH_REQUIRE_LITELLM` is set (as `.ci/run` does).

mod common;

use std::collections::BTreeMap;

use common::*;
use dispatch_gateway::config::{Credential, OpenAiCredential};
use serde_json::{Value, json};

const CONFIG: &str = r#"
model_list:
  - model_name: mock-text
    litellm_params: {model: openai/mock-text, api_key: fake, mock_response: "Hello from the mock proxy"}
  - model_name: mock-429
    litellm_params: {model: openai/mock-429, api_key: fake, mock_response: "litellm.RateLimitError"}
  - model_name: mock-500
    litellm_params: {model: openai/mock-500, api_key: fake, mock_response: "litellm.InternalServerError"}
  - model_name: mock-too-long
    litellm_params: {model: openai/mock-too-long, api_key: fake, mock_response: "litellm.ContextWindowExceededError"}
litellm_settings:
  num_retries: 0
general_settings:
  master_key: sk-test-master
"#;

/// The proxy, killed when dropped.
struct Proxy(std::process::Child);

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_litellm_proxy_streams_turns_and_its_errors_are_retried_then_reported() {
    let install = "pip install 'litellm[proxy]'";
    let Some(litellm) = program("DISPATCH_TEST_LITELLM", "litellm", "DISPATCH_REQUIRE_LITELLM", install) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("litellm.yaml"), CONFIG).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _proxy = Proxy(
        std::process::Command::new(litellm)
            .args(["--config", "litellm.yaml", "--host", "127.0.0.1", "--port", &port.to_string()])
            .current_dir(dir.path())
            // Its model price list from the package, not from the network.
            .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("the proxy starts"),
    );
    let client = reqwest::Client::new();
    let health = format!("http://127.0.0.1:{port}/health/liveliness");
    assert!(
        eventually(1200, || async { client.get(&health).send().await.is_ok_and(|r| r.status().is_success()) }).await,
        "the proxy came up"
    );
    // SAFETY: set once, before the gateway reads it; no other thread of this test reads it.
    unsafe { std::env::set_var("DISPATCH_TEST_LITELLM_KEY", "sk-test-master") };
    let mut config = test_config(dir.path());
    config.credentials.insert(
        "litellm".into(),
        Credential::Openai(OpenAiCredential {
            base_url: format!("http://127.0.0.1:{port}/v1"),
            api_key_env: Some("DISPATCH_TEST_LITELLM_KEY".into()),
            models: vec!["mock-text".into(), "mock-429".into(), "mock-500".into(), "mock-too-long".into()],
            headers: BTreeMap::new(),
            connect_timeout_secs: 5,
            idle_timeout_secs: 30,
            system_prompt: Some("be brief".into()),
            context_window: Some(4096),
            params: Default::default(),
            model_params: Default::default(),
            mcp: Vec::new(),
            max_steps: 32,
            max_parallel_tools: 4,
            max_tool_calls: 16,
        }),
    );
    let server = TestServer::start(config).await;
    let turn = |message: &'static str, model: &'static str| {
        let server = &server;
        async move {
            server
                .chat_stream(json!({"conversationId": "ll", "message": message, "model": model}))
                .await
                .collect()
                .await
        }
    };

    let events: Vec<Value> = turn("hi", "litellm/mock-text").await;
    let text: String =
        events.iter().filter(|e| e["type"] == "text-delta").map(|e| e["delta"].as_str().unwrap()).collect();
    assert_eq!(text, "Hello from the mock proxy");
    assert!(events.iter().filter(|e| e["type"] == "text-delta").count() > 1, "streamed in pieces");
    let done = events.iter().find(|e| e["type"] == "done").unwrap();
    assert_eq!(done["reason"], "stop");
    assert!(done["usage"]["outputTokens"].as_u64().unwrap() > 0, "usage came back: {done}");

    for model in ["litellm/mock-429", "litellm/mock-500"] {
        let events: Vec<Value> = turn("again", model).await;
        let error = events.iter().find(|e| e["type"] == "error").expect("an error event");
        assert_eq!(error["code"], "unavailable", "{error}");
        assert_eq!(events[events.len() - 2]["reason"], "error");
    }
    let metrics = server.metrics().await;
    assert!(metrics.contains("dispatch_runtime_errors_total{kind=\"retried\"} 6"), "three retries each: {metrics}");

    // A refusal as too long for the context is LiteLLM's ContextWindowExceededError: the
    // request is trimmed again while there is something to leave out, then the turn fails
    // with `context_length`, and is not retried as an unavailable upstream.
    let events: Vec<Value> = turn("too long", "litellm/mock-too-long").await;
    let error = events.iter().find(|e| e["type"] == "error").expect("an error event");
    assert_eq!(error["code"], "context_length", "{error}");
    let metrics = server.metrics().await;
    assert!(metrics.contains("dispatch_runtime_errors_total{kind=\"retried\"} 6"), "not retried: {metrics}");

    // The failed turns do not break the conversation: the next one goes up alternating.
    let events: Vec<Value> = turn("last", "litellm/mock-text").await;
    assert_eq!(events[events.len() - 2]["reason"], "stop");
}
