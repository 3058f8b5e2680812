/*
 * exec.c - kiln-agent's EXEC: runs a command with pipes, streams its output, reports its exit.
 *
 * EXEC payload: u32 timeout_ms (0: none), str cwd (empty: the user's home), u32 argc
 * (1..AGENT_MAX_ARGS), argc x str, u32 envc, envc x str "NAME=value", bytes stdin, and optionally
 * str user (absent: root). With AGENT_EXEC_F_SHELL argv holds one string of shell code for
 * /bin/sh -c.
 *
 * The command runs as the user (user.c): its uid, gid and groups, HOME, USER, LOGNAME and SHELL of
 * its account unless the env says otherwise, and its home as the working directory when no cwd is
 * given (/ when the home does not exist). An unknown user is an INVALID error and runs nothing.
 *
 * Each command leads its own session and process group, so a timeout or a CANCEL kills the whole
 * group. Output goes out as STDOUT/STDERR frames of at most AGENT_CHUNK bytes, read only while the
 * session's output queue has room (a slow host slows the command through its pipe). EXIT goes out
 * once the command was reaped and both pipes ended, or AGENT_DRAIN_GRACE_MS after the reap when a
 * background process still holds them.
 *
 * Detached processes (version 3, AGENT_EXEC_F_DETACHED): the EXEC is answered at once with
 * OK(u64 pid) and the process lives on its own, up to AGENT_MAX_PROCS of them (an ended one is
 * forgotten, oldest first, when a new one needs its place; none ended: BUSY). Their output goes to
 * a ring of AGENT_PROC_RING bytes (records: u8 frame type, u16 length, bytes), the oldest records
 * dropped and counted when nobody is attached. One PROC_ATTACH at a time streams the ring from its
 * cursor (the buffered tail or only what comes next) and then the EXIT; while one is attached the
 * pipes are read only as far as the ring has room past its cursor, so a slow host slows the
 * process instead of losing its output. A later attach takes over (the earlier one gets ERROR
 * TAKEN_OVER); a CANCEL of the attach, or the host going away, only detaches. Stdin stays open
 * (PROC_STDIN queues at most AGENT_PROC_STDIN_PENDING bytes; eof closes it, or sends ^D to a
 * PTY). With AGENT_EXEC_F_PTY the process runs on a new pseudo-terminal (its controlling
 * terminal): the master carries stdin and the output, which comes as STDOUT.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include "agent.h"

#define BASE_PATH AGENT_BASE_PATH

/* A detached process's output: records in a byte ring addressed by absolute positions. */
struct ring {
	uint8_t *buf;		/* AGENT_PROC_RING bytes */
	uint64_t head, tail;	/* positions of the oldest record and of the end */
	uint64_t dropped;	/* bytes of output dropped from the head so far */
};

#define RING_REC 3		/* a record's header: u8 type, u16 length */
#define RING_READ 16384u	/* bytes read from a pipe into one record, at most */

struct exec {
	bool used;
	uint32_t id;		/* the EXEC's request id; 0 for a detached process */
	pid_t pid;		/* also the process group id */
	int in_fd, out_fd, err_fd;	/* our ends; -1 when closed */
	uint8_t *stdin_buf;	/* bytes still to write, malloc'd */
	size_t stdin_len, stdin_off;
	uint64_t start_ms, deadline_ms;	/* deadline 0: none */
	bool exited, timed_out;
	int status;		/* from waitpid */
	uint64_t exit_ms;
	/* detached processes */
	bool detached;
	bool pty;		/* runs on a PTY */
	bool done;		/* exited and its output all in the ring */
	bool stdin_eof;		/* close stdin once stdin_buf is written */
	int pty_fd;		/* the PTY's master (in_fd and out_fd are duplicates), or -1 */
	uint32_t attach_id;	/* the PROC_ATTACH streaming it, or 0 */
	uint64_t cursor;	/* the attach's position in the ring */
	struct ring ring;
	char *tag, *cwd;
	char **argv, **env_names;	/* NULL-terminated copies for PROC_LIST */
};

static struct exec execs[AGENT_MAX_EXECS];

/* Frees a NULL-terminated vector of malloc'd strings. */
static void strv_free(char **v);

static void close_fd(int *fd)
{
	if (*fd >= 0)
		close(*fd);
	*fd = -1;
}

static void exec_release(struct exec *e)
{
	close_fd(&e->in_fd);
	close_fd(&e->out_fd);
	close_fd(&e->err_fd);
	close_fd(&e->pty_fd);
	free(e->stdin_buf);
	free(e->ring.buf);
	free(e->tag);
	free(e->cwd);
	strv_free(e->argv);
	strv_free(e->env_names);
	memset(e, 0, sizeof(*e));
	e->in_fd = e->out_fd = e->err_fd = e->pty_fd = -1;
}

static struct exec *exec_find(uint32_t id)
{
	for (int i = 0; i < AGENT_MAX_EXECS; i++)
		if (execs[i].used && !execs[i].detached && execs[i].id == id)
			return &execs[i];
	return NULL;
}

