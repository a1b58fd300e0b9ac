// Status changes of every conversation, over the gateway's WebSocket (`/ws`): the list follows
// them without polling. Reconnects with a growing pause when the socket drops. Signed in by the
// session cookie, which the browser sends with the handshake.

export class StatusFeed {
  constructor(indicator) {
    this.indicator = indicator;
    this.listeners = new Set();
    this.pause = 500;
    this.connect();
  }

  /** `callback({conversationId, status})` on every change; returns the unsubscribe. */
  subscribe(callback) {
    this.listeners.add(callback);
    return () => this.listeners.delete(callback);
  }

  /** Tells the listeners to read again: a change this page made that no status announces. */
  touch() {
    for (const listener of this.listeners) listener(null);
  }

  /** Drops the socket and opens a new one (after a key was entered). */
  restart() {
    if (this.socket) {
      this.socket.onclose = null;
      this.socket.close();
    }
    clearTimeout(this.retry);
    this.pause = 500;
    this.connect();
  }

  connect() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${location.host}/ws`);
    this.socket = socket;
    this.show("connecting", "connecting…");
    socket.onopen = () => {
      this.pause = 500;
      this.show("live", "live");
      // A change missed while the socket was down: the list reads itself again.
      this.touch();
    };
    socket.onmessage = (message) => {
      let data;
      try {
        data = JSON.parse(message.data);
      } catch {
        return;
      }
      if (data.type !== "conversation.statusChanged") return;
      for (const listener of this.listeners) listener(data);
    };
    socket.onclose = () => {
      this.show("offline", "reconnecting…");
      this.retry = setTimeout(() => this.connect(), this.pause);
      this.pause = Math.min(this.pause * 2, 10_000);
    };
  }

  show(state, text) {
    this.indicator.dataset.state = state;
    this.indicator.textContent = text;
  }
}
