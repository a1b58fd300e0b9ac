// The gateway itself, from `/metrics` (Prometheus text), `/ready` and `/tools`, read again two
// seconds after each answer while shown: streams, turns, events, database writes, agent
// processes per credential, each model's turns, errors and latencies since the gateway
// started, the last week's failed turns (`/metrics/errors`), and the MCP servers with their
// state and tools.

import { get, ApiError } from "./api.js";
import { h, bytes, ms, num } from "./dom.js";

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

/** The labels of a series key (`name{a="x",b="y"}`), or null for another metric's. */
function labelsOf(key, name) {
  if (!key.startsWith(`${name}{`)) return null;
  const labels = {};
  for (const [, k, v] of key.slice(name.length + 1, -1).matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[k] = v;
  return labels;
}

/** The `q` quantile of a histogram's cumulative buckets ([[upper bound, count]], ascending),
 *  interpolated inside its bucket as Prometheus's `histogram_quantile` does; undefined when
 *  empty, the last finite bound when it falls in `+Inf`. */
export function quantile(q, buckets) {
  const total = buckets.at(-1)?.[1] || 0;
  if (!total) return undefined;
  const rank = q * total;
  let [lower, below] = [0, 0];
  for (const [bound, count] of buckets) {
    if (count >= rank) {
      if (bound === Infinity) return lower;
      return lower + ((bound - lower) * (rank - below)) / Math.max(count - below, 1);
    }
    [lower, below] = [bound, count];
  }
  return lower;
}

/** A bucket's upper bound (`le`), `+Inf` included. */
const bound = (le) => (le === "+Inf" ? Infinity : Number(le));

/** Each model's figures since the gateway started, from the `dispatch_model_*` series:
 *  [{model, credential, finished, failed, aborted, errors: {code: n}, input, output, ttft, decode}]. */
export function modelFigures(values) {
  const models = new Map();
  const of = (labels) => {
    if (!models.has(labels.model)) {
      models.set(labels.model, {
        model: labels.model, credential: labels.credential, finished: 0, failed: 0, aborted: 0,
        errors: {}, input: 0, output: 0, ttft: [], decode: [],
      });
    }
    return models.get(labels.model);
  };
  for (const [key, value] of Object.entries(values)) {
    let labels;
    if ((labels = labelsOf(key, "dispatch_model_turns_total"))) of(labels)[labels.outcome] = value;
    else if ((labels = labelsOf(key, "dispatch_model_errors_total"))) of(labels).errors[labels.code] = value;
    else if ((labels = labelsOf(key, "dispatch_model_tokens_total"))) of(labels)[labels.direction] = value;
    else if ((labels = labelsOf(key, "dispatch_model_ttft_seconds_bucket"))) of(labels).ttft.push([bound(labels.le), value]);
    else if ((labels = labelsOf(key, "dispatch_model_decode_seconds_bucket"))) of(labels).decode.push([bound(labels.le), value]);
  }
  for (const m of models.values()) {
    m.ttft.sort((a, b) => a[0] - b[0]);
    m.decode.sort((a, b) => a[0] - b[0]);
  }
  return [...models.values()].sort((a, b) => a.model.localeCompare(b.model));
}

export class GatewayView {
  constructor() {
    this.ready = h("p", { class: "ready", role: "status", "aria-label": "Database state" });
    this.cards = h("dl", { class: "cards" });
    this.tools = h("div", { class: "table-scroll" });
    this.models = h("div", { class: "table-scroll" });
    this.errors = h("div", { class: "table-scroll" });
    this.element = h(
      "section",
      { class: "page", "aria-label": "Gateway" },
      h("h1", {}, "Gateway"),
      this.ready,
      this.cards,
      h("h2", {}, "Models"),
      this.models,
      h("h2", {}, "Recent errors"),
      this.errors,
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
    const recent = await this.refreshErrors();
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
    this.showModels(modelFigures(m), recent || []);
  }

  /** Each model's turns by outcome, its error rate and errors by code, time to first token
   *  (p50, p95) and decode time (p95) of its steps, and its tokens: since the gateway started. */
  showModels(models, recent) {
    if (!models.length) {
      this.models.replaceChildren(h("p", { class: "empty" }, "No turn has sealed since the gateway started."));
      return;
    }
    const seconds = (value) => (value === undefined ? "–" : ms(value * 1000));
    const rows = models.map((m) => {
      const turns = m.finished + m.failed + m.aborted;
      const errors = Object.entries(m.errors).map(([code, n]) => `${code} ${num(n)}`).join(", ");
      // Its upstream's last error this week (recent errors come newest first).
      const last = recent.find((e) => e.model === m.model);
      return h(
        "tr",
        { dataset: { model: m.model } },
        h("td", {}, m.model),
        h("td", { class: "turns" }, `${num(m.finished)} / ${num(m.failed)} / ${num(m.aborted)}`),
        h("td", { class: "error-rate" }, turns ? `${num((100 * m.failed) / turns, 1)} %` : "–", errors ? ` (${errors})` : ""),
        h("td", { class: "ttft" }, `${seconds(quantile(0.5, m.ttft))} / ${seconds(quantile(0.95, m.ttft))}`),
        h("td", { class: "decode" }, seconds(quantile(0.95, m.decode))),
        h("td", { class: "tokens" }, `${num(m.input)} / ${num(m.output)}`),
        h("td", { class: "last-error", title: last ? new Date(last.at).toLocaleString() : "" }, last ? last.message : "–"),
      );
    });
    const head = h(
      "tr",
      {},
      h("th", {}, "Model"),
      h("th", {}, "Turns finished / failed / stopped"),
      h("th", {}, "Error rate"),
      h("th", {}, "First token p50 / p95"),
      h("th", {}, "Decode p95"),
      h("th", {}, "Tokens in / out"),
      h("th", {}, "Last error (7 days)"),
    );
    this.models.replaceChildren(h("table", { "aria-label": "Models" }, h("thead", {}, head), h("tbody", {}, rows)));
  }

  /** `/metrics/errors`: the last week's failed turns, newest first, each linked to its
   *  conversation, with its model, code and message (an upstream's last error, per model). */
  async refreshErrors() {
    let answer;
    try {
      answer = await get("/metrics/errors?limit=20");
    } catch (e) {
      if (!(e instanceof ApiError)) throw e;
      return;
    }
    if (!answer.errors.length) {
      this.errors.replaceChildren(h("p", { class: "empty" }, "No turn failed in the last seven days."));
      return answer.errors;
    }
    const rows = answer.errors.map((e) =>
      h(
        "tr",
        { dataset: { turnId: e.turnId } },
        h("td", {}, h("time", { datetime: new Date(e.at).toISOString() }, new Date(e.at).toLocaleString())),
        h("td", {}, e.model),
        h("td", {}, h("a", { href: `#/c/${encodeURIComponent(e.conversationId)}` }, e.conversationId)),
        h("td", { class: "code" }, e.code || "–"),
        h("td", { class: "message" }, e.message),
      ),
    );
    const head = h("tr", {}, ["When", "Model", "Conversation", "Code", "Error"].map((c) => h("th", { scope: "col" }, c)));
    this.errors.replaceChildren(h("table", { "aria-label": "Recent errors" }, h("thead", {}, head), h("tbody", {}, rows)));
    return answer.errors;
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
