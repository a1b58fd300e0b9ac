// Attacks a gateway started with no configuration from real Chromium pages (tests/safety.rs
// started it): a page of another site, a page whose name re-binds to this machine (simulated by
// a name mapped to 127.0.0.1 and a port that forwards to the gateway, as a re-bound name would
// reach it), and a page on this machine's own origin (a web client's dev server), which must
// still work. Prints one JSON line of what each page could do; tests/safety.rs judges it and the
// gateway's state. A malformed console address is checked too.

import http from "node:http";
import net from "node:net";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { chromium } = require(process.env.PLAYWRIGHT);
const { GATEWAY, CHROMIUM } = process.env;
const gateway = new URL(GATEWAY);

/** What every attacking page runs: each attempt, and what the page could see of it. */
const ATTEMPTS = `
async function attempts(target, wsTarget, tag, victim) {
  const out = {};
  const tryIt = async (name, f) => {
    try { out[name] = await f(); } catch (e) { out[name] = "threw: " + String(e).slice(0, 80); }
  };
  await tryIt("read", async () => {
    const r = await fetch(target + "/conversations");
    return { status: r.status, body: (await r.text()).slice(0, 200) };
  });
  await tryIt("chatJson", async () => {
    const r = await fetch(target + "/chat", { method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ conversationId: tag + "-json", message: "hi", cwd: "/" }) });
    return { status: r.status };
  });
  await tryIt("chatNoCors", async () => {
    const r = await fetch(target + "/chat", { method: "POST", mode: "no-cors", headers: { "content-type": "text/plain" },
      body: JSON.stringify({ conversationId: tag + "-nocors", message: "hi", cwd: "/" }) });
    return { type: r.type };
  });
  await tryIt("stopNoCors", async () => {
    const r = await fetch(target + "/conversations/" + victim + "/stop", { method: "POST", mode: "no-cors" });
    return { type: r.type };
  });
  await tryIt("closeNoCors", async () => {
    const r = await fetch(target + "/conversations/" + victim + "/close", { method: "POST", mode: "no-cors" });
    return { type: r.type };
  });
  await tryIt("titleNoCors", async () => {
    const r = await fetch(target + "/conversations/" + victim + "/title", { method: "PUT", mode: "no-cors",
      body: JSON.stringify({ title: "owned" }) });
    return { type: r.type };
  });
  await tryIt("websocket", () => new Promise((resolve) => {
    const ws = new WebSocket(wsTarget + "/ws");
    const seen = [];
    ws.onmessage = (m) => seen.push(String(m.data).slice(0, 60));
    ws.onopen = () => setTimeout(() => { ws.close(); resolve({ opened: true, seen }); }, 500);
    ws.onerror = () => resolve({ opened: false });
  }));
  return out;
}
`;

/** A page with a form that posts `text/plain` to `action` on load (no script needed). */
const formPage = (action) => `<!doctype html><form id="f" method="POST" enctype="text/plain" action="${action}">
<input name='{"conversationId":"attack-form","message":"hi","x":"' value='"}'></form>
<script>document.getElementById("f").submit()</script>`;

const attackerPage = `<!doctype html><title>attacker</title><script>${ATTEMPTS}</script>`;

/** A server on 127.0.0.1 that serves the attacker's page and its form pages; its port. */
function site() {
  const server = http.createServer((req, res) => {
    // Each connection carries one request: the re-binding port routes a connection, not a request.
    const head = { "content-type": "text/html", connection: "close" };
    if (req.url === "/" || req.url === "/page") {
      res.writeHead(200, head);
      return res.end(attackerPage);
    }
    if (req.url.startsWith("/form")) {
      const to = new URL(req.url, "http://x").searchParams.get("to");
      res.writeHead(200, head);
      return res.end(formPage(to));
    }
    res.writeHead(404, head);
    res.end();
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve(server.address().port)));
}

/** A port whose connections go to the attacker's site for its own pages and to the gateway for
 * everything else, the Host header as the browser sent it: what a name re-bound from the
 * attacker's server to this machine reaches. */
async function rebinding() {
  const pages = await site();
  const tcp = net.createServer((client) => {
    client.once("data", (first) => {
      const line = first.toString("latin1").split("\r\n")[0];
      const own = /^GET \/(page|form|favicon)/.test(line);
      const upstream = net.connect(own ? pages : Number(gateway.port), own ? "127.0.0.1" : gateway.hostname);
      upstream.write(first);
      client.pipe(upstream);
      upstream.pipe(client);
      const end = () => {
        client.destroy();
        upstream.destroy();
      };
      client.on("error", end);
      upstream.on("error", end);
    });
  });
  return new Promise((resolve) => tcp.listen(0, "127.0.0.1", () => resolve(tcp.address().port)));
}

const browser = await chromium.launch({
  executablePath: CHROMIUM,
  args: [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
    // A name of the attacker's that resolves to this machine: its pages are of another site.
    "--host-resolver-rules=MAP evil.test 127.0.0.1",
    // Plain http:// to a name that is not this machine's: no HTTPS upgrade first.
    "--disable-features=HttpsUpgrades,HttpsFirstBalancedModeAutoEnable,HttpsFirstModeV2ForTypicallySecureUsers",
  ],
});
const context = await browser.newContext();
const report = {};

async function attack(pageUrl, target, wsTarget, tag, victim) {
  const page = await context.newPage();
  page.setDefaultTimeout(20_000);
  await page.goto(pageUrl);
  const result = await page.evaluate(([t, w, g, v]) => attempts(t, w, g, v), [target, wsTarget, tag, victim]);
  await page.close();
  return result;
}

/** The status the form's post got (it is sent as the form page loads). */
async function form(siteUrl, action) {
  const page = await context.newPage();
  const posted = page.waitForResponse((r) => r.url() === action && r.request().method() === "POST", { timeout: 10_000 });
  await page.goto(`${siteUrl}/form?to=${encodeURIComponent(action)}`);
  const status = await posted.then((r) => r.status()).catch((e) => "no answer: " + String(e).slice(0, 60));
  await page.close();
  return status;
}

const wsGateway = `ws://${gateway.host}`;
// Another site's page, reaching the gateway at its own address.
const foreignPort = await site();
const foreign = `http://evil.test:${foreignPort}`;
report.foreign = await attack(`${foreign}/page`, GATEWAY.replace(/\/$/, ""), wsGateway, "foreign", "victim");
report.foreign.form = await form(foreign, `${GATEWAY.replace(/\/$/, "")}/chat`);
// A re-bound name: the page and the gateway are of one origin, through the forwarding port.
const reboundPort = await rebinding();
const rebound = `http://evil.test:${reboundPort}`;
report.rebound = await attack(`${rebound}/page`, rebound, `ws://evil.test:${reboundPort}`, "rebound", "victim");
report.rebound.form = await form(rebound, `${rebound}/chat`);
// This machine's own page on another port (a web client's dev server): it works.
const ownPort = await site();
const own = `http://localhost:${ownPort}`;
report.own = await attack(`${own}/page`, GATEWAY.replace(/\/$/, ""), wsGateway, "own", "own-victim");

// The console at a malformed address shows the list and says why, with no script error.
const errors = [];
const page = await context.newPage();
page.on("pageerror", (e) => errors.push(String(e)));
await page.goto(`${GATEWAY.replace(/\/$/, "")}/#/c/%E0%A4%A`);
await page.getByText("That address names no conversation").waitFor({ timeout: 10_000 }).catch(() => errors.push("no notice"));
report.console = { errors, listShown: await page.locator("nav").count() };

await browser.close();
console.log("REPORT " + JSON.stringify(report));
process.exit(0);
