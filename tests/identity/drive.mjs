// A browser opens a page the gateway serves from `--web-root`, is sent to the console's
// sign-in, signs in once there, comes back and then uses the API with the session cookie alone
// (`client.js`); a page of another site then tries to use that
// cookie. Prints one JSON line of what each page could do; tests/identity.rs judges it.

import http from "node:http";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { chromium } = require(process.env.PLAYWRIGHT);
const { GATEWAY, CHROMIUM, TOKEN } = process.env;

// Another site: a name mapped to this machine, on a port of its own.
const evilPage = (gateway) => `<!doctype html><title>evil</title><script>
(async () => {
  const out = {};
  const tryIt = async (name, f) => { try { out[name] = await f(); } catch (e) { out[name] = "threw"; } };
  await tryIt("read", async () => (await fetch("${gateway}/conversations", { credentials: "include" })).status);
  await tryIt("send", async () => (await fetch("${gateway}/conversations/web-sse/messages", { method: "POST",
    credentials: "include", mode: "no-cors", headers: { "content-type": "text/plain" },
    body: JSON.stringify({ message: "forged" }) })).type);
  await tryIt("sendJson", async () => (await fetch("${gateway}/conversations/web-sse/messages", { method: "POST",
    credentials: "include", headers: { "content-type": "application/json" },
    body: JSON.stringify({ message: "forged" }) })).status);
  await tryIt("close", async () => (await fetch("${gateway}/conversations/web-ws/close", { method: "POST",
    credentials: "include", mode: "no-cors" })).type);
  await tryIt("websocket", () => new Promise((resolve) => {
    const ws = new WebSocket("${gateway.replace("http", "ws")}/ws");
    ws.onopen = () => { ws.send(JSON.stringify({ type: "chat.send", conversationId: "web-sse", message: "forged" }));
      setTimeout(() => resolve("opened"), 500); };
    ws.onerror = () => resolve("refused");
  }));
  const pre = document.createElement("pre"); pre.id = "result"; pre.textContent = JSON.stringify(out);
  document.body.append(pre);
})();
</script>`;

const evil = http.createServer((req, res) => {
  res.writeHead(200, { "content-type": "text/html" });
  res.end(evilPage(GATEWAY));
});
await new Promise((resolve) => evil.listen(0, "127.0.0.1", resolve));
const evilUrl = `http://evil.test:${evil.address().port}/`;
// A page on another port of this machine: same-site to the browser (SameSite ignores ports),
// so it is sent the cookie, and its origin is one the default --cors-origins admits.
const otherPortUrl = `http://127.0.0.1:${evil.address().port}/`;

const browser = await chromium.launch({
  executablePath: CHROMIUM,
  args: ["--no-sandbox", "--host-resolver-rules=MAP evil.test 127.0.0.1"],
});
const report = {};
try {
  const context = await browser.newContext();
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  // Not signed in: the web client's page sends the reader to the console's sign-in, which
  // comes back to it once signed in.
  await page.goto(`${GATEWAY}/app/`);
  const asked = new URL(page.url());
  report.redirected = asked.pathname + asked.search;
  await page.fill("#key-input", TOKEN);
  await page.press("#key-input", "Enter");
  await page.waitForURL(`${GATEWAY}/app/`, { timeout: 30000 });
  report.client = JSON.parse(await page.locator("#result").textContent({ timeout: 60000 }));
  // A link to the console whose way back leads to another site: signed in, the console stays.
  for (const next of ["//evil.test/", "/\\evil.test/", "http://evil.test/"]) {
    await page.goto(`${GATEWAY}/?next=${encodeURIComponent(next)}`);
    await page.waitForTimeout(1000);
    (report.nextElsewhere ||= []).push(page.url().startsWith(`${GATEWAY}/`) ? "stayed" : page.url());
  }
  report.cookies = (await context.cookies()).map((c) => ({ name: c.name, httpOnly: c.httpOnly, sameSite: c.sameSite }));
  report.scriptSeesCookie = await page.evaluate(() => document.cookie);
  const other = await context.newPage();
  await other.goto(evilUrl);
  report.evil = JSON.parse(await other.locator("#result").textContent({ timeout: 30000 }));
  const sameSite = await context.newPage();
  await sameSite.goto(otherPortUrl);
  report.otherPort = JSON.parse(await sameSite.locator("#result").textContent({ timeout: 30000 }));
  report.errors = errors;
} finally {
  await browser.close();
  evil.close();
}
console.log("REPORT " + JSON.stringify(report));
