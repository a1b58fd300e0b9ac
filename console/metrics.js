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

/** `/metrics/throughput` per model, for a day, an ISO week or a month, and the chosen model's
 *  figures over that time from `/metrics/series` (by hour for a day or a week, by day for a
 *  month): time to first token p50 and p95, output tokens per second, error rate. */
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
    this.model = h("select", { "aria-label": "Model over time" });
    this.model.addEventListener("change", () => this.drawSeries());
    this.charts = h("div", { class: "plots" });
    this.overTime = h("section", { "aria-label": "Over time" }, h("h2", {}, "Over time"), h("label", {}, "Model ", this.model), this.charts);
    this.seriesReads = new Reads(this.charts);
    this.series = null;
    this.element = h(
      "section",
      { class: "page", "aria-label": "Throughput" },
      h("h1", {}, "Throughput"),
      h("div", { class: "tools" }, h("label", {}, "Period ", this.period), h("label", {}, "Date ", this.date)),
      this.message,
      this.body,
      this.overTime,
    );
    this.refresh();
  }

  async readSeries(query) {
    let data;
    try {
      data = await this.seriesReads.newest(`/metrics/series?${query}`);
    } catch (e) {
      if (e instanceof ApiError && e.status !== 401) this.message.textContent = e.message;
      return;
    }
    if (!data) return;
    this.series = data;
    const chosen = this.model.value;
    this.model.replaceChildren(...data.models.map((m) => h("option", { value: m.model }, m.model)));
    // The model chosen before, else the one with the most turns in the period.
    const turns = (m) => m.points.reduce((sum, p) => sum + p.turns, 0);
    const busiest = data.models.reduce((a, b) => (turns(b) > turns(a) ? b : a), data.models[0]);
    this.model.value = data.models.some((m) => m.model === chosen) ? chosen : busiest?.model ?? "";
    this.drawSeries();
  }

  /** The chosen model's points: x is the hour (or day) of the period, from its start. */
  drawSeries() {
    const data = this.series;
    const model = data?.models.find((m) => m.model === this.model.value);
    if (!model) return this.charts.replaceChildren(h("p", { class: "muted" }, "No sealed turns in this period."));
    const byDay = data.bucket === "day";
    const xLabel = byDay ? "day" : "hour";
    const slot = (p) => Math.round((p.at - data.start) / data.bucketMs) + (byDay ? 1 : 0);
    const when = (p) => new Date(p.at).toLocaleString();
    const series = (value, describe) =>
      model.points.map((p) => {
        const y = value(p);
        return { x: slot(p), y, label: `${when(p)}: ${y === undefined ? "none" : describe(y)} (${num(p.turns)} turns)` };
      });
    this.charts.replaceChildren(
      linePlot({ title: "Time to first token p50", xLabel, yLabel: "ms", points: series((p) => p.ttftP50Ms, ms) }),
      linePlot({ title: "Time to first token p95", xLabel, yLabel: "ms", points: series((p) => p.ttftP95Ms, ms) }),
      linePlot({ title: "Output tokens per second over time", xLabel, yLabel: "tokens/s", points: series((p) => p.outputTokensPerSecond, (v) => `${num(v, 1)} tokens/s`) }),
      linePlot({ title: "Error rate", xLabel, yLabel: "%", points: series((p) => p.errorRate * 100, (v) => `${num(v, 1)} %`) }),
    );
  }

  async refresh() {
    const query = `period=${this.period.value}&date=${encodeURIComponent(this.date.value)}`;
    this.readSeries(query);
    let data;
    try {
      data = await this.reads.newest(`/metrics/throughput?${query}`);
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
