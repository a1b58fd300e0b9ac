// Status changes of every conversation, over the gateway's WebSocket (`/ws`): the list follows
// them without polling. Reconnects with a growing pause when the socket drops. Signed in by the
// session cookie, which the browser sends with the handshake. A socket the gateway refuses
// while it answers the page's other requests is said to be refused, not "reconnecting" for
// ever: a browser does not tell a page why a handshake failed, and the usual cause (a proxy
// that rewrites Host, so the page's origin is not the gateway's) is the operator's to fix.

export class StatusFeed {
  constructor(indicator) {
    this.indicator = indicator;
    this.listeners = new Set();
    this.pause = 500;
    // Handshakes in a row that failed before the socket opened.
    this.refused = 0;
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
    this.refused = 0;
    this.connect();
  }

  connect() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${location.host}/ws`);
    this.socket = socket;
    // Once refused, the page says so until a socket opens.
    if (this.indicator.dataset.state !== "refused") this.show("connecting", "connecting…");
    let opened = false;
    socket.onopen = () => {
      opened = true;
      this.pause = 500;
      this.refused = 0;
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
      this.refused = opened ? 0 : this.refused + 1;
      if (this.indicator.dataset.state !== "refused") this.show("offline", "reconnecting…");
      if (this.refused >= 2) this.diagnose();
      this.retry = setTimeout(() => this.connect(), this.pause);
      this.pause = Math.min(this.pause * 2, 10_000);
    };
  }

  /** Two handshakes in a row failed before opening: when the gateway answers HTTP, it refused
   *  them (a gateway that is down answers nothing). */
  async diagnose() {
    try {
      await fetch("/ready", { cache: "no-store" });
    } catch {
      return;
    }
    // A socket opened meanwhile: not refused after all.
    if (this.socket.readyState === WebSocket.OPEN) return;
    this.show(
      "refused",
      "live updates refused",
      "The gateway answers this page but refused its WebSocket: behind a proxy, pass the Host header through " +
        "or list this page's origin in --cors-origins (docs/security.md). The page still works; its lists do not update by themselves.",
    );
  }

  show(state, text, title = "") {
    this.indicator.dataset.state = state;
    this.indicator.textContent = text;
    this.indicator.title = title;
  }
}