/* The detached process `pid`, or NULL. */
static struct exec *proc_find(uint32_t pid)
{
	for (int i = 0; i < AGENT_MAX_EXECS; i++)
		if (execs[i].used && execs[i].detached && (uint32_t)execs[i].pid == pid)
			return &execs[i];
	return NULL;
}

bool exec_active(uint32_t id)
{
	if (exec_find(id))
		return true;
	for (int i = 0; i < AGENT_MAX_EXECS; i++)
		if (execs[i].used && execs[i].detached && execs[i].attach_id == id)
			return true;
	return false;
}

/* --- the output ring --- */

static void ring_copy_in(struct ring *r, uint64_t pos, const void *p, size_t n)
{
	size_t off = (size_t)(pos % AGENT_PROC_RING), first = AGENT_PROC_RING - off;

	if (first > n)
		first = n;
	memcpy(r->buf + off, p, first);
	memcpy(r->buf, (const uint8_t *)p + first, n - first);
}

static void ring_copy_out(const struct ring *r, uint64_t pos, void *p, size_t n)
{
	size_t off = (size_t)(pos % AGENT_PROC_RING), first = AGENT_PROC_RING - off;

	if (first > n)
		first = n;
	memcpy(p, r->buf + off, first);
	memcpy((uint8_t *)p + first, r->buf, n - first);
}

/* Reads the record at `pos`: its type, and its length in *n; returns the next record's position. */
static uint64_t ring_rec(const struct ring *r, uint64_t pos, uint8_t *type, size_t *n)
{
	uint8_t h[RING_REC];

	ring_copy_out(r, pos, h, RING_REC);
	*type = h[0];
	*n = ((size_t)h[1] << 8) | h[2];
	return pos + RING_REC + *n;
}

/* Appends one record of n (<= RING_READ) bytes, dropping the oldest records to make room. */
static void ring_put(struct ring *r, uint8_t type, const uint8_t *p, size_t n)
{
	uint8_t h[RING_REC] = { type, (uint8_t)(n >> 8), (uint8_t)n };

	while (r->tail - r->head + RING_REC + n > AGENT_PROC_RING) {
		uint8_t t;
		size_t len;

		r->head = ring_rec(r, r->head, &t, &len);
		r->dropped += len;
	}
	ring_copy_in(r, r->tail, h, RING_REC);
	ring_copy_in(r, r->tail + RING_REC, p, n);
	r->tail += RING_REC + n;
}

/* Bytes of output a detached process's pipes may add now: the ring's room past the attach. */
static size_t proc_room(const struct exec *e)
{
	uint64_t used = e->attach_id ? e->ring.tail - e->cursor : 0;
	size_t room = used >= AGENT_PROC_RING - RING_REC ? 0 : AGENT_PROC_RING - RING_REC - (size_t)used;

	return room > RING_READ ? RING_READ : room;
}

static void strv_free(char **v)
{
	if (!v)
		return;
	for (size_t i = 0; v[i]; i++)
		free(v[i]);
	free(v);
}

/* Index of the entry naming the same variable as `kv` in `env[0..n)`, or -1. */
static int env_index(char **env, size_t n, const char *kv)
{
	size_t klen = strcspn(kv, "=");

	for (size_t i = 0; i < n; i++)
		if (strncmp(env[i], kv, klen) == 0 && env[i][klen] == '=')
			return (int)i;
	return -1;
}

/* Adds (or replaces) one entry; takes ownership of `kv`. */
static void env_put(char **env, size_t *n, char *kv)
{
	int i = env_index(env, *n, kv);

	if (i >= 0) {
		free(env[i]);
		env[i] = kv;
	} else {
		env[(*n)++] = kv;
	}
}

/*
 * The child's side after fork: wires the pipes, resets signals, changes directory and execs.
 * Never returns. A program that cannot be found exits 127 with a shell's message, one that cannot
 * run exits 126.
 */
static void child_run(char **argv, char **envp, const char *cwd, const struct agent_cred *cred,
		      int in, int out, int err, int pty)
{
	sigset_t none;
	const char *path = NULL;

	setsid();
	if (pty >= 0) {
		/* the terminal's slave becomes the session's controlling terminal */
		in = out = err = pty;
		if (ioctl(pty, TIOCSCTTY, 0) < 0)
			_exit(126);
	}
	dup2(in, 0);
	dup2(out, 1);
	dup2(err, 2);
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	signal(SIGPIPE, SIG_DFL);
	int urc = user_become(cred);

	if (urc < 0) {
		dprintf(2, "kiln-agent: cannot become the user: %s\n", strerror(-urc));
		_exit(126);
	}
	if (chdir(cwd) < 0) {
		dprintf(2, "kiln-agent: cd: %s: %s\n", cwd, strerror(errno));
		_exit(126);
	}
	/* execvpe searches the PATH of this process, so take the one the command gets. */
	for (size_t i = 0; envp[i]; i++)
		if (strncmp(envp[i], "PATH=", 5) == 0)
			path = envp[i] + 5;
	setenv("PATH", path ? path : BASE_PATH, 1);
	execvpe(argv[0], argv, envp);
	int e = errno;

	if (e == ENOENT && !strchr(argv[0], '/'))
		dprintf(2, "%s: command not found\n", argv[0]);
	else
		dprintf(2, "%s: %s\n", argv[0], strerror(e));
	_exit(e == ENOENT || e == ENOTDIR ? 127 : 126);
}

