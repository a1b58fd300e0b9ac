// Renders turns, from the sealed history (stored chunks) and from the live stream (events),
// through the same calls, so a turn looks the same however it arrived. Reasoning is folded;
// a step's tool calls are one group (by `stepId`), each call with its output, duration and
// result (a stored result keeps the output and duration the live events carried). A history
// turn's footer comes from its metrics (`reason`, joined by `firstSeq`), a live one's from `done`.

import { h, ms, num } from "./dom.js";

export class Turn {
  constructor(userText, { live = false } = {}) {
    this.parts = h("div", { class: "assistant" });
    this.footer = h("div", { class: "turn-footer" });
    this.element = h(
      "article",
      { class: "turn", dataset: { live: String(live), sealed: String(!live) }, "aria-label": "Turn" },
      h("div", { class: "user", "aria-label": "Prompt" }, userText),
      this.parts,
      this.footer,
    );
    this.current = null;
    this.tools = new Map();
  }

  /** Appends text (`text` or `reasoning`); a run of the same kind stays one part. */
  addText(kind, text) {
    if (!this.current || this.current.kind !== kind) {
      const body = h("div", { class: "text" });
      const element =
        kind === "reasoning"
          ? h("details", { class: "reasoning" }, h("summary", {}, "Reasoning"), body)
          : h("div", { class: "reply" }, body);
      this.parts.append(element);
      this.current = { kind, body };
    }
    this.current.body.append(text);
  }

  /** Ends the running part: what follows starts a new one (a step ended, a tool was called). */
  breakPart() {
    this.current = null;
  }

  addToolCall(stepId, toolCallId, toolName, input) {
    this.breakPart();
    // Calls of one step that follow each other share a group; anything between them ends it.
    const last = this.parts.lastElementChild;
    let group = stepId && last?.classList.contains("tools") && last.dataset.stepId === stepId ? last : null;
    if (!group) {
      group = h("div", { class: "tools", role: "group", dataset: { stepId: stepId || "" }, "aria-label": "Tool calls" });
      this.parts.append(group);
    }
    const output = h("pre", { class: "tool-output", hidden: true });
    const result = h("pre", { class: "tool-result", dataset: { pending: "true" } }, "running…");
    const element = h(
      "div",
      { class: "tool", dataset: { toolCallId } },
      h("div", { class: "tool-name" }, toolName),
      h("pre", { class: "tool-input" }, JSON.stringify(input, null, 2)),
      output,
      result,
    );
    group.append(element);
    this.tools.set(toolCallId, { element, output, result });
  }

  addToolOutput(toolCallId, data) {
    const tool = this.tools.get(toolCallId);
    if (!tool) return;
    tool.output.hidden = false;
    tool.output.append(data);
  }

  addToolResult(stepId, toolCallId, toolName, content, isError, durationMs) {
    let tool = this.tools.get(toolCallId);
    if (!tool) {
      this.addToolCall(stepId, toolCallId, toolName, null);
      tool = this.tools.get(toolCallId);
    }
    tool.result.textContent = content;
    delete tool.result.dataset.pending;
    tool.element.classList.toggle("failed", Boolean(isError));
    if (durationMs !== undefined) tool.element.querySelector(".tool-name").append(h("span", { class: "meta" }, ` ${ms(durationMs)}`));
  }

  addError(message, code) {
    this.breakPart();
    this.parts.append(h("div", { class: "error", role: "note" }, code ? `${message} (${code})` : message));
  }

  addSystem(text) {
    this.breakPart();
    this.parts.append(h("div", { class: "system" }, text));
  }

  /** Why the turn ended, how long it took, what it cost: from the live `done`, or from the
   *  stored metrics, which carry the same figures (`usageReported: false` where `done` had no
   *  usage: its zeros measure nothing, so neither view shows them as a count). */
  done(event) {
    this.breakPart();
    const bits = [`done · ${event.reason}`];
    if (event.durationMs !== undefined) bits.push(ms(event.durationMs));
    bits.push(event.usage ? `${num(event.usage.outputTokens)} output tokens` : "usage not reported");
    if (event.contextSize !== undefined) bits.push(`context ${num(event.contextSize)}`);
    this.footer.replaceChildren(h("span", { class: "done", dataset: { reason: event.reason } }, bits.join(" · ")));
  }

  sealed() {
    this.element.dataset.sealed = "true";
  }
}

/** The footer a sealed turn's stored metrics give it, as the live `done` would have. */
export function doneFromMetrics(metrics) {
  return {
    reason: metrics.reason ?? "stop",
    durationMs: metrics.durationMs,
    usage: metrics.usageReported === false ? undefined : metrics.usage,
    contextSize: metrics.contextSize,
  };
}

/** Turns from stored chunks (`{seq, role, chunk}`), in order: a user text chunk starts a turn
 *  (its seq is the turn's `firstSeq`, the key to its metrics). */
export function turnsFromChunks(chunks) {
  const turns = [];
  let turn = null;
  for (const { seq, role, chunk } of chunks) {
    if (role === "user" && chunk.type === "text") {
      turn = new Turn(chunk.text);
      turn.firstSeq = seq;
      turns.push(turn);
      continue;
    }
    if (!turn) {
      // A window that starts inside a turn: its prompt is older than the window.
      turn = new Turn("(earlier prompt)");
      turns.push(turn);
    }
    switch (chunk.type) {
      case "text":
        turn.breakPart();
        turn.addText("text", chunk.text);
        break;
      case "thinking":
        turn.breakPart();
        turn.addText("reasoning", chunk.text);
        break;
      case "tool-call":
        turn.addToolCall(chunk.stepId, chunk.toolCallId, chunk.toolName, chunk.input);
        break;
      case "tool-result":
        if (chunk.output) {
          if (!turn.tools.has(chunk.toolCallId)) turn.addToolCall(chunk.stepId, chunk.toolCallId, chunk.toolName, null);
          turn.addToolOutput(chunk.toolCallId, chunk.output);
        }
        turn.addToolResult(chunk.stepId, chunk.toolCallId, chunk.toolName, chunk.content, chunk.isError, chunk.durationMs);
        break;
      case "error":
        turn.addError(chunk.message, chunk.code);
        break;
      case "system":
        turn.addSystem(chunk.text);
        break;
    }
  }
  return turns;
}

/** Applies one live event to the turn it belongs to. */
export function applyEvent(turn, event) {
  switch (event.type) {
    case "text-delta":
      turn.addText("text", event.delta);
      break;
    case "reasoning-delta":
      turn.addText("reasoning", event.delta);
      break;
    case "tool-call":
      turn.addToolCall(event.stepId, event.toolCallId, event.toolName, event.input);
      break;
    case "tool-output":
      turn.addToolOutput(event.toolCallId, event.data);
      break;
    case "tool-result":
      turn.addToolResult(event.stepId, event.toolCallId, event.toolName, event.content, event.isError, event.durationMs);
      break;
    case "step-complete":
      turn.breakPart();
      break;
    case "error":
      turn.addError(event.message, event.code);
      break;
    case "done":
      turn.done(event);
      break;
  }
}
