// A web client as a team would serve it with `--web-root`: signed in once through the
// console's sign-in, it reads, streams (SSE and WebSocket) and sends with nothing but the
// session cookie the browser keeps. It writes what it saw into #result (tests/identity.rs).

const out = {};

async function status(method, path, body) {
  const init = { method };
  if (body !== undefined) {
    init.headers = { "Content-Type": "application/json" };
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  return { status: r.status, body: await r.text() };
}

function sseTurn(id) {
  return new Promise((resolve) => {
    const types = [];
    const source = new EventSource(`/conversations/${id}/events`);
    source.onmessage = (m) => {
      const event = JSON.parse(m.data);
      types.push(event.type);
      if (event.type === "turn-sealed") {
        source.close();
        resolve(types);
      }
    };
    source.onopen = () => status("POST", `/conversations/${id}/messages`, { message: "over SSE" }).then((r) => (out.sent = r.status));
    source.onerror = () => types.push("error");
  });
}

function wsTurn(id) {
  return new Promise((resolve) => {
    const types = [];
    const socket = new WebSocket(`${location.protocol === "https:" ? "wss:" : "ws:"}//${location.host}/ws`);
    socket.onopen = () => socket.send(JSON.stringify({ type: "chat.send", conversationId: id, message: "over the socket" }));
    socket.onmessage = (m) => {
      const message = JSON.parse(m.data);
      if (message.type === "chat.delta") types.push(message.event.type);
      if (message.type === "chat.error") types.push("chat.error: " + message.message);
      if (message.type === "chat.delta" && message.event.type === "turn-sealed") {
        socket.close();
        resolve(types);
      }
    };
    socket.onerror = () => resolve([...types, "error"]);
  });
}

(async () => {
  try {
    out.who = JSON.parse((await status("GET", "/auth/session")).body);
    out.list = (await status("GET", "/conversations")).status;
    out.sse = await sseTurn("web-sse");
    out.ws = await wsTurn("web-ws");
    const history = JSON.parse((await status("GET", "/conversations/web-sse")).body);
    out.history = history.chunks.length;
  } catch (e) {
    out.failed = String(e);
  }
  const result = document.createElement("pre");
  result.id = "result";
  result.textContent = JSON.stringify(out);
  document.body.append(result);
})();
