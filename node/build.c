/*
 * build.c - template builds on this node (build.h, docs/templates.md).
 *
 * The gateway parses a version's Dockerfile when it is uploaded, moves the version to building on
 * one node (at most template_max_builds per tenant) and streams the build context here, where it
 * is written to <data_dir>/builds/<node>/<template>-<version>.tar and never read: nothing of it
 * is unpacked or run on the host. A thread then:
 *
 *   1. creates a builder sandbox of the tenant from the FROM template (the base's warm image, or
 *      the tenant's template's) under the version's egress rules: an ordinary sandbox, billed as
 *      sandbox time and listed with metadata {"kiln.template_build": "<id>/<version>"};
 *   2. at the first COPY/ADD (the steps before never see it), copies the tar in with the agent's
 *      file op and unpacks it there with tar(1); the .dockerignore is read from the guest,
 *      matched here (common/dockerfile.c) against the listing the guest gives, and what it
 *      excludes is removed in the guest;
 *   3. runs each step through the agent's exec: RUN as USER in WORKDIR with the ENV and ARG
 *      values in its environment, COPY/ADD as cp(1) inside the guest from the unpacked context,
 *      every output line into the build log (template_build_log, read by the gateway);
 *   4. starts the start command (the version's start_cmd, else CMD/ENTRYPOINT) detached, waits
 *      for the ready check (ready_cmd exiting 0), and snapshots memory and disk (shared, like a
 *      base template), whose size the host measures against template_image_max_bytes (the
 *      guest's own figure is checked before, to fail early):
 *      that snapshot (kind build) is the version's warm image, restored copy-on-write by every
 *      create from it;
 *   5. deletes the builder sandbox. The whole build is bounded by template_build_max_s.
 *
 * A version without a Dockerfile imports an image instead (build_image): the uploaded archive
 * (an OCI layout or a docker save archive), or, for a pull, nothing is uploaded: a VM of its own
 * (image_pull) pulls the version's image_ref with skopeo, its sealed credentials opened here
 * only to be written to that VM's tmpfs for that command, and the image it wrote is read out as
 * an uploaded archive and imported by the builder, which never holds the credentials (the
 * puller's memory, unlike the builder's, is never saved).
 *
 * A failing step, limit or error marks the version failed with the reason (also in the log) and
 * leaves nothing else behind: no snapshot, no builder.
 */
#include "node/build.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "auth/apikey.h"
#include "auth/crypto.h"
#include "common/clock.h"
#include "common/dockerfile.h"
#include "common/fsutil.h"
#include "common/imageref.h"
#include "common/json.h"
#include "common/log.h"
#include "metering/plan.h"
#include "netpolicy/policy.h"
#include "node/create.h"
#include "node/lifecycle.h"
#include "node/nodereq.h"
#include "node/storage_sync.h"
#include "node/template.h"
#include "vmm/agent.h"
#include "vmm/hv.h"

#define BUILD_DIR "/var/tmp/kiln-build"	/* in the guest: the tar and the unpacked context */
#define BUILD_CTX BUILD_DIR "/ctx"
#define BUILD_CAPTURE_MAX (16u << 20)	/* bytes of a listing or .dockerignore read back */
#define BUILD_STDIN_MAX (256u << 10)	/* bytes of paths handed to one rm in the guest */
#define BUILD_ENV_MAX 1024		/* ENV and ARG variables of one build */
#define BUILD_READY_TRY_MS 10000	/* one run of the ready check */
#define LAYER_KEY_LEN 64		/* hex SHA-256 */

static pthread_mutex_t builds_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t builds_cond = PTHREAD_COND_INITIALIZER;
static int builds_running;

/* One upload, then one build. */
struct build {
	struct node *n;
	char tmpl[AUTH_ID_MAX];
	int version;
	char tenant[AUTH_CLAIM_MAX];
	char tar[600];
	int fd;
	long long bytes;
	enum kiln_err refused;		/* why the upload was not taken */
	bool image;			/* an OCI image archive to import, not a build context */
	bool pull;			/* an image pulled from a registry: no upload */
	char *image_ref;		/* what a pull pulls (common/imageref's canonical form) */
	char *registry_auth;		/* its credentials, sealed (pull_seal of the gateway) */
	bool tls_verify;
	/* the build */
	char builder[AUTH_ID_MAX];
	struct sandbox *sb;
	long long deadline_ms;	/* CLOCK_MONOTONIC: no wall-clock step cuts or stretches it */
	long long log_bytes;
	bool log_cut;
	struct dockerfile df;
	char *env[BUILD_ENV_MAX + 1];	/* "K=v" of ENV and ARG, NULL-terminated */
	size_t nenv;
	json_t *image_env;		/* ENV only, for the sandboxes made from it */
	char *workdir, *user;
	char reason[KILN_ERRMSG_MAX];
	/* the builders and the layer cache */
	const char *egress;		/* the version's egress rules (JSON text), or NULL: open */
	struct kiln_ruleset *rules;	/* those rules parsed, or NULL */
	unsigned shape[3];		/* vCPUs (milli), memory (MiB), disk (GiB) */
	bool cache;			/* each disk step's result is kept as a layer */
	bool ctx_in;			/* the current builder holds the unpacked context */
	bool ctx_keyed;			/* the context's hash is in b->key */
	char key[LAYER_KEY_LEN + 1];	/* the layer key of the steps so far */
	/* the layers this build stands on, never evicted by it: "{snap_a,snap_b}" (a text[]) */
	char chain[(DOCKERFILE_MAX_STEPS + 1) * AUTH_ID_MAX + 3];
};

static void build_free(struct build *b)
{
	if (!b)
		return;
	if (b->fd >= 0)
		close(b->fd);
	dockerfile_free(&b->df);
	for (size_t i = 0; i < b->nenv; i++)
		free(b->env[i]);
	json_decref(b->image_env);
	free(b->workdir);
	free(b->user);
	free(b->image_ref);
	free(b->registry_auth);
	free(b);
}

/* b->tar := <data_dir>/builds/<node>/<template>-<version>.tar, its directory made. */
static bool build_tar_path(struct build *b)
{
	char dir[600];

	return fs_path(dir, "%s/builds/%s", b->n->cfg.data_dir, b->n->cfg.node_id) &&
	       fs_mkdir_p(dir, 0700) == 0 &&
	       fs_path(b->tar, "%s/%s-%d.tar", dir, b->tmpl, b->version);
}

/* The version's source_format of what `b` builds. */
static const char *build_format(const struct build *b)
{
	return b->pull ? "registry" : b->image ? "oci-archive" : "context";
}

/* ---- the log ---- */

/* Appends `len` bytes to the version's log, as text: control bytes but \n and \t become '?'. */
static void build_log_raw(struct build *b, const char *data, size_t len)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	char *t, v[16];
	long long max = b->n->cfg.template_build_log_max_bytes;

	if (b->log_cut || !len)
		return;
	if (b->log_bytes + (long long)len > max) {
		len = (size_t)(max - b->log_bytes);
		b->log_cut = true;
	}
	t = malloc(len + 64);
	if (!t)
		return;
	for (size_t i = 0; i < len; i++) {
		unsigned char ch = (unsigned char)data[i];
		t[i] = (ch == '\n' || ch == '\t' || (ch >= 0x20 && ch < 0x7f)) ? (char)ch : '?';
	}
	t[len] = '\0';
	if (b->log_cut)
		snprintf(t + len, 64, "\n[the log is cut: template_build_log_max_bytes]\n");
	b->log_bytes += (long long)len;
	snprintf(v, sizeof(v), "%d", b->version);
	if (pg_acquire(b->n->pg, &c, &err) == KILN_OK) {
		if (PGQ(c, NULL, &err,
			"INSERT INTO template_build_log (template_id, version, chunk) "
			"VALUES ($1, $2::int, $3)",
			b->tmpl, v, t) != KILN_OK)
			log_warn("build log of %s/%d not written: %s", b->tmpl, b->version, err.msg);
		pg_release(b->n->pg, c);
	}
	free(t);
}

static void build_log(struct build *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void build_log(struct build *b, const char *fmt, ...)
{
	char line[KILN_ERRMSG_MAX + 256];
	va_list ap;
	int k;

	va_start(ap, fmt);
	k = vsnprintf(line, sizeof(line) - 1, fmt, ap);
	va_end(ap);
	if (k < 0)
		return;
	if ((size_t)k > sizeof(line) - 2)
		k = (int)sizeof(line) - 2;
	line[k++] = '\n';
	build_log_raw(b, line, (size_t)k);
}

static int log_output(void *ctx, enum agent_stream stream, const uint8_t *data, size_t len)
{
	(void)stream;
	build_log_raw(ctx, (const char *)data, len);
	return 0;
}

/* ---- running things in the builder ---- */

/* Milliseconds left of the build, at least 1; 0 once it is over. */
static uint32_t build_left_ms(const struct build *b)
{
	long long now = clock_mono_ms();

	return now >= b->deadline_ms ? 0 : (uint32_t)(b->deadline_ms - now);
}

static enum kiln_err build_timeout(struct build *b, struct kiln_error *err)
{
	return kiln_error_set(err, KILN_E_QUOTA,
			      "the build took longer than template_build_max_s (%lld s)",
			      b->n->cfg.template_build_max_s);
}

struct capture {
	char *data;
	size_t len, cap;
	bool over;
};

static int capture_output(void *ctx, enum agent_stream stream, const uint8_t *data, size_t len)
{
	struct capture *c = ctx;

	if (stream != AGENT_STDOUT)
		return 0;
	if (c->len + len + 1 > BUILD_CAPTURE_MAX) {
		c->over = true;
		return 1;
	}
	if (c->len + len + 1 > c->cap) {
		size_t cap = (c->len + len + 1) * 2;
		char *p = realloc(c->data, cap);
		if (!p)
			return 1;
		c->data = p;
		c->cap = cap;
	}
	memcpy(c->data + c->len, data, len);
	c->len += len;
	c->data[c->len] = '\0';
	return 0;
}

/*
 * Runs `x` in the builder within the build's time; the output goes to the log, or to `cap` when
 * given. *code is the exit status (a timeout is the build's limit).
 */
static enum kiln_err build_exec(struct build *b, struct agent_exec_req *x, struct capture *cap,
				int *code, struct kiln_error *err)
{
	struct agent_exec_result res = { 0 };
	uint32_t left = build_left_ms(b);
	bool capped;	/* the exec's time is what is left of the build's */
	enum kiln_err rc;

	if (!left)
		return build_timeout(b, err);
	if (b->n->stopping)
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "the node is stopping");
	capped = !x->timeout_ms || x->timeout_ms >= left;
	if (capped)
		x->timeout_ms = left;
	pthread_mutex_lock(&b->n->reg_lock);
	b->sb->execs++;
	pthread_mutex_unlock(&b->n->reg_lock);
	if (!b->sb->agent)
		rc = kiln_error_set(err, KILN_E_SANDBOX_FAILED, "the builder sandbox stopped");
	else
		rc = agent_exec(b->sb->agent, x, cap ? capture_output : log_output, cap ? (void *)cap : b,
				&res, err);
	pthread_mutex_lock(&b->n->reg_lock);
	b->sb->execs--;
	pthread_mutex_unlock(&b->n->reg_lock);
	if (rc != KILN_OK)
		return cap && cap->over ? kiln_error_set(err, KILN_E_TOO_LARGE,
							 "the guest's answer is larger than %u bytes",
							 BUILD_CAPTURE_MAX)
					: rc;
	/* The guest times the exec on its own clock, which under TCG may run ahead of the host's:
	 * an exec cut at the build's end is the build's timeout whatever the host's clock reads. */
	if (res.timed_out && (capped || build_left_ms(b) == 0))
		return build_timeout(b, err);
	*code = res.exit_code;
	return KILN_OK;
}

