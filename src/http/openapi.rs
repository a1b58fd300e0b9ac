//! The OpenAPI document's generation (the `openapi` build): from the handlers' annotations,
//! then made exact where the generator is loose. The gateway serves the committed result.

use serde_json::{Map, Value, json};

/// Fields that are really sent as `null`; every other optional field is omitted when absent.
const NULLABLE: &[(&str, &str)] = &[
    ("ModelRequest", "model"),
    ("ModelResponse", "model"),
    ("CwdRequest", "cwd"),
    ("CwdResponse", "cwd"),
    ("ReasoningEffortRequest", "reasoningEffort"),
    ("ReasoningEffortResponse", "reasoningEffort"),
    ("LspResponse", "cwd"),
];

/// Tagged unions: each becomes a `oneOf` of references with a `discriminator` on `type`.
const UNIONS: &[&str] = &["AgentEvent", "Chunk"];

/// Makes the generated document say exactly what goes over the wire.
pub fn refine(mut doc: Value) -> Value {
    if let Some(paths) = doc.get_mut("paths").and_then(Value::as_object_mut) {
        for (path, operations) in paths.iter_mut() {
            let Some(operations) = operations.as_object_mut() else { continue };
            for (method, operation) in operations.iter_mut() {
                let takes_body = operation.get("requestBody").is_some();
                if let Some(responses) = operation.get_mut("responses").and_then(Value::as_object_mut) {
                    complete_responses(path, method, takes_body, responses);
                }
            }
        }
    }
    let Some(schemas) = doc.pointer_mut("/components/schemas").and_then(Value::as_object_mut) else {
        return doc;
    };
    for union in UNIONS {
        discriminate(schemas, union);
    }
    for (name, schema) in schemas.iter_mut() {
        drop_null_from_optionals(name, schema);
    }
    doc
}

/// Adds what every operation of its kind can answer besides what its handler declares, and the
/// description OpenAPI 3.1 requires of every response (the status's reason phrase where the
/// handler gave none):
/// - 401 on every route but the public ones: with `--api-keys` set, a request without a valid key
///   is refused before it reaches the handler;
/// - 421 on every route: a request naming a host the gateway does not answer to
///   (`--allowed-hosts`) is refused before routing;
/// - 403 on every state change and on `/ws`: a browser page of an origin the gateway does not
///   let in (`--cors-origins`);
/// - 415 on every route that takes a body: one not typed as JSON;
/// - 429 on every route that starts a turn or opens a stream: past one of the caller's quotas
///   (`[quotas]`), with `Retry-After` and the quota's name;
/// - 500 on every route whose handler answers errors with an `ErrorBody` (but `/ws`, which
///   answers its errors on the socket once upgraded, and the public ones: `/ready` reports a
///   failing database as 503): a storage failure that no other status describes; the details
///   go to the gateway's log, not to the client.
fn complete_responses(path: &str, method: &str, takes_body: bool, responses: &mut Map<String, Value>) {
    let error = |description: &str| {
        json!({
            "description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
        })
    };
    let answers_errors = responses.values().any(|r| {
        r.pointer("/content/application~1json/schema/$ref").and_then(Value::as_str)
            == Some("#/components/schemas/ErrorBody")
    });
    let public = super::layers::is_public(&crate::config::Config::defaults(), path);
    if !public {
        responses.entry("401").or_insert_with(|| {
            error("No credential, or one that is not valid (only when keys or token keys are configured)")
        });
    }
    responses.entry("421").or_insert_with(|| error("The request names a host the gateway does not answer to"));
    if matches!(method, "post" | "put" | "patch" | "delete") || path == "/ws" {
        responses.entry("403").or_insert_with(|| error("A browser page of an origin the gateway does not let in"));
    }
    if takes_body {
        responses
            .entry("415")
            .or_insert_with(|| error("The body is not typed as JSON (Content-Type: application/json)"));
    }
    let quota = matches!(
        (method, path),
        ("post", "/chat" | "/conversations/{id}/messages" | "/conversations/{id}/queue")
            | ("get", "/conversations/{id}/events" | "/conversations/{id}/last" | "/ws")
    );
    if quota {
        responses.entry("429").or_insert_with(|| {
            json!({
                "description": "Past one of the caller's quotas ([quotas]): the body names it",
                "headers": {"Retry-After": {"description": "Seconds until the quota has room", "schema": {"type": "integer"}}},
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/QuotaBody"}}},
            })
        });
    }
    if answers_errors && !public && path != "/ws" {
        responses
            .entry("500")
            .or_insert_with(|| error("Internal error (storage failed); the details are in the gateway's log"));
    }
    for (status, response) in responses.iter_mut() {
        if let Some(response) = response.as_object_mut()
            && !response.contains_key("description")
        {
            let reason = status
                .parse::<u16>()
                .ok()
                .and_then(|s| axum::http::StatusCode::from_u16(s).ok())
                .and_then(|s| s.canonical_reason())
                .unwrap_or("Response");
            response.insert("description".into(), json!(reason));
        }
    }
}

