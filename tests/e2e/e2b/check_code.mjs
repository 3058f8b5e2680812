// E2B's `@e2b/code-interpreter` SDK (2.8.0, unchanged) against Kiln, configured only by E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY: a sandbox of its default template `code-interpreter-v1`, and
// runCode with state across calls (x=1, then x+1 is 2), stdout streamed to its callback, an error
// with its traceback, a matplotlib chart returned as a PNG, a pandas DataFrame as HTML and text,
// a context of its own (created, listed, its state apart, restarted, removed), the random state of
// a second sandbox unlike the first's (each restore of the warm template reseeds), and /execute
// refused without the sandbox's token, and getHost's host routed to the guest port. Prints one JSON line: {"ok": true, "steps": [...]} or
// {"ok": false, "failure": "...", "steps": [...]}; exits 1 on a failure.
import { Sandbox } from '@e2b/code-interpreter'
import assert from 'node:assert/strict'
import http from 'node:http'

const steps = []
const step = (name, extra) => steps.push(extra === undefined ? name : { [name]: extra })
const sandboxes = []

async function main() {
  assert.ok(process.env.E2B_API_URL && process.env.E2B_SANDBOX_URL && process.env.E2B_API_KEY)

  const sbx = await Sandbox.create({ timeoutMs: 300_000 })
  sandboxes.push(sbx)
  step('create', sbx.sandboxId)

  let t0 = Date.now()
  let ex = await sbx.runCode('x = 1')
  assert.equal(ex.error, undefined, JSON.stringify(ex.error))
  ex = await sbx.runCode('x + 1')
  assert.equal(ex.text, '2')
  assert.equal(ex.results.length, 1)
  assert.equal(ex.results[0].isMainResult, true)
  step('state', Date.now() - t0)

  const seen = []
  ex = await sbx.runCode('import sys\nprint("one")\nprint("two", file=sys.stderr)\nprint("three")',
    { onStdout: (m) => seen.push(['out', m.line]), onStderr: (m) => seen.push(['err', m.line]) })
  assert.deepEqual(seen.map((s) => [s[0], s[1].trim()]), [['out', 'one'], ['err', 'two'], ['out', 'three']])
  assert.deepEqual(ex.logs.stdout.map((s) => s.trim()), ['one', 'three'])
  assert.deepEqual(ex.logs.stderr.map((s) => s.trim()), ['two'])
  step('stdout')

  ex = await sbx.runCode('def f():\n    return 1 / 0\nf()')
  assert.equal(ex.error.name, 'ZeroDivisionError')
  assert.equal(ex.error.value, 'division by zero')
  assert.match(ex.error.traceback, /Traceback[\s\S]*line 2, in f[\s\S]*ZeroDivisionError/)
  ex = await sbx.runCode('x')  // an error leaves the context's state as it was
  assert.equal(ex.text, '1')
  step('error')


  ex = await sbx.runCode('import pandas as pd\npd.DataFrame({"a": [1, 2], "b": ["x", "y"]})')
  assert.equal(ex.error, undefined, JSON.stringify(ex.error))
  const df = ex.results.find((r) => r.isMainResult)
  assert.match(df.html, /<table[\s\S]*<th>a<\/th>[\s\S]*<td>x<\/td>/)
  assert.match(df.text, /a\s+b\n0\s+1\s+x\n1\s+2\s+y/)
  step('dataframe')

  // A matplotlib chart comes back as a PNG result (plt.show()), not as the main result.
  ex = await sbx.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title("squares")\nplt.show()')
  assert.equal(ex.error, undefined, JSON.stringify(ex.error))
  const charts = ex.results.filter((r) => r.png)
  assert.equal(charts.length, 1, JSON.stringify(ex.results.map((r) => Object.keys(r))))
  const png = Buffer.from(charts[0].png, 'base64')
  assert.deepEqual([...png.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])
  assert.ok(png.length > 1000, `a PNG of ${png.length} bytes`)
  step('chart', png.length)

  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  assert.equal(ctx.cwd, '/tmp')
  ex = await sbx.runCode('import os\ny = 5\nos.getcwd()', { context: ctx })
  assert.equal(ex.text, '/tmp')
  ex = await sbx.runCode('"x" in globals(), "y" in globals()')
  assert.equal(ex.text, '(True, False)')
  const listed = await sbx.listCodeContexts()
  assert.ok(listed.some((c) => c.id === ctx.id), JSON.stringify(listed))
  await sbx.restartCodeContext(ctx)
  ex = await sbx.runCode('"y" in globals()', { context: ctx })
  assert.equal(ex.text, 'False')
  await sbx.removeCodeContext(ctx)
  assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
  step('contexts')

  // Code never runs without the sandbox's token (the SDK sends it on /execute).
  const url = process.env.E2B_SANDBOX_URL.replace(/\/$/, '') + '/execute'
  let res = await fetch(url, { method: 'POST', body: JSON.stringify({ code: '1' }),
    headers: { 'Content-Type': 'application/json', 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49999' } })
  assert.equal(res.status, 401)
  res = await fetch(url, { method: 'POST', body: JSON.stringify({ code: '1' }),
    headers: { 'Content-Type': 'application/json', 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49999',
      'X-Access-Token': '0'.repeat(32) } })
  assert.equal(res.status, 401)
  step('token')

  // getHost(port): {port}-{id}.{domain}, which the data plane routes by its Host alone.
  const host = sbx.getHost(49999)
  assert.match(host, new RegExp(`^49999-${sbx.sandboxId}\\.[a-z0-9.-]+:\\d+$`))
  const dp = new URL(process.env.E2B_SANDBOX_URL)
  const byHost = (h, path) => new Promise((resolve, reject) => {
    http.get({ host: dp.hostname, port: dp.port, path, headers: { Host: h } }, (r) => {
      let body = ''
      r.on('data', (d) => { body += d })
      r.on('end', () => resolve([r.statusCode, body]))
    }).on('error', reject)
  })
  assert.deepEqual(await byHost(host, '/health'), [200, 'OK'])
  assert.equal((await byHost(sbx.getHost(8000), '/'))[0], 401)  // a port of the user's: the token
  step('getHost')

  // Two sandboxes restored from one warm snapshot draw different random numbers.
  const code = 'import random, numpy\n(random.random(), float(numpy.random.random()))'
  const a = (await sbx.runCode(code)).text
  const other = await Sandbox.create({ timeoutMs: 120_000 })
  sandboxes.push(other)
  const b = (await other.runCode(code)).text
  assert.ok(a && b && a !== b, `random states ${a} and ${b}`)
  step('reseeded')

  for (const s of sandboxes.splice(0)) assert.equal(await s.kill(), true)
  step('kill')
}

try {
  await main()
  console.log(JSON.stringify({ ok: true, steps }))
} catch (e) {
  for (const s of sandboxes) await s.kill().catch(() => {})
  console.log(JSON.stringify({ ok: false, failure: String(e && e.stack ? e.stack : e), steps }))
  process.exit(1)
}
