/*
 * storage_sync.c - uploads of a node's snapshots to the tenants' buckets and their fetch on another
 * node (storage_sync.h, docs/storage.md "Snapshots in the bucket").
 *
 * An upload goes through three durable stages under <snap_root>/.up-<snap id>/, so that a worker
 * stopped anywhere (shutdown, crash) picks up where it was:
 *   src/          hard links of the snapshot's files and of the disk layers under it ("chain-<k>")
 *   port.tmp/     the portable copy being built: the same files, the disk flattened, a new manifest
 *   object.kiln   the packed object (snapshot_pack: written whole or not at all), then
 *   object.kiln.s3upload, the multipart state of s3_put_file while it is sent.
 * Once the object exists, src/ and port.tmp/ go; once it is stored and the row says so, all goes.
 */
#include "common/fsutil.h"
#include "node/images.h"
#include "node/storage_sync.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "auth/storage.h"
#include "common/clock.h"
#include "common/log.h"
#include "vmm/disk.h"
#include "vmm/snapshot.h"

#define ID_MAX 64		/* bytes of a snapshot id, terminator included */
#define TENANT_MAX 128		/* bytes of a tenant id, terminator included */
#define UP_PREFIX ".up-"
#define FETCH_PREFIX ".fetch-"
#define OBJECT_NAME "object.kiln"
#define MANIFEST "manifest.json"
#define DISK_NAME "disk.qcow2"

struct job {
	char snap_id[ID_MAX];
	char tenant_id[TENANT_MAX];
	bool running;
	struct job *next;
};

struct snapstore {
	struct pg *pg;
	const struct auth_master_key *mk;
	char *node_id, *snap_root, *base_image;
	char *codeint_image;	/* "" when the node has none */
	char *image_hash, *kernel, *initrd;	/* "" when not given */
	unsigned upload_tries, retry_delay_ms;
	struct s3_opts s3;
	bool has_s3;
	snapstore_part_cb on_part;
	void *on_part_arg;

	pthread_mutex_t lock;
	pthread_cond_t work;	/* a job was queued, or stopping; also the retry waits */
	pthread_cond_t idle;	/* a job ended */
	struct job *jobs;	/* queued and running, in order */
	bool stopping;
	unsigned n_workers;
	pthread_t *workers;
};

/* What a job's run ended with, besides an error. */
enum job_end { JOB_DONE, JOB_STOPPED, JOB_FAILED };

/* ---- small helpers ---- */

static bool valid_id(const char *id)
{
	size_t n = id ? strlen(id) : 0;

	if (n == 0 || n >= ID_MAX)
		return false;
	for (size_t i = 0; i < n; i++) {
		char c = id[i];

		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '_' || c == '-'))
			return false;
	}
	return true;
}

static bool valid_tenant(const char *t)
{
	return t && t[0] && strlen(t) < TENANT_MAX;
}


static bool is_dir(const char *path)
{
	struct stat st;

	return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static bool exists(const char *path)
{
	struct stat st;

	return lstat(path, &st) == 0;
}

/*
 * A hard link of `src` at `dst` (replaced), or a sparse copy where links cannot be made. The
 * snapshot's files keep their digests across the links (snapshot_file_link): its resume on this
 * node does not hash them again.
 */
static int link_or_copy(const char *src, const char *dst)
{
	int r;

	unlink(dst);
	r = snapshot_file_link(src, dst);
	if (r == 0 || (r != -EXDEV && r != -EPERM && r != -EMLINK))
		return r;
	return disk_file_copy(src, dst);
}

/*
 * Removes an upload's staging `path` (a tree of at most a few levels), its files' links first
 * through snapshot_file_link, so that the snapshot's own files keep their digests.
 */
static void remove_staged(const char *path)
{
	char child[PATH_MAX];
	struct dirent *de;
	DIR *d = opendir(path);

	while (d && (de = readdir(d))) {
		struct stat st;

		if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..") ||
		    !fs_path(child, "%s/%s", path, de->d_name) ||
		    fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
			continue;
		if (S_ISDIR(st.st_mode))
			remove_staged(child);
		else if (S_ISREG(st.st_mode))
			snapshot_file_link(child, NULL);
	}
	if (d)
		closedir(d);
	fs_remove_tree_or_warn(path);
}

/* Whether a directory entry is one of a snapshot's files: no dot names, no *.tmp. */
static bool snapshot_file_name(const char *name)
{
	size_t n = strlen(name);

	return name[0] != '.' && !(n >= 4 && strcmp(name + n - 4, ".tmp") == 0);
}

/* The object key of a snapshot, relative to the tenant's prefix. */
static void object_key(const char *snap_id, char *out, size_t len)
{
	snprintf(out, len, "%s%s%s", SNAPSTORE_KEY_DIR, snap_id, SNAPSTORE_KEY_SUFFIX);
}

/* Reads the manifest's disk_chain (host paths, base first) into a new array; NULL when malformed. */
static json_t *manifest_chain(const char *dir, json_t **manifest, struct kiln_error *err)
{
	char path[PATH_MAX];
	json_error_t jerr;
	json_t *m, *chain;

	if (!fs_path(path, "%s/%s", dir, MANIFEST))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot dir \"%s\" too long", dir), NULL;
	m = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
	if (!m) {
		kiln_error_set(err, KILN_E_INVALID, "the manifest of \"%s\" does not parse: %s", dir,
			       jerr.text);
		return NULL;
	}
	chain = json_object_get(m, "disk_chain");
	if (!json_is_array(chain) || json_array_size(chain) == 1 ||
	    json_array_size(chain) > DISK_CHAIN_MAX + 2) {
		json_decref(m);
		kiln_error_set(err, KILN_E_INVALID, "the manifest of \"%s\" has a bad disk chain", dir);
		return NULL;
	}
	for (size_t k = 0; k < json_array_size(chain); k++) {
		const char *p = json_string_value(json_array_get(chain, k));

		if (!p || p[0] != '/' || strlen(p) >= PATH_MAX) {
			json_decref(m);
			kiln_error_set(err, KILN_E_INVALID, "the manifest of \"%s\" has a bad disk chain",
				       dir);
			return NULL;
		}
	}
	*manifest = m;
	return chain;
}