/*
 * Makes room for one more detached process: forgets the one that ended first (and is not being
 * attached) when AGENT_MAX_PROCS are kept. False when all of them run.
 */
static bool proc_make_room(void)
{
	struct exec *old = NULL;
	int n = 0;

	for (int i = 0; i < AGENT_MAX_EXECS; i++) {
		struct exec *e = &execs[i];

		if (!e->used || !e->detached)
			continue;
		n++;
		if (e->done && !e->attach_id && (!old || e->exit_ms < old->exit_ms))
			old = e;
	}
	if (n < AGENT_MAX_PROCS)
		return true;
	if (!old)
		return false;
	exec_release(old);
	return true;
}

void exec_start(struct session *s, uint32_t id, uint16_t flags, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	struct exec *e = NULL;
	char **argv = NULL, **envp = NULL, *cwd = NULL;
	int in[2] = { -1, -1 }, out[2] = { -1, -1 }, err[2] = { -1, -1 };
	size_t envn = 0;
	uint32_t argc, envc, i;
	struct stat st;
	struct agent_user user;
	bool detached = flags & AGENT_EXEC_F_DETACHED, pty = flags & AGENT_EXEC_F_PTY;
	char **env_names = NULL, *tag = NULL, ptyname[64];
	int slave = -1;	/* held from before the fork, so the master never reads EIO before the
			   child has the terminal */
	uint8_t *ring = NULL;
	int master = -1;

	if (flags & ~(AGENT_EXEC_F_SHELL | AGENT_EXEC_F_DETACHED | AGENT_EXEC_F_PTY) ||
	    (pty && !detached)) {
		session_error(s, id, AGENT_S_INVALID, 0, "unknown exec flags");
		return;
	}
	if (detached && !proc_make_room()) {
		session_error(s, id, AGENT_S_BUSY, 0, "too many processes (%d)", AGENT_MAX_PROCS);
		return;
	}
	for (i = 0; i < AGENT_MAX_EXECS && !e; i++)
		if (!execs[i].used)
			e = &execs[i];
	if (!e) {
		session_error(s, id, AGENT_S_BUSY, 0, "too many execs at once (%d)", AGENT_MAX_EXECS);
		return;
	}
	agent_rd_init(&r, p, len);
	uint32_t timeout_ms = agent_rd_u32(&r);
	struct agent_bytes bcwd = agent_rd_text(&r, AGENT_MAX_PATH);

	argc = agent_rd_u32(&r);
	if (r.bad || argc == 0 || argc > AGENT_MAX_ARGS ||
	    ((flags & AGENT_EXEC_F_SHELL) && argc != 1)) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed exec argv");
		return;
	}
	argv = calloc(argc + 3, sizeof(*argv));
	if (!argv)
		goto nomem;
	size_t base = 0;

	if (flags & AGENT_EXEC_F_SHELL) {
		argv[0] = strdup("/bin/sh");
		argv[1] = strdup("-c");
		if (!argv[0] || !argv[1])
			goto nomem;
		base = 2;
	}
	for (i = 0; i < argc; i++) {
		struct agent_bytes a = agent_rd_text(&r, AGENT_MAX_PAYLOAD);

		if (r.bad)
			break;
		argv[base + i] = strndup(a.p ? (const char *)a.p : "", a.len);
		if (!argv[base + i])
			goto nomem;
	}
	envc = agent_rd_u32(&r);
	if (r.bad || envc > AGENT_MAX_ENV || argv[0][0] == '\0') {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed exec argv or env");
		goto cleanup;
	}
	char *const *defaults = session_env_defaults(s);
	size_t ndef = 0;

	while (defaults[ndef])
		ndef++;
	envp = calloc(envc + ndef + 8, sizeof(*envp));
	env_names = calloc(envc + 1, sizeof(*env_names));
	if (!envp || !env_names)
		goto nomem;
	const char *base_env[] = { "PATH=" BASE_PATH, "LANG=C.UTF-8" };

	for (i = 0; i < sizeof(base_env) / sizeof(base_env[0]); i++) {
		char *kv = strdup(base_env[i]);

		if (!kv)
			goto nomem;
		env_put(envp, &envn, kv);
	}
	for (i = 0; i < ndef; i++) {
		char *kv = strdup(defaults[i]);

		if (!kv)
			goto nomem;
		env_put(envp, &envn, kv);
	}
	for (i = 0; i < envc; i++) {
		struct agent_bytes kv = agent_rd_text(&r, AGENT_MAX_PAYLOAD);

		if (r.bad || !agent_env_ok((const char *)kv.p, kv.len)) {
			session_error(s, id, AGENT_S_INVALID, 0, "malformed exec env entry");
			goto cleanup;
		}
		char *dup = strndup((const char *)kv.p, kv.len);

		if (!dup || !(env_names[i] = strndup(dup, strcspn(dup, "=")))) {
			free(dup);
			goto nomem;
		}
		env_put(envp, &envn, dup);
	}
	struct agent_bytes bin = agent_rd_bytes(&r, AGENT_MAX_PAYLOAD), buser, btag = { NULL, 0 };
	uint16_t rows = 0, cols = 0;
	bool ok;

	if (detached) {
		/* the version 3 trailer: every field present */
		buser = agent_rd_text(&r, AGENT_MAX_USER);
		btag = agent_rd_text(&r, AGENT_MAX_TAG);
		rows = agent_rd_u16(&r);
		cols = agent_rd_u16(&r);
		ok = agent_rd_done(&r) && (!buser.len || agent_user_ok((const char *)buser.p, buser.len)) &&
		     (pty ? rows >= 1 && rows <= AGENT_MAX_PTY_DIM && cols >= 1 && cols <= AGENT_MAX_PTY_DIM
			  : rows == 0 && cols == 0);
	} else {
		ok = agent_rd_user(&r, &buser) && agent_rd_done(&r);
	}
	if (!ok) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed exec request");
		goto cleanup;
	}
	if (pty && env_index(envp, envn, "TERM=x") < 0) {
		char *kv = strdup("TERM=xterm-256color");

		if (!kv)
			goto nomem;
		envp[envn++] = kv;
	}
	int urc = user_lookup(&buser, &user);

	if (urc < 0) {
		session_error(s, id, urc == -ENOENT ? AGENT_S_INVALID : AGENT_S_IO, -urc,
			      urc == -ENOENT ? "no user \"%s\" in the sandbox" : "cannot look up user \"%s\"",
			      user.name);
		goto cleanup;
	}
	/* the account's variables, unless the defaults or the request set them */
	const char *names[] = { "HOME", "USER", "LOGNAME", "SHELL" };
	const char *values[] = { user.home, user.name, user.name, user.shell };

	for (i = 0; i < 4; i++) {
		char *kv;

		if (asprintf(&kv, "%s=%s", names[i], values[i]) < 0)
			goto nomem;
		if (env_index(envp, envn, kv) >= 0)
			free(kv);
		else
			envp[envn++] = kv;
	}
	if (bcwd.len)
		cwd = strndup((const char *)bcwd.p, bcwd.len);
	else
		cwd = strdup(stat(user.home, &st) == 0 && S_ISDIR(st.st_mode) ? user.home : "/");
	if (!cwd)
		goto nomem;
	if (!agent_path_ok(cwd, strlen(cwd))) {
		session_error(s, id, AGENT_S_INVALID, 0, "cwd must be an absolute path");
		goto cleanup;
	}
	if (stat(cwd, &st) < 0 || !S_ISDIR(st.st_mode)) {
		session_error(s, id, AGENT_S_NOT_FOUND, errno, "cwd is not a directory");
		goto cleanup;
	}
	if (detached) {
		ring = malloc(AGENT_PROC_RING);
		tag = strndup(btag.p ? (const char *)btag.p : "", btag.len);
		if (!ring || !tag)
			goto nomem;
	}
	if (bin.len) {
		e->stdin_buf = malloc(bin.len);
		if (!e->stdin_buf)
			goto nomem;
		memcpy(e->stdin_buf, bin.p, bin.len);
		e->stdin_len = bin.len;
	}
	if (pty) {
		struct winsize ws = { .ws_row = rows, .ws_col = cols };

		master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
		if (master < 0 || grantpt(master) < 0 || unlockpt(master) < 0 ||
		    ptsname_r(master, ptyname, sizeof(ptyname)) != 0 ||
		    ioctl(master, TIOCSWINSZ, &ws) < 0 ||
		    (slave = open(ptyname, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0)
			goto syserr;
		in[1] = fcntl(master, F_DUPFD_CLOEXEC, 0);
		out[0] = fcntl(master, F_DUPFD_CLOEXEC, 0);
		if (in[1] < 0 || out[0] < 0)
			goto syserr;
	} else {
		if (bin.len || detached) {
			if (pipe2(in, O_CLOEXEC) < 0)
				goto syserr;
		} else {
			in[0] = open("/dev/null", O_RDONLY | O_CLOEXEC);
			if (in[0] < 0)
				goto syserr;
		}
		if (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0)
			goto syserr;
	}

	pid_t pid = fork();

	if (pid < 0)
		goto syserr;
	if (pid == 0)
		child_run(argv, envp, cwd, &user.cred, in[0], out[1], err[1], slave);
	/*
	 * Also our group id: make sure it exists before a kill can target it. Not for a PTY: a group
	 * leader cannot start the session its terminal needs (the child's setsid makes the group).
	 */
	if (!pty)
		setpgid(pid, pid);
	e->used = true;
	e->id = detached ? 0 : id;
	e->pid = pid;
	e->in_fd = in[1];
	e->out_fd = out[0];
	e->err_fd = err[0];
	in[1] = out[0] = err[0] = -1;
	e->pty_fd = master;
	master = -1;
	if (detached) {
		uint8_t ok8[8];
		struct agent_wr w;

		e->detached = true;
		e->pty = pty;
		e->ring.buf = ring;
		e->tag = tag;
		e->cwd = cwd;
		e->argv = argv;
		e->env_names = env_names;
		ring = NULL;
		tag = cwd = NULL;
		argv = env_names = NULL;
		agent_wr_init(&w, ok8, sizeof(ok8));
		agent_wr_u64(&w, (uint64_t)pid);
		session_send(s, AGENT_T_OK, 0, id, ok8, w.len);
	}
	e->start_ms = now_ms();
	e->deadline_ms = timeout_ms ? e->start_ms + timeout_ms : 0;
	if (e->in_fd >= 0)
		fcntl(e->in_fd, F_SETFL, O_NONBLOCK);
	fcntl(e->out_fd, F_SETFL, O_NONBLOCK);
	fcntl(e->err_fd, F_SETFL, O_NONBLOCK);
	e = NULL;	/* the slot is live */
	goto cleanup;

nomem:
	session_error(s, id, AGENT_S_INTERNAL, ENOMEM, "out of memory");
	goto cleanup;
syserr:
	session_error(s, id, AGENT_S_IO, errno, "cannot start: %s", strerror(errno));
cleanup:
	if (e && !e->used) {
		free(e->stdin_buf);
		e->stdin_buf = NULL;
		e->stdin_len = 0;
	}
	for (i = 0; i < 2; i++) {
		close_fd(&in[i]);
		close_fd(&out[i]);
		close_fd(&err[i]);
	}
	if (master >= 0)
		close(master);
	if (slave >= 0)
		close(slave);
	strv_free(argv);
	strv_free(envp);
	strv_free(env_names);
	free(cwd);
	free(tag);
	free(ring);
}

void exec_cancel(uint32_t id)
{
	struct exec *e = exec_find(id);

	if (e && !e->exited)
		kill(-e->pid, SIGKILL);
	/* a CANCEL of an attach only detaches: the process goes on */
	for (int i = 0; i < AGENT_MAX_EXECS; i++)
		if (execs[i].used && execs[i].detached && execs[i].attach_id == id)
			execs[i].attach_id = 0;
}

int exec_poll_fill(struct session *s, struct pollfd *pfd, int max)
{
	int n = 0;
	bool room = session_has_room(s);

	for (int i = 0; i < AGENT_MAX_EXECS; i++) {
		struct exec *e = &execs[i];

		if (!e->used)
			continue;
		if (e->detached) {
			bool more = proc_room(e) > 0;

			if (e->in_fd >= 0 && e->stdin_off < e->stdin_len && n < max)
				pfd[n++] = (struct pollfd){ e->in_fd, POLLOUT, 0 };
			if (e->out_fd >= 0 && more && n < max)
				pfd[n++] = (struct pollfd){ e->out_fd, POLLIN, 0 };
			if (e->err_fd >= 0 && more && n < max)
				pfd[n++] = (struct pollfd){ e->err_fd, POLLIN, 0 };
			continue;
		}
		if (e->in_fd >= 0 && n < max)
			pfd[n++] = (struct pollfd){ e->in_fd, POLLOUT, 0 };
		if (e->out_fd >= 0 && room && n < max)
			pfd[n++] = (struct pollfd){ e->out_fd, POLLIN, 0 };
		if (e->err_fd >= 0 && room && n < max)
			pfd[n++] = (struct pollfd){ e->err_fd, POLLIN, 0 };
	}
	return n;
}

/*
 * Reads one chunk from a child's pipe and queues it; closes the pipe at its end. Returns true
 * when it queued bytes.
 */
static bool pump_output(struct session *s, struct exec *e, int *fd, uint8_t type)
{
	static uint8_t buf[AGENT_CHUNK];
	ssize_t n = read(*fd, buf, sizeof(buf));

	if (n > 0) {
		session_send(s, type, 0, e->id, buf, (size_t)n);
		return true;
	}
	if (n == 0 || (errno != EAGAIN && errno != EINTR))
		close_fd(fd);
	return false;
}

/*
 * Reads one chunk of a detached process's pipe into its ring, as far as the ring has room past
 * the attach; closes the pipe at its end. Returns true when it read bytes.
 */
static bool pump_ring(struct exec *e, int *fd, uint8_t type)
{
	static uint8_t buf[RING_READ];
	size_t room = proc_room(e);
	ssize_t n;

	if (!room)
		return false;
	n = read(*fd, buf, room);
	if (n > 0) {
		ring_put(&e->ring, type, buf, (size_t)n);
		return true;
	}
	if (n == 0 || (errno != EAGAIN && errno != EINTR))
		close_fd(fd);	/* the end, or EIO: a PTY whose processes are all gone */
	return false;
}

static void pump_stdin(struct exec *e)
{
	ssize_t n = write(e->in_fd, e->stdin_buf + e->stdin_off, e->stdin_len - e->stdin_off);
	bool failed = n < 0 && errno != EAGAIN && errno != EINTR;

	if (n > 0)
		e->stdin_off += (size_t)n;
	if (failed || e->stdin_off == e->stdin_len) {
		free(e->stdin_buf);
		e->stdin_buf = NULL;
		e->stdin_len = e->stdin_off = 0;
		/* done (a detached process's stdin stays open for more), or the command closed it */
		if (failed || !e->detached || e->stdin_eof)
			close_fd(&e->in_fd);
	}
}

void exec_poll_done(struct session *s, struct pollfd *pfd, int n)
{
	for (int k = 0; k < n; k++) {
		if (!pfd[k].revents)
			continue;
		for (int i = 0; i < AGENT_MAX_EXECS; i++) {
			struct exec *e = &execs[i];

			if (!e->used)
				continue;
			if (pfd[k].fd == e->in_fd)
				pump_stdin(e);
			else if (e->detached && pfd[k].fd == e->out_fd)
				pump_ring(e, &e->out_fd, AGENT_T_STDOUT);
			else if (e->detached && pfd[k].fd == e->err_fd)
				pump_ring(e, &e->err_fd, AGENT_T_STDERR);
			else if (pfd[k].fd == e->out_fd && session_has_room(s))
				pump_output(s, e, &e->out_fd, AGENT_T_STDOUT);
			else if (pfd[k].fd == e->err_fd && session_has_room(s))
				pump_output(s, e, &e->err_fd, AGENT_T_STDERR);
			else
				continue;
			break;
		}
	}
}

static void send_exit(struct session *s, struct exec *e, uint32_t id)
{
	uint8_t buf[32];
	struct agent_wr w;
	int code = 0;
	uint32_t sig = 0;

	if (WIFEXITED(e->status)) {
		code = WEXITSTATUS(e->status);
	} else if (WIFSIGNALED(e->status)) {
		sig = (uint32_t)WTERMSIG(e->status);
		code = 128 + (int)sig;
	}
	agent_wr_init(&w, buf, sizeof(buf));
	agent_wr_u32(&w, (uint32_t)code);
	agent_wr_u32(&w, sig);
	agent_wr_u8(&w, e->timed_out ? 1 : 0);
	agent_wr_u64(&w, e->exit_ms - e->start_ms);
	session_send(s, AGENT_T_EXIT, 0, id, buf, w.len);
}

/*
 * A detached process's turn: its timeout, the end of its output once it exited, and what its
 * attach may be sent (with `s`): the ring from the cursor, then the EXIT.
 */
static void proc_tick(struct session *s, struct exec *e, uint64_t now)
{
	if (!e->exited && e->deadline_ms && now >= e->deadline_ms && !e->timed_out) {
		e->timed_out = true;
		kill(-e->pid, SIGKILL);
	}
	if (e->exited && !e->done) {
		bool ended = e->out_fd < 0 && e->err_fd < 0;

		if (!ended && now >= e->exit_ms + AGENT_DRAIN_GRACE_MS) {
			/* a background process holds the pipes: take what is buffered and stop */
			while (e->out_fd >= 0 && pump_ring(e, &e->out_fd, AGENT_T_STDOUT))
				;
			while (e->err_fd >= 0 && pump_ring(e, &e->err_fd, AGENT_T_STDERR))
				;
			close_fd(&e->out_fd);
			close_fd(&e->err_fd);
			ended = true;
		}
		if (ended) {
			e->done = true;
			close_fd(&e->in_fd);
			close_fd(&e->pty_fd);
			free(e->stdin_buf);
			e->stdin_buf = NULL;
			e->stdin_len = e->stdin_off = 0;
		}
	}
	if (!s || !e->attach_id)
		return;
	while (e->cursor < e->ring.tail && session_has_room(s)) {
		static uint8_t data[RING_READ];
		uint8_t type;
		size_t n;
		uint64_t next = ring_rec(&e->ring, e->cursor, &type, &n);

		ring_copy_out(&e->ring, e->cursor + RING_REC, data, n);
		session_send(s, type, 0, e->attach_id, data, n);
		e->cursor = next;
	}
	if (e->done && e->cursor == e->ring.tail) {
		send_exit(s, e, e->attach_id);
		e->attach_id = 0;
	}
}

void exec_tick(struct session *s)
{
	uint64_t now = now_ms();
	int status;
	pid_t pid;

	/* Reap every child: ours, and any the host stopped caring about after a reset. */
	while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
		for (int i = 0; i < AGENT_MAX_EXECS; i++) {
			struct exec *e = &execs[i];

			if (e->used && e->pid == pid && !e->exited) {
				e->exited = true;
				e->status = status;
				e->exit_ms = now;
			}
		}
	}
	for (int i = 0; i < AGENT_MAX_EXECS; i++) {
		struct exec *e = &execs[i];

		if (!e->used)
			continue;
		if (e->detached) {
			proc_tick(s, e, now);
			continue;
		}
		if (!e->exited && e->deadline_ms && now >= e->deadline_ms && !e->timed_out) {
			e->timed_out = true;
			kill(-e->pid, SIGKILL);
		}
		if (!e->exited || !s)
			continue;
		bool ended = e->out_fd < 0 && e->err_fd < 0;

		if (!ended && now < e->exit_ms + AGENT_DRAIN_GRACE_MS)
			continue;	/* poll drains the pipes meanwhile */
		if (!ended) {
			/* A background process holds the pipes: take what is buffered, then report. */
			if (!session_has_room(s))
				continue;
			while (e->out_fd >= 0 && session_has_room(s) &&
			       pump_output(s, e, &e->out_fd, AGENT_T_STDOUT))
				;
			while (e->err_fd >= 0 && session_has_room(s) &&
			       pump_output(s, e, &e->err_fd, AGENT_T_STDERR))
				;
		}
		send_exit(s, e, e->id);
		exec_release(e);
	}
}