/// `oneOf: [{allOf: [{$ref: X}, {properties: {type: {enum: [t]}}}]}]` becomes
/// `oneOf: [{$ref: X}]` + `discriminator {propertyName: type, mapping {t: X}}`, with `type`
/// moved into each variant's own schema.
fn discriminate(schemas: &mut Map<String, Value>, union: &str) {
    let Some(variants) = schemas.get(union).and_then(|s| s.get("oneOf")).and_then(Value::as_array).cloned() else {
        return;
    };
    let mut refs = Vec::new();
    let mut mapping = Map::new();
    for variant in variants {
        let reference = variant.pointer("/allOf/0/$ref").and_then(Value::as_str).map(str::to_owned);
        let tag = variant.pointer("/allOf/1/properties/type/enum/0").and_then(Value::as_str).map(str::to_owned);
        let (Some(reference), Some(tag)) = (reference, tag) else { return };
        let name = reference.rsplit('/').next().unwrap_or_default().to_owned();
        if let Some(Value::Object(target)) = schemas.get_mut(&name) {
            let properties = target.entry("properties").or_insert_with(|| json!({}));
            if let Value::Object(p) = properties {
                let mut with_type = Map::new();
                with_type.insert("type".into(), json!({"type": "string", "enum": [tag]}));
                with_type.extend(std::mem::take(p));
                *p = with_type;
            }
            let required = target.entry("required").or_insert_with(|| json!([]));
            if let Value::Array(r) = required {
                r.insert(0, json!("type"));
            }
        }
        mapping.insert(tag, json!(reference));
        refs.push(json!({"$ref": reference}));
    }
    if let Some(Value::Object(u)) = schemas.get_mut(union) {
        u.insert("oneOf".into(), Value::Array(refs));
        u.insert("discriminator".into(), json!({"propertyName": "type", "mapping": mapping}));
    }
}

fn drop_null_from_optionals(schema_name: &str, schema: &mut Value) {
    let required: Vec<String> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    let Some(Value::Object(properties)) = schema.get_mut("properties") else { return };
    for (field, property) in properties.iter_mut() {
        if required.contains(field) || NULLABLE.contains(&(schema_name, field.as_str())) {
            continue;
        }
        if let Some(Value::Array(types)) = property.get_mut("type") {
            types.retain(|t| t != "null");
            if types.len() == 1 {
                let only = types.remove(0);
                property["type"] = only;
            }
        }
        // `Option<Struct>` comes out as `oneOf: [null, {$ref}]`.
        if let Some(Value::Array(one_of)) = property.get("oneOf")
            && one_of.len() == 2
            && let Some(other) = one_of.iter().find(|v| v.get("type") != Some(&json!("null")))
        {
            *property = other.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{OPENAPI_JSON, ROUTES, generated_openapi_json};

    /// The served document (the committed file) is what the annotations generate.
    #[test]
    fn the_committed_document_is_the_generated_one() {
        assert!(
            generated_openapi_json() == OPENAPI_JSON,
            "openapi/openapi.json is stale: regenerate it with \
             `cargo run --features openapi -- --print-openapi > openapi/openapi.json`"
        );
    }

    /// Every routed method and path is documented, and the document has no other operation: a
    /// handler's annotation names the path and method the router serves it on.
    #[test]
    fn the_document_has_exactly_the_routes() {
        let doc: serde_json::Value = serde_json::from_str(&generated_openapi_json()).unwrap();
        let mut documented: Vec<(String, String)> = doc["paths"]
            .as_object()
            .unwrap()
            .iter()
            .flat_map(|(path, ops)| ops.as_object().unwrap().keys().map(move |m| (m.clone(), path.clone())))
            .collect();
        let mut routed: Vec<(String, String)> = ROUTES.iter().map(|(m, p)| (m.to_string(), p.to_string())).collect();
        documented.sort();
        routed.sort();
        assert_eq!(documented, routed);
    }
}
