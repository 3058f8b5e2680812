/*
 * test_agent_client.c - the host client (vmm/agent.c) against the real kiln-agent run on this
 * host in --fd mode over a socketpair (no VM), and against fake hostile guests.
 *
 * usage: test_agent_client PATH-TO-KILN-AGENT
 */
#include <errno.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test.h"
#include "vmm/agent.h"
#include "vmm/guest/agent_proto.h"

static const char *agent_bin;
static char tmpdir[64];

static int64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/*
 * Starts kiln-agent --fd 3 on one end of a fresh socketpair; returns the other end. Only fd 3
 * reaches the agent (the pair is close-on-exec), so closing our end is an EOF for it.
 */
static int exec_agent(pid_t *pid)
{
	int sv[2];

	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
		return -1;
	*pid = fork();
	if (*pid == 0) {
		if (sv[1] == 3)
			fcntl(3, F_SETFD, 0);
		else
			dup2(sv[1], 3);
		execl(agent_bin, agent_bin, "--fd", "3", (char *)NULL);
		_exit(126);
	}
	close(sv[1]);
	return sv[0];
}

/* Starts kiln-agent and returns a client connected to it. */
static struct agent *spawn_agent(pid_t *pid)
{
	struct kiln_error err = { 0 };
	int fd = exec_agent(pid);

	return fd < 0 ? NULL : agent_open_fd(fd, &err);
}

static void stop_agent(struct agent *a, pid_t pid)
{
	int st;

	agent_free(a);	/* EOF: the agent kills its execs and exits */
	if (waitpid(pid, &st, 0) == pid)
		CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

struct capture {
	char out[8192], err[8192];
	size_t out_len, err_len;
	int chunks;
	int64_t first_ms;
};

static int on_output(void *ctx, enum agent_stream s, const uint8_t *d, size_t n)
{
	struct capture *c = ctx;
	char *buf = s == AGENT_STDOUT ? c->out : c->err;
	size_t *len = s == AGENT_STDOUT ? &c->out_len : &c->err_len;

	if (!c->chunks++)
		c->first_ms = now_ms();
	if (*len + n < sizeof(c->out) - 1) {
		memcpy(buf + *len, d, n);
		*len += n;
		buf[*len] = '\0';
	}
	return 0;
}

static void hello_reports_version_and_kernel(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct agent_hello_info h;
	struct kiln_error err = { 0 };

	CHECK(a != NULL);
	CHECK_INT(agent_hello(a, 5000, &h, &err), KILN_OK);
	CHECK_INT(h.version, AGENT_PROTO_VERSION);
	CHECK(h.kernel_release[0] != '\0');
	CHECK_STR(h.agent_version, "kiln-agent/4");
	stop_agent(a, pid);
}

static void exec_runs_argv_with_env_cwd_and_stdin(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct kiln_error err = { 0 };
	struct agent_exec_result r;
	struct capture c = { 0 };
	const char *argv[] = { "sh", "-c", "pwd; echo \"$FOO\"; cat; echo oops >&2; exit 3", NULL };
	const char *env[] = { "FOO=bar baz", NULL };
	struct agent_exec_req req = { .argv = argv, .env = env, .cwd = tmpdir,
				      .stdin_data = "from stdin\n", .stdin_len = 11 };

	CHECK_INT(agent_exec(a, &req, on_output, &c, &r, &err), KILN_OK);
	char want[200];

	snprintf(want, sizeof(want), "%s\nbar baz\nfrom stdin\n", tmpdir);
	CHECK_STR(c.out, want);
	CHECK_STR(c.err, "oops\n");
	CHECK_INT(r.exit_code, 3);
	CHECK(!r.timed_out);
	CHECK_INT(r.stdout_bytes, strlen(want));
	stop_agent(a, pid);
}

static void exec_of_missing_program_is_127_with_message(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct kiln_error err = { 0 };
	struct agent_exec_result r;
	struct capture c = { 0 };
	const char *argv[] = { "kiln-no-such-program", "x", NULL };
	struct agent_exec_req req = { .argv = argv };

	CHECK_INT(agent_exec(a, &req, on_output, &c, &r, &err), KILN_OK);
	CHECK_INT(r.exit_code, 127);
	CHECK(strstr(c.err, "kiln-no-such-program: command not found") != NULL);
	stop_agent(a, pid);
}

static void exec_timeout_kills_the_process_group(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct kiln_error err = { 0 };
	struct agent_exec_result r;
	struct agent_exec_req req = { .shell = "sleep 30 & sleep 30; echo never", .timeout_ms = 300 };
	int64_t t0 = now_ms();

	CHECK_INT(agent_exec(a, &req, NULL, NULL, &r, &err), KILN_OK);
	CHECK(r.timed_out);
	CHECK_INT(r.exit_code, 137);
	CHECK_INT(r.signal, SIGKILL);
	CHECK(now_ms() - t0 < 10000);	/* the wait ended, not left to run on */
	stop_agent(a, pid);
}

static void exec_output_streams_before_exit(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct kiln_error err = { 0 };
	struct agent_exec_result r;
	struct capture c = { 0 };
	struct agent_exec_req req = { .shell = "echo first; sleep 2; echo second" };

	CHECK_INT(agent_exec(a, &req, on_output, &c, &r, &err), KILN_OK);
	CHECK(c.chunks >= 2);
	CHECK(now_ms() - c.first_ms >= 400);	/* the first chunk came well before the end */
	CHECK_STR(c.out, "first\nsecond\n");
	stop_agent(a, pid);
}

struct par {
	struct agent *a;
	char code[256];
	enum kiln_err rc;
	struct agent_exec_result r;
	struct capture c;
};

static void *par_exec(void *arg)
{
	struct par *p = arg;
	struct agent_exec_req req = { .shell = p->code, .timeout_ms = 10000 };

	p->rc = agent_exec(p->a, &req, on_output, &p->c, &p->r, NULL);
	return NULL;
}

/* Each exec marks its own file and waits for the others' marks: run one after another, the
 * first would wait out its timeout. */
static void execs_run_at_once(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct par p[3] = { { .a = a }, { .a = a }, { .a = a } };
	pthread_t t[3];
	char dir[] = "/tmp/kiln-par.XXXXXX";

	bool made = mkdtemp(dir) != NULL;

	CHECK(made);
	if (!made) {
		stop_agent(a, pid);
		return;
	}
	for (int i = 0; i < 3; i++) {
		snprintf(p[i].code, sizeof(p[i].code),
			 "touch %s/m%d; while [ ! -e %s/m0 ] || [ ! -e %s/m1 ] || [ ! -e %s/m2 ]; "
			 "do sleep 0.05; done; echo done", dir, i, dir, dir, dir);
		pthread_create(&t[i], NULL, par_exec, &p[i]);
	}
	for (int i = 0; i < 3; i++) {
		pthread_join(t[i], NULL);
		CHECK_INT(p[i].rc, KILN_OK);
		CHECK(!p[i].r.timed_out);
		CHECK_STR(p[i].c.out, "done\n");
	}
	for (int i = 0; i < 3; i++) {
		char f[64];

		snprintf(f, sizeof(f), "%s/m%d", dir, i);
		unlink(f);
	}
	rmdir(dir);
	stop_agent(a, pid);
}

static void file_round_trip_is_byte_exact(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct kiln_error err = { 0 };
	char src[128], dst[128], gpath[128];
	size_t size = 3 * 1024 * 1024 + 17;
	uint8_t *data = malloc(size), *back = malloc(size);
	uint64_t got = 0;
	int fd;

	for (size_t i = 0; i < size; i++)
		data[i] = (uint8_t)(rand() >> 7);
	snprintf(src, sizeof(src), "%s/src", tmpdir);
	snprintf(dst, sizeof(dst), "%s/dst", tmpdir);
	snprintf(gpath, sizeof(gpath), "%s/written.bin", tmpdir);
	fd = open(src, O_RDWR | O_CREAT | O_TRUNC, 0600);
	CHECK(write(fd, data, size) == (ssize_t)size);
	lseek(fd, 0, SEEK_SET);
	CHECK_INT(agent_file_write_fd(a, gpath, 0600, fd, 100u << 20, &err), KILN_OK);
	close(fd);
	struct stat st;

	CHECK(stat(gpath, &st) == 0 && (st.st_mode & 0777) == 0600);
	fd = open(dst, O_RDWR | O_CREAT | O_TRUNC, 0600);
	CHECK_INT(agent_file_read_fd(a, gpath, fd, 100u << 20, &got, &err), KILN_OK);
	CHECK_INT(got, size);
	lseek(fd, 0, SEEK_SET);
	CHECK(read(fd, back, size) == (ssize_t)size);
	CHECK(memcmp(data, back, size) == 0);
	close(fd);
	/* Over the cap: refused, and nothing half-written takes the name. */
	fd = open(src, O_RDONLY);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_fd(a, gpath, 0, fd, 1000, &err), KILN_E_TOO_LARGE);
	close(fd);
	CHECK(stat(gpath, &st) == 0 && (size_t)st.st_size == size);
	CHECK(agent_alive(a));
	free(data);
	free(back);
	stop_agent(a, pid);
}

