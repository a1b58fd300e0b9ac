// One conversation: its sealed history, then the turn in flight over SSE, a composer, a stop
// button, its title, its folder and reasoning effort (for agent programs) and a new agent
// session, its metrics as plots, and closing or deleting it.
//
// The stream is opened first, with a cursor of no turn, so the gateway answers with `resync`
// and the horizon (`latestSeq`) of the sealed history at that moment; the history is read up
// to exactly that seq, and the stream replays the turn in flight from its start. History and
// live turn meet without overlap or gap, on the first load, on a reload, and after a drop
// (EventSource resumes by `Last-Event-ID`; a cursor whose turn has sealed meanwhile gets
// `resync` again). docs/console.md has the whole of it.

import { get, post, put, del, conversationPath, ApiError } from "./api.js";
import { h } from "./dom.js";
import { Turn, turnsFromChunks, applyEvent, doneFromMetrics } from "./transcript.js";
import { TurnPlots } from "./metrics.js";

/** Chunks read at a time: the newest on open, older ones as the reader scrolls up to them. */
const WINDOW = 500;
/** A cursor that names no turn in flight: the stream opens with `resync`. */
const NO_CURSOR = "none:0";
/** The reasoning efforts the API takes. */
const EFFORTS = ["low", "medium", "high", "xhigh", "max"];

