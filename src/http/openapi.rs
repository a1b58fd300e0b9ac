//! The OpenAPI document: generated from the handlers' annotations, then made exact where the
//! generator is loose, and serialized once.

use serde_json::{Map, Value, json};

/// Fields that are really sent as `null`; every other optional field is omitted when absent.
const NULLABLE: &[(&str, &str)] = &[("ModelResponse", "model")];

/// Tagged unions: each becomes a `oneOf` of references with a `discriminator` on `type`.
const UNIONS: &[&str] = &["AgentEvent", "Chunk"];

/// Makes the generated document say exactly what goes over the wire.
pub fn refine(mut doc: Value) -> Value {
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
