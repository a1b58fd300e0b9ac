// The console's shell: the views by the address's hash (`#/`, `#/c/<id>`, `#/throughput`,
// `#/gateway`), the status feed every view shares, and the API key prompt.

import { onUnauthorized, setApiKey, newConversationId } from "./api.js";
import { StatusFeed } from "./live.js";
import { ConversationList } from "./list.js";
import { ConversationView } from "./conversation.js";
import { ThroughputView } from "./metrics.js";
import { GatewayView } from "./gateway.js";
import { h } from "./dom.js";

const main = document.getElementById("main");
const feed = new StatusFeed(document.getElementById("connection"));
let views = [];

function show(...next) {
  for (const view of views) view.destroy();
  views = next;
}

function route() {
  const hash = location.hash.slice(1) || "/";
  for (const link of document.querySelectorAll("nav a")) {
    const here = link.dataset.view === (hash.startsWith("/throughput") ? "throughput" : hash.startsWith("/gateway") ? "gateway" : "conversations");
    link.toggleAttribute("aria-current", here);
    if (here) link.setAttribute("aria-current", "page");
  }
  if (hash.startsWith("/throughput")) {
    const view = new ThroughputView();
    show(view);
    main.replaceChildren(view.element);
    main.className = "single";
    return;
  }
  if (hash.startsWith("/gateway")) {
    const view = new GatewayView();
    show(view);
    main.replaceChildren(view.element);
    main.className = "single";
    return;
  }
  const list = new ConversationList(feed, () => (location.hash = `#/c/${newConversationId()}`));
  const id = hash.startsWith("/c/") ? decodeURIComponent(hash.slice(3)) : null;
  if (id) {
    const view = new ConversationView(id, feed);
    list.select(id);
    show(list, view);
    main.replaceChildren(list.element, view.element);
    main.className = "split has-detail";
  } else {
    show(list);
    main.replaceChildren(
      list.element,
      h("section", { class: "detail empty", "aria-label": "Conversation" }, h("p", { class: "muted" }, "Pick a conversation, or start a new one.")),
    );
    main.className = "split";
  }
}

// The key prompt: once per session, again only when the gateway refuses the key.
const dialog = document.getElementById("key-dialog");
const form = document.getElementById("key-form");
const input = document.getElementById("key-input");
const message = document.getElementById("key-message");
onUnauthorized((tried) => {
  message.textContent = tried
    ? "The gateway refused that key. Enter a valid API key."
    : "This gateway needs an API key (one of its --api-keys).";
  if (!dialog.open) dialog.showModal();
  input.focus();
});
form.addEventListener("submit", (event) => {
  event.preventDefault();
  setApiKey(input.value.trim());
  input.value = "";
  dialog.close();
  feed.restart();
  route();
});

window.addEventListener("hashchange", route);
route();
