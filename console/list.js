// The conversation list: newest activity first, searchable by title words and id prefix and by
// status, each row marked when its last turn failed, a page at a time with how many there are,
// and live: a status change anywhere (a new conversation, a turn starting or sealing) reads it
// again (as many rows as were shown).

import { get, Reads, ApiError, session } from "./api.js";
import { h, num, when } from "./dom.js";

/** Rows a page reads; a read again after a change reads as many as were shown, up to the API's
 *  most. */
const PAGE = 200;
const MOST = 1000;

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
    this.count = h("p", { class: "muted count", "aria-label": "How many" });
    this.more = h("button", { type: "button", hidden: true, onclick: () => this.loadMore() }, "Load more");
    this.next = null;
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
      this.count,
      this.more,
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

  /** The list's query: the filter, and whether to count. */
  query(extra) {
    const query = new URLSearchParams(extra);
    const search = this.search.value.trim();
    if (search) query.set("search", search);
    if (this.status.value) query.set("status", this.status.value);
    return query;
  }

  async refresh() {
    const shown = Math.min(MOST, Math.max(PAGE, this.items.children.length));
    const search = this.search.value.trim();
    let answer;
    try {
      answer = await this.reads.newest(`/conversations?${this.query({ limit: String(shown), count: "true" })}`);
    } catch (e) {
      if (e instanceof ApiError && e.status !== 401) this.message.textContent = e.message;
      return;
    }
    if (!answer) return;
    const list = answer.conversations;
    this.total = answer.total;
    this.next = answer.nextCursor ?? null;
    // An empty answer to a search is no match, not an empty gateway.
    const filtered = search || this.status.value;
    this.message.textContent = list.length
      ? ""
      : filtered
        ? `No conversation matches${search ? ` “${search}”` : ""}${this.status.value ? ` (${this.status.value})` : ""}.`
        : "No conversations yet.";
    this.items.replaceChildren(...list.map((c) => this.row(c)));
    this.showCount();
  }

  /** The next page, after the last row shown. */
  async loadMore() {
    if (!this.next) return;
    this.more.disabled = true;
    try {
      const answer = await get(`/conversations?${this.query({ limit: String(PAGE), cursor: this.next })}`);
      const shown = new Set([...this.items.children].map((li) => li.dataset.id));
      // A conversation active since the first page moved up: it is not shown twice.
      this.items.append(...answer.conversations.filter((c) => !shown.has(c.id)).map((c) => this.row(c)));
      this.next = answer.nextCursor ?? null;
      this.showCount();
    } catch (e) {
      if (e instanceof ApiError && e.status !== 401) this.message.textContent = e.message;
    } finally {
      this.more.disabled = false;
    }
  }

  showCount() {
    const shown = this.items.children.length;
    this.count.textContent = shown && this.total !== undefined ? `${num(shown)} of ${num(this.total)}` : "";
    this.more.hidden = !this.next || shown >= (this.total ?? Infinity);
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
        // Its newest ended turn failed (a runtime error, a crash): seen without opening it.
        c.lastReason === "error" ? h("span", { class: "outcome", title: "Its last turn ended with an error" }, "last turn failed") : null,
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
