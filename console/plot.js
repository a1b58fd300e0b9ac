// Plots as SVG, drawn at the width they are shown at: axes with units, ticks at round numbers,
// a value under the pointer. Readable with one point and with a few hundred.

import { h } from "./dom.js";

const HEIGHT = 200;
const MARGIN = { top: 12, right: 14, bottom: 34, left: 56 };

/** Round tick values from the first at or above `min` to the first at or above `max`. */
export function ticks(min, max, count = 5) {
  if (!(max > min)) max = min + 1;
  const rough = (max - min) / count;
  const power = 10 ** Math.floor(Math.log10(rough));
  const ratio = rough / power;
  const step = power * (ratio >= 7.5 ? 10 : ratio >= 3.5 ? 5 : ratio >= 1.5 ? 2 : 1);
  const out = [];
  const top = Math.ceil(max / step - 1e-9) * step;
  for (let v = Math.ceil(min / step - 1e-9) * step; v <= top + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function compact(value) {
  if (Math.abs(value) >= 1e6) return `${Number((value / 1e6).toPrecision(3))}M`;
  if (Math.abs(value) >= 1e4) return `${Number((value / 1e3).toPrecision(3))}k`;
  return String(Number(value.toPrecision(4)));
}

/** A figure whose SVG is redrawn when its width changes. */
function figure(title, draw) {
  const readout = h("div", { class: "readout", role: "status", "aria-live": "polite" });
  const frame = h("div", { class: "plot-frame" });
  const element = h("figure", { class: "plot" }, h("figcaption", {}, title), frame, readout);
  let width = 0;
  const render = () => {
    const next = Math.max(240, Math.floor(frame.clientWidth || 480));
    if (next === width) return;
    width = next;
    frame.replaceChildren(draw(width, readout));
  };
  new ResizeObserver(render).observe(frame);
  requestAnimationFrame(render);
  element.redraw = () => {
    width = 0;
    render();
  };
  return element;
}

function axes(svg, width, xTicks, yTicks, x, y, xLabel, yLabel, xFormat = compact) {
  const bottom = HEIGHT - MARGIN.bottom;
  for (const t of yTicks) {
    svg.append(h("line", { class: "grid", x1: MARGIN.left, x2: width - MARGIN.right, y1: y(t), y2: y(t) }));
    svg.append(h("text", { class: "tick", x: MARGIN.left - 6, y: y(t) + 4, "text-anchor": "end" }, compact(t)));
  }
  for (const t of xTicks) {
    svg.append(h("line", { class: "axis", x1: x(t), x2: x(t), y1: bottom, y2: bottom + 4 }));
    svg.append(h("text", { class: "tick", x: x(t), y: bottom + 16, "text-anchor": "middle" }, xFormat(t)));
  }
  svg.append(h("line", { class: "axis", x1: MARGIN.left, x2: width - MARGIN.right, y1: bottom, y2: bottom }));
  svg.append(h("line", { class: "axis", x1: MARGIN.left, x2: MARGIN.left, y1: MARGIN.top, y2: bottom }));
  svg.append(h("text", { class: "label", x: (MARGIN.left + width - MARGIN.right) / 2, y: HEIGHT - 4, "text-anchor": "middle" }, xLabel));
  svg.append(
    h("text", { class: "label", x: -(MARGIN.top + bottom) / 2, y: 14, transform: "rotate(-90)", "text-anchor": "middle" }, yLabel),
  );
}

/**
 * Values over turns: `points` = [{x, y, label}] with `y` undefined where a turn has no value
 * (no point, and the line breaks). `onSelect(x)` when a point is clicked; `selected` marks one.
 */
export function linePlot({ title, xLabel, yLabel, points, selected, onSelect }) {
  return figure(title, (width, readout) => {
    const shown = points.filter((p) => p.y !== undefined && p.y !== null && Number.isFinite(p.y));
    const xs = points.map((p) => p.x);
    const [x0, x1] = xs.length ? [Math.min(...xs), Math.max(...xs)] : [0, 1];
    const yMax = Math.max(0, ...shown.map((p) => p.y));
    const yTicks = ticks(0, yMax * 1.05 || 1);
    const yTop = yTicks[yTicks.length - 1];
    // One turn sits in the middle of an axis one turn wide.
    const span = x1 - x0;
    const pad = span === 0 ? 0.5 : 0;
    const x = (v) => MARGIN.left + ((v - x0 + pad) / (span + 2 * pad)) * (width - MARGIN.left - MARGIN.right);
    const y = (v) => HEIGHT - MARGIN.bottom - (v / yTop) * (HEIGHT - MARGIN.top - MARGIN.bottom);
    const xTicks = ticks(x0, x1, Math.max(2, Math.floor(width / 80))).filter((t) => Number.isInteger(t) && t >= x0 && t <= x1);
    const svg = h("svg", { width, height: HEIGHT, viewBox: `0 0 ${width} ${HEIGHT}`, role: "img", "aria-label": title });
    axes(svg, width, xTicks, yTicks, x, y, xLabel, yLabel);
    let d = "";
    let pen = false;
    for (const p of points) {
      const has = shown.includes(p);
      if (has) d += `${pen ? "L" : "M"}${x(p.x).toFixed(1)},${y(p.y).toFixed(1)}`;
      pen = has;
    }
    svg.append(h("path", { class: "series", d }));
    const radius = shown.length > 150 ? 1.8 : shown.length > 40 ? 2.6 : 3.6;
    for (const p of shown) {
      svg.append(
        h(
          "circle",
          { class: p.x === selected ? "point selected" : "point", cx: x(p.x), cy: y(p.y), r: radius, dataset: { x: p.x } },
          h("title", {}, p.label),
        ),
      );
    }
    const marker = h("circle", { class: "hover", r: radius + 3, cx: -10, cy: -10 });
    svg.append(marker);
    // The nearest point to the pointer, so a value is easy to reach among hundreds.
    const nearest = (event) => {
      const left = svg.getBoundingClientRect().left;
      const px = event.clientX - left;
      let best = null;
      for (const p of shown) if (!best || Math.abs(x(p.x) - px) < Math.abs(x(best.x) - px)) best = p;
      return best;
    };
    svg.addEventListener("pointermove", (event) => {
      const p = nearest(event);
      if (!p) return;
      marker.setAttribute("cx", x(p.x));
      marker.setAttribute("cy", y(p.y));
      readout.textContent = p.label;
    });
    svg.addEventListener("pointerleave", () => {
      marker.setAttribute("cx", -10);
      readout.textContent = "";
    });
    if (onSelect) svg.addEventListener("click", (event) => {
      const p = nearest(event);
      if (p) onSelect(p.x);
    });
    if (!shown.length) svg.append(h("text", { class: "label", x: width / 2, y: HEIGHT / 2, "text-anchor": "middle" }, "no data yet"));
    return svg;
  });
}

/**
 * Bars, each of stacked `segments` [{value, name}]: `bars` = [{label, segments, detail}].
 * `legend` names the segments' kinds in order.
 */
export function barPlot({ title, xLabel, yLabel, bars, legend = [] }) {
  return figure(title, (width, readout) => {
    const totals = bars.map((b) => b.segments.reduce((sum, s) => sum + (s.value || 0), 0));
    const yTicks = ticks(0, Math.max(0, ...totals) * 1.05 || 1);
    const yTop = yTicks[yTicks.length - 1];
    const inner = width - MARGIN.left - MARGIN.right;
    const slot = inner / Math.max(1, bars.length);
    const x = (i) => MARGIN.left + slot * (i + 0.5);
    const y = (v) => HEIGHT - MARGIN.bottom - (v / yTop) * (HEIGHT - MARGIN.top - MARGIN.bottom);
    const every = Math.max(1, Math.ceil(bars.length / Math.max(1, Math.floor(width / 70))));
    const svg = h("svg", { width, height: HEIGHT, viewBox: `0 0 ${width} ${HEIGHT}`, role: "img", "aria-label": title });
    axes(svg, width, bars.map((_, i) => i).filter((i) => i % every === 0), yTicks, x, y, xLabel, yLabel, (i) => bars[i].label);
    const barWidth = Math.max(2, Math.min(48, slot * 0.7));
    bars.forEach((bar, i) => {
      let base = 0;
      const group = h("g", { class: "bar", dataset: { index: i } }, h("title", {}, bar.detail));
      bar.segments.forEach((segment, k) => {
        const value = segment.value || 0;
        group.append(
          h("rect", { class: `segment s${k}`, x: x(i) - barWidth / 2, width: barWidth, y: y(base + value), height: Math.max(0, y(base) - y(base + value)) }),
        );
        base += value;
      });
      group.addEventListener("pointerenter", () => (readout.textContent = bar.detail));
      group.addEventListener("pointerleave", () => (readout.textContent = ""));
      svg.append(group);
    });
    if (!bars.length) svg.append(h("text", { class: "label", x: width / 2, y: HEIGHT / 2, "text-anchor": "middle" }, "no data yet"));
    const key = h("div", { class: "legend" }, legend.map((name, k) => h("span", { class: `key s${k}` }, name)));
    return h("div", {}, svg, legend.length ? key : null);
  });
}
