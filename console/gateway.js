// The gateway itself, from `/metrics` (Prometheus text), `/ready` and `/tools`, read again two
// seconds after each answer while shown: streams, turns, events, database writes, agent
// processes per credential, and the MCP servers with their state and tools.

import { get, ApiError } from "./api.js";
import { h, bytes, num } from "./dom.js";

/** `name{labels} value` lines into {"name{labels}": value}. */
export function parsePrometheus(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const space = line.lastIndexOf(" ");
    values[line.slice(0, space)] = Number(line.slice(space + 1));
  }
  return values;
}

/** The agent processes of each `command` credential: [[credential, running, started]]. */
export function agentProcesses(values) {
  const rows = [];
  for (const [key, running] of Object.entries(values)) {
    const credential = /^dispatch_agent_processes\{credential="([^"]*)"\}$/.exec(key)?.[1];
    if (credential === undefined) continue;
    rows.push([credential, running, values[`dispatch_agent_starts_total{credential="${credential}"}`]]);
  }
  return rows.sort(([a], [b]) => a.localeCompare(b));
}

export class GatewayView {
  constructor() {
    this.ready = h("p", { class: "ready", role: "status", "aria-label": "Database state" });
    this.cards = h("dl", { class: "cards" });
    this.tools = h("div", { class: "table-scroll" });
    this.element = h(
      "section",
      { class: "page", "aria-label": "Gateway" },
      h("h1", {}, "Gateway"),
      this.ready,
      this.cards,
      h("h2", {}, "Tools"),
      this.tools,
    );
    this.poll();
  }

  /** Reads, then reads again 2 s after the answer: a gateway slow to answer is not sent a new
   * read every 2 s on top of those still out (and answers cannot come back out of order). */
  async poll() {
    try {
      await this.refresh();
    } finally {
      if (!this.gone) this.timer = setTimeout(() => this.poll(), 2000);
    }
  }

  async refresh() {
    try {
      await get("/ready");
      this.ready.textContent = "Ready: the database answers and turns are accepted.";
      this.ready.dataset.state = "ready";
    } catch (e) {
      this.ready.textContent = `Not ready: ${e.message}`;
      this.ready.dataset.state = "unready";
    }
    await this.refreshTools();
    let m;
    try {
      m = parsePrometheus(await get("/metrics"));
    } catch (e) {
      if (e instanceof ApiError && e.status !== 401) this.ready.textContent = e.message;
      return;
    }
    const writes = m["dispatch_sqlite_write_seconds_count"] || 0;
    const mean = writes ? (m["dispatch_sqlite_write_seconds_sum"] / writes) * 1000 : undefined;
    // Each term with its value in one grid cell (a `dl` may group them in a `div`): as two
    // cells they fell apart wherever the row's width took an odd number of cells.
    const card = (label, value) => [h("div", {}, h("dt", {}, label), h("dd", { "aria-label": label }, value))];
    this.cards.replaceChildren(
      ...card("SSE streams", num(m['dispatch_open_streams{transport="sse"}'])),
      ...card("NDJSON streams", num(m['dispatch_open_streams{transport="ndjson"}'])),
      ...card("WebSocket sessions", num(m['dispatch_open_streams{transport="websocket"}'])),
      ...card("Turns running", num(m["dispatch_turns_running"])),
      ...card("Replay buffers", bytes(m["dispatch_hub_buffer_bytes"] || 0)),
      ...card("Conversations in the hub", num(m["dispatch_hub_channels"])),
      ...card("Turns started", num(m["dispatch_turns_started_total"])),
      ...card("Turns sealed", num(m["dispatch_turns_sealed_total"])),
      ...card("Turns failed", num(m["dispatch_turns_failed_total"])),
      ...card("Turns aborted", num(m["dispatch_turns_aborted_total"])),
      ...card("Events emitted", num(m["dispatch_events_emitted_total"])),
      ...card("Events delivered", num(m["dispatch_events_delivered_total"])),
      ...card("Database writes", num(writes)),
      ...card("Mean write", mean === undefined ? "–" : `${num(mean, 2)} ms`),
      // Each agent process (Claude Code's, say) holds memory of its own.
      ...agentProcesses(m).flatMap(([credential, running, started]) => [
        ...card(`Agent processes (${credential})`, num(running)),
        ...card(`Agent starts (${credential})`, num(started)),
      ]),
    );
  }

  /** `/tools`: each MCP server's state (a failed one with its reason) and its tools. */
  async refreshTools() {
    let servers;
    try {
      servers = (await get("/tools")).servers;
    } catch (e) {
      this.tools.replaceChildren(h("p", { class: "empty" }, `The tools could not be read: ${e.message}`));
      return;
    }
    if (!servers.length) {
      this.tools.replaceChildren(h("p", { class: "empty" }, "No MCP servers are configured (docs/tools.md)."));
      return;
    }
    const state = (s) => (s.error ? `${s.state}: ${s.error}` : s.processes === undefined ? s.state : `${s.state} (${s.processes} running)`);
    const rows = servers.map((s) =>
      h(
        "tr",
        { dataset: { server: s.name } },
        h("td", {}, s.name),
        h("td", {}, `${s.transport}, ${s.scope}`),
        h("td", { class: "state", dataset: { state: s.state } }, state(s)),
        h("td", {}, s.tools.length ? s.tools.map((t) => t.name).join(", ") : "–"),
      ),
    );
    const head = h("tr", {}, h("th", {}, "Server"), h("th", {}, "Runs"), h("th", {}, "State"), h("th", {}, "Tools (as models call them)"));
    this.tools.replaceChildren(h("table", { "aria-label": "MCP servers" }, h("thead", {}, head), h("tbody", {}, rows)));
  }

  destroy() {
    this.gone = true;
    clearTimeout(this.timer);
  }
}
