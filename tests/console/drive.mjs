// Drives the console in Chromium against two real gateways that tests/console.rs started: one
// open (reached through a TCP proxy this script can cut, for a real network drop) and one with
// an API key. Every check fails the run with a message; screenshots go to $SHOTS.

import assert from "node:assert/strict";
import net from "node:net";
import path from "node:path";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { chromium } = require(process.env.PLAYWRIGHT);
const { OPEN_URL, LOCKED_URL, API_KEY, SHOTS, CHROMIUM } = process.env;
const words = (n) => Array.from({ length: n }, (_, i) => `w${i + 1}`).join(" ");
const shot = (name) => path.join(SHOTS, `${name}.png`);
const step = (what) => console.log(`console: ${what}`);

/** A TCP proxy in front of `target` on `bind`: `cut()` drops every connection open now. With
 *  `host`, the requests' Host header becomes it, as nginx's default (`proxy_set_header Host
 *  $proxy_host`) does. */
function proxy(target, host, bind = "127.0.0.1") {
  const sockets = new Set();
  let seen = "";
  const server = net.createServer((client) => {
    const upstream = net.connect(Number(target.port), target.hostname);
    sockets.add(client);
    sockets.add(upstream);
    client.on("data", (data) => {
      seen += data.toString("latin1");
      upstream.write(host ? Buffer.from(data.toString("latin1").replace(/\r\nhost: [^\r]*/gi, `\r\nHost: ${host}`), "latin1") : data);
    });
    upstream.pipe(client);
    const end = () => {
      client.destroy();
      upstream.destroy();
      sockets.delete(client);
      sockets.delete(upstream);
    };
    for (const s of [client, upstream]) {
      s.on("error", end);
      s.on("close", end);
    }
  });
  return new Promise((resolve) =>
    server.listen(0, bind, () =>
      resolve({
        url: `http://${bind}:${server.address().port}`,
        cut: () => [...sockets].forEach((s) => s.destroy()),
        close: () => {
          server.close();
          [...sockets].forEach((s) => s.destroy());
        },
        requests: () => seen,
      }),
    ),
  );
}

/** Fails unless `locator` lies wholly inside its page's viewport (`what` says what it is). */
async function inView(locator, what) {
  const box = await locator.boundingBox();
  const height = locator.page().viewportSize().height;
  assert.ok(box && box.y >= 0 && box.y + box.height <= height, `${what}: ${JSON.stringify(box)} in a viewport ${height} px high`);
}

async function api(base, method, route, body) {
  const r = await fetch(base + route, {
    method,
    headers: body ? { "content-type": "application/json" } : {},
    body: body ? JSON.stringify(body) : undefined,
  });
  return { status: r.status, body: await r.json().catch(() => null) };
}

const browser = await chromium.launch({
  executablePath: CHROMIUM,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const pageErrors = [];
async function open(url, options = {}) {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 }, colorScheme: "light", ...options });
  const page = await context.newPage();
  page.setDefaultTimeout(20_000);
  page.on("pageerror", (e) => pageErrors.push(String(e)));
  page.on("console", (m) => m.type() === "error" && console.log(`page: ${m.text()}`));
  await page.goto(url);
  return page;
}

/** Holds the answers to the page's requests matching `pattern`: each is fetched from the
 * gateway at once and given to the page only after `release()`; `answered` resolves once the
 * first has been fetched (a read answered then, arriving after whatever the test does next). */
async function holdAnswers(page, pattern) {
  let release, fetched;
  const held = new Promise((resolve) => (release = resolve));
  const answered = new Promise((resolve) => (fetched = resolve));
  await page.route(pattern, async (route) => {
    const response = await route.fetch();
    fetched();
    await held;
    await route.fulfill({ response });
  });
  return { answered, release };
}

/** The text of the live reply in the turn `turn` (a locator of an article). */
const replyText = (turn) => turn.locator(".reply .text").allTextContents().then((t) => t.join(""));