int exec_next_timeout(void)
{
	uint64_t now = now_ms(), next = UINT64_MAX;

	for (int i = 0; i < AGENT_MAX_EXECS; i++) {
		struct exec *e = &execs[i];
		uint64_t t;

		if (!e->used || (e->detached && e->done))
			continue;
		if (e->exited)	/* past the grace it waits for room in the output queue */
			t = e->exit_ms + AGENT_DRAIN_GRACE_MS > now ? e->exit_ms + AGENT_DRAIN_GRACE_MS
								    : now + 10;
		else if (e->deadline_ms && !e->timed_out)
			t = e->deadline_ms;
		else
			continue;
		if (t < next)
			next = t;
	}
	if (next == UINT64_MAX)
		return -1;
	return next <= now ? 0 : (int)(next - now > 60000 ? 60000 : next - now);
}

void exec_reset(void)
{
	for (int i = 0; i < AGENT_MAX_EXECS; i++) {
		struct exec *e = &execs[i];

		if (!e->used)
			continue;
		if (e->detached) {
			e->attach_id = 0;	/* it goes on; a new host may attach again */
			continue;
		}
		if (!e->exited)
			kill(-e->pid, SIGKILL);
		exec_release(e);
	}
}

void exec_shutdown(void)
{
	for (int i = 0; i < AGENT_MAX_EXECS; i++) {
		struct exec *e = &execs[i];

		if (!e->used)
			continue;
		if (!e->exited)
			kill(-e->pid, SIGKILL);
		exec_release(e);
	}
}

