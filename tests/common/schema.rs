//! Checks responses against the OpenAPI document the repository keeps.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use serde_json::{Value, json};

static DOC: LazyLock<Value> = LazyLock::new(|| {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("openapi/openapi.json")).expect("the document is JSON")
});

static VALIDATORS: LazyLock<Mutex<HashMap<String, Arc<jsonschema::Validator>>>> = LazyLock::new(Default::default);

/// A validator for `schema`, whose `$ref`s point into the document's components.
fn validator(key: &str, schema: &Value) -> Arc<jsonschema::Validator> {
    let mut cache = VALIDATORS.lock().unwrap();
    cache
        .entry(key.to_owned())
        .or_insert_with(|| {
            let root = json!({
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "components": DOC["components"],
                "allOf": [schema],
            });
            Arc::new(jsonschema::validator_for(&root).unwrap_or_else(|e| panic!("schema for {key}: {e}")))
        })
        .clone()
}

fn assert_valid(key: &str, schema: &Value, instance: &Value) {
    let v = validator(key, schema);
    let errors: Vec<String> = v.iter_errors(instance).map(|e| format!("{e} at {}", e.instance_path())).collect();
    assert!(errors.is_empty(), "{key}: response does not match the document: {errors:?}\n{instance}");
}

/// The document's path template that `path` matches, if any.
fn template_for(path: &str) -> Option<String> {
    let segments: Vec<&str> = path.split('/').collect();
    DOC["paths"]
        .as_object()?
        .keys()
        .find(|template| {
            let t: Vec<&str> = template.split('/').collect();
            t.len() == segments.len()
                && t.iter()
                    .zip(&segments)
                    .all(|(t, s)| (t.starts_with('{') && t.ends_with('}') && !s.is_empty()) || t == s)
        })
        .cloned()
}

/// Checks a JSON response of `method path` against the document: its status must be one the
/// operation documents, and its body must match that status's schema. Paths and methods the
/// document does not have (the 404 and 405 fallbacks) are only checked for `{error}`.
pub fn check_response(method: &str, path_and_query: &str, status: u16, body: &Value) {
    let path = path_and_query.split('?').next().unwrap_or("");
    let operation =
        template_for(path).and_then(|t| DOC["paths"][&t].get(method.to_lowercase()).cloned().map(|op| (t, op)));
    let Some((template, operation)) = operation else {
        assert!(body["error"].is_string(), "{method} {path}: {body}");
        return;
    };
    let Some(response) = operation["responses"].get(status.to_string()) else {
        // A database that cannot take writes, or the stream cap, may refuse any route (401 and
        // 500 are in the document wherever they can happen).
        if status == 503 {
            assert_valid("ErrorBody", &json!({"$ref": "#/components/schemas/ErrorBody"}), body);
            return;
        }
        panic!("{method} {template}: status {status} is not in the document ({body})");
    };
    let Some(schema) = response.pointer("/content/application~1json/schema") else {
        return;
    };
    assert_valid(&format!("{method} {template} {status}"), schema, body);
}

/// Checks one streamed event against the `AgentEvent` schema.
pub fn check_event(event: &Value) {
    assert_valid("AgentEvent", &json!({"$ref": "#/components/schemas/AgentEvent"}), event);
}