/* Runs shell code as root in the builder; a non-zero exit fails with `what`. */
static enum kiln_err build_sh(struct build *b, const char *code, const char *const *args,
			      struct capture *cap, const char *what, struct kiln_error *err)
{
	const char *argv[16] = { "/bin/sh", "-c", code, "sh" };
	struct agent_exec_req x = { .argv = argv };
	int st = 0, k = 4;
	enum kiln_err rc;

	for (; args && *args && k < 15; args++)
		argv[k++] = *args;
	argv[k] = NULL;
	rc = build_exec(b, &x, cap, &st, err);
	if (rc == KILN_OK && st != 0)
		rc = kiln_error_set(err, KILN_E_INVALID, "%s failed (exit status %d)", what, st);
	return rc;
}

/* ---- the steps ---- */

/* Sets `name` to `value` in the build's environment (ENV and ARG). */
static enum kiln_err env_set(struct build *b, const char *name, const char *value, bool image,
			     struct kiln_error *err)
{
	size_t nl = strlen(name);
	char *kv;

	if (image && json_object_set_new(b->image_env, name, json_string(value)) != 0)
		return kiln_error_set(err, KILN_E_INVALID, "ENV %s: the value is not valid UTF-8",
				      name);
	if (asprintf(&kv, "%s=%s", name, value) < 0)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	for (size_t i = 0; i < b->nenv; i++)
		if (strncmp(b->env[i], name, nl) == 0 && b->env[i][nl] == '=') {
			free(b->env[i]);
			b->env[i] = kv;
			return KILN_OK;
		}
	if (b->nenv >= BUILD_ENV_MAX) {
		free(kv);
		return kiln_error_set(err, KILN_E_INVALID, "more than %d variables", BUILD_ENV_MAX);
	}
	b->env[b->nenv++] = kv;
	b->env[b->nenv] = NULL;
	return KILN_OK;
}

/* The account part of a USER value (a group given after ':' is not applied). */
static void user_of(const char *spec, char *out, size_t len)
{
	size_t k = strcspn(spec, ":");

	snprintf(out, len, "%.*s", (int)(k < len ? k : len - 1), spec);
}

static enum kiln_err step_run(struct build *b, const struct df_step *s, struct kiln_error *err)
{
	const char *argv[DOCKERFILE_MAX_STEPS + 1];
	char user[64] = "";
	struct agent_exec_req x = { .env = (const char *const *)b->env, .cwd = b->workdir };
	int st = 0;
	enum kiln_err rc;

	if (s->shell) {
		x.shell = s->argv[0];
	} else {
		size_t k = s->argc < DOCKERFILE_MAX_STEPS ? s->argc : DOCKERFILE_MAX_STEPS;
		for (size_t i = 0; i < k; i++)
			argv[i] = s->argv[i];
		argv[k] = NULL;
		x.argv = argv;
	}
	if (b->user) {
		user_of(b->user, user, sizeof(user));
		x.user = user;
	}
	rc = build_exec(b, &x, NULL, &st, err);
	if (rc == KILN_OK && st != 0)
		rc = kiln_error_set(err, KILN_E_INVALID,
				    "Dockerfile line %u: RUN failed (exit status %d)", s->line, st);
	return rc;
}

/*
 * COPY/ADD: the sources (wildcards expanded by the guest's shell, nothing else: no command
 * substitution reaches them) copied from the unpacked context; a directory's contents go into
 * the destination, as Docker does.
 */
static enum kiln_err step_copy(struct build *b, const struct df_step *s, struct kiln_error *err)
{
	static const char script[] =
		"set -e; cd " BUILD_CTX "; dest=$1; chown=$2; shift 2; IFS=\n"
		"for s in \"$@\"; do found=\n"
		"  for f in $s; do\n"
		"    [ -e \"$f\" ] || [ -L \"$f\" ] || continue; found=1\n"
		"    if [ -d \"$f\" ] && [ ! -L \"$f\" ]; then mkdir -p \"$dest\"; cp -a \"$f\"/. \"$dest\"/;"
		"      t=$dest\n"
		"    else case $dest in */) mkdir -p \"$dest\"; cp -a \"$f\" \"$dest\"; t=$dest${f##*/};;"
		"      *) mkdir -p \"$(dirname \"$dest\")\"; cp -a \"$f\" \"$dest\"; t=$dest;; esac\n"
		"    fi\n"
		"    [ -z \"$chown\" ] || chown -R \"$chown\" \"$t\"\n"
		"  done\n"
		"  [ -n \"$found\" ] || { echo \"no file in the build context matches $s\" >&2; exit 1; }\n"
		"done\n";
	const char *argv[DOCKERFILE_MAX_STEPS + 8] = { "/bin/sh", "-c", script, "sh" };
	struct agent_exec_req x = { .argv = argv };
	size_t k = 4;
	int st = 0;
	enum kiln_err rc;

	if (s->argc < 2 || s->argc > DOCKERFILE_MAX_STEPS)
		return kiln_error_set(err, KILN_E_INVALID, "Dockerfile line %u: bad %s", s->line,
				      dockerfile_kind_name(s->kind));
	argv[k++] = s->argv[s->argc - 1];
	argv[k++] = s->chown ? s->chown : "";
	for (size_t i = 0; i + 1 < s->argc; i++)
		argv[k++] = s->argv[i];
	argv[k] = NULL;
	rc = build_exec(b, &x, NULL, &st, err);
	if (rc == KILN_OK && st != 0)
		rc = kiln_error_set(err, KILN_E_INVALID, "Dockerfile line %u: %s failed", s->line,
				    dockerfile_kind_name(s->kind));
	return rc;
}

static enum kiln_err step_one(struct build *b, const struct df_step *s, struct kiln_error *err)
{
	enum kiln_err rc = KILN_OK;

	switch (s->kind) {
	case DF_RUN:
		return step_run(b, s, err);
	case DF_COPY:
	case DF_ADD:
		return step_copy(b, s, err);
	case DF_ENV:
	case DF_ARG:
		for (size_t i = 0; rc == KILN_OK && i + 1 < s->argc; i += 2)
			if (s->argv[i + 1])
				rc = env_set(b, s->argv[i], s->argv[i + 1], s->kind == DF_ENV, err);
		return rc;
	case DF_WORKDIR: {
		const char *args[] = { s->argv[0], NULL };
		free(b->workdir);
		b->workdir = strdup(s->argv[0]);
		if (!b->workdir)
			return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return build_sh(b, "mkdir -p -- \"$1\"", args, NULL, "WORKDIR", err);
	}
	case DF_USER:
		free(b->user);
		b->user = strdup(s->argv[0]);
		return b->user ? KILN_OK : kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	return KILN_OK;
}

/* ---- the context ---- */

/* Copies the tar in and unpacks it; then applies the .dockerignore found in it. */
static enum kiln_err build_context(struct build *b, struct kiln_error *err)
{
	struct capture ign = { 0 }, list = { 0 };
	struct dockerignore di = { 0 };
	enum kiln_err rc;
	int fd;

	rc = build_sh(b, "rm -rf " BUILD_DIR " && mkdir -p " BUILD_CTX, NULL, NULL,
		      "making the build directory", err);
	if (rc != KILN_OK)
		return rc;
	fd = open(b->tar, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return fs_err(err, -errno, "open", b->tar);
	rc = agent_file_write_fd(b->sb->agent, BUILD_DIR "/context.tar", 0600, fd,
				 (uint64_t)b->n->cfg.template_source_max_bytes, err);
	close(fd);
	if (rc != KILN_OK)
		return rc;
	rc = build_sh(b, "tar -x --no-same-owner -f " BUILD_DIR "/context.tar -C " BUILD_CTX
			 " && rm -f " BUILD_DIR "/context.tar",
		      NULL, NULL, "unpacking the build context (is it a tar?)", err);
	if (rc != KILN_OK)
		return rc;
	rc = build_sh(b, "cat " BUILD_CTX "/.dockerignore 2>/dev/null || true", NULL, &ign,
		      "reading .dockerignore", err);
	if (rc == KILN_OK && ign.len)
		rc = dockerignore_parse(ign.data, ign.len, &di, err);
	if (rc == KILN_OK && di.n)
		rc = build_sh(b, "cd " BUILD_CTX " && find . -mindepth 1 -printf '%y%P\\0'", NULL,
			      &list, "listing the build context", err);
	if (rc == KILN_OK && di.n) {
		/* Excluded files go; excluded directories go when nothing in them was kept. */
		char *files = malloc(BUILD_STDIN_MAX), *dirs = malloc(list.len + 1);
		size_t fl = 0, dl = 0, excluded = 0;

		if (!files || !dirs)
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		for (size_t i = 0; rc == KILN_OK && i < list.len;) {
			const char *e = list.data + i;
			size_t el = strnlen(e, list.len - i);
			char type = e[0];

			i += el + 1;
			if (el < 2 || !dockerignore_excluded(&di, e + 1))
				continue;
			excluded++;
			if (type == 'd') {
				memcpy(dirs + dl, e + 1, el);	/* with its NUL */
				dl += el;
				continue;
			}
			if (fl + el > BUILD_STDIN_MAX) {
				struct agent_exec_req x = {
					.argv = (const char *const[]){ "sh", "-c",
						"cd " BUILD_CTX " && xargs -0 rm -f --", NULL },
					.stdin_data = files, .stdin_len = fl };
				int st = 0;
				rc = build_exec(b, &x, NULL, &st, err);
				if (rc == KILN_OK && st)
					rc = kiln_error_set(err, KILN_E_INVALID, "applying .dockerignore failed");
				fl = 0;
			}
			memcpy(files + fl, e + 1, el);
			fl += el;
		}
		if (rc == KILN_OK && fl) {
			struct agent_exec_req x = {
				.argv = (const char *const[]){ "sh", "-c",
					"cd " BUILD_CTX " && xargs -0 rm -f --", NULL },
				.stdin_data = files, .stdin_len = fl };
			int st = 0;
			rc = build_exec(b, &x, NULL, &st, err);
			if (rc == KILN_OK && st)
				rc = kiln_error_set(err, KILN_E_INVALID, "applying .dockerignore failed");
		}
		/* Deepest first: the listing has parents before children. */
		for (size_t end = dl; rc == KILN_OK && end > 0;) {
			size_t start = end - 1;
			while (start > 0 && dirs[start - 1] != '\0')
				start--;
			{
				const char *args[] = { dirs + start, NULL };
				rc = build_sh(b, "cd " BUILD_CTX " && rmdir -- \"$1\" 2>/dev/null || true",
					      args, NULL, "applying .dockerignore", err);
			}
			end = start;
		}
		if (rc == KILN_OK)
			build_log(b, "# .dockerignore: %zu paths of the context left out", excluded);
		free(files);
		free(dirs);
	}
	dockerignore_free(&di);
	free(ign.data);
	free(list.data);
	b->ctx_in = rc == KILN_OK;
	return rc;
}

/* ---- an imported image ---- */

#define IMAGE_NEW "/kiln-new"		/* in the builder: umoci's bundle; its rootfs becomes / */

/*
 * The builder's root replaced by the unpacked image's, by a Python process of the base image that
 * has loaded all it needs before the first rename (nothing is executed from the old root once it
 * goes): every entry of / but the mount points moves aside and is deleted, the image's entries
 * take its place. It prints the bytes in use on / afterwards.
 */
static const char image_swap_py[] =
	"import os, shutil, sys\n"
	"keep = {'proc', 'sys', 'dev', 'run', 'tmp', 'lost+found', 'kiln-new', 'kiln-old'}\n"
	"new = '" IMAGE_NEW "/rootfs'\n"
	"os.mkdir('/kiln-old')\n"
	"for e in os.listdir('/'):\n"
	"    if e not in keep:\n"
	"        os.rename('/' + e, '/kiln-old/' + e)\n"
	"for e in os.listdir(new):\n"
	"    if e not in keep:\n"
	"        os.rename(new + '/' + e, '/' + e)\n"
	"shutil.rmtree('/kiln-old')\n"
	"shutil.rmtree('" IMAGE_NEW "')\n"
	"os.sync()\n"
	"st = os.statvfs('/')\n"
	"sys.stdout.write('%d\\n' % ((st.f_blocks - st.f_bfree) * st.f_frsize))\n";

/*
 * The image's runtime configuration (umoci's config.json): its ENV becomes the version's, its
 * working directory the WORKDIR and its uid, named by the image's /etc/passwd, the USER.
 */
static enum kiln_err image_config(struct build *b, const char *text, size_t len,
				  struct kiln_error *err)
{
	json_t *cfg = json_loadb(text, len, 0, NULL), *proc, *env, *v;
	const char *cwd;
	size_t i;
	enum kiln_err rc = KILN_OK;

