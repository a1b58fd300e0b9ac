// Metrics as plots: a conversation's turns (time to first token, output tokens per second,
// context size, and the steps of one turn), and the gateway's throughput per model.

import { Reads, ApiError } from "./api.js";
import { h, ms, num } from "./dom.js";
import { linePlot, barPlot } from "./plot.js";

const has = (v) => v !== undefined && v !== null;

/** Output tokens over generation time: the turn's steps' `genTotalMs` summed, over the steps
 *  whose usage the runtime reported. None for a turn with no usage reported (a stopped
 *  stream): its zeros are no measurement, and 0 tokens/s would be a false one. */
export function tokensPerSecond(turn) {
  if (turn.usageReported === false) return undefined;
  const counted = turn.steps.filter((s) => s.usageReported !== false);
  const gen = counted.reduce((sum, s) => sum + (s.genTotalMs || 0), 0);
  const output = counted.reduce((sum, s) => sum + s.usage.outputTokens, 0);
  return gen > 0 ? output / (gen / 1000) : undefined;
}

/** The plots of one conversation's sealed turns. */
export class TurnPlots {
  /** `onRead` gets each read's turns (the transcript's footers come from them). */
  constructor(conversationId, onRead = () => {}) {
    this.id = conversationId;
    this.onRead = onRead;
    this.turns = [];
    this.selected = null;
    this.pinned = false;
    this.plots = h("div", { class: "plots" });
    this.element = h("section", { class: "metrics", "aria-label": "Turn metrics" }, h("h2", {}, "Metrics"), this.plots);
    this.reads = new Reads(this.plots);
  }

  async refresh() {
    try {
      const answer = await this.reads.newest(`/conversations/${encodeURIComponent(this.id)}/metrics`);
      if (!answer) return;
      this.turns = answer.turns;
      this.onRead(this.turns);
    } catch (e) {
      if (!(e instanceof ApiError)) throw e;
      return;
    }
    // The newest turn is the one broken down, until a point is clicked.
    if (!this.pinned || this.selected > this.turns.length) this.selected = this.turns.length || null;
    this.draw();
  }

  draw() {
    const series = (value, describe) =>
      this.turns.map((t, i) => {
        const y = value(t);
        return { x: i + 1, y, label: `turn ${i + 1}: ${has(y) ? describe(y) : "none"}` };
      });
    const select = (x) => {
      this.selected = x;
      this.pinned = true;
      this.draw();
    };
    const common = { xLabel: "turn", selected: this.selected, onSelect: select };
    const plots = [
      linePlot({ ...common, title: "Time to first token", yLabel: "ms", points: series((t) => t.steps[0]?.ttftMs, ms) }),
      linePlot({ ...common, title: "Output tokens per second", yLabel: "tokens/s", points: series(tokensPerSecond, (v) => `${num(v, 1)} tokens/s`) }),
      linePlot({ ...common, title: "Context size", yLabel: "tokens", points: series((t) => t.contextSize, (v) => `${num(v)} tokens`) }),
    ];
    const turn = this.turns[this.selected - 1];
    if (turn) {
      plots.push(
        barPlot({
          title: `Steps of turn ${this.selected}`,
          xLabel: "step",
          yLabel: "ms",
          legend: ["to first token", "decoding", "generation (no first token)"],
          bars: turn.steps.map((s, k) => ({
            label: String(k + 1),
            segments: has(s.ttftMs)
              ? [{ value: s.ttftMs }, { value: s.decodeMs || 0 }]
              : [{ value: 0 }, { value: 0 }, { value: s.genTotalMs || 0 }],
            detail: `step ${k + 1}: first token ${ms(s.ttftMs)}, decoding ${ms(s.decodeMs)}, generation ${ms(s.genTotalMs)}, ${s.usageReported === false ? "usage not reported" : `${num(s.usage.inputTokens)} in / ${num(s.usage.outputTokens)} out`}`,
          })),
        }),
      );
    }
    this.plots.replaceChildren(...plots);
  }
}

const today = () => new Date().toISOString().slice(0, 10);

/** `/metrics/throughput` per model, for a day, an ISO week or a month. */
export class ThroughputView {
  constructor() {
    this.period = h(
      "select",
      { "aria-label": "Period" },
      ["day", "week", "month"].map((p) => h("option", { value: p }, p)),
    );
    this.date = h("input", { type: "date", value: today(), "aria-label": "Date" });
    this.period.addEventListener("change", () => {
      const month = this.period.value === "month";
      this.date.type = month ? "month" : "date";
      this.date.value = month ? today().slice(0, 7) : today();
      this.refresh();
    });
    this.date.addEventListener("change", () => this.refresh());
    this.message = h("p", { role: "status", class: "muted" });
    this.body = h("div");
    this.reads = new Reads(this.body);
    this.element = h(
      "section",
      { class: "page", "aria-label": "Throughput" },
      h("h1", {}, "Throughput"),
      h("div", { class: "tools" }, h("label", {}, "Period ", this.period), h("label", {}, "Date ", this.date)),
      this.message,
      this.body,
    );
    this.refresh();
  }

  async refresh() {
    let data;
    try {
      data = await this.reads.newest(`/metrics/throughput?period=${this.period.value}&date=${encodeURIComponent(this.date.value)}`);
    } catch (e) {
      if (e instanceof ApiError && e.status !== 401) this.message.textContent = e.message;
      return;
    }
    if (!data) return;
    const span = `${new Date(data.start).toLocaleString()} – ${new Date(data.end).toLocaleString()}`;
    this.message.textContent = data.models.length ? `From ${span}` : `No sealed turns from ${span}.`;
    const plot = barPlot({
      title: "Output tokens per second of generation, per model",
      xLabel: "model",
      yLabel: "tokens/s",
      bars: data.models.map((m) => ({
        label: m.model,
        segments: [{ value: m.tokensPerSecond }],
        detail: `${m.model}: ${num(m.tokensPerSecond, 1)} tokens/s over ${num(m.turns)} turns (${num(m.totalOutputTokens)} tokens in ${ms(m.totalGenMs)})`,
      })),
    });
    const table = h(
      "table",
      { "aria-label": "Throughput per model" },
      h("thead", {}, h("tr", {}, ["Model", "Tokens/s", "Turns", "Output tokens", "Generation"].map((c) => h("th", { scope: "col" }, c)))),
      h(
        "tbody",
        {},
        data.models.map((m) =>
          h("tr", {}, h("td", {}, m.model), h("td", {}, num(m.tokensPerSecond, 1)), h("td", {}, num(m.turns)), h("td", {}, num(m.totalOutputTokens)), h("td", {}, ms(m.totalGenMs))),
        ),
      ),
    );
    // A narrow window scrolls the table, not the page.
    this.body.replaceChildren(plot, h("div", { class: "table-scroll" }, table));
  }

  destroy() {}
}
