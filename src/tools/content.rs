//! A tool's result as the model reads it: one text, whatever parts the server sent (docs/tools.md).
//!
//! Read from the result's JSON (MCP's `CallToolResult`), not the SDK's types: a part of a kind
//! newer than the SDK still gets its name said instead of failing the call.

use serde_json::Value;

/// The text of a `tools/call` result: its text parts joined by newlines, other parts named
/// (`[image image/png, 20480 bytes]`), `structuredContent` when nothing else came; cut at `max`
/// bytes with a line saying how much was left out.
pub fn result_text(result: &Value, max: usize) -> String {
    let mut parts: Vec<String> = Vec::new();
    for part in result.get("content").and_then(Value::as_array).into_iter().flatten() {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("unknown");
        let text = match kind {
            "text" => part.get("text").and_then(Value::as_str).unwrap_or_default().to_owned(),
            "image" | "audio" => {
                let mime = part.get("mimeType").and_then(Value::as_str).unwrap_or("of no stated type");
                // Base64: three bytes in four characters.
                let bytes =
                    part.get("data").and_then(Value::as_str).map_or(0, |d| d.trim_end_matches('=').len() * 3 / 4);
                format!("[{kind} {mime}, {bytes} bytes]")
            }
            "resource" => {
                let resource = part.get("resource").cloned().unwrap_or(Value::Null);
                let uri = resource.get("uri").and_then(Value::as_str).unwrap_or("?");
                match resource.get("text").and_then(Value::as_str) {
                    Some(text) => format!("[resource {uri}]\n{text}"),
                    None => format!("[resource {uri}]"),
                }
            }
            "resource_link" => {
                let uri = part.get("uri").and_then(Value::as_str).unwrap_or("?");
                format!("[resource link {uri}]")
            }
            other => format!("[{other}]"),
        };
        parts.push(text);
    }
    if parts.is_empty()
        && let Some(structured) = result.get("structuredContent")
    {
        parts.push(structured.to_string());
    }
    capped(parts.join("\n"), max)
}

/// `text` cut at a character boundary at most `max` bytes in, with a line saying how many
/// bytes were left out.
pub fn capped(mut text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let left_out = text.len() - end;
    text.truncate(end);
    text.push_str(&format!("\n[{left_out} more bytes left out: the result was longer than {max} bytes]"));
    text
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn text_parts_are_joined_and_others_named() {
        let result = json!({"content": [
            {"type": "text", "text": "first"},
            {"type": "image", "mimeType": "image/png", "data": "AAAA"},
            {"type": "resource", "resource": {"uri": "file:///a", "text": "inside"}},
            {"type": "resource_link", "uri": "file:///b", "name": "b"},
            {"type": "text", "text": "last"},
        ]});
        assert_eq!(
            result_text(&result, 1 << 20),
            "first\n[image image/png, 3 bytes]\n[resource file:///a]\ninside\n[resource link file:///b]\nlast"
        );
        assert_eq!(result_text(&json!({"content": [], "structuredContent": {"n": 1}}), 100), r#"{"n":1}"#);
    }

    #[test]
    fn a_long_result_is_cut_and_says_so() {
        let text = capped("é".repeat(10), 5);
        assert!(text.starts_with("éé\n"), "{text}");
        assert!(text.contains("16 more bytes left out"), "{text}");
        assert_eq!(capped("short".into(), 5), "short");
    }
}
