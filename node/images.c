/*
 * images.c - the guest images a node has run: their record, their lookup by hash for restores,
 * and their pins against pruning (images.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include <jansson.h>

#include "common/fsutil.h"
#include "common/log.h"
#include "node/images.h"
#include "node/node.h"
#include "vmm/snapshot.h"

enum kiln_err images_check(const char *node_id, const char *hash, const char *kernel,
			   const char *initrd, const char *rootfs, struct kiln_error *err)
{
	const char *files[] = { kernel, initrd, rootfs };

	for (size_t i = 0; i < 3; i++)
		if (files[i] && files[i][0] && access(files[i], R_OK) != 0)
			return kiln_error_set(err, KILN_E_CONFLICT,
					      "node \"%s\" lacks guest image \"%s\" (\"%s\": %s): "
					      "it is restored only on the image it was taken from",
					      node_id, hash, files[i], strerror(errno));
	return KILN_OK;
}

json_t *images_manifest(const char *dir)
{
	char path[PATH_MAX];
	struct stat st;

	if (!fs_path(path, "%s/manifest.json", dir) || stat(path, &st) != 0 ||
	    st.st_size > SNAPSHOT_MANIFEST_MAX)
		return NULL;
	return json_load_file(path, 0, NULL);
}

enum kiln_err images_of_snapshot(const char *node_id, const char *dir, const char *fallback,
				 char *hash, size_t len, struct kiln_error *err)
{
	json_t *m = images_manifest(dir);
	enum kiln_err rc;

	if (!m)
		return kiln_error_set(err, KILN_E_INVALID, "snapshot \"%s\": no readable manifest", dir);
	{
		const char *h = json_string_value(json_object_get(m, "image_hash"));

		snprintf(hash, len, "%s", h && h[0] ? h : fallback);
	}
	rc = images_check(node_id, hash, json_string_value(json_object_get(m, "kernel")),
			  json_string_value(json_object_get(m, "initrd")),
			  json_string_value(json_array_get(json_object_get(m, "disk_chain"), 0)), err);
	json_decref(m);
	return rc;
}

void images_hash_of_kernel(struct pg *pg, const char *node_id, const char *kernel,
			   const char *fallback, char *hash, size_t len)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;

	snprintf(hash, len, "%s", fallback);
	if (!kernel || pg_acquire(pg, &c, &err) != KILN_OK)
		return;
	if (PGQ(c, &res, &err,
		"SELECT image_hash FROM node_images WHERE node_id = $1 AND kernel = $2 "
		"ORDER BY seen_at DESC LIMIT 1",
		node_id, kernel) == KILN_OK && pg_res_rows(res) == 1)
		snprintf(hash, len, "%s", pg_res_str(res, 0, 0));
	pg_res_free(res);
	pg_release(pg, c);
}

enum kiln_err images_find(struct pg *pg, const char *node_id, const char *hash,
			  struct node_image *out, struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	enum kiln_err rc = pg_acquire(pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, &res, err,
		 "SELECT kernel, initrd, rootfs, codeint_rootfs FROM node_images "
		 "WHERE node_id = $1 AND image_hash = $2",
		 node_id, hash);
	pg_release(pg, c);
	if (rc == KILN_OK && pg_res_rows(res) != 1)
		rc = kiln_error_set(err, KILN_E_CONFLICT,
				    "node \"%s\" never had guest image \"%s\": it is restored only on the "
				    "image it was taken from",
				    node_id, hash);
	if (rc == KILN_OK) {
		memset(out, 0, sizeof(*out));
		snprintf(out->hash, sizeof(out->hash), "%s", hash);
		snprintf(out->kernel, sizeof(out->kernel), "%s", pg_res_str(res, 0, 0));
		snprintf(out->initrd, sizeof(out->initrd), "%s", pg_res_str(res, 0, 1));
		snprintf(out->rootfs, sizeof(out->rootfs), "%s", pg_res_str(res, 0, 2));
		snprintf(out->codeint_rootfs, sizeof(out->codeint_rootfs), "%s", pg_res_str(res, 0, 3));
		rc = images_check(node_id, hash, out->kernel, out->initrd, out->rootfs, err);
	}
	pg_res_free(res);
	return rc;
}

enum kiln_err images_register(struct node *n, struct kiln_error *err)
{
	struct pg_conn *c;
	enum kiln_err rc = pg_acquire(n->pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, NULL, err,
		 "INSERT INTO node_images (node_id, image_hash, kernel, initrd, rootfs, codeint_rootfs) "
		 "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (node_id, image_hash) DO UPDATE SET "
		 "kernel = $3, initrd = $4, rootfs = $5, codeint_rootfs = $6, seen_at = now()",
		 n->cfg.node_id, node_image_hash(n), n->cfg.guest_kernel, n->cfg.guest_initrd,
		 n->cfg.guest_rootfs, n->cfg.guest_codeint_rootfs ? n->cfg.guest_codeint_rootfs : "");
	pg_release(n->pg, c);
	return rc;
}

/* The directory of file `path` into `out` ("" for an empty path). */
static void dir_of(const char *path, char *out, size_t len)
{
	char tmp[PATH_MAX];

	out[0] = '\0';
	if (!path || !path[0])
		return;
	snprintf(tmp, sizeof(tmp), "%s", path);
	snprintf(out, len, "%s", dirname(tmp));
}

