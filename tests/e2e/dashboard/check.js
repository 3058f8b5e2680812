// check.js URL KEY NARROW_KEY SANDBOX_ID TEMPLATE_ID: walks the dashboard in Debian's Chromium (headless) as a
// user would and prints what it saw as one JSON object; test_dashboard.py judges it. With
// KILN_DASHBOARD_SCREENSHOT=<file.png> it also saves the page once the charts are drawn.
"use strict";
const { chromium } = require("playwright-core");

const [url, key, narrowKey, sandbox, template] = process.argv.slice(2);
const seen = { console_errors: [], page_errors: [], csp_violations: [] };
// The sign-in attempts with bad keys fail on purpose: the browser logs those answers.
const EXPECTED = /Failed to load resource: the server responded with a status of 40[13]/;

async function signIn(page, k) {
  await page.fill("#key", k);
  await page.click("button[type=submit]");
}

(async () => {
  const browser = await chromium.launch({
    executablePath: "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"],
  });
  try {
    const page = await browser.newPage();
    page.on("console", (m) => {
      if (m.type() === "error" && !EXPECTED.test(m.text())) seen.console_errors.push(m.text());
    });
    page.on("pageerror", (e) => seen.page_errors.push(String(e)));
    await page.exposeFunction("cspViolation", (what) => seen.csp_violations.push(what));
    await page.addInitScript(() => document.addEventListener("securitypolicyviolation",
      (e) => window.cspViolation(e.violatedDirective + " " + e.blockedURI)));
    await page.goto(url);
    seen.title = await page.title();

    // a key that is not one, then a key without billing:read: the sign-in form says why
    await signIn(page, "kiln_sk_notakey");
    await page.waitForSelector("#signin-error:not([hidden])");
    seen.bad_key_error = await page.textContent("#signin-error");
    await signIn(page, narrowKey);
    await page.waitForFunction(() => !document.getElementById("signin-error").hidden &&
      document.getElementById("signin-error").textContent.includes("scope"));
    seen.narrow_key_error = await page.textContent("#signin-error");
    seen.board_hidden_after_errors = await page.isHidden("#board");

    // the tenant's key: balance, the sandbox, its per-second series
    await signIn(page, key);
    await page.waitForSelector("#board:not([hidden])");
    await page.waitForFunction(() => document.getElementById("balance").textContent !== "–");
    seen.balance = await page.textContent("#balance");
    seen.granted = await page.textContent("#granted");
    const row = `#sandboxes tr[data-id="${sandbox}"]`;
    await page.waitForSelector(row);
    seen.row = await page.$$eval(`${row} td`, (tds) => tds.map((td) => td.textContent));
    await page.click(row);
    await page.waitForFunction(() => {
      const svg = document.querySelector("#chart-mem svg");
      return svg && Number(svg.dataset.points) >= 3;
    }, null, { timeout: 60000 });
    seen.detail_id = await page.textContent("#detail-id");
    for (const c of ["cpu", "mem", "net", "cost"]) {
      seen[c] = await page.$eval(`#chart-${c}`, (fig) => ({
        points: Number(fig.querySelector("svg").dataset.points),
        max: Number(fig.querySelector("svg").dataset.max),
        lines: fig.querySelectorAll("polyline").length,
        latest: fig.querySelector(".latest").textContent,
      }));
    }
    if (process.env.KILN_DASHBOARD_SCREENSHOT)
      await page.screenshot({ path: process.env.KILN_DASHBOARD_SCREENSHOT, fullPage: true });
    // the series grows while the page is open
    const before = seen.mem.points;
    await page.waitForFunction((n) => Number(document.querySelector("#chart-mem svg").dataset.points) > n,
      before, { timeout: 30000 });
    seen.mem_points_later = await page.$eval("#chart-mem svg", (svg) => Number(svg.dataset.points));

    // the daily totals come from the ledger: the meter flushes them every few seconds
    // (the sandbox's row: the template build's builder sandbox has one too)
    await page.waitForFunction((id) => [...document.querySelectorAll("#days tbody tr td:nth-child(2)")]
      .some((td) => td.textContent === id), sandbox, { timeout: 60000 });
    seen.day_row = await page.$$eval("#days tbody tr", (trs, id) => trs.map((tr) =>
      [...tr.cells].map((td) => td.textContent)).find((r) => r[1] === id), sandbox);

    // kept snapshots (the failed build's cached layer) are billed as storage: their own rows
    await page.waitForFunction(() => [...document.querySelectorAll("#days tbody tr td:nth-child(3)")]
      .some((td) => td.textContent === "storage"), null, { timeout: 90000 });
    seen.storage_row = await page.$$eval("#days tbody tr", (trs) => trs.map((tr) =>
      [...tr.cells].map((td) => td.textContent)).find((r) => r[2] === "storage"));

    // the templates: the newest version of each, the chosen one's versions and their build logs
    const trow = `#templates tr[data-id="${template}"]`;
    await page.waitForSelector(trow);
    seen.template_row = await page.$$eval(`${trow} td`, (tds) => tds.map((td) => td.textContent));
    await page.click(trow);
    await page.waitForSelector("#template-detail:not([hidden]) #versions tbody tr");
    seen.versions = await page.$$eval("#versions tbody tr", (trs) => trs.map((tr) =>
      [...tr.cells].map((td) => td.textContent)));
    seen.pending_log_state = await page.textContent("#log-state");
    await page.click('#versions tr[data-version="1"]');
    await page.waitForFunction(() => document.getElementById("build-log").dataset.ended === "failed",
      null, { timeout: 60000 });
    seen.log = await page.textContent("#build-log");
    seen.log_state = await page.textContent("#log-state");
    seen.log_version = await page.textContent("#log-version");

    // a reload keeps the session (this tab's storage); "Forget key" ends it
    await page.reload();
    await page.waitForSelector("#board:not([hidden])");
    seen.board_after_reload = true;
    await page.click("#signout");
    await page.waitForSelector("#signin:not([hidden])");
    seen.key_left = await page.evaluate(() => sessionStorage.getItem("kiln_key"));
  } finally {
    await browser.close();
  }
  process.stdout.write(JSON.stringify(seen) + "\n");
})().catch((e) => {
  process.stdout.write(JSON.stringify({ ...seen, failure: String(e && e.stack || e) }) + "\n");
  process.exit(1);
});
