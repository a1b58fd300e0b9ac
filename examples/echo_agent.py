#!/usr/bin/env python3
"""A minimal agent for the gateway's `ndjson` command protocol: echoes every message back."""
import json
import sys
import uuid

session = None


def emit(**event):
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


for line in sys.stdin:
    message = json.loads(line)
    if message.get("type") != "user":
        continue  # an interrupt between turns: nothing to stop
    if session is None:
        session = message.get("sessionId") or str(uuid.uuid4())
        emit(type="session", id=session)
    emit(type="step_start")
    for word in ("You said: " + message["text"]).split(" "):
        emit(type="text", delta=word + " ")
    emit(type="usage", usage={"inputTokens": len(message["text"]) // 4 + 1, "outputTokens": 3})
    emit(type="step_end")
    emit(type="done", reason="stop")