	proc = cfg ? json_object_get(cfg, "process") : NULL;
	if (!json_is_object(proc)) {
		json_decref(cfg);
		return kiln_error_set(err, KILN_E_INVALID, "the image's configuration is unreadable");
	}
	env = json_object_get(proc, "env");
	json_array_foreach(env, i, v) {
		const char *kv = json_string_value(v), *eq = kv ? strchr(kv, '=') : NULL;
		char name[256];

		if (!eq || eq == kv || (size_t)(eq - kv) >= sizeof(name))
			continue;
		snprintf(name, sizeof(name), "%.*s", (int)(eq - kv), kv);
		rc = env_set(b, name, eq + 1, true, err);
		if (rc != KILN_OK)
			break;
	}
	cwd = json_string_value(json_object_get(proc, "cwd"));
	if (rc == KILN_OK && cwd && cwd[0] == '/' && strcmp(cwd, "/") != 0) {
		b->workdir = strdup(cwd);
		if (!b->workdir)
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	json_decref(cfg);
	return rc;
}

#define PULL_AUTH "/run/kiln-pull-auth.json"	/* in the builder (tmpfs): a pull's credentials */

/*
 * A pull's credentials as skopeo's auth file, written into the builder's tmpfs: the sealed
 * "username:password" opened with the master key (bound to the tenant, template and version as
 * the gateway sealed it) and base64'd under the registry's key. Never logged.
 */
static enum kiln_err pull_auth_write(struct build *b, const struct imageref *ref,
				     struct kiln_error *err)
{
	unsigned char *pt = NULL;
	size_t ptlen = 0;
	char ad[AUTH_CLAIM_MAX + AUTH_ID_MAX + 48], *b64 = NULL, *json = NULL;
	enum kiln_err rc;
	int fd = -1, n = -1;

	if (!b->n->inject)	/* loaded with the master key, as secrets (node/secrets.c) */
		return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED,
				      "registry credentials need a master key on the build's node");
	snprintf(ad, sizeof(ad), "template-registry:%s:%s:%d", b->tenant, b->tmpl, b->version);
	rc = auth_open(&b->n->mk, b->registry_auth, strlen(b->registry_auth), ad, strlen(ad),
			       &pt, &ptlen, err);
	if (rc == KILN_OK) {
		b64 = malloc(4 * ((ptlen + 2) / 3) + 1);
		if (b64)
			EVP_EncodeBlock((unsigned char *)b64, pt, (int)ptlen);
		n = b64 ? asprintf(&json, "{\"auths\": {\"%s\": {\"auth\": \"%s\"}}}\n", ref->registry,
				   b64) : -1;
		if (n < 0) {
			json = NULL;
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		}
	}
	if (rc == KILN_OK) {
		fd = memfd_create("kiln-pull-auth", MFD_CLOEXEC);
		if (fd < 0 || write(fd, json, (size_t)n) != n || lseek(fd, 0, SEEK_SET) != 0)
			rc = kiln_error_set(err, KILN_E_IO, "the registry's credentials cannot be "
					    "handed to the builder");
	}
	if (rc == KILN_OK)
		rc = agent_file_write_fd(b->sb->agent, PULL_AUTH, 0600, fd, 65536, err);
	if (fd >= 0)
		close(fd);
	if (b64)
		OPENSSL_cleanse(b64, strlen(b64));
	if (json)
		OPENSSL_cleanse(json, (size_t)n);
	free(b64);
	free(json);
	auth_secret_free(pt, ptlen);
	return rc;
}

/*
 * Brings the image into the builder as an OCI layout `oci` in BUILD_DIR, tagged `latest` or
 * named by its index: the archive (uploaded, or written by image_pull) copied in and untarred (a
 * docker save archive converted by skopeo).
 */
static enum kiln_err image_fetch(struct build *b, struct kiln_error *err)
{
	static const char unpack[] =
		"set -e; cd " BUILD_DIR "\n"
		"mkdir oci; tar -x --no-same-owner -f image.tar -C oci\n"
		"if [ -f oci/oci-layout ]; then rm -f image.tar\n"
		"elif [ -f oci/manifest.json ]; then\n"
		"  echo '# a docker save archive: converting its first image with skopeo'\n"
		"  rm -rf oci\n"
		"  skopeo --insecure-policy copy --quiet docker-archive:image.tar:@0 oci:oci:latest ||\n"
		"    { echo 'not a docker save archive skopeo can read' >&2; exit 2; }\n"
		"  rm -f image.tar\n"
		"else\n"
		"  echo 'not an OCI image archive: it holds neither an oci-layout file nor a docker"
		" save manifest.json' >&2; exit 2\n"
		"fi\n";
	enum kiln_err rc;
	int fd;

	fd = open(b->tar, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return fs_err(err, -errno, "open", b->tar);
	rc = agent_file_write_fd(b->sb->agent, BUILD_DIR "/image.tar", 0600, fd,
				 (uint64_t)b->n->cfg.template_source_max_bytes, err);
	close(fd);
	if (rc == KILN_OK)
		rc = build_sh(b, unpack, NULL, NULL, "unpacking the image", err);
	return rc;
}

/*
 * Imports the image: brings it into the builder (the base image, which holds umoci and skopeo)
 * as an OCI layout (image_fetch), unpacks it there with umoci into a root file system (layers in
 * order, whiteouts, ownership, xattrs), adds Kiln's pieces (the static agent, init's table, the
 * network files), reads the image's configuration, and makes the image's root the builder's.
 * Nothing of the image is read on the host.
 */
static enum kiln_err build_image(struct build *b, struct kiln_error *err)
{
	static const char unpack[] =
		"set -e; cd " BUILD_DIR "\n"
		"tag=$(umoci ls --layout oci | head -n 1)\n"
		"[ -n \"$tag\" ] || { echo 'the archive names no image"
		" (org.opencontainers.image.ref.name in index.json)' >&2; exit 2; }\n"
		"echo \"# unpacking oci:$tag\"\n"
		"umoci unpack --image \"oci:$tag\" " IMAGE_NEW "\n"
		"rm -rf oci\n"
		"r=" IMAGE_NEW "/rootfs\n"
		"[ -x \"$r/bin/sh\" ] || [ -L \"$r/bin/sh\" ] ||"
		" echo '# the image has no /bin/sh: commands run only in exec form' \n"
		"for d in proc sys dev run tmp; do rm -rf \"$r/$d\"; done\n"
		"rm -rf \"$r/usr/local/bin/kiln-agent\" \"$r/etc/inittab\" \"$r/etc/kiln\"\n"
		"mkdir -p \"$r/usr/local/bin\" \"$r/etc\"\n"
		"cp /usr/local/bin/kiln-agent \"$r/usr/local/bin/kiln-agent\"\n"
		"cp /etc/inittab \"$r/etc/inittab\"; cp -r /etc/kiln \"$r/etc/kiln\"\n"
		"for f in hosts resolv.conf hostname; do rm -f \"$r/etc/$f\"; cp /etc/$f \"$r/etc/$f\"; done\n";
	struct capture cfg = { 0 }, user = { 0 }, used = { 0 };
	enum kiln_err rc;
	long long bytes;

	rc = build_sh(b, "rm -rf " BUILD_DIR " " IMAGE_NEW " /kiln-old && mkdir -p " BUILD_DIR,
		      NULL, NULL, "making the build directory", err);
	if (rc == KILN_OK)
		rc = image_fetch(b, err);
	if (rc == KILN_OK)
		rc = build_sh(b, unpack, NULL, NULL, "unpacking the image", err);
	if (rc == KILN_OK)
		rc = build_sh(b, "cat " IMAGE_NEW "/config.json", NULL, &cfg,
			      "reading the image's configuration", err);
	if (rc == KILN_OK)
		rc = image_config(b, cfg.data ? cfg.data : "", cfg.len, err);
	if (rc == KILN_OK) {
		/* The image's uid by its name in the image's own /etc/passwd, as the agent takes it. */
		static const char who[] =
			"import json, sys\n"
			"u = json.load(open('" IMAGE_NEW "/config.json'))['process']['user'].get('uid', 0)\n"
			"if u:\n"
			"    for l in open('" IMAGE_NEW "/rootfs/etc/passwd', errors='replace'):\n"
			"        f = l.split(':')\n"
			"        if len(f) > 2 and f[2] == str(u):\n"
			"            sys.stdout.write(f[0])\n"
			"            break\n"
			"    else:\n"
			"        sys.exit(\"the image's user (uid %d) has no account in its /etc/passwd\" % u)\n";
		const char *argv[] = { "/usr/bin/python3", "-c", who, NULL };
		struct agent_exec_req x = { .argv = argv };
		int st = 0;

		rc = build_exec(b, &x, &user, &st, err);
		if (rc == KILN_OK && st != 0)
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "the image's user has no account in its /etc/passwd");
	}
	if (rc == KILN_OK && user.len) {
		b->user = strdup(user.data);
		if (!b->user)
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	if (rc == KILN_OK) {
		const char *argv[] = { "/usr/bin/python3", "-c", image_swap_py, NULL };
		struct agent_exec_req x = { .argv = argv };
		int st = 0;

		rc = build_exec(b, &x, &used, &st, err);
		if (rc == KILN_OK && st != 0)
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "making the image the root file system failed (exit "
					    "status %d)",
					    st);
	}
	if (rc == KILN_OK) {
		/* The guest's word, checked early; the host measures the saved image again. */
		bytes = used.data ? atoll(used.data) : 0;
		build_log(b, "# image unpacked: env %zu, workdir %s, user %s; file system: %lld bytes "
			  "in use",
			  json_object_size(b->image_env), b->workdir ? b->workdir : "/",
			  b->user ? b->user : "root", bytes);
		if (bytes > b->n->cfg.template_image_max_bytes)
			rc = kiln_error_set(err, KILN_E_QUOTA,
					    "the image's file system uses %lld bytes, more than "
					    "template_image_max_bytes (%lld)",
					    bytes, b->n->cfg.template_image_max_bytes);
	}
	free(cfg.data);
	free(user.data);
	free(used.data);
	return rc;
}

/* ---- the end: start, ready, size, snapshot ---- */

/* `s` as one single-quoted shell word appended to `out`; false when it does not fit. */
static bool sh_quote(char *out, size_t cap, size_t *len, const char *s)
{
	if (*len + 3 > cap)
		return false;
	out[(*len)++] = '\'';
	for (; *s; s++) {
		if (*s == '\'') {
			if (*len + 5 > cap)
				return false;
			memcpy(out + *len, "'\\''", 4);
			*len += 4;
		} else {
			if (*len + 3 > cap)
				return false;
			out[(*len)++] = *s;
		}
	}
	out[(*len)++] = '\'';
	out[*len] = '\0';
	return true;
}

static enum kiln_err build_start(struct build *b, const char *start_cmd, const char *ready_cmd,
				 struct kiln_error *err)
{
	char cmd[DOCKERFILE_MAX_LINE + 1024], user[64] = "";
	size_t len = 0;
	enum kiln_err rc;
	int st = 0;