/* A source of no bytes, and a sink that drops what it gets. */
static long fd_src(void *ctx, uint8_t *buf, size_t cap)
{
	return read(*(int *)ctx, buf, cap);
}

static int discard(void *ctx, const uint8_t *d, size_t n)
{
	return 0;
}

static void file_errors_map_to_codes(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct kiln_error err = { 0 };
	char p[128];
	int fd = open("/dev/null", O_RDWR);

	CHECK_INT(agent_file_read_fd(a, "relative/x", fd, 100, NULL, &err), KILN_E_INVALID);
	CHECK_INT(agent_file_write_fd(a, "relative/x", 0, fd, 100, &err), KILN_E_INVALID);
	snprintf(p, sizeof(p), "%s/absent", tmpdir);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_read_fd(a, p, fd, 100, NULL, &err), KILN_E_NOT_FOUND);
	/* a parent that is a file, not a directory: not found, and nothing made under it */
	snprintf(p, sizeof(p), "%s/plain", tmpdir);
	close(open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644));
	snprintf(p, sizeof(p), "%s/plain/sub/x", tmpdir);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_fd(a, p, 0, fd, 100, &err), KILN_E_NOT_FOUND);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_read_fd(a, tmpdir, fd, 100, NULL, &err), KILN_E_INVALID);
	CHECK(agent_alive(a));
	close(fd);
	stop_agent(a, pid);
}

/*
 * A write makes the missing parent directories (0755), as `mkdir -p` would; a write that fails
 * afterwards removes the ones it made, and leaves alone those that were there.
 */
static void file_write_makes_parent_directories(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct kiln_error err = { 0 };
	struct stat st;
	char p[192], d[192];
	int fd = open("/dev/null", O_RDONLY);

	snprintf(p, sizeof(p), "%s/mk/a/b/c.txt", tmpdir);
	CHECK_INT(agent_file_write_fd(a, p, 0, fd, 100, &err), KILN_OK);
	CHECK(stat(p, &st) == 0 && S_ISREG(st.st_mode));
	snprintf(d, sizeof(d), "%s/mk/a/b", tmpdir);
	CHECK(stat(d, &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & 0777) == 0755);
	/* again beside it: the directories are there now, nothing to make */
	snprintf(p, sizeof(p), "%s/mk/a/b/d.txt", tmpdir);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_fd(a, p, 0, fd, 100, &err), KILN_OK);
	/* slashes doubled and trailing dots are the same directories */
	snprintf(p, sizeof(p), "%s//mk/./a//e.txt", tmpdir);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_fd(a, p, 0, fd, 100, &err), KILN_OK);
	snprintf(d, sizeof(d), "%s/mk/a/e.txt", tmpdir);
	CHECK(access(d, F_OK) == 0);
	/* a write over the size it announced fails: the directories it made go with it */
	int big = open("/dev/zero", O_RDONLY);

	snprintf(p, sizeof(p), "%s/mk/a/new1/new2/x", tmpdir);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_fd(a, p, 0, big, 64 * 1024, &err), KILN_E_TOO_LARGE);
	close(big);
	/* the agent takes frames in order: after the next request's answer the cancel is done */
	snprintf(d, sizeof(d), "%s/mk/a/f.txt", tmpdir);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_fd(a, d, 0, fd, 100, &err), KILN_OK);
	snprintf(d, sizeof(d), "%s/mk/a/new1", tmpdir);
	CHECK(access(d, F_OK) != 0);
	snprintf(d, sizeof(d), "%s/mk/a/b", tmpdir);
	CHECK(access(d, F_OK) == 0);
	CHECK(agent_alive(a));
	close(fd);
	stop_agent(a, pid);
}

/*
 * A user of this host's /etc/passwd (the agent reads it as a guest's): an exec runs with its ids,
 * home and variables; a file written for it is its own; the kernel checks its permissions; an
 * unknown user runs nothing. The agent must run as root to act as another user.
 */
static void exec_and_files_run_as_the_named_user(void)
{
	pid_t pid;
	struct agent *a;
	struct kiln_error err = { 0 };
	struct agent_exec_result r;
	struct capture c = { 0 };
	struct passwd *pw = getpwnam("nobody");
	struct stat st;
	char dir[64], own[128], p[192], want[512], marker[192];
	const char *show[] = { "sh", "-c", "id -u; id -g; echo $HOME $USER $LOGNAME; pwd", NULL };
	int fd;

	CHECK(geteuid() == 0);
	CHECK(pw != NULL);
	if (geteuid() != 0 || !pw)
		return;
	snprintf(dir, sizeof(dir), "/tmp/kiln-agent-user.XXXXXX");
	CHECK(mkdtemp(dir) != NULL);
	chmod(dir, 0755);
	snprintf(own, sizeof(own), "%s/own", dir);
	CHECK(mkdir(own, 0755) == 0 && chown(own, pw->pw_uid, pw->pw_gid) == 0);
	a = spawn_agent(&pid);
	CHECK(a != NULL);

	struct agent_exec_req req = { .argv = show, .user = "nobody", .timeout_ms = 10000 };

	CHECK_INT(agent_exec(a, &req, on_output, &c, &r, &err), KILN_OK);
	snprintf(want, sizeof(want), "%u\n%u\n%s nobody nobody\n%s\n", (unsigned)pw->pw_uid,
		 (unsigned)pw->pw_gid, pw->pw_dir,
		 stat(pw->pw_dir, &st) == 0 && S_ISDIR(st.st_mode) ? pw->pw_dir : "/");
	CHECK_STR(c.out, want);
	CHECK_INT(r.exit_code, 0);
	/* without a user: root, as before the field */
	memset(&c, 0, sizeof(c));
	req.user = NULL;
	CHECK_INT(agent_exec(a, &req, on_output, &c, &r, &err), KILN_OK);
	CHECK_STR(c.out, "0\n0\n/root root root\n/root\n");
	/* the user cannot write where root can */
	snprintf(marker, sizeof(marker), "%s/by-nobody", dir);
	const char *touch[] = { "touch", marker, NULL };

	req = (struct agent_exec_req){ .argv = touch, .user = "nobody", .timeout_ms = 10000 };
	CHECK_INT(agent_exec(a, &req, NULL, NULL, &r, &err), KILN_OK);
	CHECK(r.exit_code != 0);
	CHECK(access(marker, F_OK) != 0);
	/* an unknown user: invalid, naming it, and the command never ran */
	req = (struct agent_exec_req){ .argv = touch, .user = "nosuchuser-kiln", .timeout_ms = 10000 };
	kiln_error_clear(&err);
	CHECK_INT(agent_exec(a, &req, NULL, NULL, &r, &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "nosuchuser-kiln") != NULL);
	CHECK(access(marker, F_OK) != 0);
	/* and a malformed one never leaves the host */
	req.user = "../root";
	kiln_error_clear(&err);
	CHECK_INT(agent_exec(a, &req, NULL, NULL, &r, &err), KILN_E_INVALID);

	/* files: written for nobody belongs to nobody */
	fd = open("/dev/null", O_RDONLY);
	snprintf(p, sizeof(p), "%s/mine", own);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_as(a, p, 0600, "nobody", fd_src, &fd, 100, &err), KILN_OK);
	CHECK(stat(p, &st) == 0 && st.st_uid == pw->pw_uid && st.st_gid == pw->pw_gid &&
	      (st.st_mode & 0777) == 0600);
	/* the parents a write for nobody makes are nobody's */
	snprintf(p, sizeof(p), "%s/sub/y/mine", own);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_as(a, p, 0, "nobody", fd_src, &fd, 100, &err), KILN_OK);
	snprintf(p, sizeof(p), "%s/sub/y", own);
	CHECK(stat(p, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == pw->pw_uid &&
	      st.st_gid == pw->pw_gid);
	snprintf(p, sizeof(p), "%s/sub", own);
	CHECK(stat(p, &st) == 0 && st.st_uid == pw->pw_uid);
	snprintf(p, sizeof(p), "%s/mine", own);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_read_as(a, p, "nobody", discard, NULL, 100, NULL, &err), KILN_OK);
	/* where nobody may not write: forbidden, nothing left behind */
	snprintf(p, sizeof(p), "%s/not-mine", dir);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_as(a, p, 0, "nobody", fd_src, &fd, 100, &err), KILN_E_FORBIDDEN);
	snprintf(p, sizeof(p), "%s/not-mine-dir/x", dir);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_as(a, p, 0, "nobody", fd_src, &fd, 100, &err), KILN_E_FORBIDDEN);
	snprintf(want, sizeof(want), "ls -A '%s' | wc -l", dir);
	FILE *ls = popen(want, "r");
	int entries = -1;

	CHECK(ls && fscanf(ls, "%d", &entries) == 1);
	if (ls)
		pclose(ls);
	CHECK_INT(entries, 1);	/* only own/ */
	/* root's private file: nobody may not read it, root may */
	snprintf(p, sizeof(p), "%s/private", dir);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_as(a, p, 0600, NULL, fd_src, &fd, 100, &err), KILN_OK);
	CHECK(stat(p, &st) == 0 && st.st_uid == 0);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_read_as(a, p, "nobody", discard, NULL, 100, NULL, &err), KILN_E_FORBIDDEN);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_read_as(a, p, NULL, discard, NULL, 100, NULL, &err), KILN_OK);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_read_as(a, p, "nosuchuser-kiln", discard, NULL, 100, NULL, &err),
		  KILN_E_INVALID);
	kiln_error_clear(&err);
	snprintf(p, sizeof(p), "%s/x", own);
	CHECK_INT(agent_file_write_as(a, p, 0, "nosuchuser-kiln", fd_src, &fd, 100, &err),
		  KILN_E_INVALID);
	CHECK(access(p, F_OK) != 0);
	/* the agent took its own identity back: root writes anywhere again */
	snprintf(p, sizeof(p), "%s/by-root", dir);
	kiln_error_clear(&err);
	CHECK_INT(agent_file_write_as(a, p, 0, NULL, fd_src, &fd, 100, &err), KILN_OK);
	CHECK(agent_alive(a));
	close(fd);
	stop_agent(a, pid);
	snprintf(want, sizeof(want), "rm -rf '%s'", dir);
	CHECK(system(want) == 0);
}