/* --- PROC_* requests --- */

static void send_ok(struct session *s, uint32_t id, uint64_t v)
{
	uint8_t b[8];
	struct agent_wr w;

	agent_wr_init(&w, b, sizeof(b));
	agent_wr_u64(&w, v);
	session_send(s, AGENT_T_OK, 0, id, b, w.len);
}

/* The detached process `pid`; ERROR NOT_FOUND and NULL if none. */
static struct exec *proc_of(struct session *s, uint32_t id, uint32_t pid)
{
	struct exec *e = proc_find(pid);

	if (!e)
		session_error(s, id, AGENT_S_NOT_FOUND, ESRCH, "no process %u", pid);
	return e;
}

void proc_attach(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	struct exec *e;
	uint8_t replay;

	agent_rd_init(&r, p, len);
	uint32_t pid = agent_rd_u32(&r);

	replay = agent_rd_u8(&r);
	if (!agent_rd_done(&r) || replay > 1) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed attach");
		return;
	}
	if (!(e = proc_of(s, id, pid)))
		return;
	if (e->attach_id)
		session_error(s, e->attach_id, AGENT_S_TAKEN_OVER, 0,
			      "another attach took process %d over", (int)e->pid);
	e->attach_id = id;
	e->cursor = replay ? e->ring.head : e->ring.tail;
	send_ok(s, id, e->ring.dropped);
}