	if (start_cmd) {
		snprintf(cmd, sizeof(cmd), "%s", start_cmd);
	} else if (b->df.start_argv) {
		cmd[0] = '\0';
		for (size_t i = 0; i < b->df.start_argc; i++) {
			if (i && len + 1 < sizeof(cmd))
				cmd[len++] = ' ';
			if (!sh_quote(cmd, sizeof(cmd), &len, b->df.start_argv[i]))
				return kiln_error_set(err, KILN_E_INVALID,
						      "the start command is too long");
		}
	} else {
		cmd[0] = '\0';
	}
	if (b->user)
		user_of(b->user, user, sizeof(user));
	if (cmd[0]) {
		/* Detached from the exec: it outlives it, its output in /var/log/kiln-start.log. */
		struct agent_exec_req x = {
			.argv = (const char *const[]){ "/bin/sh", "-c",
				"setsid sh -c \"$1\" </dev/null >>/var/log/kiln-start.log 2>&1 &",
				"sh", cmd, NULL },
			.env = (const char *const *)b->env, .cwd = b->workdir,
			.user = user[0] ? user : NULL };
		if (user[0]) {
			const char *args[] = { user, NULL };
			rc = build_sh(b, "touch /var/log/kiln-start.log && chown \"$1\" /var/log/kiln-start.log",
				      args, NULL, "preparing the start command's log", err);
			if (rc != KILN_OK)
				return rc;
		}
		build_log(b, "# start: %s", cmd);
		rc = build_exec(b, &x, NULL, &st, err);
		if (rc == KILN_OK && st)
			rc = kiln_error_set(err, KILN_E_INVALID, "the start command could not start");
		if (rc != KILN_OK)
			return rc;
	}
	if (!ready_cmd)
		return KILN_OK;
	build_log(b, "# ready check: %s", ready_cmd);
	for (;;) {
		struct agent_exec_req x = { .shell = ready_cmd, .env = (const char *const *)b->env,
					    .cwd = b->workdir, .user = user[0] ? user : NULL,
					    .timeout_ms = BUILD_READY_TRY_MS };
		struct capture quiet = { 0 };

		rc = build_exec(b, &x, &quiet, &st, err);
		free(quiet.data);
		if (rc != KILN_OK)
			return rc == KILN_E_QUOTA ? kiln_error_set(err, KILN_E_QUOTA,
								   "the ready check did not pass within "
								   "template_build_max_s (%lld s)",
								   b->n->cfg.template_build_max_s)
						  : rc;
		if (st == 0)
			return KILN_OK;
		sleep(1);
		if (!build_left_ms(b))
			return kiln_error_set(err, KILN_E_QUOTA,
					      "the ready check did not pass within "
					      "template_build_max_s (%lld s)",
					      b->n->cfg.template_build_max_s);
	}
}

/* The guest's root file system's bytes in use against template_image_max_bytes. */
static enum kiln_err build_size(struct build *b, struct kiln_error *err)
{
	struct capture out = { 0 };
	long long used;
	enum kiln_err rc;

	rc = build_sh(b, "rm -rf " BUILD_DIR "; sync; df -B1 --output=used / | tail -n 1", NULL,
		      &out, "measuring the image", err);
	if (rc == KILN_OK) {
		used = out.data ? atoll(out.data) : 0;
		/* The guest's word, checked early; the host measures the saved image again. */
		build_log(b, "# file system: %lld bytes in use", used);
		if (used > b->n->cfg.template_image_max_bytes)
			rc = kiln_error_set(err, KILN_E_QUOTA,
					    "the image's file system uses %lld bytes, more than "
					    "template_image_max_bytes (%lld)",
					    used, b->n->cfg.template_image_max_bytes);
	}
	free(out.data);
	return rc;
}

/* ---- the layer cache's records ---- */

/* Adds snapshot `snap` to the layers this build stands on (b->chain, a text[] literal). */
static void chain_add(struct build *b, const char *snap)
{
	size_t len = strlen(b->chain), sl = strlen(snap);

	if (len + sl + 3 > sizeof(b->chain))
		return;
	if (len < 2) {
		b->chain[0] = '{';
		len = 1;
	} else {
		b->chain[len - 1] = ',';
	}
	memcpy(b->chain + len, snap, sl);
	memcpy(b->chain + len + sl, "}", 2);
}

/*
 * Records snapshot `snap` (marked deleted by snap_record_public) as the tenant's layer under
 * b->key, in the caller's transaction, under the tenant's plan lock. A live layer another build
 * kept under that key first stays (a build may be resuming from it): this one's snapshot stays
 * deleted, its files going once the builder restored from it ends. Then the tenant's least
 * recently used layers, but those this build stands on, are evicted while its layers take more
 * than half of max_snapshot_bytes; when this build's own layers alone take more, the new one is
 * not kept either and the build keeps no more.
 */
static enum kiln_err layer_record(struct build *b, struct pg_conn *c, const char *snap,
				  struct kiln_error *err)
{
	struct node *n = b->n;
	struct pg_res *res = NULL;
	long long size, left, cap = 0;
	char capb[24];
	enum kiln_err rc;

	rc = PGQ(c, NULL, err,
		 "SELECT pg_advisory_xact_lock(hashtextextended('kiln-plan:' || $1, 0))", b->tenant);
	if (rc == KILN_OK)
		rc = plan_snapshot_limit(c, b->tenant, &cap, err);
	if (rc == KILN_OK)
		rc = PGQ(c, &res, err,
			 "WITH ins AS (INSERT INTO template_layers (tenant_id, node_id, key, snapshot_id, "
			 "template_id) SELECT $1, $2, $3, $4, $5 FROM templates WHERE id = $5 "
			 "AND deleted_at IS NULL ON CONFLICT (tenant_id, node_id, key) DO UPDATE SET "
			 "snapshot_id = EXCLUDED.snapshot_id, template_id = EXCLUDED.template_id, "
			 "created_at = now(), used_at = now() WHERE NOT EXISTS (SELECT 1 FROM snapshots s "
			 "WHERE s.id = template_layers.snapshot_id AND s.deleted_at IS NULL "
			 "AND s.purged_at IS NULL) RETURNING 1), "
			 "un AS (UPDATE snapshots SET deleted_at = NULL WHERE id = $4 "
			 "AND EXISTS (SELECT 1 FROM ins) RETURNING size_bytes) "
			 "SELECT (SELECT size_bytes FROM un), "
			 "EXISTS (SELECT 1 FROM templates WHERE id = $5 AND deleted_at IS NULL)",
			 b->tenant, n->cfg.node_id, b->key, snap, b->tmpl);
	if (rc != KILN_OK) {
		pg_res_free(res);
		return rc;
	}
	if (strcmp(pg_res_str(res, 0, 1), "t") != 0)
		rc = kiln_error_set(err, KILN_E_CONFLICT, "the template was deleted during its build");
	else if (!pg_res_get(res, 0, 0))
		build_log(b, "# layer %.12s: another build kept it first; this one is not kept",
			  b->key);
	if (rc != KILN_OK || !pg_res_get(res, 0, 0)) {
		pg_res_free(res);
		return rc;
	}
	size = pg_res_int(res, 0, 0, 0);
	pg_res_free(res);
	res = NULL;
	chain_add(b, snap);
	snprintf(capb, sizeof(capb), "%lld", cap / 2);
	rc = PGQ(c, &res, err,
		 "WITH ls AS (SELECT l.node_id, l.key, l.snapshot_id, l.used_at, s.size_bytes, "
		 "l.snapshot_id = ANY ($2::text[]) AS mine FROM template_layers l JOIN snapshots s "
		 "ON s.id = l.snapshot_id AND s.deleted_at IS NULL AND s.purged_at IS NULL "
		 "WHERE l.tenant_id = $1), "
		 "tot AS (SELECT coalesce(sum(size_bytes), 0) AS total FROM ls), "
		 "ev AS (SELECT x.* FROM (SELECT ls.*, sum(size_bytes) OVER (ORDER BY used_at, node_id, "
		 "key ROWS UNBOUNDED PRECEDING) AS freed FROM ls WHERE NOT mine) x, tot "
		 "WHERE tot.total - (x.freed - x.size_bytes) > $3::bigint), "
		 "del AS (DELETE FROM template_layers l USING ev WHERE l.tenant_id = $1 "
		 "AND l.node_id = ev.node_id AND l.key = ev.key RETURNING l.snapshot_id), "
		 "sd AS (UPDATE snapshots SET deleted_at = now() WHERE id IN (SELECT snapshot_id FROM del) "
		 "AND deleted_at IS NULL) "
		 "SELECT (SELECT count(*) FROM del), "
		 "(SELECT total FROM tot) - (SELECT coalesce(sum(size_bytes), 0) FROM ev)",
		 b->tenant, b->chain, capb);
	if (rc != KILN_OK) {
		pg_res_free(res);
		return rc;
	}
	left = pg_res_int(res, 0, 1, 0);
	if (pg_res_int(res, 0, 0, 0) > 0)
		build_log(b, "# layer cache: %lld least recently used layers evicted (a tenant's "
			  "layers are kept within half of max_snapshot_bytes, %lld MiB)",
			  pg_res_int(res, 0, 0, 0), (cap / 2) >> 20);
	pg_res_free(res);
	if (left > cap / 2) {
		b->cache = false;
		build_log(b, "# layer cache: this build's layers would take %lld MiB, more than half "
			  "of max_snapshot_bytes (%lld MiB): no more layers kept", left >> 20,
			  (cap / 2) >> 20);
		return PGQ(c, NULL, err,
			   "WITH d AS (DELETE FROM template_layers WHERE tenant_id = $1 AND node_id = $2 "
			   "AND key = $3 AND snapshot_id = $4) "
			   "UPDATE snapshots SET deleted_at = now() WHERE id = $4",
			   b->tenant, n->cfg.node_id, b->key, snap);
	}
	build_log(b, "# layer %.12s kept: %lld bytes (memory and disk)", b->key, size);
	return KILN_OK;
}

/* Removes cached layer `snap` of the tenant (its row, and its snapshot marked deleted). */
static void layer_drop(struct build *b, const char *snap)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	if (pg_acquire(b->n->pg, &c, &err) != KILN_OK) {
		log_warn("the broken layer \"%s\" is not dropped: %s", snap, err.msg);
		return;
	}
	if (PGQ(c, NULL, &err,
		"WITH d AS (DELETE FROM template_layers WHERE tenant_id = $1 AND snapshot_id = $2) "
		"UPDATE snapshots SET deleted_at = now() WHERE id = $2 AND tenant_id = $1 "
		"AND kind = 'build' AND deleted_at IS NULL",
		b->tenant, snap) != KILN_OK)
		log_warn("the broken layer \"%s\" is not dropped: %s", snap, err.msg);
	pg_release(b->n->pg, c);
}

void build_layers_gc(struct node *n, const char *tenant)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;

