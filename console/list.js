// The conversation list: newest activity first, searchable by title words and id prefix and by
// status, and live:
// a status change anywhere (a new conversation, a turn starting or sealing) reads it again.

import { Reads, ApiError, session } from "./api.js";
import { h, when } from "./dom.js";

export class ConversationList {
  constructor(feed, onNew) {
    this.selected = null;
    this.search = h("input", { type: "search", placeholder: "search titles, ids", "aria-label": "Search titles and ids" });
    this.status = h(
      "select",
      { "aria-label": "Status filter" },
      h("option", { value: "" }, "any status"),
      ["active", "idle", "closed"].map((s) => h("option", { value: s }, s)),
    );
    this.items = h("ul", { class: "conversations", "aria-label": "Conversations" });
    this.message = h("p", { class: "muted", role: "status" });
    this.reads = new Reads(this.items);
    this.search.addEventListener("input", () => this.schedule());
    this.status.addEventListener("change", () => this.refresh());
    this.element = h(
      "section",
      { class: "list", "aria-label": "Conversation list" },
      h(
        "div",
        { class: "list-tools" },
        h("button", { type: "button", class: "primary", onclick: onNew }, "New conversation"),
        this.search,
        this.status,
      ),
      this.message,
      this.items,
    );
    this.unsubscribe = feed.subscribe((change) => {
      if (change) this.mark(change);
      this.schedule();
    });
    this.refresh();
  }

  /** Reads the list again soon, once for a burst of changes. */
  schedule() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.refresh(), 150);
  }

  /** Shows a change at once, before the list is read again. */
  mark({ conversationId, status }) {
    const badge = this.items.querySelector(`li[data-id="${CSS.escape(conversationId)}"] .status`);
    if (badge) {
      badge.textContent = status;
      badge.dataset.status = status;
    }
  }

  async refresh() {
    const query = new URLSearchParams({ limit: "200" });
    const search = this.search.value.trim();
    if (search) query.set("search", search);
    if (this.status.value) query.set("status", this.status.value);
    let list;
    try {
      list = (await this.reads.newest(`/conversations?${query}`))?.conversations;
    } catch (e) {
      if (e instanceof ApiError && e.status !== 401) this.message.textContent = e.message;
      return;
    }
    if (!list) return;
    // An empty answer to a search is no match, not an empty gateway.
    const filtered = search || this.status.value;
    this.message.textContent = list.length
      ? ""
      : filtered
        ? `No conversation matches${search ? ` “${search}”` : ""}${this.status.value ? ` (${this.status.value})` : ""}.`
        : "No conversations yet.";
    this.items.replaceChildren(...list.map((c) => this.row(c)));
  }

  row(c) {
    return h(
      "li",
      { dataset: { id: c.id }, class: c.id === this.selected ? "selected" : "" },
      h(
        "a",
        { href: `#/c/${encodeURIComponent(c.id)}`, "aria-current": c.id === this.selected ? "page" : undefined },
        h("span", { class: "title" }, c.title || c.id),
        h("span", { class: "status", dataset: { status: c.status } }, c.status),
        // A titled conversation shows its id too: titles repeat, and the search is by id.
        // An administrator sees everyone's: each says whose it is.
        meta(
          [c.title ? c.id : null, c.model || "default model", session?.admin && c.owner ? `owner ${c.owner}` : null]
            .filter(Boolean)
            .join(" · "),
        ),
        h("time", { class: "meta", datetime: new Date(c.lastActivityAt).toISOString() }, when(c.lastActivityAt)),
      ),
    );
  }

  select(id) {
    this.selected = id;
    for (const li of this.items.children) {
      const on = li.dataset.id === id;
      li.classList.toggle("selected", on);
      if (on) li.firstChild.setAttribute("aria-current", "page");
      else li.firstChild.removeAttribute("aria-current");
    }
  }

  destroy() {
    this.unsubscribe();
    clearTimeout(this.timer);
  }
}

/** A line of small print, whole on hover when the column cuts it. */
function meta(text) {
  return h("span", { class: "meta", title: text }, text);
}