static int count_output(void *ctx, enum agent_stream s, const uint8_t *d, size_t n)
{
	uint64_t *total = ctx;

	*total += n;
	return 0;
}

static void large_output_arrives_whole_through_flow_control(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct kiln_error err = { 0 };
	struct agent_exec_result r;
	uint64_t total = 0;
	struct agent_exec_req req = { .shell = "head -c 30000000 /dev/zero; echo tail >&2" };

	CHECK_INT(agent_exec(a, &req, count_output, &total, &r, &err), KILN_OK);
	CHECK_INT(r.exit_code, 0);
	CHECK_INT(r.stdout_bytes, 30000000);
	CHECK_INT(r.stderr_bytes, 5);
	CHECK_INT(total, 30000005);
	stop_agent(a, pid);
}

/* Sends one raw frame to a socket. */
static void raw_send(int fd, uint8_t type, uint16_t flags, uint32_t id, const void *p, size_t len)
{
	struct agent_hdr h = { AGENT_PROTO_VERSION, type, flags, id, (uint32_t)len };
	uint8_t hdr[AGENT_HDR_SIZE];

	agent_hdr_encode(&h, hdr);
	CHECK(write(fd, hdr, sizeof(hdr)) == sizeof(hdr));
	if (len)
		CHECK(write(fd, p, len) == (ssize_t)len);
}

/* Reads one raw frame; returns its type (payload into buf), or -1. */
static int raw_recv(int fd, struct agent_hdr *h, uint8_t *buf, size_t cap)
{
	uint8_t hdr[AGENT_HDR_SIZE];
	size_t got = 0;

	while (got < sizeof(hdr)) {
		ssize_t n = read(fd, hdr + got, sizeof(hdr) - got);

		if (n <= 0)
			return -1;
		got += (size_t)n;
	}
	if (agent_hdr_decode(hdr, h) < 0 || h->len > cap)
		return -1;
	for (got = 0; got < h->len;) {
		ssize_t n = read(fd, buf + got, h->len - got);

		if (n <= 0)
			return -1;
		got += (size_t)n;
	}
	return h->type;
}