	if (pg_acquire(n->pg, &c, &err) != KILN_OK)
		return;
	if (PGQ(c, &res, &err,
		"WITH d AS (DELETE FROM template_layers l USING snapshots s WHERE l.node_id = $1 "
		"AND ($2 = '' OR l.tenant_id = $2) AND s.id = l.snapshot_id "
		"AND (s.image_hash IS DISTINCT FROM $3 OR s.deleted_at IS NOT NULL "
		"OR NOT EXISTS (SELECT 1 FROM templates t WHERE t.id = l.template_id "
		"AND t.deleted_at IS NULL)) RETURNING l.snapshot_id) "
		"UPDATE snapshots SET deleted_at = now() WHERE id IN (SELECT snapshot_id FROM d) "
		"AND kind = 'build' AND deleted_at IS NULL RETURNING id",
		n->cfg.node_id, tenant ? tenant : "", node_image_hash(n)) != KILN_OK)
		log_warn("cached layers not collected: %s", err.msg);
	else if (pg_res_rows(res) > 0)
		log_info("%d cached layers dropped (their template deleted or of another image)",
			 pg_res_rows(res));
	pg_res_free(res);
	pg_release(n->pg, c);
}

/*
 * Saves the builder's memory and disk as snapshot `snap` (its VM ends in it, and the builder is
 * deleted either way): with `layer`, a cached layer of the tenant under the key b->key; without,
 * the version's warm image, and the version is recorded ready.
 */
static enum kiln_err build_save(struct build *b, const char *snap, bool layer,
				struct kiln_error *err)
{
	struct node *n = b->n;
	struct sandbox *sb = b->sb;
	char dir[600], v[16], *env = NULL;
	struct pg_res *res = NULL;
	struct pg_conn *c;
	enum kiln_err rc;

	snap_dir(n, snap, dir, sizeof(dir));
	pthread_mutex_lock(&sb->lock);
	if (sb->state != SB_RUNNING || !sb->vm)
		rc = kiln_error_set(err, KILN_E_CONFLICT, "the builder sandbox is %s",
				    sb_state_name(sb->state));
	else
		rc = save_policy_public(sb, dir, err);
	if (rc == KILN_OK)
		rc = vmm_snapshot(sb->vm, dir, VMM_SNAP_SHARED, err);
	if (rc == KILN_OK)
		rc = write_manifest_public(n, sb, dir, err);
	if (rc == KILN_OK)
		rc = pg_acquire(n->pg, &c, err);
	if (rc == KILN_OK) {
		env = json_dumps(b->image_env, JSON_COMPACT);
		snprintf(v, sizeof(v), "%d", b->version);
		rc = pg_exec(c, "BEGIN", err);
		if (rc == KILN_OK)
			rc = snap_record_public(n, c, sb, snap, "build", NULL, dir, err);
		/* The image's size as the host measured it (memory + disk), not as the guest says. */
		if (rc == KILN_OK && !layer)
			rc = PGQ(c, &res, err,
				 "UPDATE snapshots SET deleted_at = NULL WHERE id = $1 RETURNING size_bytes",
				 snap);
		if (rc == KILN_OK && layer)
			rc = layer_record(b, c, snap, err);
		if (rc == KILN_OK && !layer && pg_res_int(res, 0, 0, 0) > n->cfg.template_image_max_bytes)
			rc = kiln_error_set(err, KILN_E_QUOTA,
					    "the image takes %lld bytes (memory and disk), more than "
					    "template_image_max_bytes (%lld)",
					    pg_res_int(res, 0, 0, 0), n->cfg.template_image_max_bytes);
		if (rc == KILN_OK && !layer)
			build_log(b, "# image: %lld bytes (memory and disk)", pg_res_int(res, 0, 0, 0));
		pg_res_free(res);
		res = NULL;
		if (rc == KILN_OK && !layer)
			rc = PGQ(c, &res, err,
				 "UPDATE template_versions SET status = 'ready', snapshot_id = $3, "
				 "env = $4::jsonb, workdir = $5, run_user = $6, finished_at = now(), "
				 "builder_id = NULL WHERE template_id = $1 AND version = $2::int "
				 "AND status = 'building' AND template_id IN "
				 "(SELECT id FROM templates WHERE deleted_at IS NULL) RETURNING 1",
				 b->tmpl, v, snap, env ? env : "{}", b->workdir, b->user);
		if (rc == KILN_OK && !layer && pg_res_rows(res) != 1)
			rc = kiln_error_set(err, KILN_E_CONFLICT,
					    "the template was deleted during its build");
		/* Going to the tenant's bucket (image_upload): shown so from the moment it is ready. */
		if (rc == KILN_OK && !layer && n->store)
			rc = PGQ(c, NULL, err,
				 "UPDATE snapshots SET status = 'uploading', storage = 's3' WHERE id = $1 "
				 "AND EXISTS (SELECT 1 FROM tenant_storage WHERE tenant_id = $2)",
				 snap, b->tenant);
		pg_res_free(res);
		if (rc == KILN_OK)
			rc = pg_exec(c, "COMMIT", err);
		else
			pg_exec(c, "ROLLBACK", NULL);
		pg_release(n->pg, c);
	}
	free(env);
	/* The builder's VM ended inside the snapshot (or failed): it is deleted either way. */
	{
		struct kiln_error derr = { 0 };
		struct record_fence f = sb_fence(n, sb);
		if (record_deleted(n->pg, NULL, &f, &derr) != KILN_OK)
			log_error("the builder \"%s\" not recorded deleted: %s", sb->id, derr.msg);
		sb_teardown(n, sb);
		sb->state = SB_STOPPED;
	}
	pthread_mutex_unlock(&sb->lock);
	if (rc != KILN_OK)
		snap_remove_files(dir);
	return rc;
}

/*
 * Starts the upload of the version's image `snap` to the tenant's bucket, when it has one
 * (docs/templates.md, "The image in the tenant's bucket"). An upload that cannot start leaves the
 * image on this node, usable, its row `failed` with the reason.
 */
static void image_upload(struct build *b, const char *snap)
{
	struct kiln_error err = { 0 }, perr = { 0 };
	char why[KILN_ERRMSG_MAX + 32];
	struct pg_conn *c;

	if (!b->n->store || snapstore_upload_start(b->n->store, snap, b->tenant, &err) == KILN_OK)
		return;
	log_error("upload of the image of %s/%d did not start: %s", b->tmpl, b->version, err.msg);
	snprintf(why, sizeof(why), "the upload did not start: %s", err.msg);
	if (pg_acquire(b->n->pg, &c, &perr) != KILN_OK)
		return;
	PGQ(c, NULL, &perr,
	    "UPDATE snapshots SET status = 'failed', storage = 's3', reason = $2 WHERE id = $1 "
	    "AND status = 'uploading'",
	    snap, why);
	pg_release(b->n->pg, c);
}

/* ---- the build ---- */

/* The version's row; fails when it is no longer building here. */
static enum kiln_err build_load(struct build *b, char **start_cmd, char **ready_cmd,
				char **egress, unsigned shape[3], char **from_snap,
				struct kiln_error *err)
{
	struct pg_res *res = NULL;
	struct pg_conn *c;
	char v[16];
	enum kiln_err rc = pg_acquire(b->n->pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	snprintf(v, sizeof(v), "%d", b->version);
	rc = PGQ(c, &res, err,
		 "SELECT v.dockerfile, v.start_cmd, v.ready_cmd, v.egress::text, v.vcpu_milli, "
		 "v.memory_mib, v.disk_gib, v.image_ref, v.registry_auth, v.registry_tls_verify "
		 "FROM template_versions v JOIN templates t "
		 "ON t.id = v.template_id WHERE t.tenant_id = $1 AND t.id = $2 AND v.version = $3::int "
		 "AND v.status = 'building' AND v.node_id = $4 AND v.source_format = $5 "
		 "AND (v.dockerfile IS NOT NULL OR v.source_format <> 'context') "
		 "AND (v.image_ref IS NOT NULL OR v.source_format <> 'registry')",
		 b->tenant, b->tmpl, v, b->n->cfg.node_id, build_format(b));
	if (rc == KILN_OK && pg_res_rows(res) != 1)
		rc = kiln_error_set(err, KILN_E_NOT_FOUND, "the version is not building here");
	if (rc == KILN_OK && b->image) {
		/* An import builds upon the base's image, in which umoci unpacks it. */
		b->df.from = strdup("base");
		if (!b->df.from)
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	} else if (rc == KILN_OK) {
		const char *df = pg_res_str(res, 0, 0);
		rc = dockerfile_parse(df, strlen(df), &b->df, err);
	}
	if (rc == KILN_OK) {
		*start_cmd = pg_res_get(res, 0, 1) ? strdup(pg_res_str(res, 0, 1)) : NULL;
		*ready_cmd = pg_res_get(res, 0, 2) ? strdup(pg_res_str(res, 0, 2)) : NULL;
		*egress = pg_res_get(res, 0, 3) ? strdup(pg_res_str(res, 0, 3)) : NULL;
		for (int i = 0; i < 3; i++)
			shape[i] = (unsigned)pg_res_int(res, 0, 4 + i, 0);
	}
	if (rc == KILN_OK && b->pull) {
		b->image_ref = strdup(pg_res_str(res, 0, 7));
		b->registry_auth = pg_res_get(res, 0, 8) ? strdup(pg_res_str(res, 0, 8)) : NULL;
		b->tls_verify = strcmp(pg_res_str(res, 0, 9), "t") == 0;
		if (!b->image_ref || (pg_res_get(res, 0, 8) && !b->registry_auth))
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	pg_res_free(res);
	res = NULL;
	/*
	 * FROM another template of the tenant: its latest ready version's image, held here or in
	 * the tenant's bucket (the builder's create fetches it: snap_fetch_copy).
	 */
	if (rc == KILN_OK && strcmp(b->df.from, "base") != 0 && strcmp(b->df.from, "python") != 0) {
		rc = PGQ(c, &res, err,
			 "SELECT v.snapshot_id, snapshot_held(s.id, $3) OR s.status = 'stored', "
			 "v.vcpu_milli, v.memory_mib "
			 "FROM templates t JOIN template_versions v ON v.template_id = t.id "
			 "JOIN snapshots s ON s.id = v.snapshot_id AND s.deleted_at IS NULL "
			 "WHERE t.tenant_id = $1 AND t.name = $2 AND t.deleted_at IS NULL "
			 "AND v.status = 'ready' ORDER BY v.version DESC LIMIT 1",
			 b->tenant, b->df.from, b->n->cfg.node_id);
		if (rc == KILN_OK && pg_res_rows(res) != 1)
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "FROM %s: the tenant has no ready template of that name",
					    b->df.from);
		else if (rc == KILN_OK && strcmp(pg_res_str(res, 0, 1), "t") != 0)
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "FROM %s: its image is on another node and not in the "
					    "tenant's bucket", b->df.from);
		else if (rc == KILN_OK && ((unsigned)pg_res_int(res, 0, 2, 0) != shape[0] ||
					   (unsigned)pg_res_int(res, 0, 3, 0) != shape[1]))
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "FROM %s: a template built upon another has its vCPUs and "
					    "memory",
					    b->df.from);
		else if (rc == KILN_OK)
			*from_snap = strdup(pg_res_str(res, 0, 0));
	}
	pg_res_free(res);
	pg_release(b->n->pg, c);
	return rc;
}