/* Writes the strings of `v` that fit in `budget` bytes (each u32 length + bytes), counted first. */
static void wr_strv_budget(struct agent_wr *w, char **v, size_t budget)
{
	uint32_t n = 0;
	size_t used = 0;

	while (v && v[n] && used + 4 + strlen(v[n]) <= budget) {
		used += 4 + strlen(v[n]);
		n++;
	}
	agent_wr_u32(w, n);
	for (uint32_t i = 0; i < n; i++)
		agent_wr_str(w, v[i]);
}

void proc_list(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	static uint8_t buf[AGENT_PROC_ENTRY_MAX];
	uint64_t count = 0;

	if (len) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed list");
		return;
	}
	for (int i = 0; i < AGENT_MAX_EXECS; i++) {
		struct exec *e = &execs[i];
		struct agent_wr w;
		int code = -1;

		if (!e->used || !e->detached)
			continue;
		if (e->exited)
			code = WIFEXITED(e->status) ? WEXITSTATUS(e->status)
			       : WIFSIGNALED(e->status) ? 128 + WTERMSIG(e->status) : 0;
		agent_wr_init(&w, buf, sizeof(buf));
		agent_wr_u32(&w, (uint32_t)e->pid);
		agent_wr_u8(&w, e->exited ? 0 : 1);
		agent_wr_u8(&w, e->pty ? 1 : 0);
		agent_wr_u32(&w, (uint32_t)code);
		agent_wr_str(&w, e->tag);
		agent_wr_str(&w, e->cwd);
		/* what is left of the entry, argv first; the 4 bytes of envc kept */
		wr_strv_budget(&w, e->argv, sizeof(buf) - w.len - 8 - 4);
		wr_strv_budget(&w, e->env_names, sizeof(buf) - w.len - 4);
		if (w.overflow)
			continue;	/* cannot happen: the budgets hold */
		session_send(s, AGENT_T_PROC_ENTRY, 0, id, buf, w.len);
		count++;
	}
	send_ok(s, id, count);
}