static void agent_itself_rejects_bad_requests(void)
{
	int fd;
	pid_t pid;
	uint8_t buf[4096], req[64];
	struct agent_hdr h;
	struct agent_wr w;
	struct agent_error_msg em;
	int st;

	fd = exec_agent(&pid);
	/* A relative path, straight to the agent (the client would refuse it first). */
	agent_wr_init(&w, req, sizeof(req));
	agent_wr_str(&w, "etc/passwd");
	raw_send(fd, AGENT_T_FILE_READ, 0, 5, req, w.len);
	CHECK_INT(raw_recv(fd, &h, buf, sizeof(buf)), AGENT_T_ERROR);
	CHECK_INT(h.id, 5);
	CHECK(agent_parse_error(buf, h.len, &em) == 0 && em.status == AGENT_S_INVALID);
	/* A truncated exec payload. */
	raw_send(fd, AGENT_T_EXEC, 0, 6, "\0\0", 2);
	CHECK_INT(raw_recv(fd, &h, buf, sizeof(buf)), AGENT_T_ERROR);
	CHECK_INT(h.id, 6);
	/* A frame type only the guest sends. */
	raw_send(fd, AGENT_T_STDOUT, 0, 7, "x", 1);
	CHECK_INT(raw_recv(fd, &h, buf, sizeof(buf)), AGENT_T_ERROR);
	CHECK_INT(h.id, 7);
	/* Garbage: the agent ends the session with an ERROR on id 0. */
	CHECK(write(fd, "NOT A FRAME AT ALL", 18) == 18);
	CHECK_INT(raw_recv(fd, &h, buf, sizeof(buf)), AGENT_T_ERROR);
	CHECK_INT(h.id, 0);
	close(fd);
	CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* A fake guest: answers the first request with `reply` (raw bytes), then stays silent. */
struct fake {
	int fd;
	const uint8_t *reply;
	size_t len;
	bool close_after;
};

static void *fake_guest(void *arg)
{
	struct fake *f = arg;
	uint8_t hdr[AGENT_HDR_SIZE], skip[4096];
	struct agent_hdr h;

	if (read(f->fd, hdr, sizeof(hdr)) == sizeof(hdr) && agent_hdr_decode(hdr, &h) == 0) {
		if (h.len)
			CHECK(read(f->fd, skip, h.len) == (ssize_t)h.len);
		if (f->len) {
			/* Patch the request id into frames that leave it 0xFFFFFFFF. */
			uint8_t *out = malloc(f->len);

			memcpy(out, f->reply, f->len);
			if (f->len >= AGENT_HDR_SIZE && memcmp(out + 8, "\xff\xff\xff\xff", 4) == 0) {
				out[8] = (uint8_t)(h.id >> 24);
				out[9] = (uint8_t)(h.id >> 16);
				out[10] = (uint8_t)(h.id >> 8);
				out[11] = (uint8_t)h.id;
			}
			CHECK(write(f->fd, out, f->len) == (ssize_t)f->len);
			free(out);
		}
	}
	if (f->close_after)
		shutdown(f->fd, SHUT_RDWR);
	return NULL;
}

/* Runs a hello against a fake guest; returns the result. */
static enum kiln_err hello_against(const uint8_t *reply, size_t len, bool close_after,
				   int timeout_ms, struct agent **out)
{
	int sv[2];
	struct kiln_error err = { 0 };
	struct fake f;
	pthread_t t;
	enum kiln_err rc;

	socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
	f = (struct fake){ sv[1], reply, len, close_after };
	pthread_create(&t, NULL, fake_guest, &f);
	*out = agent_open_fd(sv[0], &err);
	rc = agent_hello(*out, timeout_ms, NULL, &err);
	pthread_join(t, NULL);
	close(sv[1]);
	return rc;
}

static void hostile_guests_fail_the_sandbox(void)
{
	struct agent *a;
	uint8_t frame[64];
	struct agent_hdr h = { AGENT_PROTO_VERSION, AGENT_T_HELLO_OK, 0, 0xffffffffu, 0 };

	/* Garbage instead of a frame. */
	CHECK_INT(hello_against((const uint8_t *)"GARBAGE GARBAGE GARBAGE!", 24, false, 2000, &a),
		  KILN_E_SANDBOX_FAILED);
	CHECK(!agent_alive(a));
	agent_free(a);
	/* A length over the cap. */
	h.len = AGENT_MAX_PAYLOAD + 1;
	agent_hdr_encode(&h, frame);
	CHECK_INT(hello_against(frame, AGENT_HDR_SIZE, false, 2000, &a), KILN_E_SANDBOX_FAILED);
	agent_free(a);
	/* A well-framed but malformed hello. */
	h.len = 3;
	agent_hdr_encode(&h, frame);
	memcpy(frame + AGENT_HDR_SIZE, "\x00\x01\x00", 3);
	CHECK_INT(hello_against(frame, AGENT_HDR_SIZE + 3, false, 2000, &a), KILN_E_SANDBOX_FAILED);
	agent_free(a);
	/* A frame type only the host may send. */
	h.type = AGENT_T_EXEC;
	h.len = 0;
	agent_hdr_encode(&h, frame);
	CHECK_INT(hello_against(frame, AGENT_HDR_SIZE, false, 2000, &a), KILN_E_SANDBOX_FAILED);
	agent_free(a);
	/* Silence: the wait times out. */
	int64_t t0 = now_ms();

	CHECK_INT(hello_against(NULL, 0, false, 300, &a), KILN_E_SANDBOX_FAILED);
	CHECK(now_ms() - t0 < 10000);	/* the wait ended, not left to run on */
	agent_free(a);
	/* The guest hangs up. */
	CHECK_INT(hello_against(NULL, 0, true, 5000, &a), KILN_E_SANDBOX_FAILED);
	agent_free(a);
}

/* Runs a grow-root against a fake guest that answers with `reply`; returns the result. */
static enum kiln_err grow_against(const uint8_t *reply, size_t len, uint64_t *fs_bytes,
				  struct kiln_error *err)
{
	int sv[2];
	struct fake f;
	pthread_t t;
	struct agent *a;
	enum kiln_err rc;

	socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
	f = (struct fake){ sv[1], reply, len, false };
	pthread_create(&t, NULL, fake_guest, &f);
	a = agent_open_fd(sv[0], err);
	rc = agent_grow_root(a, 10ull << 30, 500, fs_bytes, err);
	pthread_join(t, NULL);
	agent_free(a);
	close(sv[1]);
	return rc;
}

/* GROW_ROOT: the guest's size comes back, its errors map to codes, a bad reply fails it. */
static void grow_root_replies_are_checked(void)
{
	struct agent_hdr h = { AGENT_PROTO_VERSION, AGENT_T_OK, 0, 0xffffffffu, 8 };
	struct kiln_error err = { 0 };
	uint8_t frame[128];
	struct agent_wr w;
	uint64_t fs = 0;

	agent_hdr_encode(&h, frame);
	agent_wr_init(&w, frame + AGENT_HDR_SIZE, sizeof(frame) - AGENT_HDR_SIZE);
	agent_wr_u64(&w, 9580ull << 20);
	CHECK_INT(grow_against(frame, AGENT_HDR_SIZE + 8, &fs, &err), KILN_OK);
	CHECK(fs == 9580ull << 20);
	/* the guest's disk never grew: its IO error, named */
	h.type = AGENT_T_ERROR;
	agent_wr_init(&w, frame + AGENT_HDR_SIZE, sizeof(frame) - AGENT_HDR_SIZE);
	agent_wr_u32(&w, AGENT_S_IO);
	agent_wr_u32(&w, 0);
	agent_wr_str(&w, "the root disk shows 1 bytes");
	h.len = (uint32_t)w.len;
	agent_hdr_encode(&h, frame);
	kiln_error_clear(&err);
	CHECK_INT(grow_against(frame, AGENT_HDR_SIZE + w.len, NULL, &err), KILN_E_IO);
	CHECK(strstr(err.msg, "root disk shows") != NULL);
	/* a reply of the wrong kind */
	h.type = AGENT_T_EXIT;
	h.len = 0;
	agent_hdr_encode(&h, frame);
	kiln_error_clear(&err);
	CHECK_INT(grow_against(frame, AGENT_HDR_SIZE, NULL, &err), KILN_E_SANDBOX_FAILED);
	/* a wait over the cap is refused before anything is sent */
	kiln_error_clear(&err);
	CHECK_INT(agent_grow_root(NULL, 1, AGENT_MAX_GROW_WAIT_MS + 1, NULL, &err), KILN_E_INVALID);
}


/* --- port streams --- */

/* A listening TCP socket on 127.0.0.1 with an ephemeral port; stores the port. */
static int tcp_listen(uint16_t *port)
{
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t sl = sizeof(sa);
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	CHECK(fd >= 0);
	CHECK(bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
	CHECK(listen(fd, 16) == 0);
	CHECK(getsockname(fd, (struct sockaddr *)&sa, &sl) == 0);
	*port = ntohs(sa.sin_port);
	return fd;
}

/* What a test server does with its one connection. */
enum srv_mode { SRV_ECHO, SRV_SEND, SRV_SINK, SRV_RESET };

struct srv {
	int lfd;
	enum srv_mode mode;
	size_t send_bytes;	/* SRV_SEND: bytes sent, then the server closes */
	int release;		/* SRV_SINK: a pipe; the server closes when it becomes readable */
};

static void *srv_main(void *arg)
{
	struct srv *sv = arg;
	int fd = accept(sv->lfd, NULL, NULL);
	static __thread uint8_t buf[65536];

	if (fd < 0)
		return NULL;
	if (sv->mode == SRV_ECHO) {
		ssize_t n;

		while ((n = read(fd, buf, sizeof(buf))) > 0)
			CHECK(write(fd, buf, (size_t)n) == n);
	} else if (sv->mode == SRV_SEND) {
		for (size_t sent = 0; sent < sv->send_bytes;) {
			size_t k = sv->send_bytes - sent < sizeof(buf) ? sv->send_bytes - sent : sizeof(buf);

			memset(buf, (int)(sent / sizeof(buf)) & 0xff, k);
			if (write(fd, buf, k) != (ssize_t)k)
				break;
			sent += k;
		}
	} else if (sv->mode == SRV_SINK) {
		char c;

		CHECK(read(sv->release, &c, 1) >= 0);
	} else {
		struct linger l = { 1, 0 };
		char c;

		/* after the client's first byte: a reset before it could reach the agent while its
		 * open is still being answered, and fail the open instead of the stream */
		CHECK(read(fd, &c, 1) == 1);
		setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
	}
	close(fd);
	return NULL;
}

struct pwriter {
	struct agent_port *p;
	const uint8_t *data;
	size_t len;
	int rc;
};

static void *pwriter_main(void *arg)
{
	struct pwriter *w = arg;

	w->rc = agent_port_write(w->p, w->data, w->len);
	if (w->rc == 0)
		w->rc = agent_port_shutdown(w->p);
	return NULL;
}

/* 3 MiB (twelve windows) through an echo server and back, both ways at once, byte-exact. */
static void port_stream_echoes_both_ways(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct kiln_error err = { 0 };
	struct srv sv = { .mode = SRV_ECHO };
	size_t len = 3u << 20, got = 0;
	uint8_t *data = malloc(len), *back = malloc(len);
	struct agent_port *p = NULL;
	pthread_t st, wt;
	uint16_t port;
	ssize_t n;

	for (size_t i = 0; i < len; i++)
		data[i] = (uint8_t)(i * 7 + (i >> 13));
	sv.lfd = tcp_listen(&port);
	pthread_create(&st, NULL, srv_main, &sv);
	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	CHECK_INT(agent_port_open(a, port, 5000, &p, &err), KILN_OK);
	struct pwriter w = { p, data, len, -1 };

	pthread_create(&wt, NULL, pwriter_main, &w);
	while ((n = agent_port_read(p, back + got, len - got, 10000)) > 0)
		got += (size_t)n;
	CHECK_INT(n, 0);	/* the server closed after our end */
	pthread_join(wt, NULL);
	CHECK_INT(w.rc, 0);
	CHECK_INT(got, len);
	CHECK(memcmp(data, back, len) == 0);
	agent_port_close(p);
	pthread_join(st, NULL);
	close(sv.lfd);
	/* the agent is still well: another request is served */
	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	free(data);
	free(back);
	stop_agent(a, pid);
}

/*
 * A stream whose reader stops does not stall the channel: the guest holds back at the window,
 * an exec is served meanwhile, and every byte still arrives once the reader goes on.
 */
static void port_stream_slow_reader_stalls_only_itself(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct kiln_error err = { 0 };
	struct srv sv = { .mode = SRV_SEND, .send_bytes = 16u << 20 };
	struct agent_port *p = NULL;
	struct agent_exec_result r;
	struct capture cap = { 0 };
	const char *argv[] = { "/bin/echo", "still here", NULL };
	struct agent_exec_req req = { .argv = argv, .timeout_ms = 10000 };
	static uint8_t buf[65536];
	size_t got = 0;
	pthread_t st;
	uint16_t port;
	ssize_t n;
	bool ok = true;

	sv.lfd = tcp_listen(&port);
	pthread_create(&st, NULL, srv_main, &sv);
	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	CHECK_INT(agent_port_open(a, port, 5000, &p, &err), KILN_OK);
	usleep(300 * 1000);	/* the server has filled its socket and the window by now */
	int64_t t0 = now_ms();

	CHECK_INT(agent_exec(a, &req, on_output, &cap, &r, &err), KILN_OK);
	CHECK(!r.timed_out);
	CHECK(now_ms() - t0 < 10000);	/* answered, not held behind the full port */
	CHECK_STR(cap.out, "still here\n");
	while ((n = agent_port_read(p, buf, sizeof(buf), 10000)) > 0) {
		for (ssize_t i = 0; i < n; i++)
			ok = ok && buf[i] == (uint8_t)(((got + (size_t)i) / 65536) & 0xff);
		got += (size_t)n;
	}
	CHECK_INT(n, 0);
	CHECK_INT(got, 16u << 20);
	CHECK(ok);
	CHECK_INT(agent_port_shutdown(p), 0);
	agent_port_close(p);
	pthread_join(st, NULL);
	close(sv.lfd);
	stop_agent(a, pid);
}

/*
 * Nothing listening is KILN_E_PORT_CLOSED; a reset by the server reaches the reader; a writer
 * blocked on a server that never reads is woken by agent_port_abort.
 */
static void port_stream_errors(void)
{
	pid_t pid;
	struct agent *a = spawn_agent(&pid);
	struct kiln_error err = { 0 };
	struct agent_port *p = NULL;
	uint8_t buf[256];
	uint16_t port;
	pthread_t st, wt;
	int rel[2];

	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	/* a port nobody listens on: bind one, learn its number, close it */
	close(tcp_listen(&port));
	CHECK_INT(agent_port_open(a, port, 5000, &p, &err), KILN_E_PORT_CLOSED);
	CHECK(p == NULL);
	kiln_error_clear(&err);
	CHECK_INT(agent_port_open(a, 0, 5000, &p, &err), KILN_E_INVALID);
	kiln_error_clear(&err);

	/* the server resets the connection */
	struct srv sv = { .mode = SRV_RESET };

	sv.lfd = tcp_listen(&port);
	pthread_create(&st, NULL, srv_main, &sv);
	CHECK_INT(agent_port_open(a, port, 5000, &p, &err), KILN_OK);
	CHECK_INT(agent_port_write(p, "x", 1), 0);
	pthread_join(st, NULL);
	CHECK_INT(agent_port_read(p, buf, sizeof(buf), 10000), -ECONNRESET);
	agent_port_close(p);
	close(sv.lfd);

	/* a server that never reads: the writer blocks at the window until aborted */
	CHECK(pipe(rel) == 0);
	sv = (struct srv){ .mode = SRV_SINK, .release = rel[0] };
	sv.lfd = tcp_listen(&port);
	pthread_create(&st, NULL, srv_main, &sv);
	CHECK_INT(agent_port_open(a, port, 5000, &p, &err), KILN_OK);
	size_t big = 64u << 20;
	uint8_t *data = calloc(1, big);
	struct pwriter w = { p, data, big, 1 };

	pthread_create(&wt, NULL, pwriter_main, &w);
	usleep(1000 * 1000);
	CHECK_INT(w.rc, 1);	/* still blocked */
	agent_port_abort(p);
	pthread_join(wt, NULL);
	CHECK_INT(w.rc, -ECANCELED);
	CHECK_INT(agent_port_read(p, buf, sizeof(buf), 1000), -ECANCELED);
	agent_port_close(p);
	CHECK(write(rel[1], "x", 1) == 1);
	pthread_join(st, NULL);
	close(sv.lfd);
	close(rel[0]);
	close(rel[1]);
	free(data);
	/* the agent serves on */
	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	stop_agent(a, pid);
}

/* Encodes a guest frame into `out`; returns its size. */
static size_t guest_frame(uint8_t *out, uint8_t type, uint32_t id, const void *p, size_t len)
{
	struct agent_hdr h = { AGENT_PROTO_VERSION, type, 0, id, (uint32_t)len };

	agent_hdr_encode(&h, out);
	if (len)
		memcpy(out + AGENT_HDR_SIZE, p, len);
	return AGENT_HDR_SIZE + len;
}

/* A scripted guest: says hello as `version`, then answers PORT_OPEN as `mode` says. */
struct pguest {
	int fd;
	const char *version;
	int mode;	/* 0: never answer; 1: OK, then data past the window */
};

static void *pguest_main(void *arg)
{
	struct pguest *g = arg;
	static __thread uint8_t buf[AGENT_HDR_SIZE + 65536];
	uint8_t pl[256];
	struct agent_hdr h;
	struct agent_wr w;

	if (raw_recv(g->fd, &h, buf, sizeof(buf)) != AGENT_T_HELLO)
		return NULL;
	agent_wr_init(&w, pl, sizeof(pl));
	agent_wr_u16(&w, AGENT_PROTO_VERSION);
	agent_wr_str(&w, "6.1.0");
	agent_wr_str(&w, "boot");
	agent_wr_str(&w, g->version);
	agent_wr_u64(&w, 1);
	size_t n = guest_frame(buf, AGENT_T_HELLO_OK, h.id, pl, w.len);

	CHECK(write(g->fd, buf, n) == (ssize_t)n);
	if (raw_recv(g->fd, &h, buf, sizeof(buf)) != AGENT_T_PORT_OPEN || g->mode == 0)
		return NULL;
	uint32_t id = h.id;

	n = guest_frame(buf, AGENT_T_OK, id, "\0\0\0\0\0\0\0\0", 8);
	CHECK(write(g->fd, buf, n) == (ssize_t)n);
	static __thread uint8_t chunk[65536];

	for (int i = 0; i < 5; i++) {	/* 320 KiB against a 256 KiB window */
		n = guest_frame(buf, AGENT_T_STREAM_DATA, id, chunk, sizeof(chunk));
		if (write(g->fd, buf, n) != (ssize_t)n)
			break;
	}
	return NULL;
}

static enum kiln_err port_against(struct pguest *g, struct agent **out, struct agent_port **p,
				  int timeout_ms)
{
	int sv[2];
	struct kiln_error err = { 0 };
	pthread_t t;
	enum kiln_err rc;

	socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
	g->fd = sv[1];
	pthread_create(&t, NULL, pguest_main, g);
	*out = agent_open_fd(sv[0], &err);
	CHECK_INT(agent_hello(*out, 2000, NULL, &err), KILN_OK);
	rc = agent_port_open(*out, 8080, timeout_ms, p, &err);
	if (rc == KILN_E_NOT_IMPLEMENTED)
		shutdown(g->fd, SHUT_RD);	/* nothing was sent: wake the guest's read */
	pthread_join(t, NULL);
	return rc;
}

/* The host refuses an old agent, times out a silent one, and drops one that overruns a window. */
static void port_stream_hostile_guests(void)
{
	struct agent *a;
	struct agent_port *p = NULL;
	struct pguest g = { -1, "kiln-agent/1", 1 };
	uint8_t *buf = malloc(1u << 20);
	ssize_t n;
	size_t got = 0;

	CHECK_INT(port_against(&g, &a, &p, 2000), KILN_E_NOT_IMPLEMENTED);
	agent_free(a);
	close(g.fd);
	g = (struct pguest){ -1, "kiln-agent/2", 0 };
	int64_t t0 = now_ms();

	CHECK_INT(port_against(&g, &a, &p, 300), KILN_E_PORT_TIMEOUT);
	CHECK(now_ms() - t0 < 10000);	/* the wait ended, not left to run on */
	CHECK(agent_alive(a));
	agent_free(a);
	close(g.fd);
	g = (struct pguest){ -1, "kiln-agent/2", 1 };
	CHECK_INT(port_against(&g, &a, &p, 2000), KILN_OK);
	for (int i = 0; i < 200 && agent_alive(a); i++)
		usleep(10 * 1000);
	CHECK(!agent_alive(a));
	while ((n = agent_port_read(p, buf + got, (1u << 20) - got, 2000)) > 0)
		got += (size_t)n;
	CHECK_INT(n, -EPIPE);
	CHECK(got <= AGENT_STREAM_WINDOW);
	agent_port_close(p);
	agent_free(a);
	close(g.fd);
	free(buf);
}

/* ---- detached processes (version 3) ---- */

/* An attach's consumer: keeps the output; stops the attach once `until` shows up (if set). */
struct pcap {
	char out[1u << 16];
	size_t len;
	uint64_t total;
	char last[9];		/* the last 8 bytes seen */
	const char *until;
	int stop_after_ms;	/* > 0: stop on the first silence tick past this long */
	int64_t t0;
};

static int pcap_output(void *ctx, enum agent_stream s, const uint8_t *d, size_t n)
{
	struct pcap *c = ctx;

	if (!n)	/* a second of silence */
		return c->stop_after_ms > 0 && now_ms() - c->t0 > c->stop_after_ms;
	c->total += n;
	for (size_t i = 0; i < n; i++) {
		memmove(c->last, c->last + 1, 7);
		c->last[7] = (char)d[i];
	}
	if (c->len + n < sizeof(c->out) - 1) {
		memcpy(c->out + c->len, d, n);
		c->len += n;
		c->out[c->len] = '\0';
	}
	return c->until && strstr(c->out, c->until) ? 1 : 0;
}

struct plist {
	int n;
	uint32_t pid;
	bool found, running;
	int exit_code;
	char tag[80], cwd[256], argv2[256], env0[64];
	int argc;
};

static int plist_entry(void *ctx, const struct agent_proc_info *p)
{
	struct plist *l = ctx;

	l->n++;
	if (p->pid != l->pid)
		return 0;
	l->found = true;
	l->running = p->running;
	l->exit_code = p->exit_code;
	snprintf(l->tag, sizeof(l->tag), "%s", p->tag);
	snprintf(l->cwd, sizeof(l->cwd), "%s", p->cwd);
	for (l->argc = 0; p->argv[l->argc]; l->argc++)
		;
	snprintf(l->argv2, sizeof(l->argv2), "%s", l->argc > 2 ? p->argv[2] : "");
	snprintf(l->env0, sizeof(l->env0), "%s", p->env_names[0] ? p->env_names[0] : "");
	return 0;
}

static void procs_outlive_attach_take_stdin_and_signals(void)
{
	pid_t apid;
	struct agent *a = spawn_agent(&apid);
	struct kiln_error err = { 0 };
	const char *env[] = { "GREETING=hi", NULL };
	struct agent_proc_req req = { .exec = { .shell = "echo start $GREETING; read line; echo got:$line; "
							 "exec sleep 60",
						.env = env, .cwd = "/tmp" },
				      .tag = "my-tag" };
	struct agent_exec_result r;
	struct pcap c = { .until = "start hi" };
	struct plist l = { 0 };
	uint64_t dropped = 1;
	uint32_t pid = 0;

	CHECK(a != NULL);
	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	CHECK_INT(agent_proc_start(a, &req, &pid, &err), KILN_OK);
	CHECK(pid > 0);
	/* the first attach replays from the start and leaves when it saw enough */
	CHECK_INT(agent_proc_attach(a, pid, true, pcap_output, &c, &dropped, &r, &err), KILN_E_IO);
	CHECK_INT(dropped, 0);
	CHECK(strstr(c.out, "start hi\n") != NULL);
	kiln_error_clear(&err);
	/* it still runs: listed, and it takes stdin */
	l.pid = pid;
	CHECK_INT(agent_proc_list(a, plist_entry, &l, &err), KILN_OK);
	CHECK(l.found && l.running);
	CHECK_INT(l.exit_code, -1);
	CHECK_STR(l.tag, "my-tag");
	CHECK_STR(l.cwd, "/tmp");
	CHECK_INT(l.argc, 3);
	CHECK(strstr(l.argv2, "read line") != NULL);
	CHECK_STR(l.env0, "GREETING");
	CHECK_INT(agent_proc_stdin(a, (uint32_t)pid, "hello\n", 6, false, &err), KILN_OK);
	c = (struct pcap){ .until = "got:hello" };
	CHECK_INT(agent_proc_attach(a, pid, true, pcap_output, &c, NULL, &r, &err), KILN_E_IO);
	CHECK(strstr(c.out, "start hi\ngot:hello\n") != NULL);
	kiln_error_clear(&err);
	/* a signal ends it; an attach without replay sees only the exit */
	CHECK_INT(agent_proc_signal(a, pid, SIGKILL, &err), KILN_OK);
	c = (struct pcap){ 0 };
	CHECK_INT(agent_proc_attach(a, pid, false, pcap_output, &c, NULL, &r, &err), KILN_OK);
	CHECK_INT(c.len, 0);
	CHECK_INT(r.signal, SIGKILL);
	CHECK_INT(r.exit_code, 128 + SIGKILL);
	l = (struct plist){ .pid = pid };
	CHECK_INT(agent_proc_list(a, plist_entry, &l, &err), KILN_OK);
	CHECK(l.found && !l.running);
	CHECK_INT(l.exit_code, 128 + SIGKILL);
	/* an ended process takes no signal or stdin; an unknown pid is not found */
	CHECK_INT(agent_proc_signal(a, pid, SIGTERM, &err), KILN_E_NOT_FOUND);
	kiln_error_clear(&err);
	CHECK_INT(agent_proc_stdin(a, pid, "x", 1, false, &err), KILN_E_INVALID);
	kiln_error_clear(&err);
	CHECK_INT(agent_proc_signal(a, 999999, SIGTERM, &err), KILN_E_NOT_FOUND);
	kiln_error_clear(&err);
	CHECK_INT(agent_proc_attach(a, 999999, true, pcap_output, &c, NULL, &r, &err), KILN_E_NOT_FOUND);
	kiln_error_clear(&err);
	CHECK(agent_alive(a));
	stop_agent(a, apid);
}

static void proc_stdin_eof_and_timeout(void)
{
	pid_t apid;
	struct agent *a = spawn_agent(&apid);
	struct kiln_error err = { 0 };
	struct agent_proc_req req = { .exec = { .shell = "wc -c" } };
	struct agent_proc_req slow = { .exec = { .shell = "sleep 60", .timeout_ms = 300 } };
	struct agent_exec_result r;
	struct pcap c = { 0 };
	uint32_t pid = 0;

	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	CHECK_INT(agent_proc_start(a, &req, &pid, &err), KILN_OK);
	CHECK_INT(agent_proc_stdin(a, pid, "abc", 3, false, &err), KILN_OK);
	CHECK_INT(agent_proc_stdin(a, pid, "de", 2, true, &err), KILN_OK);
	CHECK_INT(agent_proc_attach(a, pid, true, pcap_output, &c, NULL, &r, &err), KILN_OK);
	CHECK_INT(atoi(c.out), 5);
	CHECK_INT(r.exit_code, 0);
	CHECK_INT(agent_proc_start(a, &slow, &pid, &err), KILN_OK);
	c = (struct pcap){ 0 };
	CHECK_INT(agent_proc_attach(a, pid, true, pcap_output, &c, NULL, &r, &err), KILN_OK);
	CHECK(r.timed_out);
	CHECK_INT(r.signal, SIGKILL);
	stop_agent(a, apid);
}

/* Output nobody reads is kept to the ring's size, the oldest dropped and counted. */
static void proc_ring_keeps_the_tail(void)
{
	pid_t apid;
	struct agent *a = spawn_agent(&apid);
	struct kiln_error err = { 0 };
	struct agent_proc_req req = { .exec = { .shell = "head -c 3000000 /dev/zero; echo; echo THE-END" } };
	struct agent_exec_result r;
	struct pcap c = { .stop_after_ms = 30000 };
	struct plist l = { 0 };
	uint64_t dropped = 0;
	uint32_t pid = 0;

	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	CHECK_INT(agent_proc_start(a, &req, &pid, &err), KILN_OK);
	l.pid = pid;
	for (int i = 0; i < 300; i++) {
		l.found = false;
		CHECK_INT(agent_proc_list(a, plist_entry, &l, &err), KILN_OK);
		if (l.found && !l.running)
			break;
		usleep(50 * 1000);
	}
	CHECK(l.found && !l.running);
	c.t0 = now_ms();
	CHECK_INT(agent_proc_attach(a, pid, true, pcap_output, &c, &dropped, &r, &err), KILN_OK);
	CHECK_INT(r.exit_code, 0);
	CHECK(c.total <= AGENT_PROC_RING_BYTES);
	CHECK(c.total > AGENT_PROC_RING_BYTES - 64 * 1024);
	CHECK_INT(dropped + c.total, 3000000 + 1 + 8);
	CHECK_STR(c.last, "THE-END\n");
	stop_agent(a, apid);
}

static void proc_pty_runs_a_shell_with_resize(void)
{
	pid_t apid;
	struct agent *a = spawn_agent(&apid);
	struct kiln_error err = { 0 };
	struct agent_proc_req req = { .exec = { .argv = (const char *const[]){ "/bin/sh", NULL } },
				      .rows = 24, .cols = 80 };
	struct agent_exec_result r;
	struct pcap c = { .until = "24 80" };
	uint32_t pid = 0;
	const char *cmd = "tty; stty size; echo h''i\n";

	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	CHECK_INT(agent_proc_start(a, &req, &pid, &err), KILN_OK);
	CHECK_INT(agent_proc_stdin(a, pid, cmd, strlen(cmd), false, &err), KILN_OK);
	CHECK_INT(agent_proc_attach(a, pid, true, pcap_output, &c, NULL, &r, &err), KILN_E_IO);
	kiln_error_clear(&err);
	CHECK(strstr(c.out, "/dev/pts/") != NULL);
	CHECK_INT(agent_proc_resize(a, pid, 40, 100, &err), KILN_OK);
	cmd = "stty size\n";
	CHECK_INT(agent_proc_stdin(a, pid, cmd, strlen(cmd), false, &err), KILN_OK);
	c = (struct pcap){ .until = "40 100" };
	CHECK_INT(agent_proc_attach(a, pid, true, pcap_output, &c, NULL, &r, &err), KILN_E_IO);
	CHECK(strstr(c.out, "hi") != NULL);
	kiln_error_clear(&err);
	/* end of input is ^D: the shell exits */
	CHECK_INT(agent_proc_stdin(a, pid, NULL, 0, true, &err), KILN_OK);
	c = (struct pcap){ 0 };
	CHECK_INT(agent_proc_attach(a, pid, false, pcap_output, &c, NULL, &r, &err), KILN_OK);
	CHECK_INT(r.exit_code, 0);
	/* a process on pipes has no terminal to resize */
	req = (struct agent_proc_req){ .exec = { .shell = "sleep 30" } };
	CHECK_INT(agent_proc_start(a, &req, &pid, &err), KILN_OK);
	CHECK_INT(agent_proc_resize(a, pid, 10, 10, &err), KILN_E_INVALID);
	kiln_error_clear(&err);
	CHECK_INT(agent_proc_resize(a, pid, 0, 10, &err), KILN_E_INVALID);
	kiln_error_clear(&err);
	req.rows = 2000;
	req.cols = 10;
	CHECK_INT(agent_proc_start(a, &req, &pid, &err), KILN_E_INVALID);
	stop_agent(a, apid);
}

struct attacher {
	struct agent *a;
	uint32_t pid;
	enum kiln_err rc;
};

static void *attacher_main(void *arg)
{
	struct attacher *t = arg;
	struct kiln_error err = { 0 };
	struct agent_exec_result r;
	struct pcap *c = calloc(1, sizeof(*c));

	c->t0 = now_ms();
	c->stop_after_ms = 30000;
	t->rc = agent_proc_attach(t->a, t->pid, false, pcap_output, c, NULL, &r, &err);
	free(c);
	return NULL;
}

/* The caps: processes, stdin unread, a stdin frame; a later attach takes over. */
static void proc_limits_hold(void)
{
	pid_t apid;
	struct agent *a = spawn_agent(&apid);
	struct kiln_error err = { 0 };
	struct agent_proc_req req = { .exec = { .shell = "exec sleep 60" } };
	uint32_t pids[AGENT_PROC_MAX], pid;
	static uint8_t chunk[AGENT_PROC_STDIN_CHUNK + 1];
	enum kiln_err rc = KILN_OK;
	int i;

	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	for (i = 0; i < AGENT_PROC_MAX; i++)
		CHECK_INT(agent_proc_start(a, &req, &pids[i], &err), KILN_OK);
	CHECK_INT(agent_proc_start(a, &req, &pid, &err), KILN_E_RATE_LIMITED);
	CHECK(strstr(err.msg, "too many processes") != NULL);
	kiln_error_clear(&err);
	/* an ended process gives its place */
	CHECK_INT(agent_proc_signal(a, pids[0], SIGKILL, &err), KILN_OK);
	for (i = 0; i < 100; i++) {
		rc = agent_proc_start(a, &req, &pid, &err);
		kiln_error_clear(&err);
		if (rc == KILN_OK)
			break;
		usleep(50 * 1000);
	}
	CHECK_INT(rc, KILN_OK);
	/* sleep never reads: its pipe fills, then the agent's 256 KiB, then it is refused */
	for (i = 0; i < 32 && (rc = agent_proc_stdin(a, pids[1], chunk, AGENT_PROC_STDIN_CHUNK, false,
						     &err)) == KILN_OK; i++)
		;
	CHECK_INT(rc, KILN_E_RATE_LIMITED);
	CHECK(i >= 4 && i <= 6);
	kiln_error_clear(&err);
	CHECK_INT(agent_proc_stdin(a, pids[2], chunk, sizeof(chunk), false, &err), KILN_E_TOO_LARGE);
	kiln_error_clear(&err);
	CHECK_INT(agent_proc_signal(a, pids[2], 0, &err), KILN_E_INVALID);
	kiln_error_clear(&err);
	/* two attaches: the later one takes the process over */
	struct attacher t1 = { a, pids[3], KILN_OK };
	pthread_t th;

	pthread_create(&th, NULL, attacher_main, &t1);
	usleep(300 * 1000);
	struct attacher t2 = { a, pids[3], KILN_OK };
	pthread_t th2;

	pthread_create(&th2, NULL, attacher_main, &t2);
	pthread_join(th, NULL);
	CHECK_INT(t1.rc, KILN_E_CONFLICT);
	CHECK_INT(agent_proc_signal(a, pids[3], SIGTERM, &err), KILN_OK);
	pthread_join(th2, NULL);
	CHECK_INT(t2.rc, KILN_OK);
	CHECK(agent_alive(a));
	stop_agent(a, apid);
}

/* A version-2 agent gets no process frame: the host refuses first and the session goes on. */
static void procs_refused_to_an_old_agent(void)
{
	struct pguest g = { -1, "kiln-agent/2", 0 };
	struct kiln_error err = { 0 };
	struct agent_proc_req req = { .exec = { .shell = "true" } };
	struct agent_exec_result r;
	struct agent *a;
	uint32_t pid = 7, wid = 0;
	bool dropped, ended;
	int sv[2];
	pthread_t t;

	socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
	g.fd = sv[1];
	pthread_create(&t, NULL, pguest_main, &g);
	a = agent_open_fd(sv[0], &err);
	CHECK_INT(agent_hello(a, 2000, NULL, &err), KILN_OK);
	CHECK_INT(agent_proc_start(a, &req, &pid, &err), KILN_E_NOT_IMPLEMENTED);
	CHECK(strstr(err.msg, "predates processes") != NULL);
	CHECK_INT(pid, 0);
	kiln_error_clear(&err);
	CHECK_INT(agent_proc_attach(a, 5, true, NULL, NULL, NULL, &r, &err), KILN_E_NOT_IMPLEMENTED);
	kiln_error_clear(&err);
	CHECK_INT(agent_proc_list(a, NULL, NULL, &err), KILN_E_NOT_IMPLEMENTED);
	kiln_error_clear(&err);
	CHECK_INT(agent_proc_signal(a, 5, 9, &err), KILN_E_NOT_IMPLEMENTED);
	kiln_error_clear(&err);
	CHECK_INT(agent_proc_stdin(a, 5, "x", 1, false, &err), KILN_E_NOT_IMPLEMENTED);
	kiln_error_clear(&err);
	CHECK_INT(agent_proc_resize(a, 5, 5, 5, &err), KILN_E_NOT_IMPLEMENTED);
	kiln_error_clear(&err);
	CHECK_INT(agent_watch_add(a, "/tmp", false, NULL, &wid, &err), KILN_E_NOT_IMPLEMENTED);
	CHECK(strstr(err.msg, "predates directory watches") != NULL);
	kiln_error_clear(&err);
	CHECK_INT(agent_watch_read(a, 1, 0, NULL, NULL, &dropped, &ended, &err), KILN_E_NOT_IMPLEMENTED);
	kiln_error_clear(&err);
	CHECK_INT(agent_watch_remove(a, 1, &err), KILN_E_NOT_IMPLEMENTED);
	CHECK(agent_alive(a));
	shutdown(g.fd, SHUT_RD);
	pthread_join(t, NULL);
	agent_free(a);
	close(g.fd);
}

/* The events a watch read, "type:name" each, space-separated. */
struct wcap {
	char text[8192];
	int n;
};

static int wcap_event(void *ctx, int type, const char *name)
{
	static const char *const t[] = { "?", "create", "write", "remove", "rename", "chmod" };
	struct wcap *c = ctx;
	size_t l = strlen(c->text);

	snprintf(c->text + l, sizeof(c->text) - l, "%s%s:%s", l ? " " : "", t[type], name);
	c->n++;
	return 0;
}

/* Reads watch `wid` until `last` is among its events or 5 s pass; true when it came. */
static bool wread_until(struct agent *a, uint32_t wid, struct wcap *c, const char *last)
{
	struct kiln_error err = { 0 };
	bool dropped, ended;
	int64_t end = now_ms() + 5000;

	while (!strstr(c->text, last) && now_ms() < end)
		if (agent_watch_read(a, wid, 1000, wcap_event, c, &dropped, &ended, &err) != KILN_OK)
			return false;
	return strstr(c->text, last) != NULL;
}

static void watches_report_events_in_order(void)
{
	pid_t apid;
	struct agent *a = spawn_agent(&apid);
	struct kiln_error err = { 0 };
	char dir[128], path[256], cmd[600];
	struct wcap c = { 0 };
	bool dropped = true, ended = true;
	uint32_t wid = 0, rwid = 0;
	int64_t t0;

	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	snprintf(dir, sizeof(dir), "%s/watched", tmpdir);
	CHECK(mkdir(dir, 0755) == 0);
	CHECK_INT(agent_watch_add(a, dir, false, NULL, &wid, &err), KILN_OK);
	CHECK(wid > 0);
	/* nothing yet: a read without a wait answers at once, a read with one after it */
	CHECK_INT(agent_watch_read(a, wid, 0, wcap_event, &c, &dropped, &ended, &err), KILN_OK);
	CHECK_INT(c.n, 0);
	CHECK(!dropped && !ended);
	t0 = now_ms();
	CHECK_INT(agent_watch_read(a, wid, 300, wcap_event, &c, &dropped, &ended, &err), KILN_OK);
	CHECK(now_ms() - t0 >= 250);
	CHECK_INT(c.n, 0);
	/* created, written, renamed, chmodded, removed: in order, with envd's types */
	snprintf(cmd, sizeof(cmd), "cd '%s' && echo a > f && mv f g && chmod 600 g && rm g", dir);
	CHECK(system(cmd) == 0);
	CHECK(wread_until(a, wid, &c, "remove:g"));
	CHECK_STR(c.text, "create:f write:f rename:f create:g chmod:g remove:g");
	/* a file the agent writes is its file's creation: its temporary file is not shown */
	memset(&c, 0, sizeof(c));
	snprintf(path, sizeof(path), "%s/x.txt", dir);
	{
		int nul = open("/dev/null", O_RDONLY);

		CHECK_INT(agent_file_write(a, path, 0644, fd_src, &nul, 16, &err), KILN_OK);
		close(nul);
	}
	CHECK(wread_until(a, wid, &c, "create:x.txt"));
	CHECK(strstr(c.text, "kiln-") == NULL);
	/* recursive: names below the directory, directories that appear later too */
	CHECK_INT(agent_watch_add(a, dir, true, NULL, &rwid, &err), KILN_OK);
	snprintf(cmd, sizeof(cmd), "mkdir '%s/sub'", dir);
	CHECK(system(cmd) == 0);
	memset(&c, 0, sizeof(c));
	CHECK(wread_until(a, rwid, &c, "create:sub"));
	snprintf(cmd, sizeof(cmd), "touch '%s/sub/deep'", dir);
	CHECK(system(cmd) == 0);
	CHECK(wread_until(a, rwid, &c, "create:sub/deep"));
	/* the non-recursive watch saw the directory, not what is in it */
	memset(&c, 0, sizeof(c));
	CHECK(wread_until(a, wid, &c, "create:sub"));
	CHECK_INT(agent_watch_read(a, wid, 200, wcap_event, &c, &dropped, &ended, &err), KILN_OK);
	CHECK(strstr(c.text, "deep") == NULL);
	/* one read at a time; the directory's end ends the watch */
	CHECK_INT(agent_watch_remove(a, rwid, &err), KILN_OK);
	CHECK_INT(agent_watch_read(a, rwid, 0, NULL, NULL, &dropped, &ended, &err), KILN_E_NOT_FOUND);
	snprintf(cmd, sizeof(cmd), "rm -r '%s'", dir);
	CHECK(system(cmd) == 0);
	ended = false;
	for (t0 = now_ms(); !ended && now_ms() - t0 < 5000;)
		CHECK_INT(agent_watch_read(a, wid, 1000, NULL, NULL, &dropped, &ended, &err), KILN_OK);
	CHECK(ended);
	CHECK_INT(agent_watch_read(a, wid, 0, NULL, NULL, &dropped, &ended, &err), KILN_E_NOT_FOUND);
	CHECK(agent_alive(a));
	stop_agent(a, apid);
}

static void watch_limits_hold(void)
{
	pid_t apid;
	struct agent *a = spawn_agent(&apid);
	struct kiln_error err = { 0 };
	uint32_t wids[AGENT_WATCH_MAX], wid;
	char dir[128], path[256], cmd[300];
	bool dropped = false, ended = false;
	struct wcap c = { 0 };
	int i;

	CHECK_INT(agent_hello(a, 5000, NULL, &err), KILN_OK);
	snprintf(dir, sizeof(dir), "%s/many", tmpdir);
	CHECK(mkdir(dir, 0755) == 0);
	snprintf(path, sizeof(path), "%s/file", dir);
	CHECK(close(open(path, O_CREAT | O_WRONLY, 0644)) == 0);
	CHECK_INT(agent_watch_add(a, path, false, NULL, &wid, &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "not a directory") != NULL);
	kiln_error_clear(&err);
	CHECK_INT(agent_watch_add(a, "/nonexistent-dir", false, NULL, &wid, &err), KILN_E_NOT_FOUND);
	kiln_error_clear(&err);
	CHECK_INT(agent_watch_add(a, "relative", false, NULL, &wid, &err), KILN_E_INVALID);
	kiln_error_clear(&err);
	CHECK_INT(agent_watch_add(a, dir, false, "no-such-user", &wid, &err), KILN_E_INVALID);
	kiln_error_clear(&err);
	for (i = 0; i < AGENT_WATCH_MAX; i++)
		CHECK_INT(agent_watch_add(a, dir, false, NULL, &wids[i], &err), KILN_OK);
	CHECK_INT(agent_watch_add(a, dir, false, NULL, &wid, &err), KILN_E_RATE_LIMITED);
	kiln_error_clear(&err);
	CHECK_INT(agent_watch_remove(a, wids[0], &err), KILN_OK);
	CHECK_INT(agent_watch_remove(a, wids[0], &err), KILN_E_NOT_FOUND);
	kiln_error_clear(&err);
	for (i = 2; i < AGENT_WATCH_MAX; i++)
		CHECK_INT(agent_watch_remove(a, wids[i], &err), KILN_OK);
	/* more events than the agent keeps: the next read says some were dropped */
	snprintf(cmd, sizeof(cmd), "cd '%s' && seq 5000 | xargs touch", dir);
	CHECK(system(cmd) == 0);
	for (i = 0; i < 200 && !dropped; i++)
		CHECK_INT(agent_watch_read(a, wids[1], 200, wcap_event, &c, &dropped, &ended, &err),
			  KILN_OK);
	CHECK(dropped);
	CHECK(c.n > 0 && c.n <= 4096);
	CHECK(!ended);
	CHECK(agent_alive(a));
	stop_agent(a, apid);
}

int main(int argc, char **argv)
{
	char cmd[128];
	int rc;

	if (argc < 2) {
		fprintf(stderr, "usage: test_agent_client PATH-TO-KILN-AGENT\n");
		return 2;
	}
	agent_bin = argv[1];
	signal(SIGPIPE, SIG_IGN);
	snprintf(tmpdir, sizeof(tmpdir), "/tmp/kiln-agent-test.XXXXXX");
	if (!mkdtemp(tmpdir))
		return 1;
	TEST(hello_reports_version_and_kernel);
	TEST(exec_runs_argv_with_env_cwd_and_stdin);
	TEST(exec_of_missing_program_is_127_with_message);
	TEST(exec_timeout_kills_the_process_group);
	TEST(exec_output_streams_before_exit);
	TEST(execs_run_at_once);
	TEST(file_round_trip_is_byte_exact);
	TEST(file_errors_map_to_codes);
	TEST(file_write_makes_parent_directories);
	TEST(exec_and_files_run_as_the_named_user);
	TEST(large_output_arrives_whole_through_flow_control);
	TEST(agent_itself_rejects_bad_requests);
	TEST(hostile_guests_fail_the_sandbox);
	TEST(grow_root_replies_are_checked);
	TEST(port_stream_echoes_both_ways);
	TEST(port_stream_slow_reader_stalls_only_itself);
	TEST(port_stream_errors);
	TEST(port_stream_hostile_guests);
	TEST(procs_outlive_attach_take_stdin_and_signals);
	TEST(proc_stdin_eof_and_timeout);
	TEST(proc_ring_keeps_the_tail);
	TEST(proc_pty_runs_a_shell_with_resize);
	TEST(proc_limits_hold);
	TEST(procs_refused_to_an_old_agent);
	TEST(watches_report_events_in_order);
	TEST(watch_limits_hold);
	rc = test_summary();
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
	if (system(cmd) != 0)
		fprintf(stderr, "cannot remove '%s'\n", tmpdir);
	return rc;
}