/* Marks the version failed with `why`, unless it left building. */
static void build_failed(struct build *b, const char *why)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	char v[16];

	snprintf(v, sizeof(v), "%d", b->version);
	if (pg_acquire(b->n->pg, &c, &err) != KILN_OK) {
		log_error("build %s/%d failed, not recorded: %s", b->tmpl, b->version, why);
		return;
	}
	if (PGQ(c, NULL, &err,
		"UPDATE template_versions SET status = 'failed', reason = $3, finished_at = now(), "
		"builder_id = NULL WHERE template_id = $1 AND version = $2::int "
		"AND status = 'building'",
		b->tmpl, v, why) != KILN_OK)
		log_error("build %s/%d failed, not recorded: %s", b->tmpl, b->version, err.msg);
	pg_release(b->n->pg, c);
}

/* ---- builders and the layer cache ---- */

/*
 * Creates the next builder sandbox of the build, from `from_snap` (NULL: the base's template);
 * `own_memory`: in a memory file of its own, as a builder whose memory is saved needs (else a
 * private map of the template's, never written anywhere).
 */
static enum kiln_err builder_new(struct build *b, const char *from_snap, bool own_memory,
				 struct kiln_error *err)
{
	struct node *n = b->n;
	char meta[256], v[16];
	struct pg_conn *c;
	enum kiln_err rc = auth_new_id("sb_", b->builder, sizeof(b->builder));

	if (rc == KILN_OK && pg_acquire(n->pg, &c, err) == KILN_OK) {
		snprintf(v, sizeof(v), "%d", b->version);
		PGQ(c, NULL, err,
		    "UPDATE template_versions SET builder_id = $3 WHERE template_id = $1 "
		    "AND version = $2::int",
		    b->tmpl, v, b->builder);
		pg_release(n->pg, c);
	}
	if (rc == KILN_OK) {
		struct create_req r = {
			.id = b->builder, .tenant_id = b->tenant, .template_name = b->df.from,
			.metadata = meta, .from_snap = from_snap, .vcpu_milli = b->shape[0],
			.mem_mib = b->shape[1], .disk_gib = b->shape[2],
			.timeout_s = n->cfg.template_build_max_s + 600,
			.init = { .egress = b->rules }, .own_memory = own_memory,
		};
		snprintf(meta, sizeof(meta), "{\"kiln.template_build\": \"%s/%d\"}", b->tmpl,
			 b->version);
		/* From the base: its warm template of the shape, waited for when it is still booting
		 * (a node just started) rather than a cold boot beside it that slows both. */
		if (!from_snap)
			tpl_wait(n, b->shape[0], b->shape[1], b->shape[2], build_left_ms(b));
		rc = create_sandbox(n, &r, err);
	}
	b->ctx_in = false;
	if (rc == KILN_OK) {
		b->sb = sb_get(n, b->builder);
		if (!b->sb)
			rc = kiln_error_set(err, KILN_E_SANDBOX_FAILED, "the builder sandbox is gone");
	}
	return rc;
}

/* Deletes the current builder unless its VM already ended in a snapshot (build_save). */
static void builder_end(struct build *b)
{
	struct node *n = b->n;

	if (!b->sb)
		return;
	pthread_mutex_lock(&b->sb->lock);
	if (b->sb->state != SB_STOPPED) {
		struct kiln_error derr = { 0 };
		struct record_fence f = sb_fence(n, b->sb);
		if (record_deleted(n->pg, NULL, &f, &derr) != KILN_OK)
			log_error("the builder \"%s\" not recorded deleted: %s", b->builder, derr.msg);
		sb_teardown(n, b->sb);
		b->sb->state = SB_STOPPED;
	}
	pthread_mutex_unlock(&b->sb->lock);
	sb_put(n, b->sb);
	b->sb = NULL;
}

/*
 * A pull, in a VM of its own before the builder's: a sandbox of the tenant from the base's
 * template under the build's egress rules, its memory a private map that is never saved. The
 * credentials go to its tmpfs for skopeo alone (PULL_AUTH, shredded when skopeo ends), skopeo
 * writes the image as an oci-archive, which is read out to b->tar as an upload is (never read
 * here), and the VM is deleted with all it held: skopeo's freed heap, the kernel's buffers, the
 * agent's. The builder, whose memory becomes the template's warm image, never sees them.
 */
static enum kiln_err image_pull(struct build *b, struct kiln_error *err)
{
	static const char pull[] =
		"mkdir -p " BUILD_DIR " && cd " BUILD_DIR "\n"
		"echo \"# pulling $1\"\n"
		"a=--src-no-creds; [ -f " PULL_AUTH " ] && a=--src-authfile=" PULL_AUTH "\n"
		"skopeo --insecure-policy copy --quiet \"$a\" --src-tls-verify=\"$2\""
		" \"docker://$1\" oci-archive:image.tar:latest; s=$?\n"
		"[ -f " PULL_AUTH " ] && shred -zu " PULL_AUTH "\n"
		"exit $s\n";
	/* skopeo's docker transport takes a tag or a digest, not both: the digest wins */
	struct imageref ref;
	char what[sizeof(ref.canonical)];
	const char *args[] = { what, b->tls_verify ? "true" : "false", NULL };
	uint64_t bytes = 0;
	enum kiln_err rc;
	int fd;

	rc = imageref_parse(b->image_ref, &ref, err);
	if (rc != KILN_OK)
		return rc;
	snprintf(what, sizeof(what), "%s/%s%s%s", ref.registry, ref.name,
		 ref.digest[0] ? "@" : ":", ref.digest[0] ? ref.digest : ref.tag);
	if (!build_tar_path(b)) {
		b->tar[0] = '\0';
		return kiln_error_set(err, KILN_E_IO, "the pulled image has no place on the node");
	}
	build_log(b, "# puller sandbox from base (its memory is never saved)");
	rc = builder_new(b, NULL, false, err);
	if (rc == KILN_OK && b->registry_auth)
		rc = pull_auth_write(b, &ref, err);
	if (rc == KILN_OK)
		rc = build_sh(b, pull, args, NULL, "pulling the image", err);
	if (rc == KILN_OK) {
		fd = open(b->tar, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		if (fd < 0)
			rc = fs_err(err, -errno, "open", b->tar);
		else if (!b->sb->agent)
			rc = kiln_error_set(err, KILN_E_SANDBOX_FAILED, "the puller sandbox stopped");
		else
			rc = agent_file_read_fd(b->sb->agent, BUILD_DIR "/image.tar", fd,
						(uint64_t)b->n->cfg.template_source_max_bytes, &bytes,
						err);
		if (fd >= 0)
			close(fd);
		if (rc == KILN_E_TOO_LARGE)
			rc = kiln_error_set(err, rc, "the pulled image is larger than "
					    "template_source_max_bytes (%lld bytes)",
					    b->n->cfg.template_source_max_bytes);
	}
	builder_end(b);
	b->bytes = (long long)bytes;
	return rc;
}

/* b->key := SHA-256 of b->key and `parts` (each with its length, so no two lists hash alike). */
static enum kiln_err key_chain(struct build *b, const char *const *parts, size_t nparts,
			       struct kiln_error *err)
{
	static const char hex[] = "0123456789abcdef";
	unsigned char md[EVP_MAX_MD_SIZE];
	unsigned int mdlen = 0;
	EVP_MD_CTX *ctx = EVP_MD_CTX_new();
	bool ok = ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) &&
		  EVP_DigestUpdate(ctx, b->key, strlen(b->key));

	for (size_t i = 0; ok && i < nparts; i++) {
		const char *p = parts[i] ? parts[i] : "";
		char len[24];

		snprintf(len, sizeof(len), "\n%zu:", strlen(p));
		ok = EVP_DigestUpdate(ctx, len, strlen(len)) && EVP_DigestUpdate(ctx, p, strlen(p));
	}
	ok = ok && EVP_DigestFinal_ex(ctx, md, &mdlen) && mdlen * 2 == LAYER_KEY_LEN;
	EVP_MD_CTX_free(ctx);
	if (!ok)
		return kiln_error_set(err, KILN_E_INTERNAL, "hashing a layer key failed");
	for (unsigned i = 0; i < mdlen; i++) {
		b->key[2 * i] = hex[md[i] >> 4];
		b->key[2 * i + 1] = hex[md[i] & 15];
	}
	b->key[LAYER_KEY_LEN] = '\0';
	return KILN_OK;
}

/*
 * The hash of the whole context (after .dockerignore), chained into the key at the first COPY/ADD:
 * for every path (in byte order) its type, mode, owner, size and link target, and every file's
 * SHA-256. Every step from that one on may read the context (a RUN too, as it lies in the
 * builder from then on), so every key from there on covers all of it; the steps before never see
 * it (it is copied in at the first COPY/ADD). Computed in the guest (the host never reads the
 * context), so a guest that lies about it can only spoil its own tenant's cache; a userland
 * lacking a tool for it turns the cache off.
 */
static enum kiln_err ctx_hash(struct build *b, unsigned line, char out[LAYER_KEY_LEN + 1],
			      struct kiln_error *err)
{
	static const char script[] =
		"set -e; export LC_ALL=C; cd " BUILD_CTX "\n"
		"{ find . -print0 | sort -z | xargs -0 -r stat -c '%F %a %u:%g %s %N' --\n"
		"  find . -type f -print0 | sort -z | xargs -0 -r sha256sum --; } > " BUILD_DIR
		"/hash.in\n"
		"sha256sum < " BUILD_DIR "/hash.in | cut -c1-64; rm -f " BUILD_DIR "/hash.in\n";
	const char *argv[] = { "/bin/sh", "-c", script, NULL };
	struct agent_exec_req x = { .argv = argv };
	struct capture cap = { 0 };
	int st = 0;
	enum kiln_err rc;

