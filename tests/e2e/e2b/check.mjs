// E2B's `e2b` SDK (2.51.0, unchanged) against Kiln's E2B-compatible API, configured only by
// E2B_API_URL and E2B_API_KEY (E2B_OTHER_API_KEY: another tenant's key). Drives a real sandbox
// through create, getInfo, list with a metadata filter, setTimeout, pause, connect (resume),
// updateNetwork, getMetrics, snapshots and kill, and another tenant's calls on it. Prints one JSON line: {"ok": true,
// "steps": [...]} or {"ok": false, "failure": "...", "steps": [...]}; exits 1 on a failure.
import { ALL_TRAFFIC, Sandbox, SandboxError, SandboxNotFoundError } from 'e2b'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'

const steps = []
const step = (name, extra) => steps.push(extra === undefined ? name : { [name]: extra })
const other = { apiKey: process.env.E2B_OTHER_API_KEY }
const run = randomBytes(6).toString('hex')
let sbx

async function main() {
  assert.ok(process.env.E2B_API_URL && process.env.E2B_API_KEY && other.apiKey)

  sbx = await Sandbox.create({ metadata: { suite: run, role: 'first' }, timeoutMs: 120_000 })
  const token = sbx.envdAccessToken
  assert.match(sbx.sandboxId, /^sb_/)
  assert.match(token, /^[0-9a-f]{32}$/)
  step('create', sbx.sandboxId)

  let info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.state, 'running')
  assert.deepEqual(info.metadata, { suite: run, role: 'first' })
  assert.ok(info.startedAt instanceof Date && !isNaN(info.startedAt))
  const end1 = info.endAt.getTime()
  assert.ok(end1 > Date.now() + 60_000 && end1 <= Date.now() + 125_000, `endAt ${info.endAt}`)
  step('getInfo')

  let found = await Sandbox.list({ query: { metadata: { suite: run } } }).nextItems()
  assert.deepEqual(found.map((s) => s.sandboxId), [sbx.sandboxId])
  assert.equal(found[0].state, 'running')
  found = await Sandbox.list({ query: { metadata: { suite: run, role: 'none' } } }).nextItems()
  assert.deepEqual(found, [])
  found = await Sandbox.list({ query: { metadata: { suite: run }, state: ['paused'] } }).nextItems()
  assert.deepEqual(found, [])
  step('list')

  await sbx.setTimeout(600_000)
  info = await sbx.getInfo()
  assert.ok(info.endAt.getTime() > Date.now() + 500_000, `endAt after setTimeout ${info.endAt}`)
  step('setTimeout')

  // Egress through the SDK onto Kiln's rules (the driver checks the API took each one).
  await sbx.updateNetwork({ allowInternetAccess: false })
  await sbx.updateNetwork({ denyOut: [ALL_TRAFFIC], allowOut: ['203.0.113.7', 'pypi.org'] })
  await assert.rejects(sbx.updateNetwork({ denyOut: ['10.0.0.0/8'] }),
    (e) => e instanceof SandboxError && /denyOut/.test(e.message))
  await sbx.updateNetwork({})
  step('updateNetwork')

  const metrics = await sbx.getMetrics()
  assert.ok(Array.isArray(metrics))
  step('getMetrics', metrics.length)

  // Another tenant's key sees nothing of it.
  await assert.rejects(Sandbox.getInfo(sbx.sandboxId, other), SandboxNotFoundError)
  await assert.rejects(Sandbox.setTimeout(sbx.sandboxId, 10_000, other), SandboxNotFoundError)
  await assert.rejects(Sandbox.pause(sbx.sandboxId, other), SandboxNotFoundError)
  await assert.rejects(Sandbox.connect(sbx.sandboxId, other), SandboxNotFoundError)
  assert.equal(await Sandbox.kill(sbx.sandboxId, other), false)
  assert.deepEqual(await Sandbox.list({ ...other, query: { metadata: { suite: run } } }).nextItems(), [])
  assert.equal((await sbx.getInfo()).state, 'running')
  step('otherTenant')

  assert.equal(await sbx.pause(), true)
  assert.equal((await sbx.getInfo()).state, 'paused')
  assert.equal(await sbx.pause(), false) // already paused: 409
  found = await Sandbox.list({ query: { metadata: { suite: run }, state: ['paused'] } }).nextItems()
  assert.deepEqual(found.map((s) => s.sandboxId), [sbx.sandboxId])
  step('pause')

  const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 300_000 })
  assert.equal(again.sandboxId, sbx.sandboxId)
  assert.equal(again.envdAccessToken, token) // the same token across pause and resume
  assert.equal((await again.getInfo()).state, 'running')
  const same = await Sandbox.connect(sbx.sandboxId) // running: 200, the same sandbox
  assert.equal(same.envdAccessToken, token)
  step('connect')

  // A snapshot of it, a sandbox from the snapshot, the snapshot's delete.
  const snap = await again.createSnapshot({ name: `e2b-${run}` })
  assert.match(snap.snapshotId, /^snap_/)
  assert.deepEqual(snap.names, [`e2b-${run}`])
  let snaps = await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems()
  assert.deepEqual(snaps.map((s) => s.snapshotId), [snap.snapshotId])
  snaps = await Sandbox.listSnapshots({ ...other, sandboxId: sbx.sandboxId }).nextItems()
  assert.deepEqual(snaps, [])
  const child = await Sandbox.create(snap.snapshotId, { metadata: { suite: run, role: 'child' } })
  assert.notEqual(child.sandboxId, sbx.sandboxId)
  assert.equal((await child.getInfo()).state, 'running')
  await child.kill()
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, other), false)
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
  step('snapshots')

  await again.kill()
  await assert.rejects(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  assert.equal(await Sandbox.kill('sb_doesnotexist0000'), false)
  sbx = null
  step('kill')
}

try {
  await main()
  console.log(JSON.stringify({ ok: true, steps }))
} catch (e) {
  if (sbx) await Sandbox.kill(sbx.sandboxId).catch(() => {})
  console.log(JSON.stringify({ ok: false, failure: String(e && e.stack ? e.stack : e), steps }))
  process.exitCode = 1
}
