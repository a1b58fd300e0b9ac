//! A recorded Claude Code transcript, mapped event by event.

use super::*;

#[tokio::test]
async fn a_recorded_claude_transcript_maps_to_the_exact_event_list() {
    let transcript = [
        json!({"type": "system", "subtype": "init", "session_id": "claude-sess", "model": "sonnet", "tools": []}),
        json!({"type": "assistant", "message": {"id": "m1", "role": "assistant", "content": [
            {"type": "thinking", "thinking": "List the files."},
            {"type": "text", "text": "I'll look."},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}
        ], "usage": {"input_tokens": 100, "output_tokens": 20, "cache_read_input_tokens": 50, "cache_creation_input_tokens": 10}}}),
        json!({"type": "user", "message": {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt\nb.txt", "is_error": false}
        ]}}),
        json!({"type": "system", "subtype": "compact_boundary"}),
        json!({"type": "stream_event", "event": {"type": "ping"}}),
        json!({"type": "assistant", "message": {"id": "m2", "role": "assistant", "content": [
            {"type": "text", "text": "Two files."}
        ], "usage": {"input_tokens": 130, "output_tokens": 5}}}),
        json!({"type": "result", "subtype": "success", "is_error": false, "result": "Two files.", "session_id": "claude-sess",
               "usage": {"input_tokens": 230, "output_tokens": 25}, "some_new_field": true}),
    ];
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = transcript.iter().map(|l| l.to_string()).collect();
    let script = agent(
        dir.path(),
        "claude.py",
        &format!(
            r#"
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "starts.log"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
LINES = {lines:?}
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("type") != "user":
        continue
    assert msg["message"]["content"][0]["text"] == "list files"
    for out in LINES:
        print(out, flush=True)
"#
        ),
    );
    let server = gateway(dir.path(), &script, Dialect::ClaudeStreamJson).await;
    let events = turn(&server, "cc", "list files").await;
    let turn_id = events[0]["turnId"].as_str().unwrap().to_owned();
    let (s0, s1) = (format!("{turn_id}#0"), format!("{turn_id}#1"));
    let mut stripped = events.clone();
    for e in &mut stripped {
        let o = e.as_object_mut().unwrap();
        for k in ["conversationId", "turnId", "ttftMs", "decodeMs", "genTotalMs", "durationMs"] {
            o.remove(k);
        }
    }
    assert_eq!(
        stripped,
        vec![
            json!({"type": "user-message", "text": "list files"}),
            json!({"type": "turn-start"}),
            json!({"type": "reasoning-delta", "delta": "List the files."}),
            json!({"type": "text-delta", "delta": "I'll look."}),
            json!({"type": "tool-call", "stepId": s0, "toolCallId": "toolu_1", "toolName": "Bash", "input": {"command": "ls"}}),
            json!({"type": "usage", "stepId": s0, "usage": {"inputTokens": 160, "outputTokens": 20, "cacheReadTokens": 50, "cacheWriteTokens": 10}}),
            json!({"type": "step-complete", "stepId": s0}),
            json!({"type": "tool-result", "stepId": s0, "toolCallId": "toolu_1", "toolName": "Bash", "content": "a.txt\nb.txt", "isError": false}),
            json!({"type": "text-delta", "delta": "Two files."}),
            json!({"type": "usage", "stepId": s1, "usage": {"inputTokens": 130, "outputTokens": 5}}),
            json!({"type": "step-complete", "stepId": s1}),
            json!({"type": "done", "reason": "stop", "usage": {"inputTokens": 290, "outputTokens": 25, "cacheReadTokens": 50, "cacheWriteTokens": 10}, "contextSize": 135}),
            json!({"type": "turn-sealed"}),
        ]
    );
    // Launched in stream-json mode with its model and token streaming; the session was stored
    // for `--resume`. (Input counts the cache: Anthropic's `input_tokens` leaves it out.)
    let launch = &starts(dir.path())[0];
    assert!(launch.contains("--input-format stream-json --output-format stream-json"), "{launch}");
    assert!(launch.contains("--model fake"), "{launch}");
    assert!(launch.contains("--include-partial-messages"), "{launch}");
    let server = server.restart().await;
    turn(&server, "cc", "list files").await;
    assert!(starts(dir.path())[1].contains("--resume=claude-sess"), "{:?}", starts(dir.path()));
}