	rc = build_exec(b, &x, &cap, &st, err);
	if (rc == KILN_OK && (st != 0 || cap.len != LAYER_KEY_LEN + 1 ||
			      strspn(cap.data, "0123456789abcdef") != LAYER_KEY_LEN))
		rc = kiln_error_set(err, KILN_E_INVALID,
				    "hashing the build context at line %u failed (exit status %d)",
				    line, st);
	if (rc == KILN_OK)
		snprintf(out, LAYER_KEY_LEN + 1, "%s", cap.data);
	free(cap.data);
	return rc;
}

/* Chains step `s` into b->key: the instruction, the ENV/ARG, USER and WORKDIR in effect, `ctx`. */
static enum kiln_err key_step(struct build *b, const struct df_step *s, const char *ctx,
			      struct kiln_error *err)
{
	/* every argument and variable: two steps that differ in any never share a key */
	const char **parts = calloc(s->argc + b->nenv + 8, sizeof(*parts));
	char line[16];
	size_t k = 0;
	enum kiln_err rc;

	if (!parts)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	parts[k++] = dockerfile_kind_name(s->kind);
	parts[k++] = s->shell ? "shell" : "exec";
	snprintf(line, sizeof(line), "%zu", s->argc);
	parts[k++] = line;
	for (size_t i = 0; i < s->argc; i++)
		parts[k++] = s->argv[i] ? s->argv[i] : "\x01(unset)";
	parts[k++] = s->chown;
	parts[k++] = b->user;
	parts[k++] = b->workdir;
	parts[k++] = ctx;
	for (size_t i = 0; i < b->nenv; i++)
		parts[k++] = b->env[i];
	rc = key_chain(b, parts, k, err);
	free(parts);
	return rc;
}

/* The newest kept layer of the tenant on this node under b->key, into `snap`; false if none. */
static bool layer_find(struct build *b, char snap[AUTH_ID_MAX])
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	bool found = false;

	if (pg_acquire(b->n->pg, &c, &err) != KILN_OK)
		return false;
	if (PGQ(c, &res, &err,
		"UPDATE template_layers l SET used_at = now() FROM snapshots s "
		"WHERE l.tenant_id = $1 AND l.node_id = $2 AND l.key = $3 AND s.id = l.snapshot_id "
		"AND s.tenant_id = $1 AND s.node_id = $2 AND s.deleted_at IS NULL "
		"AND s.purged_at IS NULL RETURNING l.snapshot_id",
		b->tenant, b->n->cfg.node_id, b->key) == KILN_OK && pg_res_rows(res) == 1) {
		snprintf(snap, AUTH_ID_MAX, "%s", pg_res_str(res, 0, 0));
		chain_add(b, snap);
		found = true;
	}
	pg_res_free(res);
	pg_release(b->n->pg, c);
	return found;
}

/*
 * After a disk step: the builder's memory and disk kept as a layer under b->key, and the build
 * goes on in a new builder restored from it (milliseconds: the same shared snapshot as a
 * template's). A tenant at its snapshot limit keeps no more layers of this build (it goes on).
 */
static enum kiln_err layer_keep(struct build *b, struct kiln_error *err)
{
	struct kiln_error perr = { 0 };
	char snap[AUTH_ID_MAX];
	struct pg_conn *c;
	enum kiln_err rc = pg_acquire(b->n->pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	rc = plan_snapshot_check(c, b->tenant, &perr);
	pg_release(b->n->pg, c);
	if (rc != KILN_OK) {
		b->cache = false;
		build_log(b, "# layer cache: no more layers kept (%s)", perr.msg);
		return KILN_OK;
	}
	rc = auth_new_id("snap_", snap, sizeof(snap));
	if (rc == KILN_OK)
		rc = build_save(b, snap, true, err);
	builder_end(b);
	if (rc == KILN_OK)
		rc = builder_new(b, snap, true, err);
	if (rc == KILN_E_SANDBOX_FAILED && !b->n->stopping) {
		/* A restore that failed left nothing behind (create.h): once more, as a build is long. */
		build_log(b, "# restoring the builder from layer %s failed (%s): once more", snap,
			  err->msg);
		builder_end(b);
		kiln_error_clear(err);
		rc = builder_new(b, snap, true, err);
	}
	return rc;
}

/* Whether a builder restored from a cached layer failed for the layer's sake, not the tenant's. */
static bool layer_broken(const struct build *b, enum kiln_err rc)
{
	return !b->n->stopping && rc != KILN_E_QUOTA && rc != KILN_E_CREDITS &&
	       rc != KILN_E_SUSPENDED && rc != KILN_E_RATE_LIMITED && rc != KILN_E_NO_CAPACITY &&
	       rc != KILN_E_UNAVAILABLE && rc != KILN_E_DB_SWITCH && rc != KILN_E_NOMEM;
}

/*
 * Ends the current builder and goes on from cached layer `snap`. When that layer does not
 * restore, its name goes into `broken` (build_steps drops it and starts again uncached).
 */
static enum kiln_err layer_resume(struct build *b, const char *snap, char broken[AUTH_ID_MAX],
				  struct kiln_error *err)
{
	enum kiln_err rc;

	builder_end(b);
	build_log(b, "# builder sandbox from cached layer %s", snap);
	rc = builder_new(b, snap, true, err);
	if (rc != KILN_OK && layer_broken(b, rc))
		snprintf(broken, AUTH_ID_MAX, "%s", snap);
	return rc;
}

static bool step_writes_disk(const struct df_step *s)
{
	return s->kind == DF_RUN || s->kind == DF_COPY || s->kind == DF_ADD || s->kind == DF_WORKDIR;
}

/*
 * One pass over the steps, with the layer cache: the key of each step chains its parent's (the
 * FROM image and the shape and egress of the build first); with `lookup`, while every disk step
 * so far has a kept layer, the step is not run ("(cached)" in the log) and only its effect on the
 * build's state (ENV, ARG, USER, WORKDIR) is taken; at the first that has none, the build goes on
 * from the deepest layer found, and every disk step after it keeps its own. The context is copied
 * into the builder at the first COPY/ADD that needs it, its hash chained into the key there.
 */
static enum kiln_err steps_pass(struct build *b, const char *from_snap, bool lookup,
				char broken[AUTH_ID_MAX], struct kiln_error *err)
{
	char hit[AUTH_ID_MAX] = "", snap[AUTH_ID_MAX], shape[3][16];
	size_t cached = 0;
	enum kiln_err rc = KILN_OK;

	for (int i = 0; i < 3; i++)
		snprintf(shape[i], sizeof(shape[i]), "%u", b->shape[i]);
	{
		const char *parts[] = { "kiln-layer-2", b->n->cfg.guest_image_hash, from_snap ? from_snap : "base",
					shape[0], shape[1], shape[2], b->egress };
		b->key[0] = '\0';
		b->ctx_keyed = false;
		if (b->cache)
			rc = key_chain(b, parts, sizeof(parts) / sizeof(parts[0]), err);
	}
	for (size_t i = 0; rc == KILN_OK && i < b->df.nsteps; i++) {
		const struct df_step *s = &b->df.steps[i];
		bool disk = step_writes_disk(s), copy = s->kind == DF_COPY || s->kind == DF_ADD;
		char ctx[LAYER_KEY_LEN + 1] = "";

		if (copy && !b->ctx_in && (!lookup || !b->ctx_keyed))
			rc = build_context(b, err);
		if (rc == KILN_OK && b->cache && copy && !b->ctx_keyed) {
			struct kiln_error herr = { 0 };
			if (ctx_hash(b, s->line, ctx, &herr) != KILN_OK) {
				if (herr.code == KILN_E_QUOTA || b->n->stopping) {
					*err = herr;
					return herr.code;
				}
				b->cache = false;
				build_log(b, "# layer cache off from line %u: %s", s->line, herr.msg);
			}
			b->ctx_keyed = b->cache;
		}
		if (rc == KILN_OK && b->cache)
			rc = key_step(b, s, ctx, err);
		if (rc == KILN_OK && lookup && disk && b->cache && layer_find(b, snap)) {
			snprintf(hit, sizeof(hit), "%s", snap);
			cached++;
			build_log(b, "# step %zu/%zu (line %u): %s %s (cached)", i + 1, b->df.nsteps,
				  s->line, dockerfile_kind_name(s->kind), s->argc ? s->argv[0] : "");
			if (s->kind == DF_WORKDIR) {
				free(b->workdir);
				b->workdir = strdup(s->argv[0]);
				if (!b->workdir)
					rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			}
			continue;
		}
		if (rc == KILN_OK && lookup && disk) {
			lookup = false;
			if (hit[0])
				rc = layer_resume(b, hit, broken, err);
			if (rc == KILN_OK && copy && !b->ctx_in)
				rc = build_context(b, err);
		}
		if (rc != KILN_OK)
			break;
		build_log(b, "# step %zu/%zu (line %u): %s %s", i + 1, b->df.nsteps, s->line,
			  dockerfile_kind_name(s->kind), s->argc ? s->argv[0] : "");
		rc = step_one(b, s, err);
		if (rc == KILN_OK && disk && b->cache)
			rc = layer_keep(b, err);
	}
	if (rc == KILN_OK && lookup && hit[0])
		rc = layer_resume(b, hit, broken, err);
	if (rc == KILN_OK && cached)
		build_log(b, "# layer cache: %zu steps cached", cached);
	return rc;
}

/* The build's state back to its start (ENV, ARG, USER, WORKDIR), for a pass from the FROM image. */
static void state_reset(struct build *b)
{
	for (size_t i = 0; i < b->nenv; i++)
		free(b->env[i]);
	b->nenv = 0;
	b->env[0] = NULL;
	free(b->workdir);
	free(b->user);
	b->workdir = b->user = NULL;
	json_object_clear(b->image_env);
}

/*
 * The steps: a pass with the layer cache; when a cached layer it found does not restore, that
 * layer is dropped (its row, its snapshot marked deleted), and the steps run again from the FROM
 * image in a new builder, keeping new layers.
 */
static enum kiln_err build_steps(struct build *b, const char *from_snap, struct kiln_error *err)
{
	char broken[AUTH_ID_MAX] = "";
	enum kiln_err rc = steps_pass(b, from_snap, b->cache, broken, err);

	if (rc == KILN_OK || !broken[0])
		return rc;
	build_log(b, "# cached layer %s does not restore (%s): dropped; the build goes on uncached "
		  "from a new builder", broken, err->msg);
	log_warn("template %s: cached layer \"%s\" does not restore (%s): dropped", b->tmpl, broken,
		 err->msg);
	layer_drop(b, broken);
	kiln_error_clear(err);
	builder_end(b);
	state_reset(b);
	build_log(b, "# builder sandbox from %s", b->df.from);
	rc = builder_new(b, from_snap, true, err);
	if (rc == KILN_OK)
		rc = steps_pass(b, from_snap, false, broken, err);
	return rc;
}

/* ---- the build ---- */

static enum kiln_err build_run(struct build *b, struct kiln_error *err)
{
	struct node *n = b->n;
	char *start_cmd = NULL, *ready_cmd = NULL, *egress = NULL, *from_snap = NULL;
	char snap[AUTH_ID_MAX];
	struct kiln_ruleset rules = { 0 };
	struct kiln_cidr deny[2 * KILN_DENY_MAX];
	size_t ndeny = 0;
	json_t *ej = NULL;
	enum kiln_err rc;