void proc_signal(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	struct exec *e;
	uint32_t sig;

	agent_rd_init(&r, p, len);
	uint32_t pid = agent_rd_u32(&r);

	sig = agent_rd_u32(&r);
	if (!agent_rd_done(&r) || sig < 1 || sig > 64) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed signal request (signal 1..64)");
		return;
	}
	if (!(e = proc_of(s, id, pid)))
		return;
	if (e->exited) {
		session_error(s, id, AGENT_S_NOT_FOUND, ESRCH, "process %d has ended", (int)e->pid);
		return;
	}
	/* a PTY's child may not have made its group yet: then the process itself */
	if (kill(-e->pid, (int)sig) < 0 && (errno != ESRCH || kill(e->pid, (int)sig) < 0)) {
		session_error(s, id, AGENT_S_IO, errno, "cannot signal: %s", strerror(errno));
		return;
	}
	send_ok(s, id, 0);
}

void proc_stdin(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	struct exec *e;
	uint8_t eof;
	struct agent_bytes data;

	agent_rd_init(&r, p, len);
	uint32_t pid = agent_rd_u32(&r);

	eof = agent_rd_u8(&r);
	data = agent_rd_bytes(&r, AGENT_PROC_STDIN_MAX);
	if (!agent_rd_done(&r) || eof > 1) {
		session_error(s, id, r.bad ? AGENT_S_TOO_LARGE : AGENT_S_INVALID, 0,
			      "malformed stdin request (at most %u bytes)", AGENT_PROC_STDIN_MAX);
		return;
	}
	if (!(e = proc_of(s, id, pid)))
		return;
	if (e->exited || e->in_fd < 0 || e->stdin_eof) {
		session_error(s, id, AGENT_S_INVALID, EPIPE, "the stdin of process %d is closed",
			      (int)e->pid);
		return;
	}
	bool ctrl_d = eof && e->pty_fd >= 0;	/* a terminal's end of input */
	size_t pending = e->stdin_len - e->stdin_off, add = data.len + (ctrl_d ? 1 : 0);

	if (pending + add > AGENT_PROC_STDIN_PENDING) {
		session_error(s, id, AGENT_S_BUSY, 0, "process %d has %zu bytes of stdin unread (at most %u)",
			      (int)e->pid, pending, AGENT_PROC_STDIN_PENDING);
		return;
	}
	if (add) {
		uint8_t *nb = malloc(pending + add);

		if (!nb) {
			session_error(s, id, AGENT_S_INTERNAL, ENOMEM, "out of memory");
			return;
		}
		if (pending)
			memcpy(nb, e->stdin_buf + e->stdin_off, pending);
		if (data.len)
			memcpy(nb + pending, data.p, data.len);
		if (ctrl_d)
			nb[pending + data.len] = 0x04;
		free(e->stdin_buf);
		e->stdin_buf = nb;
		e->stdin_off = 0;
		e->stdin_len = pending + add;
	}
	if (eof && !ctrl_d) {
		e->stdin_eof = true;
		if (e->stdin_len == e->stdin_off)
			close_fd(&e->in_fd);
	}
	send_ok(s, id, 0);
}

void proc_resize(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	struct exec *e;
	struct winsize ws = { 0 };

	agent_rd_init(&r, p, len);
	uint32_t pid = agent_rd_u32(&r);

	ws.ws_row = agent_rd_u16(&r);
	ws.ws_col = agent_rd_u16(&r);
	if (!agent_rd_done(&r) || ws.ws_row < 1 || ws.ws_row > AGENT_MAX_PTY_DIM || ws.ws_col < 1 ||
	    ws.ws_col > AGENT_MAX_PTY_DIM) {
		session_error(s, id, AGENT_S_INVALID, 0, "rows and cols are 1..%d", AGENT_MAX_PTY_DIM);
		return;
	}
	if (!(e = proc_of(s, id, pid)))
		return;
	if (e->pty_fd < 0) {
		session_error(s, id, e->exited ? AGENT_S_NOT_FOUND : AGENT_S_INVALID, 0,
			      e->exited ? "process %d has ended" : "process %d has no terminal",
			      (int)e->pid);
		return;
	}
	if (ioctl(e->pty_fd, TIOCSWINSZ, &ws) < 0) {
		session_error(s, id, AGENT_S_IO, errno, "cannot resize: %s", strerror(errno));
		return;
	}
	send_ok(s, id, 0);
}