/* Whether one of the node's sandboxes runs on image `hash`. */
static bool image_running(struct node *n, const char *hash)
{
	bool used = false;

	pthread_mutex_lock(&n->reg_lock);
	for (struct sandbox *it = n->sandboxes; it && !used; it = it->next)
		used = strcmp(it->image_hash, hash) == 0;
	pthread_mutex_unlock(&n->reg_lock);
	return used;
}

#define PIN_DIRS_MAX 256

void images_pin(struct node *n)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	static char pinned[PIN_DIRS_MAX][PATH_MAX];	/* the ticker's thread only */
	size_t npinned = 0;
	bool overflow = false;	/* past PIN_DIRS_MAX pins: unpin nothing this round */

	if (pg_acquire(n->pg, &c, &err) != KILN_OK)
		return;
	if (PGQ(c, &res, &err,
		"SELECT i.image_hash, i.kernel, i.initrd, i.rootfs, i.codeint_rootfs, "
		"  i.image_hash = $2 OR EXISTS (SELECT 1 FROM snapshots p "
		"    WHERE p.image_hash = i.image_hash AND p.purged_at IS NULL) "
		"FROM node_images i WHERE i.node_id = $1 ORDER BY i.image_hash",
		n->cfg.node_id, node_image_hash(n)) != KILN_OK) {
		log_warn("guest images not pinned: %s", err.msg);
		pg_release(n->pg, c);
		return;
	}
	pg_release(n->pg, c);
	/* Two passes: the directories in use first, so that a directory two images share and one
	 * of them still uses keeps its pin. */
	for (int pass = 0; pass < 2; pass++) {
		for (int i = 0; i < pg_res_rows(res); i++) {
			bool used = strcmp(pg_res_str(res, i, 5), "t") == 0 ||
				    image_running(n, pg_res_str(res, i, 0));

			if (used != (pass == 0))
				continue;
			for (int f = 1; f <= 4; f++) {
				char dir[PATH_MAX], pin[PATH_MAX];
				bool keep = false;

				dir_of(pg_res_str(res, i, f), dir, sizeof(dir));
				if (!dir[0] || !fs_path(pin, "%s/" IMAGE_PIN_PREFIX "%s", dir, n->cfg.node_id))
					continue;
				for (size_t k = 0; k < npinned && !keep; k++)
					keep = strcmp(pinned[k], dir) == 0;
				if (used && !keep) {
					int fd = open(pin, O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC,
						      0644);

					if (fd >= 0)
						close(fd);
					else if (errno != ENOENT)
						log_warn("cannot pin guest image \"%s\" (\"%s\"): %s",
							 pg_res_str(res, i, 0), pin, strerror(errno));
					if (npinned < PIN_DIRS_MAX)
						snprintf(pinned[npinned++], PATH_MAX, "%s", dir);
					else
						overflow = true;
				} else if (!used && !keep && !overflow && unlink(pin) == 0) {
					log_info("guest image \"%s\" is no longer used here: unpinned",
						 pg_res_str(res, i, 0));
				}
			}
		}
	}
	pg_res_free(res);
}
