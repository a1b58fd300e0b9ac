"""A smoke turn against a gateway in a container, from outside it (docker/ci-image).

  ci-smoke.py URL first    a turn; its history and metrics
  ci-smoke.py URL stop     watch a long turn until the container's stop seals it aborted
  ci-smoke.py URL again    a new container on the same volume: history, metrics and seq go on
  ci-smoke.py URL compose  a turn through the compose file's service
  ci-smoke.py URL cluster NODE_URL...
                           the cluster profile: a turn started and watched through the proxy
                           (URL), the same history read from every gateway directly
"""
import json
import sys
import urllib.request

url, step = sys.argv[1], sys.argv[2]
CONVERSATION = "docker-smoke"


def call(method, path, body=None):
    """The whole response body (a turn's stream ends after turn-sealed)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


def get(path):
    return json.loads(call("GET", path))


def turn(conversation, message):
    body = call("POST", "/chat", {"conversationId": conversation, "message": message})
    events = [json.loads(line) for line in body.splitlines() if line.strip()]
    assert events[0]["type"] == "user-message" and events[-1]["type"] == "turn-sealed", events
    assert events[-2]["type"] == "done", events
    return events


def check(condition, what):
    if not condition:
        sys.exit(f"ci-smoke {step}: {what}")


if step in ("first", "compose"):
    conversation = CONVERSATION if step == "first" else "compose-smoke"
    events = turn(conversation, "hello from outside the container")
    check(events[-2]["reason"] == "stop", events[-2])
    chunks = get(f"/conversations/{conversation}")["chunks"]
    check([c["seq"] for c in chunks] == list(range(1, len(chunks) + 1)), chunks)
    check(len(get(f"/conversations/{conversation}/metrics")["turns"]) == 1, "one turn of metrics")
elif step == "stop":
    # A turn long enough to be running when the stop comes (10 tokens/s).
    events = turn(CONVERSATION, "a long one " * 200)
    check(events[-2]["reason"] == "aborted", f"the stop ended the turn {events[-2]}")
elif step == "again":
    before = get(f"/conversations/{CONVERSATION}")["chunks"]
    check(len(before) >= 3, f"the volume kept the log: {before}")
    check(len(get(f"/conversations/{CONVERSATION}/metrics")["turns"]) == 2, "both turns' metrics are kept")
    turn(CONVERSATION, "after the restart")
    after = get(f"/conversations/{CONVERSATION}")["chunks"]
    check([c["seq"] for c in after] == list(range(1, len(after) + 1)), "seq goes on gap-free")
    check(len(after) > len(before), "the new turn was appended")
elif step == "cluster":
    conversation = "cluster-smoke"
    started = json.loads(call("POST", f"/conversations/{conversation}/messages", {"message": "hello, cluster"}))
    check(started.get("conversationId") == conversation, started)
    # Whichever gateway the proxy picks for the watch, it replays the turn from its start.
    body = call("GET", f"/conversations/{conversation}/events?until=sealed")
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    types = [e.get("type") for e in events]
    check(types[0] == "user-message" and types[-2:] == ["done", "turn-sealed"], types)
    histories = []
    for node in sys.argv[3:]:
        with urllib.request.urlopen(f"{node}/conversations/{conversation}", timeout=60) as r:
            histories.append(json.loads(r.read())["chunks"])
    check(len(histories) == 3 and all(h == histories[0] for h in histories), "every gateway reads the same history")
    check([c["seq"] for c in histories[0]] == list(range(1, len(histories[0]) + 1)), histories[0])
print(f"ci-smoke {step}: ok")