const px = await proxy(new URL(OPEN_URL));
try {
  const page = await open(`${px.url}/`);

  // The list, and its live updates.
  await page.getByRole("link", { name: /Five hundred turns/ }).waitFor();
  assert.equal((await api(OPEN_URL, "POST", "/conversations", { id: "made-elsewhere", title: "Made elsewhere" })).status, 201);
  await page.getByRole("link", { name: /Made elsewhere/ }).waitFor({ timeout: 10_000 });
  // A title of forty characters shows whole.
  const long = "Planning the release of version two now";
  assert.equal((await api(OPEN_URL, "POST", "/conversations", { id: "long-title", title: long })).status, 201);
  const longTitle = page.locator('li[data-id="long-title"] .title');
  await longTitle.waitFor({ timeout: 10_000 });
  assert.equal(await longTitle.textContent(), long);
  const size = await longTitle.evaluate((el) => [el.scrollWidth, el.clientWidth, el.scrollHeight, el.clientHeight]);
  assert.ok(size[0] <= size[1] + 1 && size[2] <= size[3] + 1, `a forty-character title is not cut: ${size}`);
  // A titled row shows its id, which is what the search takes.
  assert.match(await page.locator('li[data-id="made-elsewhere"] .meta').first().textContent(), /^made-elsewhere · /);
  await page.getByRole("searchbox", { name: "Search titles and ids" }).fill("made-");
  await page.waitForFunction(() => document.querySelectorAll("ul.conversations li").length === 1);
  assert.equal(await page.locator("ul.conversations li").getAttribute("data-id"), "made-elsewhere");
  // A read of the list answered after a newer one does not put its list back: the search for
  // "made-e" is held until the search is cleared and the whole list shown.
  const search = await holdAnswers(page, /\/conversations\?limit=200&count=true&search=made-e$/);
  await page.getByRole("searchbox", { name: "Search titles and ids" }).fill("made-e");
  await search.answered;
  await page.getByRole("searchbox", { name: "Search titles and ids" }).fill("");
  await page.getByRole("link", { name: /Five hundred turns/ }).waitFor();
  search.release();
  await page.locator('ul.conversations[aria-busy="false"]').waitFor();
  assert.ok((await page.locator("ul.conversations li").count()) > 1, "the older read's list did not come back");
  // A word of a title finds it, in any case; a search that finds nothing says so.
  const searchbox = page.getByRole("searchbox", { name: "Search titles and ids" });
  await searchbox.fill("HUNDRED");
  await page.waitForFunction(() => document.querySelectorAll("ul.conversations li").length === 1);
  assert.equal(await page.locator("ul.conversations li").getAttribute("data-id"), "many-turns");
  await searchbox.fill("no-such-words");
  await page.getByRole("status").filter({ hasText: "No conversation matches “no-such-words”." }).waitFor();
  await searchbox.fill("");
  await page.getByRole("link", { name: /Five hundred turns/ }).waitFor();
  // A page of 200 rows says how many there are; the next page comes after it, without a row twice.
  const rows = page.locator("ul.conversations li");
  const total = (await api(OPEN_URL, "GET", "/conversations?count=true&limit=1")).body.total;
  assert.ok(total > 200, `more conversations than a page (${total})`);
  assert.equal(await rows.count(), 200);
  assert.equal(await page.getByLabel("How many").textContent(), `200 of ${total}`);
  await page.getByRole("button", { name: "Load more" }).click();
  await page.getByLabel("How many").filter({ hasText: `${total} of ${total}` }).waitFor();
  const ids = await rows.evaluateAll((lis) => lis.map((li) => li.dataset.id));
  assert.equal(new Set(ids).size, total, "every conversation once");
  assert.equal(await page.getByRole("button", { name: "Load more" }).isHidden(), true);
  // A conversation whose last turn failed says so in its row; the others do not.
  assert.equal(await page.locator('li[data-id="failed-last"] .outcome').textContent(), "last turn failed");
  assert.equal(await page.locator('li[data-id="many-turns"] .outcome').count(), 0);
  assert.equal((await api(OPEN_URL, "POST", "/conversations/watched-elsewhere/messages", { message: "paced elsewhere" })).status, 202);
  await page.locator('li[data-id="watched-elsewhere"] .status[data-status="active"]').waitFor({ timeout: 10_000 });
  await page.screenshot({ path: shot("list") });
  await page.locator('li[data-id="watched-elsewhere"] .status[data-status="idle"]').waitFor({ timeout: 20_000 });
  step("the list shows new conversations (a titled one with its id, found by its prefix) and status changes without a reload");

  // Send, and watch the stream.
  await page.getByRole("button", { name: "New conversation" }).click();
  await page.waitForURL(/#\/c\//);
  const conversationId = decodeURIComponent(new URL(page.url()).hash.slice(4));
  const send = async (text) => {
    await page.getByRole("textbox", { name: "Message" }).fill(text);
    await page.getByRole("button", { name: "Send" }).click();
  };
  await send("paced hello");
  const first = page.locator('article.turn[data-live="true"]').last();
  await first.locator(".reply .text").filter({ hasText: "w12 " }).waitFor();
  await page.screenshot({ path: shot("streaming") });
  await page.locator('article.turn[data-live="true"][data-sealed="true"]').waitFor();
  assert.equal(await replyText(first), words(60), "the streamed reply, whole and once");
  assert.match(await first.locator(".done").textContent(), /done · stop/);
  const firstFooter = await first.locator(".turn-footer").textContent();
  step("a sent message streams into the transcript");

  // Reload in the middle of a turn: the history, then the replay, which continues.
  await send("paced reload");
  await page.locator('article.turn[data-live="true"][data-sealed="false"] .reply .text').filter({ hasText: "w8 " }).waitFor();
  await page.reload();
  const replayed = page.locator('article.turn[data-live="true"]');
  await replayed.locator(".reply .text").first().waitFor();
  assert.equal(await page.locator('article.turn[data-live="false"]').count(), 1, "the sealed turn comes from history");
  await page.locator('article.turn[data-live="true"][data-sealed="true"]').waitFor();
  assert.equal(await replyText(replayed), words(60), "the replayed turn, whole and once");
  assert.equal(await page.locator(".user", { hasText: "paced reload" }).count(), 1, "the prompt shows once");
  assert.equal(await replyText(page.locator('article.turn[data-live="false"]')), words(60));
  step("a reload mid-turn shows the history, then the replay continues");

  // A network drop in the middle of a turn: EventSource resumes by Last-Event-ID.
  await send("dropped turn");
  const dropped = page.locator('article.turn[data-live="true"][data-sealed="false"]');
  await dropped.locator(".reply .text").filter({ hasText: "w10 " }).waitFor();
  await page.screenshot({ path: shot("live-turn") });
  await dropped.evaluate((el) => (el.dataset.marker = "kept"));
  const before = px.requests().length;
  px.cut();
  await page.locator('article[data-marker="kept"][data-sealed="true"]').waitFor({ timeout: 30_000 });
  assert.equal(await replyText(page.locator('article[data-marker="kept"]')), words(80), "no duplicate, no gap across the drop");
  const after = px.requests().slice(before);
  assert.match(after, /GET \/conversations\/[^ ]+\/events[^\n]*\r\n(?:[^\r\n]+\r\n)*last-event-id: [^\r\n]+:\d+\r\n/i, "the reconnect carries Last-Event-ID");
  step("a dropped connection resumes where it was");

  // A tool-call turn: one group per step, each call with its result.
  await send("tools please");
  const tools = page.locator('article.turn[data-sealed="true"]').last().locator(".tools");
  await page.locator('article.turn[data-live="true"][data-sealed="true"] .tools').last().waitFor();
  const checkTools = async (turn, where) => {
    const group = turn.locator(".tools");
    assert.equal(await group.count(), 1, `${where}: one group for the step's calls`);
    assert.match(await group.getAttribute("data-step-id"), /#0$/, where);
    assert.deepEqual(await group.locator(".tool .tool-result").allTextContents(), ["alpha", "no such file"], where);
    assert.equal(await group.locator(".tool.failed").count(), 1, `${where}: the failed call is marked`);
    assert.equal(await turn.locator("details.reasoning").count(), 1, `${where}: reasoning is folded`);
    assert.equal(await turn.locator("details.reasoning[open]").count(), 0, where);
    // The first call streamed output and was timed: both stay after a reload.
    const call = group.locator(".tool").first();
    assert.equal(await call.locator(".tool-output").textContent(), "reading a", `${where}: the tool's output`);
    assert.match(await call.locator(".tool-name").textContent(), /^read 3 ms$/, `${where}: the tool's duration`);
  };
  await checkTools(page.locator('article.turn[data-live="true"]').last(), "live");
  await tools.last().scrollIntoViewIfNeeded();
  await page.screenshot({ path: shot("tool-calls") });
  step("a tool-call turn is grouped by step");

  // Stop a turn; a Send while it runs is refused, and says so where the user looks.
  await send("endless please");
  await page.locator('article.turn[data-sealed="false"] .reply .text').filter({ hasText: "token token" }).waitFor();
  await send("while it runs");
  const refused = page.getByRole("alert").filter({ hasText: "already" });
  await refused.waitFor();
  await inView(refused, "a refused Send's error");
  await page.getByRole("button", { name: "Stop" }).click();
  await page.locator('.done[data-reason="aborted"]').waitFor();
  assert.match(await page.locator('.done[data-reason="aborted"]').textContent(), /done · aborted/);
  // The turn streamed into view ends above the composer, its footer included.
  const footer = await page.locator('.done[data-reason="aborted"]').boundingBox();
  const composer = await page.locator("form.composer").boundingBox();
  assert.ok(footer.y + footer.height <= composer.y + 1, `the footer (${JSON.stringify(footer)}) must end above the composer (${JSON.stringify(composer)})`);
  await inView(page.locator('.done[data-reason="aborted"]'), "the stopped turn's footer");
  // It stopped before its step reported usage: no count is made up for it.
  assert.match(await page.locator('.done[data-reason="aborted"]').textContent(), /usage not reported/);
  await page.screenshot({ path: shot("aborted") });
  step("Stop ends the turn with done{aborted}; a refused Send and the turn's end are in view");

  // The title, editable; and the history renders tool calls as the live stream did.
  await page.getByRole("textbox", { name: "Title" }).fill("Console test");
  await page.getByRole("button", { name: "Save title" }).click();
  await page.getByRole("link", { name: /Console test/ }).waitFor();
  // Each turn's footer as the live view showed it (the first one's before the reload of the
  // second turn made it history).
  const liveFooters = [firstFooter, ...(await page.locator('article.turn[data-live="true"] .turn-footer').allTextContents())];
  assert.equal(liveFooters.length, 5);
  await page.reload();
  await page.locator("article.turn .tools").first().waitFor();
  const historyTurns = page.locator('article.turn[data-live="false"]');
  assert.equal(await historyTurns.count(), 5, "five sealed turns from history");
  // The same footers from the stored metrics: a stopped turn does not pass for a whole reply.
  await page.locator('article.turn[data-live="false"] .done[data-reason="aborted"]').waitFor();
  assert.deepEqual(await historyTurns.locator(".turn-footer").allTextContents(), liveFooters);
  await checkTools(historyTurns.nth(3), "history");
  assert.equal(await replyText(historyTurns.nth(2)), words(80));
  step("the title is saved and the history renders as the stream did");

  // The folder, the effort and the session are off for the scripted model, which reads none
  // of them, and on for an agent program's.
  const controls = [page.getByRole("textbox", { name: "Folder" }), page.getByRole("combobox", { name: "Reasoning effort" }), page.getByRole("button", { name: "New session" }), page.getByRole("button", { name: "Save settings" })];
  const disabled = async () => Promise.all(controls.map((c) => c.isDisabled()));
  assert.deepEqual(await disabled(), [true, true, true, true], "nothing the scripted model would ignore is offered");
  assert.equal(await controls[0].getAttribute("title"), "demo/scripted does not use a folder");
  const chooseAgent = () => page.getByRole("combobox", { name: "Model" }).selectOption("agent/echo");
  await chooseAgent();
  assert.deepEqual(await disabled(), [false, false, false, false]);
  // The folder and reasoning effort agent programs get.
  await page.getByRole("textbox", { name: "Folder" }).fill("/tmp");
  await page.getByRole("combobox", { name: "Reasoning effort" }).selectOption("low");
  const saved = page.waitForResponse((r) => r.url().endsWith("/reasoning-effort") && r.request().method() === "PUT");
  await page.getByRole("button", { name: "Save settings" }).click();
  assert.equal((await saved).status(), 200);
  const setting = async (path, key) => (await api(OPEN_URL, "GET", `/conversations/${conversationId}/${path}`)).body[key];
  assert.equal(await setting("cwd", "cwd"), "/tmp");
  assert.equal(await setting("reasoning-effort", "reasoningEffort"), "low");
  await page.reload();
  await page.locator("article.turn").first().waitFor();
  await page.waitForFunction(() => document.querySelector('[aria-label="Folder"]').value === "/tmp");
  assert.equal(await page.getByRole("combobox", { name: "Reasoning effort" }).inputValue(), "low");
  step("the folder and reasoning effort are saved and read back");

  // A new agent session: the session is forgotten, and the page says what that means.
  await chooseAgent();
  const forgotten = page.waitForResponse((r) => r.url().endsWith("/session") && r.request().method() === "DELETE");
  await page.getByRole("button", { name: "New session" }).click();
  assert.equal((await forgotten).status(), 204);
  await page.getByRole("alert").filter({ hasText: "The next turn starts a new agent session." }).waitFor();
  step("a new agent session is asked for");

  // Plots: as many points as sealed turns, with 5 and with 500.
  const points = async (title) => page.locator("figure.plot", { hasText: title }).locator("circle.point").count();
  await page.locator("figure.plot", { hasText: "Context size" }).locator("circle.point").first().waitFor();
  const five = (await api(OPEN_URL, "GET", `/conversations/${conversationId}/metrics`)).body.turns;
  assert.equal(five.length, 5);
  // The stopped turn ended before its step reported usage: then it has no context size, and
  // no output rate (its zeros measure nothing; 0 tokens/s would be a false point).
  assert.equal(five[4].usageReported, false, "the stopped turn's usage is marked unreported");
  assert.equal(await points("Context size"), five.filter((t) => t.contextSize !== undefined).length);
  const rated = (t) => t.usageReported !== false && t.steps.some((s) => s.usageReported !== false && s.genTotalMs > 0);
  assert.ok(five[4].steps.some((s) => s.genTotalMs > 0), "the stopped turn generated for a while");
  assert.equal(await points("Output tokens per second"), five.filter(rated).length);
  assert.equal(await points("Time to first token"), five.filter((t) => t.steps[0]?.ttftMs !== undefined).length);
  await page.locator("section.metrics").screenshot({ path: shot("plots") });
  await page.locator("figure.plot", { hasText: "Steps of turn 5" }).waitFor();
  await page.locator("figure.plot", { hasText: "Context size" }).locator('circle.point[data-x="3"]').click();
  await page.locator("figure.plot", { hasText: "Steps of turn 3" }).waitFor();
  // One sealed turn: one point, still on its axes.
  await page.goto(`${px.url}/#/c/watched-elsewhere`);
  await page.locator("figure.plot", { hasText: "Context size" }).locator("circle.point").first().waitFor();
  assert.equal(await points("Context size"), 1);
  await page.locator("section.metrics").screenshot({ path: shot("plots-1") });
  await page.goto(`${px.url}/#/c/many-turns`);
  // It opens at its newest turn.
  await page.locator("article.turn", { hasText: "question 499" }).waitFor();
  await inView(page.locator("article.turn").last(), "the newest of 500 turns on opening");
  // The list stays beside the conversation, scrolled 80,000 px down.
  await inView(page.getByRole("button", { name: "New conversation" }), "the list beside a long conversation");
  const ttft = page.locator("figure.plot", { hasText: "Time to first token" });
  await page.locator("figure.plot", { hasText: "Context size" }).locator("circle.point").nth(499).waitFor({ state: "attached" });
  const manyTurns = (await api(OPEN_URL, "GET", "/conversations/many-turns/metrics")).body.turns;
  assert.equal(manyTurns.length, 500);
  // A point for every sealed turn; a turn without the value (no first token, or a generation
  // under a millisecond) has none there.
  assert.equal(await points("Context size"), 500);
  assert.equal(await points("Time to first token"), manyTurns.filter((t) => t.steps[0]?.ttftMs !== undefined).length);
  const generating = manyTurns.filter((t) => t.steps.some((s) => s.genTotalMs > 0)).length;
  assert.equal(await points("Output tokens per second"), generating);
  // The pointer over the plot shows the nearest turn's value (moved until it does: a plot is
  // redrawn when its width settles).
  let readout = "";
  for (let i = 0; i < 50 && !/^turn \d+: /.test(readout); i++) {
    const svg = ttft.locator("svg");
    await svg.scrollIntoViewIfNeeded();
    const box = await svg.boundingBox();
    await page.mouse.move(box.x + box.width - 20 - (i % 2), box.y + box.height / 2);
    readout = await ttft.locator(".readout").textContent();
  }
  assert.match(readout, /^turn \d+: /, "a hover value");
  await page.locator("section.metrics").screenshot({ path: shot("plots-500") });
  step("plots have a point per sealed turn, with 1, 5 and 500, and hover values");

  // It opened with the newest window of its log only; scrolling up loads the older turns
  // above, until the first, each whole and once, with its footer.
  const turnCount = () => page.locator("article.turn").count();
  assert.ok((await turnCount()) < 500, "a long conversation opens with its newest turns only");
  assert.match(await page.locator(".transcript > p[role=status]").textContent(), /^[\d,]+ older chunks above$/);
  for (let i = 0; i < 20 && (await turnCount()) < 500; i++) {
    const before = await turnCount();
    await page.evaluate(() => window.scrollTo(0, 0));
    await page.waitForFunction((n) => document.querySelectorAll("article.turn").length > n, before);
  }
  const prompts = await page.locator("article.turn .user").allTextContents();
  assert.deepEqual(prompts, Array.from({ length: 500 }, (_, i) => `question ${i}`), "every turn once, in order");
  assert.equal(await page.getByRole("button", { name: "Load older turns" }).isHidden(), true);
  await page.waitForFunction(() => document.querySelectorAll("article.turn .turn-footer .done").length === 500);
  step("a long conversation loads older turns as the reader scrolls up");

  // Throughput and the gateway's own state.
  await page.getByRole("link", { name: "Throughput", exact: true }).click();
  const row = page.getByRole("table", { name: "Throughput per model" }).locator("tbody tr").first();
  await row.waitFor();
  assert.match(await row.locator("td").first().textContent(), /scripted/);
  await page.screenshot({ path: shot("throughput") });
  // The model's figures over the day, by hour, as /metrics/series gives them: a point per hour
  // with turns, the failed turn in the error rate.
  const overTime = page.getByRole("region", { name: "Over time" });
  const series = (await api(OPEN_URL, "GET", "/metrics/series")).body.models.find((m) => m.model === "demo/scripted");
  assert.equal(await overTime.getByRole("combobox", { name: "Model over time" }).inputValue(), "demo/scripted");
  const hourly = async (title) => overTime.locator("figure.plot", { hasText: title }).locator("circle.point").count();
  await overTime.locator("figure.plot", { hasText: "Error rate" }).locator("circle.point").first().waitFor();
  assert.equal(await hourly("Error rate"), series.points.length);
  assert.equal(await hourly("Time to first token p95"), series.points.filter((p) => p.ttftP95Ms !== undefined).length);
  assert.ok(series.points.some((p) => p.failed > 0 && p.errorRate > 0), "the failed turn is in the error rate");
  await overTime.screenshot({ path: shot("over-time") });
  await page.getByRole("link", { name: "Gateway", exact: true }).click();
  await page.getByRole("status", { name: "Database state" }).filter({ hasText: "Ready" }).waitFor();
  assert.ok(Number(await page.getByLabel("WebSocket sessions", { exact: true }).textContent()) >= 1, "the console's own feed");
  assert.ok(Number((await page.getByLabel("Turns sealed", { exact: true }).textContent()).replace(/,/g, "")) >= 505);
  // The last week's failed turns: the failed conversation's, with its code and error.
  const failedRow = page.getByRole("table", { name: "Recent errors" }).locator("tbody tr").filter({ hasText: "failed-last" });
  await failedRow.waitFor();
  assert.equal(await failedRow.locator("td.code").textContent(), "upstream");
  assert.equal(await failedRow.locator("td.message").textContent(), "the upstream went away");
  // The agent program the test ran a turn on stays up between turns.
  assert.equal(await page.getByLabel("Agent processes (agent)", { exact: true }).textContent(), "1");
  assert.equal(await page.getByLabel("Agent starts (agent)", { exact: true }).textContent(), "1");
  // Each model's turns since the gateway started: by outcome (the stopped turn among them),
  // the time to first token and decode time of its steps, its tokens.
  const models = page.getByRole("table", { name: "Models" });
  const scripted = models.locator('tr[data-model="demo/scripted"]');
  await scripted.waitFor();
  const [finished, , stopped] = (await scripted.locator("td.turns").textContent())
    .split(" / ")
    .map((n) => Number(n.replace(/,/g, "")));
  assert.ok(finished >= 500 && stopped >= 1, `the scripted model's turns: ${finished} finished, ${stopped} stopped`);
  assert.match(await scripted.locator("td.ttft").textContent(), /^(\d+ ms|[\d.]+ s|–) \/ (\d+ ms|[\d.]+ s|–)$/);
  assert.match(await scripted.locator("td.tokens").textContent(), /^[\d,]+ \/ [\d,]+$/);
  // Its upstream's last error, the failed conversation's; the agent program has had none.
  assert.equal(await scripted.locator("td.last-error").textContent(), "the upstream went away");
  assert.equal(await models.locator('tr[data-model^="agent/"]').count(), 1, "the agent program's model");
  assert.equal(await models.locator('tr[data-model^="agent/"] td.last-error').textContent(), "–");
  // Each value stands under its own label, whatever the width.
  const misplaced = await page.evaluate(() =>
    [...document.querySelectorAll(".cards dd")]
      .filter((dd) => dd.getBoundingClientRect().left !== dd.previousElementSibling.getBoundingClientRect().left)
      .map((dd) => dd.getAttribute("aria-label")),
  );
  assert.deepEqual(misplaced, [], "values under their labels");
  // The MCP servers: a ready one with its tools as models call them, one that cannot start
  // with the reason.
  const servers = page.getByRole("table", { name: "MCP servers" });
  await servers.locator('tr[data-server="tiny"] td.state[data-state="ready"]').waitFor();
  assert.match(await servers.locator('tr[data-server="tiny"]').textContent(), /tiny__ping/);
  await servers.locator('tr[data-server="gone"] td.state[data-state="failed"]').waitFor();
  assert.match(await servers.locator('tr[data-server="gone"] td.state').textContent(), /could not be started/);
  await page.screenshot({ path: shot("gateway") });
  step("throughput per model and the gateway's state, its agent processes and MCP servers too");

  // A gateway slow to answer is not sent a read every 2 s on top of those still out: the view
  // reads again 2 s after an answer (the page's clock is the test's to move).
  const polled = await (await browser.newContext()).newPage();
  await polled.clock.install();
  let metricsReads = 0;
  polled.on("request", (r) => new URL(r.url()).pathname === "/metrics" && metricsReads++);
  const slowMetrics = await holdAnswers(polled, (url) => url.pathname === "/metrics");
  await polled.goto(`${px.url}/#/gateway`);
  await slowMetrics.answered;
  await polled.clock.runFor(10_000);
  assert.equal(metricsReads, 1, "one read of /metrics out at a time");
  slowMetrics.release();
  await polled.getByLabel("Turns sealed", { exact: true }).waitFor();
  const next = polled.waitForRequest((r) => new URL(r.url()).pathname === "/metrics");
  await polled.clock.runFor(2_000);
  await next;
  assert.equal(metricsReads, 2, "read again 2 s after the answer");
  await polled.context().close();
  step("the gateway view reads again after an answer, never piling reads on a slow gateway");

  // Closing, and deleting once asked twice. The view's first read is answered before the close
  // and held until after it: its status ("idle") is older than the close and must not undo it.
  const firstRead = await holdAnswers(page, /\/conversations\?q=watched-elsewhere&/);
  await page.goto(`${px.url}/#/c/watched-elsewhere`);
  const listed = page.locator('li[data-id="watched-elsewhere"]');
  await listed.waitFor();
  await firstRead.answered;
  await page.getByRole("button", { name: "Close conversation" }).click();
  await page.locator('.detail-head .status[data-status="closed"]').waitFor({ timeout: 10_000 });
  firstRead.release(); // later reads pass through the route as they come
  // The read fills the model choices right after the status.
  await page.waitForFunction(() => document.querySelector('.detail select[aria-label="Model"]')?.options.length > 1);
  assert.equal(await page.locator(".detail-head .status").getAttribute("data-status"), "closed", "a read older than the close");
  assert.ok(await page.getByRole("button", { name: "Close conversation" }).isDisabled(), "closed once");
  await page.getByRole("button", { name: "Delete", exact: true }).click();
  await page.getByRole("button", { name: "Keep it" }).click();
  assert.equal((await api(OPEN_URL, "GET", "/conversations/watched-elsewhere/status")).status, 200, "kept");
  await page.getByRole("button", { name: "Delete", exact: true }).click();
  await page.screenshot({ path: shot("delete") });
  await page.getByRole("button", { name: "Delete for good" }).click();
  await page.waitForURL(/#\/$/);
  await listed.waitFor({ state: "detached", timeout: 10_000 });
  assert.equal((await api(OPEN_URL, "GET", "/conversations/watched-elsewhere/status")).status, 404);
  step("a conversation is closed, and deleted once asked twice");

  // 390 pixels wide, and the dark theme.
  const narrow = await open(`${px.url}/#/c/${encodeURIComponent(conversationId)}`, { viewport: { width: 390, height: 844 } });
  await narrow.locator("article.turn").first().waitFor();
  assert.ok(await narrow.getByRole("link", { name: "← Conversations" }).isVisible());
  assert.ok((await narrow.evaluate(() => document.documentElement.scrollWidth)) <= 390, "no sideways scrolling at 390 px");
  await narrow.screenshot({ path: shot("narrow") });
  const narrowThroughput = await open(`${px.url}/#/throughput`, { viewport: { width: 390, height: 844 } });
  await narrowThroughput.getByRole("table", { name: "Throughput per model" }).locator("tbody tr").first().waitFor();
  const wide = await narrowThroughput.evaluate(() => document.documentElement.scrollWidth);
  assert.ok(wide <= 390, `the throughput view scrolls no page sideways at 390 px (${wide} px wide)`);
  const dark = await open(`${px.url}/#/c/${encodeURIComponent(conversationId)}`, { colorScheme: "dark" });
  await dark.locator("article.turn").first().waitFor();
  const background = await dark.evaluate(() => getComputedStyle(document.body).backgroundColor);
  const [r, g, b] = background.match(/\d+/g).map(Number);
  assert.ok(r + g + b < 150, `a dark background, got ${background}`);
  await dark.screenshot({ path: shot("dark") });
  step("usable at 390 px, dark with the system");

  // Auth: signing in is asked for once, a wrong token or key is said to be wrong.
  const locked = await open(`${LOCKED_URL}/`);
  const dialog = locked.getByRole("dialog", { name: "Sign in" });
  await dialog.filter({ hasText: "needs you to sign in" }).waitFor();
  await locked.screenshot({ path: shot("key-prompt") });
  // Dismissed with Escape, the page says why it is empty and offers the prompt again.
  await locked.keyboard.press("Escape");
  await locked.getByRole("button", { name: "Sign in" }).click();
  await dialog.filter({ hasText: "needs you to sign in" }).waitFor();
  await locked.getByRole("textbox", { name: "Token or API key" }).fill("not-the-key");
  await dialog.getByRole("button", { name: "Sign in" }).click();
  await dialog.filter({ hasText: "refused that token or key" }).waitFor();
  await locked.getByRole("textbox", { name: "Token or API key" }).fill(API_KEY);
  await dialog.getByRole("button", { name: "Sign in" }).click();
  // Signed in with a key: an administrator, who sees everyone's conversations and whose they are.
  await locked.getByRole("status", { name: "Signed in as" }).filter({ hasText: "(administrator)" }).waitFor();
  const alices = locked.locator('li[data-id="alices-own"]');
  await alices.filter({ hasText: "owner alice" }).waitFor();
  assert.equal(await locked.evaluate(() => document.cookie), "", "the page's scripts hold no credential");
  await locked.getByRole("link", { name: /Behind a key/ }).click();
  await locked.getByRole("textbox", { name: "Message" }).fill("hello behind the key");
  await locked.getByRole("button", { name: "Send" }).click();
  await locked.locator('article.turn[data-live="true"][data-sealed="true"] .done').waitFor();
  await locked.reload();
  await locked.locator('article.turn[data-live="false"]').waitFor();
  assert.equal(await dialog.isVisible(), false, "the session is kept");
  step("with keys on: asked once (again after Escape), refused clearly, then working (stream included)");

  // Signing out, then in as a user with a token: only her own conversation, no owner shown.
  await locked.getByRole("button", { name: "Sign out" }).click();
  await dialog.filter({ hasText: "needs you to sign in" }).waitFor();
  await locked.getByRole("textbox", { name: "Token or API key" }).fill(process.env.ALICE_TOKEN);
  await dialog.getByRole("button", { name: "Sign in" }).click();
  await locked.getByRole("status", { name: "Signed in as" }).filter({ hasText: /^alice$/ }).waitFor();
  await alices.waitFor();
  assert.equal(await locked.locator('li[data-id="behind-a-key"]').count(), 0, "a user sees her own only");
  assert.equal(await alices.filter({ hasText: "owner" }).count(), 0, "a user is not shown owners");
  await locked.screenshot({ path: shot("signed-in-user") });
  step("signed out, then in with a token: her own conversations only");

  // Behind a proxy that rewrites Host, the page's origin (here http://127.0.0.2:port, a name
  // the gateway's default --cors-origins does not list, as a public name would not be) is not
  // the gateway's: the gateway refuses the console's WebSocket (a page cannot learn why), and
  // the header says so instead of "reconnecting" for ever; the page itself still reads.
  const rewriting = await proxy(new URL(OPEN_URL), new URL(OPEN_URL).host, "127.0.0.2");
  try {
    const behind = await open(`${rewriting.url}/`);
    await behind.getByRole("link", { name: /Five hundred turns/ }).waitFor();
    const feedState = behind.getByRole("status", { name: "Status feed" });
    await feedState.filter({ hasText: "live updates refused" }).waitFor({ timeout: 15_000 });
    assert.match(await feedState.getAttribute("title"), /Host header/);
    await behind.screenshot({ path: shot("refused-feed") });
    await behind.close();
  } finally {
    rewriting.close();
  }
  step("behind a proxy that rewrites Host: the refused WebSocket is said, not retried in silence");

  assert.deepEqual(pageErrors, [], "no script errors on any page");
  console.log("console: all checks passed");
} finally {
  await browser.close();
  px.close();
}