/* Writes `m` as `dir`/manifest.json atomically (as the driver writes it: sorted, indent 2). */
static enum kiln_err manifest_save(const char *dir, json_t *m, struct kiln_error *err)
{
	char path[PATH_MAX], tmp[PATH_MAX];
	int r;

	if (!fs_path(path, "%s/%s", dir, MANIFEST) || !fs_path(tmp, "%s/%s.tmp", dir, MANIFEST))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot dir \"%s\" too long", dir);
	if (json_dump_file(m, tmp, JSON_INDENT(2) | JSON_SORT_KEYS) < 0) {
		unlink(tmp);
		return kiln_error_set(err, KILN_E_IO, "cannot write \"%s\"", tmp);
	}
	if ((r = fs_fsync_path(tmp)) == 0 && rename(tmp, path) < 0)
		r = -errno;
	if (r == 0)
		r = fs_fsync_path(dir);
	if (r < 0) {
		unlink(tmp);
		return fs_err(err, r, "cannot write", path);
	}
	return KILN_OK;
}

/* ---- Postgres ---- */

static enum kiln_err set_status(struct snapstore *s, const char *snap_id, const char *status,
				const char *reason, struct kiln_error *err)
{
	struct pg_conn *c;
	enum kiln_err rc = pg_acquire(s->pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	if (strcmp(status, "uploading") == 0)
		rc = PGQ(c, NULL, err,
			 "UPDATE snapshots SET status = 'uploading', storage = 's3', reason = NULL "
			 "WHERE id = $1",
			 snap_id);
	else if (strcmp(status, "stored") == 0)
		rc = PGQ(c, NULL, err,
			 "UPDATE snapshots SET status = 'stored', storage = 's3', reason = NULL "
			 "WHERE id = $1 AND status = 'uploading'",
			 snap_id);
	else
		rc = PGQ(c, NULL, err,
			 "UPDATE snapshots SET status = 'failed', storage = 's3', reason = $2 "
			 "WHERE id = $1",
			 snap_id, reason ? reason : "");
	pg_release(s->pg, c);
	return rc;
}

/* The tenant's bucket (storage_load on a pooled connection). */
static enum kiln_err load_target(struct snapstore *s, const char *tenant_id, struct s3_target *t,
				 struct kiln_error *err)
{
	struct pg_conn *c;
	enum kiln_err rc = pg_acquire(s->pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	rc = storage_load(c, s->mk, tenant_id, t, err);
	pg_release(s->pg, c);
	return rc;
}

/* ---- the upload's stages ---- */

/*
 * Stage 1: <up>/src/ gets hard links of the snapshot's files and, as chain-<k>, of the frozen
 * layers its disk stands on (the base image is never removed and needs none). Built in src.tmp.
 */
static enum kiln_err stage_links(struct snapstore *s, const char *snap_id, const char *up,
				 struct kiln_error *err)
{
	char dir[PATH_MAX], src[PATH_MAX], tmp[PATH_MAX], from[PATH_MAX], to[PATH_MAX];
	enum kiln_err rc = KILN_OK;
	json_t *m = NULL, *chain;
	struct dirent *de;
	DIR *d;
	int r;

	if (!fs_path(dir, "%s/%s", s->snap_root, snap_id) || !fs_path(src, "%s/src", up) ||
	    !fs_path(tmp, "%s/src.tmp", up))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot root too long");
	if (!is_dir(dir))
		return kiln_error_set(err, KILN_E_NOT_FOUND, "the files of snapshot \"%s\" are not on this node",
				      snap_id);
	if (mkdir(up, 0700) < 0 && errno != EEXIST)
		return fs_err(err, -errno, "cannot create", up);
	remove_staged(tmp);
	if (mkdir(tmp, 0700) < 0)
		return fs_err(err, -errno, "cannot create", tmp);
	d = opendir(dir);
	if (!d)
		return fs_err(err, -errno, "cannot read", dir);
	while (rc == KILN_OK && (de = readdir(d))) {
		struct stat st;

		if (!snapshot_file_name(de->d_name) || fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 ||
		    !S_ISREG(st.st_mode))
			continue;
		if (!fs_path(from, "%s/%s", dir, de->d_name) || !fs_path(to, "%s/%s", tmp, de->d_name))
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot path too long");
		else if ((r = link_or_copy(from, to)) < 0)
			rc = fs_err(err, r, "cannot link", from);
	}
	closedir(d);
	if (rc == KILN_OK && (chain = manifest_chain(dir, &m, err))) {
		/* chain: base, the layers under this snapshot's own, and its own (the last) */
		for (size_t k = 1; rc == KILN_OK && k + 1 < json_array_size(chain); k++) {
			const char *p = json_string_value(json_array_get(chain, k));

			if (!fs_path(to, "%s/chain-%zu", tmp, k))
				rc = kiln_error_set(err, KILN_E_INVALID, "snapshot path too long");
			else if ((r = link_or_copy(p, to)) < 0)
				rc = fs_err(err, r, "cannot link the disk layer", p);
		}
		json_decref(m);
	} else if (rc == KILN_OK) {
		rc = err->code ? err->code : KILN_E_INVALID;
	}
	if (rc == KILN_OK && (r = fs_fsync_path(tmp)) < 0)
		rc = fs_err(err, r, "cannot sync", tmp);
	if (rc == KILN_OK) {
		remove_staged(src);
		r = rename(tmp, src) < 0 ? -errno : fs_fsync_path(up);
		if (r < 0)
			rc = fs_err(err, r, "cannot rename", tmp);
	}
	if (rc != KILN_OK)
		remove_staged(tmp);
	return rc;
}

/*
 * The snapshot's disk as one qcow2 layer over the base image with the same content, into `out`
 * (replaced): its layer (src/disk.qcow2) is copied into `work` beside symlinks that resolve the
 * chain's jail names (base, layer1..layer<depth> = src/chain-<k>), then rebased onto `base` in safe
 * mode, which writes into the copy every cluster where the old chain and the base differ.
 * (qemu-img convert -B would keep only the clusters of the top layer itself and lose those of the
 * layers between.)
 */
static enum kiln_err flatten_onto_base(const char *src, const char *base, unsigned depth,
				       const char *work, const char *out, struct kiln_error *err)
{
	char link[PATH_MAX], target[PATH_MAX], top[PATH_MAX], name[16], msg[1024];
	enum kiln_err rc = KILN_OK;
	int r;

	fs_remove_tree_or_warn(work);
	if (mkdir(work, 0700) < 0)
		return fs_err(err, -errno, "cannot create", work);
	for (unsigned k = 0; rc == KILN_OK && k <= depth; k++) {
		disk_layer_name(k, name, sizeof(name));
		if (!fs_path(link, "%s/%s", work, name) ||
		    (k > 0 && !fs_path(target, "%s/chain-%u", src, k)) || (k == 0 && !fs_path(target, "%s", base)))
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot path too long");
		else if (symlink(target, link) < 0)
			rc = fs_err(err, -errno, "cannot link", link);
	}
	if (rc == KILN_OK && (!fs_path(top, "%s/top", work) || !fs_path(target, "%s/%s", src, DISK_NAME)))
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot path too long");
	if (rc == KILN_OK && (r = disk_file_copy(target, top)) < 0)
		rc = fs_err(err, r, "cannot copy the disk layer", target);
	if (rc == KILN_OK) {
		char *argv[] = { "qemu-img", "rebase", "-q", "-f", "qcow2", "-b", "base", "-F", "raw", top,
				 NULL };

		msg[0] = '\0';
		if ((r = disk_run(argv, msg, sizeof(msg))) < 0)
			rc = kiln_error_set(err, KILN_E_IO, "cannot flatten the disk layer \"%s\": %s", target,
					    msg[0] ? msg : strerror(-r));
	}
	if (rc == KILN_OK && (chmod(top, 0444) < 0 || rename(top, out) < 0))
		rc = fs_err(err, -errno, "cannot move the flattened disk to", out);
	fs_remove_tree_or_warn(work);
	return rc;
}

/*
 * Stage 2: the portable copy in <up>/port.tmp (the snapshot's files, its disk flattened onto the
 * base, the manifest rewritten for it), packed into <up>/object.kiln for the tenant.
 */
static enum kiln_err stage_object(struct snapstore *s, const char *snap_id, const char *tenant_id,
				  const char *up, struct kiln_error *err)
{
	char src[PATH_MAX], port[PATH_MAX], obj[PATH_MAX], from[PATH_MAX], to[PATH_MAX], tmp[PATH_MAX];
	struct snapshot_meta *meta;
	enum kiln_err rc;
	json_t *m = NULL, *chain = NULL;
	size_t n = 0;
	bool has_disk = false;
	int r;

	if (!fs_path(src, "%s/src", up) || !fs_path(port, "%s/port.tmp", up) ||
	    !fs_path(obj, "%s/%s", up, OBJECT_NAME) || !fs_path(tmp, "%s/flatten.tmp", up))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot root too long");
	meta = calloc(1, sizeof(*meta));
	if (!meta)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	/* what leaves the node is what was taken: check it first */
	rc = snapshot_verify(src, NULL, meta, err);
	if (rc == KILN_OK && !(chain = manifest_chain(src, &m, err)))
		rc = err->code ? err->code : KILN_E_INVALID;
	if (rc == KILN_OK) {
		n = json_array_size(chain);
		remove_staged(port);
		remove_staged(tmp);
		if (mkdir(port, 0700) < 0)
			rc = fs_err(err, -errno, "cannot create", port);
	}
	for (unsigned i = 0; rc == KILN_OK && i < meta->n_files; i++) {
		const char *name = meta->files[i].name;

		has_disk |= strcmp(name, DISK_NAME) == 0;
		if (!fs_path(from, "%s/%s", src, name) || !fs_path(to, "%s/%s", port, name))
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot path too long");
		else if ((r = link_or_copy(from, to)) < 0)
			rc = fs_err(err, r, "cannot link", from);
	}
	if (rc == KILN_OK && has_disk != (n > 0))
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot \"%s\": its disk chain does not match its files",
				    snap_id);
	if (rc == KILN_OK && n > 2) {
		if (!fs_path(to, "%s/%s", port, DISK_NAME))
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot path too long");
		else
			rc = flatten_onto_base(src, json_string_value(json_array_get(chain, 0)),
					       (unsigned)(n - 2), tmp, to, err);
	}
	if (rc == KILN_OK && n > 0) {
		/* the copy's chain: the base, then its one layer (a fetch rewrites both paths) */
		char own[PATH_MAX];
		json_t *c2 = json_array();

		if (!fs_path(own, "%s/%s/%s", s->snap_root, snap_id, DISK_NAME) || !c2 ||
		    json_array_append(c2, json_array_get(chain, 0)) < 0 ||
		    json_array_append_new(c2, json_string(own)) < 0 ||
		    json_object_set_new(m, "disk_chain", c2) < 0)
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	if (rc == KILN_OK)
		rc = manifest_save(port, m, err);
	if (rc == KILN_OK)
		rc = snapshot_manifest_write(port, meta, err);	/* sizes and digests of the copy */
	if (rc == KILN_OK)
		rc = snapshot_pack(port, s->mk, tenant_id, obj, err);
	if (rc == KILN_OK && (r = fs_fsync_path(up)) < 0)
		rc = fs_err(err, r, "cannot sync", up);
	if (rc == KILN_OK)
		remove_staged(src);
	remove_staged(port);
	remove_staged(tmp);
	json_decref(m);
	free(meta);
	return rc;
}

/* ---- the workers ---- */

struct put_ctx {
	struct snapstore *s;
	const char *snap_id;
};

static enum kiln_err on_part(void *arg, unsigned part, unsigned nparts, bool sent)
{
	struct put_ctx *p = arg;
	bool stop;

	if (p->s->on_part)
		p->s->on_part(p->s->on_part_arg, p->snap_id, part, nparts, sent);
	pthread_mutex_lock(&p->s->lock);
	stop = p->s->stopping;
	pthread_mutex_unlock(&p->s->lock);
	return stop ? KILN_E_UNAVAILABLE : KILN_OK;
}

/* Waits `ms` unless the store stops first; returns false when it stops. */
static bool wait_retry(struct snapstore *s, unsigned ms)
{
	struct timespec until;
	bool stopping;

	until = clock_after_ms(CLOCK_MONOTONIC, ms);
	pthread_mutex_lock(&s->lock);
	while (!s->stopping && pthread_cond_timedwait(&s->work, &s->lock, &until) != ETIMEDOUT)
		;
	stopping = s->stopping;
	pthread_mutex_unlock(&s->lock);
	return !stopping;
}

static bool is_stopping(struct snapstore *s)
{
	bool v;

	pthread_mutex_lock(&s->lock);
	v = s->stopping;
	pthread_mutex_unlock(&s->lock);
	return v;
}

/* Stage 3: sends <up>/object.kiln, trying again while the bucket cannot be reached. */
static enum job_end send_object(struct snapstore *s, const struct job *j, const char *up,
				struct kiln_error *err)
{
	char obj[PATH_MAX], key[ID_MAX + 32];
	unsigned delay = s->retry_delay_ms;
	struct put_ctx ctx = { s, j->snap_id };

	if (!fs_path(obj, "%s/%s", up, OBJECT_NAME))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot root too long"), JOB_FAILED;
	object_key(j->snap_id, key, sizeof(key));
	for (unsigned try = 1;; try++) {
		struct s3_put_stats stats = { 0 };
		struct s3_target t;
		struct s3_client *c;
		enum kiln_err rc;

		kiln_error_clear(err);
		rc = load_target(s, j->tenant_id, &t, err);
		if (rc == KILN_E_NOT_FOUND) {
			kiln_error_clear(err);
			kiln_error_set(err, KILN_E_CONFLICT, "the tenant has no bucket any more");
			return JOB_FAILED;
		}
		if (rc == KILN_OK) {
			c = s3_client_new(&t, s->has_s3 ? &s->s3 : NULL, err);
			s3_target_wipe(&t);
			rc = c ? s3_put_file(c, key, obj, on_part, &ctx, &stats, err) : err->code;
			s3_client_free(c);
		}
		if (rc == KILN_OK) {
			log_info("snapshot \"%s\" stored in the tenant's bucket (%u of %u parts sent%s)",
				 j->snap_id, stats.parts_sent, stats.parts, stats.resumed ? ", resumed" : "");
			return JOB_DONE;
		}
		if (is_stopping(s))
			return JOB_STOPPED;
		if (rc != KILN_E_UNAVAILABLE || try >= s->upload_tries)
			return JOB_FAILED;
		log_warn("upload of snapshot \"%s\" (try %u of %u): %s; trying again in %u ms", j->snap_id,
			 try, s->upload_tries, err->msg, delay);
		if (!wait_retry(s, delay))
			return JOB_STOPPED;
		delay = delay > UINT_MAX / 2 ? UINT_MAX : delay * 2;
	}
}

static void run_job(struct snapstore *s, struct job *j)
{
	char up[PATH_MAX], src[PATH_MAX], obj[PATH_MAX];
	struct kiln_error err = { 0 };
	enum kiln_err rc = KILN_OK;
	enum job_end end;

	if (!fs_path(up, "%s/%s%s", s->snap_root, UP_PREFIX, j->snap_id) ||
	    !fs_path(src, "%s/src", up) || !fs_path(obj, "%s/%s", up, OBJECT_NAME)) {
		kiln_error_set(&err, KILN_E_INVALID, "snapshot root too long");
		end = JOB_FAILED;
		goto out;
	}
	if (!exists(obj)) {
		if (!is_dir(src))
			rc = stage_links(s, j->snap_id, up, &err);
		if (rc == KILN_OK && !is_stopping(s))
			rc = stage_object(s, j->snap_id, j->tenant_id, up, &err);
	}
	if (rc != KILN_OK)
		end = JOB_FAILED;
	else if (is_stopping(s))
		end = JOB_STOPPED;
	else
		end = send_object(s, j, up, &err);
out:
	if (end == JOB_STOPPED) {
		log_info("upload of snapshot \"%s\" stopped; it resumes at the next start", j->snap_id);
		return;
	}
	if (end == JOB_DONE) {
		struct kiln_error perr = { 0 };

		/* the work goes only once the row says stored: else a restart sends it again */
		if (set_status(s, j->snap_id, "stored", NULL, &perr) == KILN_OK)
			remove_staged(up);
		else
			log_error("snapshot \"%s\" is stored but its status was not recorded: %s",
				  j->snap_id, perr.msg);
		return;
	}
	log_error("upload of snapshot \"%s\" failed: %s", j->snap_id, err.msg);
	struct kiln_error perr = { 0 };
	if (set_status(s, j->snap_id, "failed", err.msg, &perr) != KILN_OK)
		log_error("status of snapshot \"%s\" not recorded: %s", j->snap_id, perr.msg);
	remove_staged(up);
}

static void *worker(void *arg)
{
	struct snapstore *s = arg;

	pthread_mutex_lock(&s->lock);
	while (!s->stopping) {
		struct job *j = s->jobs;

		while (j && j->running)
			j = j->next;
		if (!j) {
			pthread_cond_wait(&s->work, &s->lock);
			continue;
		}
		j->running = true;
		pthread_mutex_unlock(&s->lock);
		run_job(s, j);
		pthread_mutex_lock(&s->lock);
		for (struct job **pp = &s->jobs; *pp; pp = &(*pp)->next)
			if (*pp == j) {
				*pp = j->next;
				break;
			}
		free(j);
		pthread_cond_broadcast(&s->idle);
	}
	pthread_mutex_unlock(&s->lock);
	return NULL;
}

/* Queues an upload unless one of the same snapshot is queued or running. */
static enum kiln_err enqueue(struct snapstore *s, const char *snap_id, const char *tenant_id,
			     struct kiln_error *err)
{
	struct job *j, **tail;

	pthread_mutex_lock(&s->lock);
	for (tail = &s->jobs; *tail; tail = &(*tail)->next)
		if (strcmp((*tail)->snap_id, snap_id) == 0) {
			pthread_mutex_unlock(&s->lock);
			return KILN_OK;
		}
	j = calloc(1, sizeof(*j));
	if (!j) {
		pthread_mutex_unlock(&s->lock);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	snprintf(j->snap_id, sizeof(j->snap_id), "%s", snap_id);
	snprintf(j->tenant_id, sizeof(j->tenant_id), "%s", tenant_id);
	*tail = j;
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&s->lock);
	return KILN_OK;
}

/* ---- the API ---- */

struct snapstore *snapstore_open(const struct snapstore_config *cfg, struct kiln_error *err)
{
	struct snapstore *s;

	if (!cfg || !cfg->pg || !cfg->mk || !cfg->node_id || !cfg->snap_root || !cfg->base_image ||
	    !cfg->snap_root[0]) {
		kiln_error_set(err, KILN_E_INVALID, "snapstore: pg, mk, node_id, snap_root and base_image are required");
		return NULL;
	}
	s = calloc(1, sizeof(*s));
	if (!s) {
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return NULL;
	}
	s->pg = cfg->pg;
	s->mk = cfg->mk;
	s->node_id = strdup(cfg->node_id);
	s->snap_root = strdup(cfg->snap_root);
	s->base_image = strdup(cfg->base_image);
	s->codeint_image = strdup(cfg->codeint_image ? cfg->codeint_image : "");
	s->image_hash = strdup(cfg->image_hash ? cfg->image_hash : "");
	s->kernel = strdup(cfg->kernel ? cfg->kernel : "");
	s->initrd = strdup(cfg->initrd ? cfg->initrd : "");
	s->n_workers = cfg->workers ? cfg->workers : 2;
	s->upload_tries = cfg->upload_tries ? cfg->upload_tries : 5;
	s->retry_delay_ms = cfg->retry_delay_ms ? cfg->retry_delay_ms : 2000;
	if (cfg->s3) {
		s->s3 = *cfg->s3;
		s->has_s3 = true;
	}
	s->on_part = cfg->on_part;
	s->on_part_arg = cfg->on_part_arg;
	s->workers = calloc(s->n_workers, sizeof(*s->workers));
	if (!s->node_id || !s->snap_root || !s->base_image || !s->codeint_image || !s->image_hash ||
	    !s->kernel || !s->initrd || !s->workers) {
		free(s->image_hash);
		free(s->kernel);
		free(s->initrd);
		free(s->node_id);
		free(s->snap_root);
		free(s->base_image);
		free(s->codeint_image);
		free(s->workers);
		free(s);
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return NULL;
	}
	pthread_mutex_init(&s->lock, NULL);
	clock_cond_init(&s->work, CLOCK_MONOTONIC);
	clock_cond_init(&s->idle, CLOCK_MONOTONIC);
	for (unsigned i = 0; i < s->n_workers; i++) {
		if (pthread_create(&s->workers[i], NULL, worker, s) != 0) {
			s->n_workers = i;
			snapstore_shutdown(s);
			kiln_error_set(err, KILN_E_INTERNAL, "cannot start the snapshot upload threads");
			return NULL;
		}
	}
	return s;
}

void snapstore_shutdown(struct snapstore *s)
{
	if (!s)
		return;
	pthread_mutex_lock(&s->lock);
	s->stopping = true;
	pthread_cond_broadcast(&s->work);
	pthread_mutex_unlock(&s->lock);
	for (unsigned i = 0; i < s->n_workers; i++)
		pthread_join(s->workers[i], NULL);
	while (s->jobs) {
		struct job *j = s->jobs;

		s->jobs = j->next;
		free(j);
	}
	pthread_cond_destroy(&s->work);
	pthread_cond_destroy(&s->idle);
	pthread_mutex_destroy(&s->lock);
	free(s->node_id);
	free(s->snap_root);
	free(s->base_image);
	free(s->image_hash);
	free(s->kernel);
	free(s->initrd);
	free(s->codeint_image);
	free(s->workers);
	free(s);
}

bool snapstore_wait_idle(struct snapstore *s, unsigned timeout_ms)
{
	struct timespec until = clock_after_ms(CLOCK_MONOTONIC, timeout_ms);
	bool idle;

	pthread_mutex_lock(&s->lock);
	while (s->jobs && !s->stopping) {
		if (timeout_ms == 0)
			pthread_cond_wait(&s->idle, &s->lock);
		else if (pthread_cond_timedwait(&s->idle, &s->lock, &until) == ETIMEDOUT)
			break;
	}
	idle = s->jobs == NULL;
	pthread_mutex_unlock(&s->lock);
	return idle;
}

enum kiln_err snapstore_upload_start(struct snapstore *s, const char *snap_id,
				     const char *tenant_id, struct kiln_error *err)
{
	char up[PATH_MAX];
	struct s3_target t;
	struct pg_conn *c;
	struct pg_res *res = NULL;
	enum kiln_err rc;

	if (!valid_id(snap_id) || !valid_tenant(tenant_id))
		return kiln_error_set(err, KILN_E_INVALID, "bad snapshot or tenant id");
	if (!fs_path(up, "%s/%s%s", s->snap_root, UP_PREFIX, snap_id))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot root too long");
	rc = load_target(s, tenant_id, &t, err);
	s3_target_wipe(&t);
	if (rc == KILN_E_NOT_FOUND) {
		/*
		 * No bucket: the snapshot stays local. A row already shown `uploading` (a template's
		 * image, marked so as it became ready) lost its bucket in between: it says so.
		 */
		kiln_error_clear(err);
		if (pg_acquire(s->pg, &c, err) == KILN_OK) {
			PGQ(c, NULL, err,
			    "UPDATE snapshots SET status = 'failed', storage = 's3', reason = $2 "
			    "WHERE id = $1 AND status = 'uploading'",
			    snap_id, "the tenant's bucket was removed before the upload started; "
				     "the snapshot stays on its node");
			pg_release(s->pg, c);
		}
		if (err->code != KILN_OK)
			log_warn("snapshot \"%s\" left uploading: %s", snap_id, err->msg);
		kiln_error_clear(err);
		return KILN_OK;
	}
	if (rc == KILN_E_INTERNAL) {
		struct kiln_error perr = { 0 };
		char reason[KILN_ERRMSG_MAX];

		snprintf(reason, sizeof(reason), "%s", err->msg);
		set_status(s, snap_id, "failed", reason, &perr);
		return rc;
	}
	if (rc != KILN_OK)
		return rc;
	rc = pg_acquire(s->pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, &res, err, "SELECT 1 FROM snapshots WHERE id = $1 AND tenant_id = $2", snap_id,
		 tenant_id);
	if (rc == KILN_OK && pg_res_rows(res) != 1)
		rc = kiln_error_set(err, KILN_E_NOT_FOUND, "no snapshot \"%s\" of tenant \"%s\"", snap_id,
				    tenant_id);
	pg_res_free(res);
	pg_release(s->pg, c);
	if (rc != KILN_OK)
		return rc;
	/* an upload of it already queued or running keeps its work */
	pthread_mutex_lock(&s->lock);
	for (struct job *j = s->jobs; j; j = j->next)
		if (strcmp(j->snap_id, snap_id) == 0) {
			pthread_mutex_unlock(&s->lock);
			return KILN_OK;
		}
	pthread_mutex_unlock(&s->lock);
	/* the files first (a restart finds an upload without them and stages again) */
	remove_staged(up);
	rc = stage_links(s, snap_id, up, err);
	if (rc == KILN_OK)
		rc = set_status(s, snap_id, "uploading", NULL, err);
	if (rc == KILN_OK)
		rc = enqueue(s, snap_id, tenant_id, err);
	if (rc != KILN_OK)
		remove_staged(up);
	return rc;
}

unsigned snapstore_resume_pending(struct snapstore *s)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	unsigned queued = 0;
	struct dirent *de;
	DIR *d;

	if (pg_acquire(s->pg, &c, &err) != KILN_OK) {
		log_error("pending snapshot uploads not resumed: %s", err.msg);
		return 0;
	}
	if (PGQ(c, &res, &err,
		"SELECT id, tenant_id FROM snapshots WHERE node_id = $1 AND status = 'uploading' "
		"ORDER BY created_at",
		s->node_id) != KILN_OK) {
		pg_release(s->pg, c);
		log_error("pending snapshot uploads not resumed: %s", err.msg);
		return 0;
	}
	pg_release(s->pg, c);
	for (int i = 0; i < pg_res_rows(res); i++) {
		const char *id = pg_res_str(res, i, 0), *tenant = pg_res_str(res, i, 1);

		kiln_error_clear(&err);
		if (!valid_id(id) || !valid_tenant(tenant))
			continue;
		if (enqueue(s, id, tenant, &err) == KILN_OK)
			queued++;
	}
	/* work directories nothing needs: uploads no longer pending, interrupted fetches */
	d = opendir(s->snap_root);
	while (d && (de = readdir(d))) {
		char path[PATH_MAX];
		bool keep = false;

		if (strncmp(de->d_name, UP_PREFIX, strlen(UP_PREFIX)) == 0) {
			for (int i = 0; !keep && i < pg_res_rows(res); i++)
				keep = strcmp(de->d_name + strlen(UP_PREFIX), pg_res_str(res, i, 0)) == 0;
		} else if (strncmp(de->d_name, FETCH_PREFIX, strlen(FETCH_PREFIX)) != 0) {
			continue;
		}
		if (!keep && fs_path(path, "%s/%s", s->snap_root, de->d_name)) {
			log_info("removing leftover snapshot work \"%s\"", path);
			fs_remove_tree_or_warn(path);
		}
	}
	if (d)
		closedir(d);
	pg_res_free(res);
	if (queued)
		log_info("%u snapshot upload(s) resumed", queued);
	return queued;
}

/*
 * Rewrites the disk chain, kernel and initramfs of a fetched snapshot in `work` for its place
 * `final` on this node.
 */
static enum kiln_err localize(struct snapstore *s, const char *work, const char *final,
			      struct kiln_error *err)
{
	char own[PATH_MAX], disk[PATH_MAX];
	json_t *m = NULL, *chain, *c2;
	enum kiln_err rc = KILN_OK;

	chain = manifest_chain(work, &m, err);
	if (!chain)
		return err->code ? err->code : KILN_E_INVALID;
	if (json_array_size(chain) == 0) {
		json_decref(m);
		return KILN_OK;
	}
	if (json_array_size(chain) != 2) {
		json_decref(m);
		return kiln_error_set(err, KILN_E_INVALID, "the snapshot's disk is not standalone (%zu layers)",
				      json_array_size(chain) - 1);
	}
	if (!fs_path(own, "%s/%s", final, DISK_NAME) || !fs_path(disk, "%s/%s", work, DISK_NAME)) {
		json_decref(m);
		return kiln_error_set(err, KILN_E_INVALID, "snapshot root too long");
	}
	/*
	 * The files of the image the snapshot was taken on, as this node has them: its configured
	 * image's, or those node_images records for that hash here (refused when it has none). The
	 * code interpreter's root file system when the layer was made on that image's copy of it,
	 * else its base: never another path the manifest names, whatever file is there.
	 */
	const char *base = json_string_value(json_array_get(chain, 0));
	const char *hash = json_string_value(json_object_get(m, "image_hash"));
	const char *rootfs = s->base_image, *codeint = s->codeint_image;
	const char *kernel = s->kernel, *initrd = s->initrd;
	struct node_image img;

	if (s->image_hash[0] && hash && strcmp(hash, s->image_hash) != 0) {
		rc = images_find(s->pg, s->node_id, hash, &img, err);
		if (rc != KILN_OK) {
			json_decref(m);
			return rc;
		}
		rootfs = img.rootfs;
		codeint = img.codeint_rootfs;
		kernel = img.kernel;
		initrd = img.initrd;
	}
	if (!base || !codeint[0] || strcmp(base, codeint) != 0)
		base = rootfs;
	c2 = json_pack("[s, s]", base, own);
	if (!c2 || json_object_set_new(m, "disk_chain", c2) < 0)
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if (rc == KILN_OK && kernel[0] &&
	    (json_object_set_new(m, "kernel", json_string(kernel)) < 0 ||
	     json_object_set_new(m, "initrd", initrd[0] ? json_string(initrd) : json_null()) < 0))
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if (rc == KILN_OK)
		rc = manifest_save(work, m, err);
	json_decref(m);
	/* a frozen layer, as the driver leaves its own: root's, read-only */
	if (rc == KILN_OK && (chmod(disk, 0444) < 0 || (geteuid() == 0 && chown(disk, 0, 0) < 0)))
		rc = fs_err(err, -errno, "cannot freeze", disk);
	return rc;
}

enum kiln_err snapstore_fetch(struct snapstore *s, const char *snap_id, const char *tenant_id,
			      struct kiln_error *err)
{
	char final[PATH_MAX], work[PATH_MAX], obj[PATH_MAX], snap[PATH_MAX], key[ID_MAX + 32];
	unsigned char rnd[4];
	struct s3_target t;
	struct s3_client *cl = NULL;
	struct pg_conn *c;
	struct pg_res *res = NULL;
	enum kiln_err rc;
	int r;

	if (!valid_id(snap_id) || !valid_tenant(tenant_id))
		return kiln_error_set(err, KILN_E_INVALID, "bad snapshot or tenant id");
	if (!fs_path(final, "%s/%s", s->snap_root, snap_id))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot root too long");

	rc = pg_acquire(s->pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, &res, err,
		 "SELECT status, coalesce(reason, '') FROM snapshots WHERE id = $1 AND tenant_id = $2",
		 snap_id, tenant_id);
	pg_release(s->pg, c);
	if (rc == KILN_OK && pg_res_rows(res) != 1)
		rc = kiln_error_set(err, KILN_E_NOT_FOUND, "no snapshot \"%s\"", snap_id);
	else if (rc == KILN_OK && is_dir(final)) {
		pg_res_free(res);
		return KILN_OK;		/* here already (taken here, or fetched before) */
	} else if (rc == KILN_OK && strcmp(pg_res_str(res, 0, 0), "uploading") == 0)
		rc = kiln_error_set(err, KILN_E_UNAVAILABLE,
				    "snapshot \"%s\" is not in the bucket yet: the node that took it is still uploading it",
				    snap_id);
	else if (rc == KILN_OK && strcmp(pg_res_str(res, 0, 0), "stored") != 0)
		rc = kiln_error_set(err, KILN_E_CONFLICT,
				    "snapshot \"%s\" is not in the tenant's bucket (status %s%s%s): its files are only on the node that took it",
				    snap_id, pg_res_str(res, 0, 0), pg_res_str(res, 0, 1)[0] ? ": " : "",
				    pg_res_str(res, 0, 1));
	pg_res_free(res);
	if (rc != KILN_OK)
		return rc;

	rc = load_target(s, tenant_id, &t, err);
	if (rc == KILN_E_NOT_FOUND) {
		kiln_error_clear(err);
		return kiln_error_set(err, KILN_E_CONFLICT,
				      "snapshot \"%s\" is in the tenant's bucket but the tenant has no bucket configured any more",
				      snap_id);
	}
	if (rc != KILN_OK)
		return rc;
	cl = s3_client_new(&t, s->has_s3 ? &s->s3 : NULL, err);
	s3_target_wipe(&t);
	if (!cl)
		return err->code ? err->code : KILN_E_INTERNAL;

	if (getrandom(rnd, sizeof(rnd), 0) != sizeof(rnd))
		memset(rnd, 0, sizeof(rnd));
	if (!fs_path(work, "%s/%s%s.%02x%02x%02x%02x", s->snap_root, FETCH_PREFIX, snap_id, rnd[0],
		      rnd[1], rnd[2], rnd[3]) ||
	    !fs_path(obj, "%s/%s", work, OBJECT_NAME) || !fs_path(snap, "%s/snap", work)) {
		s3_client_free(cl);
		return kiln_error_set(err, KILN_E_INVALID, "snapshot root too long");
	}
	if (mkdir(work, 0700) < 0) {
		s3_client_free(cl);
		return fs_err(err, -errno, "cannot create", work);
	}
	object_key(snap_id, key, sizeof(key));
	{
		struct kiln_error gerr = { 0 };

		rc = s3_get_file(cl, key, obj, &gerr);
		if (rc == KILN_E_UNAVAILABLE)
			kiln_error_set(err, rc, "the snapshot's bucket cannot be reached: %s", gerr.msg);
		else if (rc == KILN_E_NOT_FOUND)
			kiln_error_set(err, rc, "snapshot \"%s\" is missing from the tenant's bucket: %s",
				       snap_id, gerr.msg);
		else if (rc != KILN_OK)
			kiln_error_set(err, rc, "snapshot \"%s\" cannot be read from the tenant's bucket: %s",
				       snap_id, gerr.msg);
	}
	s3_client_free(cl);
	if (rc == KILN_OK)
		rc = snapshot_unpack(obj, s->mk, tenant_id, snap, err);
	if (rc == KILN_OK)
		unlink(obj);
	if (rc == KILN_OK)
		rc = snapshot_verify(snap, NULL, NULL, err);
	if (rc == KILN_OK)
		rc = localize(s, snap, final, err);
	if (rc == KILN_OK && rename(snap, final) < 0) {
		if (errno == EEXIST || errno == ENOTEMPTY)
			log_info("snapshot \"%s\" was fetched meanwhile by another request", snap_id);
		else
			rc = fs_err(err, -errno, "cannot rename", snap);
	}
	if (rc == KILN_OK && (r = fs_fsync_path(s->snap_root)) < 0)
		rc = fs_err(err, r, "cannot sync", s->snap_root);
	fs_remove_tree_or_warn(work);
	if (rc == KILN_OK)
		log_info("snapshot \"%s\" fetched from the tenant's bucket", snap_id);
	return rc;
}

enum kiln_err snapstore_delete(struct snapstore *s, const char *snap_id, const char *tenant_id,
			       struct kiln_error *err)
{
	char key[ID_MAX + 32];
	struct s3_target t;
	struct s3_client *cl;
	enum kiln_err rc;
	bool busy = false;

	if (!valid_id(snap_id) || !valid_tenant(tenant_id))
		return kiln_error_set(err, KILN_E_INVALID, "bad snapshot or tenant id");
	pthread_mutex_lock(&s->lock);
	for (struct job *j = s->jobs; j && !busy; j = j->next)
		busy = strcmp(j->snap_id, snap_id) == 0;
	pthread_mutex_unlock(&s->lock);
	if (busy)
		return kiln_error_set(err, KILN_E_CONFLICT, "snapshot \"%s\" is being uploaded", snap_id);
	rc = load_target(s, tenant_id, &t, err);
	if (rc == KILN_E_NOT_FOUND) {
		kiln_error_clear(err);
		return KILN_OK;
	}
	if (rc != KILN_OK)
		return rc;
	cl = s3_client_new(&t, s->has_s3 ? &s->s3 : NULL, err);
	s3_target_wipe(&t);
	if (!cl)
		return err->code ? err->code : KILN_E_INTERNAL;
	object_key(snap_id, key, sizeof(key));
	rc = s3_delete(cl, key, err);
	s3_client_free(cl);
	return rc;
}