export class ConversationView {
  constructor(id, feed) {
    this.id = id;
    this.feed = feed;
    this.path = conversationPath(id);
    // The sealed history shown ends at seq `horizon`; `sealedLive` turns were watched live and
    // sealed since (they follow the horizon in order).
    this.horizon = 0;
    this.sealedLive = 0;
    this.opened = false;
    this.live = null;
    // How many times the status was set (`setStatus`) and read (`readMeta`, `readStatus`).
    this.statusSets = 0;
    this.statusReads = 0;
    this.lastEventId = "";
    this.work = Promise.resolve();

    this.title = h("input", { type: "text", "aria-label": "Title", placeholder: "untitled", maxlength: 500 });
    this.folder = h("input", { type: "text", "aria-label": "Folder", placeholder: "the credential's folder" });
    this.effort = h(
      "select",
      { "aria-label": "Reasoning effort" },
      h("option", { value: "" }, "default effort"),
      EFFORTS.map((e) => h("option", { value: e }, e)),
    );
    this.status = h("span", { class: "status", "aria-label": "Status" });
    this.stream = h("span", { class: "stream-state", role: "status", "aria-label": "Stream" });
    this.alert = h("p", { class: "alert", role: "alert" });
    this.note = h("p", { class: "muted", role: "status" });
    // Older turns load when this comes into view (the reader scrolled to the top), or on a click.
    this.olderButton = h("button", { type: "button", hidden: true, onclick: () => this.queue(() => this.loadOlder()) }, "Load older turns");
    this.olderWatch = new IntersectionObserver((seen) => {
      if (seen.some((e) => e.isIntersecting) && !this.olderButton.hidden) this.queue(() => this.loadOlder());
    });
    this.olderWatch.observe(this.olderButton);
    // The seq of the oldest chunk shown, and the chunks of a first turn whose prompt is older
    // than that (a window that begins inside a turn): the next older read completes it.
    this.oldestSeq = 0;
    this.partial = null;
    this.metrics = [];
    this.history = h("div", { class: "history" });
    this.liveArea = h("div", { class: "live-area" });
    this.message = h("textarea", { "aria-label": "Message", rows: 3, placeholder: "Write a message; Enter sends, Shift+Enter breaks the line" });
    this.model = h("select", { "aria-label": "Model" }, h("option", { value: "" }, "conversation's model"));
    this.model.addEventListener("change", () => this.fitControls());
    // What the gateway says each model reads of the settings (`/models`), and which model a
    // turn runs on when neither the composer nor the conversation names one.
    this.modelInfo = {};
    this.defaultModel = "";
    this.stickyModel = "";
    this.sendButton = h("button", { type: "submit", class: "primary" }, "Send");
    this.stopButton = h("button", { type: "button", disabled: true, onclick: () => this.stop() }, "Stop");
    // History turns by the seq of their user message, until their metrics give them a footer.
    this.unfooted = new Map();
    this.plots = new TurnPlots(id, (turns) => this.footers(turns));
    // Deleting asks twice: the first press only shows the confirming button.
    this.closeButton = h("button", { type: "button", onclick: () => this.close() }, "Close conversation");
    this.deleteButton = h("button", { type: "button", class: "danger", onclick: () => this.askDelete(true) }, "Delete");
    this.confirmDelete = h("button", { type: "button", class: "danger", hidden: true, onclick: () => this.remove() }, "Delete for good");
    this.cancelDelete = h("button", { type: "button", hidden: true, onclick: () => this.askDelete(false) }, "Keep it");

    this.message.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        this.send();
      }
    });
    // Errors show in the composer, which stays on screen: above the transcript, a failed Send
    // said nothing a user could see.
    const form = h("form", { class: "composer", "aria-label": "Composer" }, this.alert, this.message, h("div", { class: "composer-tools" }, this.model, this.sendButton, this.stopButton));
    // A turn scrolled into view ends above the composer (which sticks to the bottom), not
    // under it: its height is the turns' scroll margin (style.css).
    this.resizer = new ResizeObserver(() => this.element.style.setProperty("--composer-height", `${form.offsetHeight}px`));
    this.resizer.observe(form);
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    const titleForm = h("form", { class: "title-form" }, this.title, h("button", { type: "submit" }, "Save title"));
    titleForm.addEventListener("submit", (event) => {
      event.preventDefault();
      this.saveTitle();
    });
    // Where agent programs run and how hard they think, and their session: each control is
    // enabled only when the model in use reads it (`fitControls`).
    this.saveSettingsButton = h("button", { type: "submit" }, "Save settings");
    this.newSessionButton = h("button", { type: "button", onclick: () => this.newSession() }, "New session");
    const settingsForm = h(
      "form",
      { class: "settings-form", "aria-label": "Settings" },
      this.folder,
      this.effort,
      this.saveSettingsButton,
      this.newSessionButton,
    );
    settingsForm.addEventListener("submit", (event) => {
      event.preventDefault();
      this.saveSettings();
    });

    this.element = h(
      "section",
      { class: "detail", "aria-label": "Conversation" },
      h("a", { href: "#/", class: "back" }, "← Conversations"),
      h("header", { class: "detail-head" }, titleForm, this.status, this.stream),
      h("p", { class: "muted id" }, "id ", h("code", {}, id)),
      settingsForm,
      h("section", { class: "transcript", "aria-label": "Transcript" }, this.olderButton, this.note, this.history, this.liveArea),
      form,
      this.plots.element,
      h(
        "div",
        { class: "danger-zone", "aria-label": "Close or delete" },
        this.closeButton,
        this.deleteButton,
        this.confirmDelete,
        this.cancelDelete,
      ),
    );
    this.unsubscribe = feed.subscribe((change) => {
      if (change === null) this.readStatus(); // a change the feed may have missed
      else if (change.conversationId === id) this.setStatus(change.status);
    });
    this.load();
  }

  async load() {
    this.connect();
    await this.readMeta();
  }

  /** The title, status, folder, effort and model choices. */
  async readMeta() {
    const stamp = [++this.statusReads, this.statusSets];
    try {
      const [meta, models, sticky, cwd, effort] = await Promise.all([
        this.listed(),
        get("/models"),
        get(`${this.path}/model`),
        get(`${this.path}/cwd`),
        get(`${this.path}/reasoning-effort`),
      ]);
      if (meta) this.title.value = meta.title;
      if (document.activeElement !== this.folder) this.folder.value = cwd.cwd || "";
      if (document.activeElement !== this.effort) this.effort.value = effort.reasoningEffort || "";
      this.statusRead(meta, stamp);
      const chosen = this.model.value;
      this.model.replaceChildren(this.model.firstChild, ...models.models.map((m) => h("option", { value: m }, m)));
      this.model.value = sticky.model || chosen;
      this.modelInfo = models.modelInfo || {};
      this.defaultModel = models.defaultModel || "";
      this.stickyModel = sticky.model || "";
      this.fitControls();
    } catch (e) {
      this.fail(e);
    }
  }

  /** Enables the settings the model in use reads, and says of the others why they are off: a
   *  folder or an effort a model ignores would be saved and do nothing. */
  fitControls() {
    const model = this.model.value || this.stickyModel || this.defaultModel;
    const reads = new Set(this.modelInfo[model]?.settings || []);
    const fit = (control, setting, what) => {
      control.disabled = !reads.has(setting);
      control.title = control.disabled ? `${model} does not use ${what}` : "";
    };
    fit(this.folder, "cwd", "a folder");
    fit(this.effort, "reasoningEffort", "a reasoning effort");
    fit(this.newSessionButton, "session", "an agent session");
    this.saveSettingsButton.disabled = this.folder.disabled && this.effort.disabled;
  }

  /** The status alone (what the feed may have missed while its socket was down). */
  async readStatus() {
    const stamp = [++this.statusReads, this.statusSets];
    try {
      this.statusRead(await this.listed(), stamp);
    } catch (e) {
      this.fail(e);
    }
  }

  /** The conversation as the list has it (none before its first message). */
  async listed() {
    const list = await get(`/conversations?q=${encodeURIComponent(this.id)}&limit=50`);
    return list.conversations.find((c) => c.id === this.id);
  }

  /** A status read, `stamp` being which read it was and how many times the status had been
   * set when it started: a newer read, or a status set since (the feed, the stream, a close),
   * knows better; so does the stream while it shows a turn in flight. */
  statusRead(meta, [read, set]) {
    if (!this.live && read === this.statusReads && set === this.statusSets) this.showStatus(meta ? meta.status : "new");
  }

  connect() {
    const cursor = this.lastEventId || NO_CURSOR;
    const source = new EventSource(`${this.path}/events?lastEventId=${encodeURIComponent(cursor)}`);
    this.source = source;
    this.showStream("connecting");
    source.onopen = () => this.showStream("live");
    source.onmessage = (message) => this.queue(() => this.onEvent(message));
    source.addEventListener("resync", (message) => this.queue(() => this.onResync(JSON.parse(message.data))));
    source.onerror = () => {
      // EventSource retries by itself (sending `Last-Event-ID`) unless the answer was not a
      // stream; then a new one starts from the last id seen.
      if (source.readyState !== EventSource.CLOSED) return this.showStream("reconnecting");
      this.showStream("offline");
      this.retry = setTimeout(() => this.connect(), 2000);
    };
  }

  /** Events are handled one after another, a history read included. */
  queue(step) {
    this.work = this.work.then(step).catch((e) => this.fail(e));
  }

  async onResync({ latestSeq }) {
    // The turn in flight is replayed from its start after this message.
    if (this.live) {
      this.live.element.remove();
      this.live = null;
    }
    // The plots are read once the stream says where the sealed history ends, and again when
    // it grew.
    const grew = latestSeq > this.horizon || !this.opened;
    this.opened = true;
    if (latestSeq > this.horizon) {
      const query = new URLSearchParams({ beforeSeq: String(latestSeq + 1) });
      if (this.horizon > 0) query.set("sinceSeq", String(this.horizon));
      else query.set("limit", String(WINDOW));
      const window = await get(`${this.path}?${query}`);
      const opening = this.horizon === 0;
      const turns = turnsFromChunks(window.chunks).slice(this.sealedLive);
      this.history.append(...turns.map((t) => t.element));
      this.awaitFooters(turns);
      if (opening && window.chunks.length) this.olderShown(window.chunks, turns[0]);
      // A conversation opens at its newest turn, where a reader picks it up.
      if (this.horizon === 0 && !this.live) turns.at(-1)?.element.scrollIntoView({ block: "end", behavior: "instant" });
      this.horizon = latestSeq;
      this.sealedLive = 0;
    }
    if (grew) this.plots.refresh();
  }

  /** Reads the window of chunks before the oldest shown and puts its turns above, the reader's
   *  place on the page kept. */
  async loadOlder() {
    if (this.oldestSeq <= 1) return;
    const query = new URLSearchParams({ beforeSeq: String(this.oldestSeq), limit: String(WINDOW) });
    const older = (await get(`${this.path}?${query}`)).chunks;
    if (!older.length) return;
    const chunks = older.concat(this.partial ? this.partial.chunks : []);
    const turns = turnsFromChunks(chunks);
    const page = document.scrollingElement;
    const height = page.scrollHeight;
    this.partial?.turn.element.remove();
    this.history.prepend(...turns.map((t) => t.element));
    page.scrollTop += page.scrollHeight - height;
    this.awaitFooters(turns);
    this.olderShown(chunks, turns[0]);
    this.footers(this.metrics);
  }

  /** After a window whose first chunk is `chunks[0]`: what is older, and the first turn when
   *  its prompt is older still. */
  olderShown(chunks, first) {
    this.oldestSeq = chunks[0].seq;
    const prompt = chunks.findIndex((c) => c.role === "user" && c.chunk.type === "text");
    this.partial = this.oldestSeq > 1 && prompt !== 0 ? { turn: first, chunks: chunks.slice(0, prompt < 0 ? chunks.length : prompt) } : null;
    const hidden = this.oldestSeq - 1;
    this.olderButton.hidden = hidden === 0;
    this.note.textContent = hidden ? `${hidden.toLocaleString("en-US")} older chunks above` : "";
  }

  /** History turns wait for their metrics (read with the plots) for their footer. */
  awaitFooters(turns) {
    for (const turn of turns) if (turn.firstSeq !== undefined) this.unfooted.set(turn.firstSeq, turn);
  }

  /** Gives history turns the footer their live `done` gave them (metrics read by the plots). */
  footers(metrics) {
    this.metrics = metrics;
    for (const m of metrics) {
      const turn = this.unfooted.get(m.firstSeq);
      if (!turn) continue;
      turn.done(doneFromMetrics(m));
      this.unfooted.delete(m.firstSeq);
    }
  }

  onEvent(message) {
    this.lastEventId = message.lastEventId;
    const event = JSON.parse(message.data);
    if (event.type === "user-message") {
      this.live = new Turn(event.text, { live: true });
      this.live.element.dataset.turnId = event.turnId;
      this.liveArea.append(this.live.element);
      this.setStatus("active");
      return;
    }
    if (!this.live) return;
    if (event.type === "turn-sealed") {
      this.live.sealed();
      this.history.append(this.live.element);
      this.live = null;
      this.sealedLive += 1;
      // A turn a close stopped seals after the conversation was marked closed.
      if (this.status.dataset.status === "active") this.setStatus("idle");
      this.plots.refresh();
      // A first turn names the conversation after its prompt.
      if (!this.title.value && document.activeElement !== this.title) this.readMeta();
      return;
    }
    applyEvent(this.live, event);
    this.live.element.scrollIntoView({ block: "end", behavior: "instant" });
  }

  async send() {
    const message = this.message.value.trim();
    if (!message) return;
    const body = { message };
    if (this.model.value) body.model = this.model.value;
    this.sendButton.disabled = true;
    try {
      await post(`${this.path}/messages`, body);
      this.message.value = "";
      this.alert.textContent = "";
    } catch (e) {
      this.fail(e.status === 409 ? new Error("A turn is already running in this conversation; wait for it or stop it.") : e);
    } finally {
      this.sendButton.disabled = false;
    }
  }

  async stop() {
    try {
      const answer = await post(`${this.path}/stop`);
      if (!answer.abortedTurn) this.alert.textContent = "No turn was running.";
    } catch (e) {
      this.fail(e);
    }
  }

  async saveTitle() {
    try {
      const answer = await put(`${this.path}/title`, { title: this.title.value });
      this.title.value = answer.title;
      this.alert.textContent = "";
      this.feed.touch();
    } catch (e) {
      this.fail(e.status === 404 ? new Error("The conversation starts with its first message; give it a title after that.") : e);
    }
  }

  async saveSettings() {
    try {
      // Only what the model in use reads: the other stays as it was.
      const folder = this.folder.value.trim();
      if (!this.folder.disabled) await put(`${this.path}/cwd`, { cwd: folder || null });
      if (!this.effort.disabled) await put(`${this.path}/reasoning-effort`, { reasoningEffort: this.effort.value || null });
      this.alert.textContent = "";
    } catch (e) {
      this.fail(e);
    }
  }

  /** Forgets the agent session: the next turn starts a new one (an agent program's memory of
   *  the earlier turns is gone; the transcript stays). The way on when a session cannot be
   *  resumed, as Claude Code's after a change of folder. */
  async newSession() {
    try {
      await del(`${this.path}/session`);
      this.alert.textContent = "The next turn starts a new agent session.";
    } catch (e) {
      if (e.status === 409) this.fail(new Error("A turn is running; stop it first."));
      else if (e.status === 404) this.fail(new Error("The conversation starts with its first message; it has no session yet."));
      else this.fail(e);
    }
  }

  /** Stops a running turn and marks the conversation closed (it stays readable). */
  async close() {
    try {
      await post(`${this.path}/close`);
      this.setStatus("closed");
      this.alert.textContent = "";
    } catch (e) {
      this.fail(e);
    }
  }

  askDelete(asking) {
    this.deleteButton.hidden = asking;
    this.confirmDelete.hidden = !asking;
    this.cancelDelete.hidden = !asking;
    if (asking) this.confirmDelete.focus();
  }

  /** Deletes the conversation and its log, then goes back to the list. */
  async remove() {
    this.askDelete(false);
    try {
      await del(this.path);
      this.feed.touch();
      location.hash = "#/";
    } catch (e) {
      this.fail(e.status === 409 ? new Error("A turn is running; stop it (or close the conversation) first.") : e);
    }
  }

  setStatus(status) {
    this.statusSets++;
    this.showStatus(status);
  }

  showStatus(status) {
    this.status.textContent = status;
    this.status.dataset.status = status;
    this.stopButton.disabled = status !== "active";
    this.closeButton.disabled = status === "closed";
  }

  showStream(state) {
    this.stream.dataset.state = state;
    this.stream.textContent = `stream ${state}`;
  }

  fail(error) {
    if (error instanceof ApiError && error.status === 401) return;
    this.alert.textContent = error.message;
  }

  destroy() {
    this.resizer.disconnect();
    this.olderWatch.disconnect();
    this.source?.close();
    clearTimeout(this.retry);
    this.unsubscribe();
  }
}
