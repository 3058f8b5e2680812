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
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent.h"

#define BASE_PATH AGENT_BASE_PATH

struct exec {
	bool used;
	uint32_t id;
	pid_t pid;		/* also the process group id */
	int in_fd, out_fd, err_fd;	/* our ends; -1 when closed */
	uint8_t *stdin_buf;	/* bytes still to write, malloc'd */
	size_t stdin_len, stdin_off;
	uint64_t start_ms, deadline_ms;	/* deadline 0: none */
	bool exited, timed_out;
	int status;		/* from waitpid */
	uint64_t exit_ms;
};

static struct exec execs[AGENT_MAX_EXECS];

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
	free(e->stdin_buf);
	memset(e, 0, sizeof(*e));
	e->in_fd = e->out_fd = e->err_fd = -1;
}

static struct exec *exec_find(uint32_t id)
{
	for (int i = 0; i < AGENT_MAX_EXECS; i++)
		if (execs[i].used && execs[i].id == id)
			return &execs[i];
	return NULL;
}

bool exec_active(uint32_t id)
{
	return exec_find(id) != NULL;
}

/* Frees a NULL-terminated vector of malloc'd strings. */
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
		      int in, int out, int err)
{
	sigset_t none;
	const char *path = NULL;

	setsid();
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

	for (i = 0; i < AGENT_MAX_EXECS && !e; i++)
		if (!execs[i].used)
			e = &execs[i];
	if (!e) {
		session_error(s, id, AGENT_S_BUSY, 0, "too many execs at once (%d)", AGENT_MAX_EXECS);
		return;
	}
	if (flags & ~AGENT_EXEC_F_SHELL) {
		session_error(s, id, AGENT_S_INVALID, 0, "unknown exec flags");
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
	if (!envp)
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

		if (!dup)
			goto nomem;
		env_put(envp, &envn, dup);
	}
	struct agent_bytes bin = agent_rd_bytes(&r, AGENT_MAX_PAYLOAD), buser;

	if (!agent_rd_user(&r, &buser) || !agent_rd_done(&r)) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed exec request");
		goto cleanup;
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
	if (bin.len) {
		e->stdin_buf = malloc(bin.len);
		if (!e->stdin_buf)
			goto nomem;
		memcpy(e->stdin_buf, bin.p, bin.len);
		e->stdin_len = bin.len;
		if (pipe2(in, O_CLOEXEC) < 0)
			goto syserr;
	} else {
		in[0] = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (in[0] < 0)
			goto syserr;
	}
	if (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0)
		goto syserr;

	pid_t pid = fork();

	if (pid < 0)
		goto syserr;
	if (pid == 0)
		child_run(argv, envp, cwd, &user.cred, in[0], out[1], err[1]);
	/* Also our group id: make sure it exists before a kill can target it. */
	setpgid(pid, pid);
	e->used = true;
	e->id = id;
	e->pid = pid;
	e->in_fd = in[1];
	e->out_fd = out[0];
	e->err_fd = err[0];
	in[1] = out[0] = err[0] = -1;
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
	strv_free(argv);
	strv_free(envp);
	free(cwd);
}

void exec_cancel(uint32_t id)
{
	struct exec *e = exec_find(id);

	if (e && !e->exited)
		kill(-e->pid, SIGKILL);
}

int exec_poll_fill(struct session *s, struct pollfd *pfd, int max)
{
	int n = 0;
	bool room = session_has_room(s);

	for (int i = 0; i < AGENT_MAX_EXECS; i++) {
		struct exec *e = &execs[i];

		if (!e->used)
			continue;
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

static void pump_stdin(struct exec *e)
{
	ssize_t n = write(e->in_fd, e->stdin_buf + e->stdin_off, e->stdin_len - e->stdin_off);

	if (n > 0)
		e->stdin_off += (size_t)n;
	if ((n < 0 && errno != EAGAIN && errno != EINTR) || e->stdin_off == e->stdin_len) {
		close_fd(&e->in_fd);	/* done, or the command closed its stdin */
		free(e->stdin_buf);
		e->stdin_buf = NULL;
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

static void send_exit(struct session *s, struct exec *e)
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
	session_send(s, AGENT_T_EXIT, 0, e->id, buf, w.len);
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
		send_exit(s, e);
		exec_release(e);
	}
}

int exec_next_timeout(void)
{
	uint64_t now = now_ms(), next = UINT64_MAX;

	for (int i = 0; i < AGENT_MAX_EXECS; i++) {
		struct exec *e = &execs[i];
		uint64_t t;

		if (!e->used)
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
		if (!e->exited)
			kill(-e->pid, SIGKILL);
		exec_release(e);
	}
}
