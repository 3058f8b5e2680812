// E2B's `e2b` SDK (2.51.0, unchanged) against Kiln's E2B-compatible API, configured only by
// E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (E2B_OTHER_API_KEY: another tenant's key). Drives a real sandbox
// through create, getInfo, list with a metadata filter, setTimeout, updateNetwork (with connection
// attempts whose verdicts the driver checks), files on the data plane (write,
// read, list, exists, makeDir, rename, remove; a wrong token and another tenant's refused), commands
// (run with output and exit code, a failing one, streamed callbacks, a background command's stdin,
// list, connect and kill, a PTY), watchDir (and the polling watchers), getMetrics, pause,
// connect (resume) with a file and a running process intact,
// snapshots and kill, and another tenant's calls on it. Prints one JSON line: {"ok": true,
// "steps": [...]} or {"ok": false, "failure": "...", "steps": [...]}; exits 1 on a failure.
import { ALL_TRAFFIC, CommandExitError, FileNotFoundError, InvalidArgumentError, Sandbox, SandboxError,
  SandboxNotFoundError } from 'e2b'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'

const steps = []
const step = (name, extra) => steps.push(extra === undefined ? name : { [name]: extra })
const other = { apiKey: process.env.E2B_OTHER_API_KEY }
const run = randomBytes(6).toString('hex')
let sbx

