// Small DOM helpers. Every piece of data reaches the page as text (textContent), never as
// markup, so nothing a conversation holds can run in the console.

/** Creates an element: `h("a", {href: "#/"}, "text", child)`. `class`, `dataset`, `on*` too. */
export function h(tag, attrs = {}, ...children) {
  const svg = SVG_TAGS.has(tag);
  const node = svg ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "dataset") Object.assign(node.dataset, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "class" && !svg) node.className = value;
    else if (!svg && name in node && typeof value !== "string") node[name] = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

const SVG = "http://www.w3.org/2000/svg";
const SVG_TAGS = new Set(["svg", "g", "line", "path", "circle", "rect", "text", "title", "polyline"]);

/** A duration in ms, as people read it. */
export function ms(value) {
  if (value === undefined || value === null || Number.isNaN(value)) return "–";
  if (value < 1000) return `${Math.round(value)} ms`;
  return `${(value / 1000).toFixed(value < 10_000 ? 2 : 1)} s`;
}

/** A count with thousands separators and at most `digits` decimals. */
export function num(value, digits = 0) {
  if (value === undefined || value === null || Number.isNaN(value)) return "–";
  return value.toLocaleString("en-US", { maximumFractionDigits: digits });
}

/** A byte count in B, KiB or MiB. */
export function bytes(value) {
  if (value < 1024) return `${value} B`;
  if (value < 1024 * 1024) return `${(value / 1024).toFixed(1)} KiB`;
  return `${(value / 1024 / 1024).toFixed(1)} MiB`;
}

/** An epoch-ms time as a local date and time. */
export function when(epochMs) {
  return new Date(epochMs).toLocaleString();
}
