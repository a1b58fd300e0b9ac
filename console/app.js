// The console's shell: the views by the address's hash (`#/`, `#/c/<id>`, `#/throughput`,
// `#/gateway`), the status feed every view shares, and signing in and out.

import { onUnauthorized, newConversationId, whoAmI, signIn, signOut, ApiError } from "./api.js";
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

/** The views that take the whole page, by the start of their hash. */
const PAGES = { "/throughput": () => new ThroughputView(), "/gateway": () => new GatewayView() };

function route() {
  const hash = location.hash.slice(1) || "/";
  const page = Object.keys(PAGES).find((p) => hash.startsWith(p));
  const here = page ? page.slice(1) : "conversations";
  for (const link of document.querySelectorAll("nav a")) {
    if (link.dataset.view === here) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  if (page) {
    const view = PAGES[page]();
    show(view);
    main.replaceChildren(view.element);
    main.className = "single";
    return;
  }
  const list = new ConversationList(feed, () => (location.hash = `#/c/${newConversationId()}`));
  // A hand-typed or cut address may not decode (`%E0%A4%A`): it names no conversation, and
  // says so, rather than leave a blank page.
  let id = null;
  let unreadable = false;
  if (hash.startsWith("/c/")) {
    try {
      id = decodeURIComponent(hash.slice(3));
    } catch {
      unreadable = true;
    }
  }
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
      h(
        "section",
        { class: "detail empty", "aria-label": "Conversation" },
        h("p", { class: "muted" }, unreadable ? "That address names no conversation. Pick one, or start a new one." : "Pick a conversation, or start a new one."),
      ),
    );
    main.className = "split";
  }
}

// Signing in: a token or key is traded once for the session cookie (the page keeps neither);
// asked again only when the gateway answers 401.
const dialog = document.getElementById("key-dialog");
const form = document.getElementById("key-form");
const input = document.getElementById("key-input");
const message = document.getElementById("key-message");
const who = document.getElementById("who");
const whoName = document.getElementById("who-name");
function askForKey() {
  dialog.returnValue = "";
  if (!dialog.open) dialog.showModal();
  input.focus();
}
function showWho(session) {
  // With auth off everyone is the one anonymous administrator: nothing to show or sign out of.
  const shown = session && session.subject !== "anonymous";
  who.hidden = !shown;
  whoName.textContent = shown ? `${session.subject}${session.admin ? " (administrator)" : ""}` : "";
}
onUnauthorized(() => {
  showWho(null);
  message.textContent = "This gateway needs you to sign in: paste a token or one of its API keys.";
  askForKey();
});
// Sent here to sign in by a page of the gateway's web client (`/?next=/app/...`): once signed
// in, back to it. Only a path of this origin (never `//host`), so the link cannot lead away.
function goBack(session) {
  const next = new URLSearchParams(location.search).get("next");
  if (session && next && /^\/(?![\/\\])/.test(next)) {
    location.assign(next);
    return true;
  }
  return false;
}
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  const token = input.value.trim();
  let session;
  try {
    session = await signIn(token);
    showWho(session);
  } catch (e) {
    message.textContent =
      e instanceof ApiError && e.status === 401 ? "The gateway refused that token or key. " + e.message : e.message;
    return;
  }
  input.value = "";
  dialog.close("key");
  if (goBack(session)) return;
  feed.restart();
  route();
});
document.getElementById("sign-out").addEventListener("click", async () => {
  await signOut();
  showWho(null);
  feed.restart();
  route();
});
// Dismissed (Escape) without a key: the views have nothing to show, so the page says why and
// offers the prompt again instead of staying blank.
dialog.addEventListener("close", () => {
  if (dialog.returnValue === "key") return;
  show();
  main.replaceChildren(
    h(
      "section",
      { class: "detail empty", "aria-label": "Sign in needed" },
      h("p", { class: "muted" }, "This gateway needs you to sign in before the console can show anything."),
      h("button", { type: "button", class: "primary", onclick: askForKey }, "Sign in"),
    ),
  );
  main.className = "single";
});

window.addEventListener("hashchange", route);
whoAmI().then((session) => {
  showWho(session);
  // Signed in already (another tab): straight back to the page that sent the reader here.
  if (session && session.subject !== "anonymous") goBack(session);
}, () => {});
route();