	b->deadline_ms = clock_mono_ms() + n->cfg.template_build_max_s * 1000;
	b->image_env = json_object();
	if (!b->image_env)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = build_load(b, &start_cmd, &ready_cmd, &egress, b->shape, &from_snap, err);
	if (rc == KILN_OK && egress) {
		ej = json_loads(egress, 0, NULL);
		rc = kiln_policy_deny_ranges(n->cfg.egress_deny, deny, 2 * KILN_DENY_MAX, &ndeny, err);
		if (rc == KILN_OK)
			rc = nodereq_egress(ej, deny, ndeny, &rules, err);
		b->rules = &rules;
	}
	b->egress = egress;
	b->cache = !b->image;	/* an import is one step: nothing to cache */
	if (rc == KILN_OK)
		rc = auth_new_id("snap_", snap, sizeof(snap));
	if (rc == KILN_OK && b->pull)
		rc = image_pull(b, err);
	if (rc == KILN_OK) {
		build_log(b, "# builder sandbox from %s", b->df.from);
		rc = builder_new(b, from_snap, true, err);
	}
	if (rc == KILN_OK && b->image) {
		build_log(b, "# image archive: %lld bytes", b->bytes);
		rc = build_image(b, err);
	} else if (rc == KILN_OK) {
		/* Copied into the builder at the first COPY/ADD: the steps before it never see it. */
		build_log(b, "# build context: %lld bytes", b->bytes);
		build_layers_gc(n, b->tenant);
	}
	if (rc == KILN_OK)
		rc = build_steps(b, from_snap, err);
	if (rc == KILN_OK)
		rc = build_start(b, start_cmd, ready_cmd, err);
	if (rc == KILN_OK && !b->image)	/* an import measured its file system in build_image */
		rc = build_size(b, err);
	if (rc == KILN_OK)
		rc = build_save(b, snap, false, err);
	if (rc == KILN_OK)
		image_upload(b, snap);
	builder_end(b);
	b->rules = NULL;
	b->egress = NULL;
	json_decref(ej);
	kiln_ruleset_free(&rules);
	free(start_cmd);
	free(ready_cmd);
	free(egress);
	free(from_snap);
	return rc;
}

static void *build_thread(void *arg)
{
	struct build *b = arg;
	struct kiln_error err = { 0 };
	enum kiln_err rc;
	long long t0 = clock_mono_ms();	/* what it took, whatever steps the wall clock took */

	log_info("building template %s version %d", b->tmpl, b->version);
	rc = build_run(b, &err);
	unlink(b->tar);
	if (rc == KILN_OK) {
		build_log(b, "# ready in %lld s", (clock_mono_ms() - t0) / 1000);
		log_info("template %s version %d ready", b->tmpl, b->version);
	} else {
		build_log(b, "# failed: %s", err.msg);
		build_failed(b, err.msg);
		log_warn("template %s version %d failed: %s", b->tmpl, b->version, err.msg);
	}
	build_free(b);
	pthread_mutex_lock(&builds_lock);
	builds_running--;
	pthread_cond_broadcast(&builds_cond);
	pthread_mutex_unlock(&builds_lock);
	return NULL;
}

/* ---- the upload ---- */

static void upload_free(void *p)
{
	struct build *b = p;

	if (b && b->tar[0])
		unlink(b->tar);	/* not handed to a build */
	build_free(b);
}

/* Takes the upload when version ?version of {id} is building here for `tenant`. */
static enum kiln_err upload_begin(struct http_req *req, const char *tenant, struct build *b)
{
	struct node *n = http_req_app(req);
	const char *ver = http_req_query(req, "version"), *fmt = http_req_query(req, "format");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	char *end = NULL;
	long v = ver ? strtol(ver, &end, 10) : 0;
	enum kiln_err rc;

	if (!ver || !end || *end || v < 1 || v > 1000000)
		return KILN_E_INVALID;
	b->pull = fmt && strcmp(fmt, "registry") == 0;
	b->image = b->pull || (fmt && strcmp(fmt, "oci-archive") == 0);
	b->version = (int)v;
	snprintf(b->tmpl, sizeof(b->tmpl), "%s", http_req_param(req, "id"));
	snprintf(b->tenant, sizeof(b->tenant), "%s", tenant);
	rc = pg_acquire(n->pg, &c, &err);
	if (rc != KILN_OK)
		return KILN_E_UNAVAILABLE;
	rc = PGQ(c, &res, &err,
		 "SELECT 1 FROM template_versions v JOIN templates t ON t.id = v.template_id "
		 "WHERE t.tenant_id = $1 AND t.id = $2 AND v.version = $3::int "
		 "AND v.status = 'building' AND v.node_id = $4 AND v.builder_id IS NULL "
		 "AND v.source_format = $5",
		 tenant, b->tmpl, ver, n->cfg.node_id, build_format(b));
	pg_release(n->pg, c);
	if (rc != KILN_OK)
		rc = KILN_E_UNAVAILABLE;
	else if (pg_res_rows(res) != 1)
		rc = KILN_E_NOT_FOUND;
	pg_res_free(res);
	if (rc != KILN_OK || b->pull)
		return rc;	/* a pull uploads nothing */
	if (!build_tar_path(b)) {
		b->tar[0] = '\0';
		return KILN_E_IO;
	}
	b->fd = open(b->tar, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (b->fd < 0) {
		b->tar[0] = '\0';
		return KILN_E_IO;
	}
	return KILN_OK;
}

enum kiln_err build_source_sink(struct http_req *req, const char *tenant, const char *data,
				size_t len)
{
	struct node *n = http_req_app(req);
	struct build *b = http_req_hctx(req);

	if (!b) {
		b = calloc(1, sizeof(*b));
		if (!b)
			return KILN_E_NOMEM;
		b->fd = -1;
		b->n = n;
		http_req_set_hctx(req, b, upload_free);
		b->refused = upload_begin(req, tenant, b);
	}
	if (b->refused)
		return b->refused;
	if (b->pull && len)
		return b->refused = KILN_E_INVALID;	/* the gateway sends a pull no body */
	if (b->bytes + (long long)len > n->cfg.template_source_max_bytes)
		return b->refused = KILN_E_TOO_LARGE;
	b->bytes += (long long)len;
	while (len) {
		ssize_t w = write(b->fd, data, len);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0)
			return b->refused = KILN_E_IO;
		data += w;
		len -= (size_t)w;
	}
	return KILN_OK;
}

/* Puts a version whose upload failed back to pending: nothing of it changed. */
static void upload_undo(struct node *n, const char *tenant, const char *tmpl, const char *ver)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	if (!ver || pg_acquire(n->pg, &c, &err) != KILN_OK)
		return;
	PGQ(c, NULL, &err,
	    "UPDATE template_versions v SET status = 'pending', node_id = NULL, started_at = NULL, "
	    "source_format = 'context' FROM templates t WHERE t.id = v.template_id AND t.tenant_id = $1 AND t.id = $2 "
	    "AND v.version = $3::int AND v.status = 'building' AND v.node_id = $4 "
	    "AND v.builder_id IS NULL",
	    tenant, tmpl, ver, n->cfg.node_id);
	pg_release(n->pg, c);
}

void build_source_done(struct http_req *req, const char *tenant)
{
	struct node *n = http_req_app(req);
	struct build *b = http_req_hctx(req);
	struct kiln_error err = { 0 };
	enum kiln_err src = http_req_stream_error(req, &err);
	const char *id = http_req_param(req, "id"), *ver = http_req_query(req, "version");
	pthread_t th;

	if (!b && src == KILN_OK) {
		/* an empty body: the sink never ran with data */
		src = build_source_sink(req, tenant, NULL, 0);
		b = http_req_hctx(req);
	}
	if (b && b->refused)
		src = b->refused;
	if (src == KILN_E_NOT_FOUND) {
		http_reply_error(req, src, "template \"%s\" has no version %s building on this node",
				 id, ver ? ver : "?");
		return;	/* not ours to undo */
	}
	if (src == KILN_OK && (!b || (b->bytes == 0 && !b->pull)))
		src = KILN_E_INVALID;
	if (src == KILN_OK && !b->pull && fsync(b->fd) != 0)
		src = KILN_E_IO;
	if (src != KILN_OK) {
		upload_undo(n, tenant, id, ver);
		if (src == KILN_E_TOO_LARGE)
			http_reply_error(req, src,
					 "the build context is larger than template_source_max_bytes "
					 "(%lld bytes)",
					 n->cfg.template_source_max_bytes);
		else if (src == KILN_E_INVALID)
			http_reply_error(req, src, "the build context must be a non-empty tar");
		else
			http_reply_error(req, src == KILN_E_NOMEM ? src : KILN_E_UNAVAILABLE,
					 "the build context could not be stored");
		return;
	}
	if (b->fd >= 0)
		close(b->fd);
	b->fd = -1;
	{
		/* The build takes the upload over; the request's copy is left empty. */
		struct build *t = malloc(sizeof(*t));
		if (!t) {
			upload_undo(n, tenant, id, ver);
			http_reply_error(req, KILN_E_NOMEM, "out of memory");
			return;	/* upload_free removes the file */
		}
		*t = *b;
		b->tar[0] = '\0';
		b = t;
	}
	pthread_mutex_lock(&builds_lock);
	builds_running++;
	pthread_mutex_unlock(&builds_lock);
	if (n->stopping || pthread_create(&th, NULL, build_thread, b) != 0) {
		pthread_mutex_lock(&builds_lock);
		builds_running--;
		pthread_mutex_unlock(&builds_lock);
		unlink(b->tar);
		build_free(b);
		upload_undo(n, tenant, id, ver);
		http_reply_error(req, KILN_E_UNAVAILABLE, "the build could not start");
		return;
	}
	pthread_detach(th);
	http_reply_json(req, 202, json_pack("{s:s, s:i, s:s}", "id", id, "version", atoi(ver),
					    "status", "building"));
}

void build_init(struct node *n)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	char dir[600];

	if (pg_acquire(n->pg, &c, &err) == KILN_OK) {
		PGQ(c, NULL, &err,
		    "UPDATE template_versions SET status = 'failed', finished_at = now(), "
		    "reason = 'the node restarted during the build', builder_id = NULL "
		    "WHERE node_id = $1 AND status = 'building'",
		    n->cfg.node_id);
		pg_release(n->pg, c);
	}
	if (fs_path(dir, "%s/builds/%s", n->cfg.data_dir, n->cfg.node_id))
		fs_remove_tree(dir);
}

void build_exit(struct node *n)
{
	(void)n;
	pthread_mutex_lock(&builds_lock);
	while (builds_running > 0)
		pthread_cond_wait(&builds_cond, &builds_lock);
	pthread_mutex_unlock(&builds_lock);
}