async function main() {
  assert.ok(process.env.E2B_API_URL && process.env.E2B_SANDBOX_URL && process.env.E2B_API_KEY &&
    other.apiKey)

  const tCreate = Date.now()
  sbx = await Sandbox.create({ metadata: { suite: run, role: 'first' }, timeoutMs: 240_000 })
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
  // 240 s from the create (a cold boot on a loaded host may take a good part of it)
  assert.ok(end1 >= tCreate + 235_000 && end1 <= Date.now() + 245_000, `endAt ${info.endAt}`)
  step('getInfo')

  let found = await Sandbox.list({ query: { metadata: { suite: run } } }).nextItems()
  assert.deepEqual(found.map((s) => s.sandboxId), [sbx.sandboxId])
  assert.equal(found[0].state, 'running')
  found = await Sandbox.list({ query: { metadata: { suite: run, role: 'none' } } }).nextItems()
  assert.deepEqual(found, [])
  found = await Sandbox.list({ query: { metadata: { suite: run }, state: ['paused'] } }).nextItems()
  assert.deepEqual(found, [])
  found = await Sandbox.list({ query: { metadata: { suite: run }, template: 'base' } }).nextItems()
  assert.deepEqual(found.map((s) => s.sandboxId), [sbx.sandboxId])
  found = await Sandbox.list({ query: { metadata: { suite: run }, template: 'code-interpreter-v1' } }).nextItems()
  assert.deepEqual(found, [])
  step('list')

  await sbx.setTimeout(600_000)
  info = await sbx.getInfo()
  assert.ok(info.endAt.getTime() > Date.now() + 500_000, `endAt after setTimeout ${info.endAt}`)
  step('setTimeout')

  // Egress through the SDK onto Kiln's rules (the driver checks the API took each one, and the
  // eBPF policy's verdicts on these attempts in the connection log: 7001 denied, 7002 allowed,
  // 7003 denied).
  const dial = (host, port) => sbx.commands.run(`timeout 2 bash -c 'echo >/dev/tcp/${host}/${port}' || true`)
  await sbx.updateNetwork({ allowInternetAccess: false })
  await dial('203.0.113.7', 7001)
  // rules' headers become a Kiln secret for the exact host; {} below clears it again
  await sbx.updateNetwork({ denyOut: [ALL_TRAFFIC], allowOut: ['203.0.113.7', 'pypi.org'],
    rules: { 'pypi.org': [{ transform: { headers: { 'X-Api-Key': 'e2b-rule-value' } } }] } })
  await dial('203.0.113.7', 7002)
  await dial('198.51.100.7', 7003)
  await assert.rejects(sbx.updateNetwork({ denyOut: ['10.0.0.0/8'] }),
    (e) => e instanceof SandboxError && /denyOut/.test(e.message))
  await assert.rejects(sbx.updateNetwork({ denyOut: [ALL_TRAFFIC], allowOut: ['*.pypi.org'],
    rules: { '*.pypi.org': [{ transform: { headers: { 'X-Api-Key': 'v' } } }] } }),
  (e) => e instanceof SandboxError && /wildcard/.test(e.message))
  await sbx.updateNetwork({})
  step('updateNetwork')


  // Files on the data plane (E2B_SANDBOX_URL), as E2B's default user `user`.
  let t0 = Date.now()
  const w = await sbx.files.write('hello.txt', 'hello kiln\n')
  assert.equal(w.path, '/home/user/hello.txt')
  assert.equal(w.name, 'hello.txt')
  assert.equal(await sbx.files.read('/home/user/hello.txt'), 'hello kiln\n')
  assert.equal(await sbx.files.read('hello.txt'), 'hello kiln\n')
  const ws = await sbx.files.write([{ path: '/home/user/d/a.txt', data: 'A' },
    { path: 'd/b "q".txt', data: new Uint8Array([0, 1, 2, 255]) }])
  assert.deepEqual(ws.map((e) => e.path), ['/home/user/d/a.txt', '/home/user/d/b "q".txt'])
  assert.deepEqual([...await sbx.files.read('d/b "q".txt', { format: 'bytes' })], [0, 1, 2, 255])
  assert.equal((await sbx.files.write('empty', '')).path, '/home/user/empty')
  assert.equal(await sbx.files.read('empty'), '')
  assert.equal(await sbx.files.makeDir('/home/user/d/sub'), true)
  assert.equal(await sbx.files.makeDir('/home/user/d/sub'), false) // already there
  let ls = await sbx.files.list('/home/user/d')
  assert.deepEqual(ls.map((e) => [e.name, e.type, e.path]), [['a.txt', 'file', '/home/user/d/a.txt'],
    ['b "q".txt', 'file', '/home/user/d/b "q".txt'], ['sub', 'dir', '/home/user/d/sub']])
  assert.equal(ls[0].size, 1)
  assert.equal(ls[0].owner, 'user')
  assert.equal(ls[0].permissions, '-rw-r--r--')
  assert.ok(ls[0].modifiedTime instanceof Date && ls[0].modifiedTime.getTime() > Date.now() - 3_600_000)
  assert.equal(await sbx.files.exists('/home/user/d/a.txt'), true)
  assert.equal(await sbx.files.exists('/home/user/nothing'), false)
  const moved = await sbx.files.rename('/home/user/d/a.txt', '/home/user/d/sub/c.txt')
  assert.equal(moved.path, '/home/user/d/sub/c.txt')
  ls = await sbx.files.list('/home/user/d', { depth: 2 })
  assert.deepEqual(ls.map((e) => e.path).sort(), ['/home/user/d/b "q".txt', '/home/user/d/sub',
    '/home/user/d/sub/c.txt'])
  await assert.rejects(sbx.files.list('/home/user/nothing'), FileNotFoundError)
  await assert.rejects(sbx.files.list('/home/user/hello.txt'), InvalidArgumentError)
  await assert.rejects(sbx.files.read('/home/user/nothing'), FileNotFoundError)
  await sbx.files.remove('/home/user/d')
  assert.equal(await sbx.files.exists('/home/user/d'), false)
  await assert.rejects(sbx.files.write('/root/x', 'no'), SandboxError) // `user` may not write there
  step('files', Date.now() - t0) // milliseconds, printed by the driver
  t0 = Date.now()

  // Commands: envd's process.Start streamed from Kiln's exec, as `user` in its home.
  let res = await sbx.commands.run(`python3 -c 'import os,sys; print("out", os.getuid(), os.getcwd()); ` +
    `print("err \u00e9", file=sys.stderr)'`)
  assert.equal(res.exitCode, 0)
  assert.equal(res.stdout, 'out 1000 /home/user\n')
  assert.equal(res.stderr, 'err \u00e9\n')
  res = await sbx.commands.run('echo "$KILN_E2B_V" && pwd', { envs: { KILN_E2B_V: 'v 1' }, cwd: '/tmp' })
  assert.equal(res.stdout, 'v 1\n/tmp\n')
  await assert.rejects(sbx.commands.run('python3 -c "import sys; print(1); sys.exit(3)"'),
    (e) => e instanceof CommandExitError && e.exitCode === 3 && e.stdout === '1\n' && e.error === 'exit status 3')
  await assert.rejects(sbx.commands.run('true', { cwd: '/nothing/here' }), InvalidArgumentError)
  // Output as it comes: callbacks in order, the first long before the command ends.
  const seen = []
  const t1 = Date.now()
  res = await sbx.commands.run('for i in 1 2 3; do echo o$i; echo e$i >&2; sleep 0.6; done', {
    onStdout: (d) => seen.push(['o', d, Date.now()]), onStderr: (d) => seen.push(['e', d, Date.now()]) })
  const tEnd = Date.now()
  assert.equal(res.stdout, 'o1\no2\no3\n')
  assert.equal(res.stderr, 'e1\ne2\ne3\n')
  assert.equal(seen.filter((x) => x[0] === 'o').map((x) => x[1]).join(''), res.stdout)
  assert.equal(seen.filter((x) => x[0] === 'e').map((x) => x[1]).join(''), res.stderr)
  const rounds = seen.map((x) => Number(x[1].match(/\d/)[0]))
  assert.deepEqual(rounds, [...rounds].sort(), `callbacks out of order: ${JSON.stringify(seen)}`)
  assert.ok(tEnd - seen[0][2] >= 800, `the first output came ${tEnd - seen[0][2]} ms before the end ` +
    `(after ${seen[0][2] - t1} ms): not streamed`)
  // Background processes outlive their stream: stdin, list, connect after the stream dropped, kill.
  const until = async (f, what) => {
    for (let i = 0; i < 300 && !f(); i++) await new Promise((r) => setTimeout(r, 100))
    assert.ok(f(), what)
  }
  const bg = await sbx.commands.run('read x; echo got:$x; exec sleep 600', { background: true, stdin: true })
  assert.ok(bg.pid > 1)
  await sbx.commands.sendStdin(bg.pid, 'hi\n')
  await until(() => bg.stdout.includes('got:hi\n'), `no stdin echo: ${JSON.stringify(bg.stdout)}`)
  assert.ok((await sbx.commands.list()).some((p) => p.pid === bg.pid && p.args.join(' ').includes('read x')))
  await bg.disconnect()
  let later = ''
  const re = await sbx.commands.connect(bg.pid, { onStdout: (d) => { later += d } })
  assert.equal(await sbx.commands.kill(bg.pid), true)
  await assert.rejects(re.wait(), (e) => e instanceof CommandExitError && e.error === 'signal: killed')
  assert.equal(later, '')
  assert.equal(await sbx.commands.kill(bg.pid), false)
  assert.ok(!(await sbx.commands.list()).some((p) => p.pid === bg.pid))
  // A PTY: input, output, resize, kill.
  let screen = ''
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { screen += new TextDecoder().decode(d) } })
  await sbx.pty.sendInput(term.pid, new TextEncoder().encode('echo h""i; stty size\n'))
  await until(() => screen.includes('hi') && screen.includes('24 80'), `pty: ${JSON.stringify(screen)}`)
  await sbx.pty.resize(term.pid, { cols: 100, rows: 40 })
  await sbx.pty.sendInput(term.pid, new TextEncoder().encode('stty size\n'))
  await until(() => screen.includes('40 100'), `pty resize: ${JSON.stringify(screen)}`)
  assert.equal(await sbx.pty.kill(term.pid), true)
  step('commands', Date.now() - t0)
  t0 = Date.now()

  // watchDir: envd's WatchDir stream on a watch in the guest (inotify, as `user`): a file created,
  // written, renamed and removed, in order; a file the SDK writes; a directory made below a
  // recursive watch and a file in it; nothing once the watch is stopped.
  await sbx.files.makeDir('/home/user/w')
  const events = []
  const names = () => events.map((e) => `${e[0]}:${e[1]}`)
  const wh = await sbx.files.watchDir('/home/user/w', (e) => events.push([e.type, e.name]),
    { recursive: true })
  await sbx.commands.run('cd ~/w && echo a > f && echo b >> f && mv f g && rm g')
  await until(() => names().includes('remove:g'), `watchDir: ${JSON.stringify(events)}`)
  assert.deepEqual(names().filter((n, i, a) => n !== a[i - 1]),
    ['create:f', 'write:f', 'rename:f', 'create:g', 'remove:g'])
  events.length = 0
  await sbx.files.write('w/x.txt', 'x')
  await sbx.files.makeDir('w/sub')
  await sbx.files.write('w/sub/y.txt', 'y')
  await until(() => names().includes('create:sub/y.txt'), `watchDir: ${JSON.stringify(events)}`)
  assert.deepEqual(names().filter((n) => n.startsWith('create:')), ['create:x.txt', 'create:sub',
    'create:sub/y.txt'])
  await wh.stop()
  events.length = 0
  await sbx.commands.run('touch ~/w/after && sleep 1')
  assert.deepEqual(events, [], 'a stopped watcher got events')
  await assert.rejects(sbx.files.watchDir('/home/user/nothing', () => {}), FileNotFoundError)
  step('watchDir', Date.now() - t0)
  t0 = Date.now()

  // The data plane's own checks: the token, the sandbox, the port.
  const dp = async (path, headers, body) => fetch(process.env.E2B_SANDBOX_URL + path, {
    method: body === undefined ? 'GET' : 'POST', body,
    headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49983',
      'Content-Type': 'application/json', ...headers },
  })
  let r = await dp('/files?path=/home/user/hello.txt', {})
  assert.equal(r.status, 401, 'no token')
  assert.equal((await r.json()).code, 401)
  r = await dp('/files?path=/home/user/hello.txt', { 'X-Access-Token': '0'.repeat(32) })
  assert.equal(r.status, 401, 'wrong token')
  r = await dp('/filesystem.Filesystem/Stat', { 'X-Access-Token': token.slice(0, 31) + (token[31] === '0' ? '1' : '0') },
    '{"path":"/home/user"}')
  assert.equal(r.status, 401, 'wrong token (RPC)')
  r = await dp('/files?path=/home/user/hello.txt', { 'X-Access-Token': token })
  assert.equal(r.status, 200)
  assert.equal(await r.text(), 'hello kiln\n')
  r = await dp('/files?path=/home/user/hello.txt', { 'X-Access-Token': token, 'E2b-Sandbox-Port': '49999' })
  assert.equal(r.status, 502, 'another port')
  // The polling watchers (other SDKs): created, read, removed.
  r = await dp('/filesystem.Filesystem/CreateWatcher', { 'X-Access-Token': token }, '{"path":"w"}')
  assert.equal(r.status, 200)
  const watcherId = (await r.json()).watcherId
  await sbx.files.write('w/polled.txt', 'p')
  r = await dp('/filesystem.Filesystem/GetWatcherEvents', { 'X-Access-Token': token },
    JSON.stringify({ watcherId }))
  assert.equal(r.status, 200)
  assert.deepEqual((await r.json()).events, [{ name: 'polled.txt', type: 'EVENT_TYPE_CREATE' }])
  r = await dp('/filesystem.Filesystem/RemoveWatcher', { 'X-Access-Token': token }, JSON.stringify({ watcherId }))
  assert.equal(r.status, 200)
  r = await dp('/filesystem.Filesystem/GetWatcherEvents', { 'X-Access-Token': token },
    JSON.stringify({ watcherId }))
  assert.equal(r.status, 404)
  assert.equal((await r.json()).code, 'not_found')
  r = await dp('/process.Process/StreamInput', { 'X-Access-Token': token }, '{}')
  assert.equal(r.status, 501) // client streaming: the SDK never calls it
  assert.equal((await r.json()).code, 'unimplemented')
  // Another tenant's sandbox: its token does not open this one, nor this one's token it.
  const theirs = await Sandbox.create({ ...other, metadata: { suite: run, role: 'theirs' } })
  try {
    r = await dp('/files?path=/home/user/hello.txt', { 'X-Access-Token': theirs.envdAccessToken })
    assert.equal(r.status, 401, "another sandbox's token")
    r = await dp('/files?path=/etc/hostname', { 'X-Access-Token': token, 'E2b-Sandbox-Id': theirs.sandboxId })
    assert.equal(r.status, 401, "this token on another tenant's sandbox")
    await theirs.files.write('/home/user/theirs.txt', 'theirs')
    assert.equal(await sbx.files.exists('/home/user/theirs.txt'), false)
  } finally {
    await theirs.kill()
  }
  r = await dp('/files?path=/etc/hostname', { 'X-Access-Token': theirs.envdAccessToken,
    'E2b-Sandbox-Id': theirs.sandboxId })
  assert.equal(r.status, 502, 'a killed sandbox')
  step('dataPlane', Date.now() - t0)

  // Another tenant's key sees nothing of it.
  await assert.rejects(Sandbox.getInfo(sbx.sandboxId, other), SandboxNotFoundError)
  await assert.rejects(Sandbox.setTimeout(sbx.sandboxId, 10_000, other), SandboxNotFoundError)
  await assert.rejects(Sandbox.pause(sbx.sandboxId, other), SandboxNotFoundError)
  await assert.rejects(Sandbox.connect(sbx.sandboxId, other), SandboxNotFoundError)
  assert.equal(await Sandbox.kill(sbx.sandboxId, other), false)
  assert.deepEqual(await Sandbox.list({ ...other, query: { metadata: { suite: run } } }).nextItems(), [])
  assert.equal((await sbx.getInfo()).state, 'running')
  step('otherTenant')

  // A process that runs across pause and resume: started in the background, its stream dropped.
  let before = ''
  const counter = await sbx.commands.run('i=0; while :; do i=$((i+1)); echo n$i; sleep 0.2; done',
    { background: true, onStdout: (d) => { before += d } })
  await until(() => /n3\n/.test(before), `counter: ${JSON.stringify(before)}`)
  await counter.disconnect()
  const counted = (text) => (text.match(/n\d+\n/g) || []).map((m) => Number(m.slice(1, -1)))

  // The meter's samples of it (the driver runs kiln-meter): its size, and memory used once the
  // meter has read some (the first bucket may precede its first reading).
  let samples = []
  const used = () => samples.some((x) => x.memUsed > 0)
  for (let i = 0; i < 40 && !used(); i++) {
    samples = await sbx.getMetrics()
    if (!used()) await new Promise((r) => setTimeout(r, 500))
  }
  assert.ok(used(), `no memory in the metrics: ${JSON.stringify(samples)}`)
  assert.ok(samples.every((x) => x.cpuCount >= 1 && x.memTotal > 0), JSON.stringify(samples))
  step('getMetrics', samples.length)

  assert.equal(await sbx.pause(), true)
  assert.equal((await sbx.getInfo()).state, 'paused')
  await assert.rejects(sbx.files.read('/home/user/hello.txt'), (e) => e instanceof SandboxError &&
    !(e instanceof FileNotFoundError)) // the data plane answers 502 while it is paused
  assert.equal(await sbx.pause(), false) // already paused: 409
  found = await Sandbox.list({ query: { metadata: { suite: run }, state: ['paused'] } }).nextItems()
  assert.deepEqual(found.map((s) => s.sandboxId), [sbx.sandboxId])
  step('pause')

  const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 300_000 })
  assert.equal(again.sandboxId, sbx.sandboxId)
  assert.equal(again.envdAccessToken, token) // the same token across pause and resume
  assert.equal((await again.getInfo()).state, 'running')
  assert.equal(await again.files.read('/home/user/hello.txt'), 'hello kiln\n') // kept, same token
  const same = await Sandbox.connect(sbx.sandboxId) // running: 200, the same sandbox
  assert.equal(same.envdAccessToken, token)
  // The counter is the same process after resume: listed, and counting on from where it was (a
  // process started afresh would count from 1), one step at a time.
  assert.ok((await again.commands.list()).some((p) => p.pid === counter.pid && p.args.join(' ').includes('while')),
    'the counter is not listed after resume')
  let after = ''
  const rec = await again.commands.connect(counter.pid, { onStdout: (d) => { after += d } })
  await until(() => counted(after).length >= 3, `no output after resume: ${JSON.stringify(after)}`)
  const last = Math.max(...counted(before)), nums = counted(after)
  assert.ok(nums[0] > last, `counted ${nums[0]} after resume, ${last} before pause`)
  assert.deepEqual(nums.slice(0, 3), [nums[0], nums[0] + 1, nums[0] + 2])
  assert.equal(await again.commands.kill(counter.pid), true)
  await assert.rejects(rec.wait(), (e) => e instanceof CommandExitError && e.error === 'signal: killed')
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
