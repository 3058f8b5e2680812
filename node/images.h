/*
 * images.h - the guest images a node has run, so that a snapshot restores on the image it was
 * taken from (docs/operations.md, "Rolling upgrades").
 *
 * An image is a kernel, an initramfs (holding nothing of the agent: the agent is in the root file
 * system) and a root file system, plus the code interpreter's root file system, known by the hash
 * the node is configured with (guest_image_hash). Each start of a node records its configured
 * image in `node_images` (migrations/0030) next to those of its earlier runs. A snapshot names its
 * image (its manifest's image_hash, snapshots.image_hash): a snapshot taken here restores on the
 * files its manifest names, and one fetched from a bucket on this node's files of that hash;
 * a node without them refuses the restore, never putting the guest on another image. Images that
 * a live snapshot or one of the node's VMs still uses are pinned against
 * vmm/guest/build-image.sh --prune (a file `.kiln-pin-<node>` in the image's directory).
 */
#ifndef KILN_NODE_IMAGES_H
#define KILN_NODE_IMAGES_H

#include <limits.h>
#include <stdbool.h>

#include <jansson.h>

#include "common/err.h"
#include "common/pg.h"

#define IMAGE_HASH_MAX 128
#define IMAGE_PIN_PREFIX ".kiln-pin-"

struct node_image {
	char hash[IMAGE_HASH_MAX];
	char kernel[PATH_MAX], initrd[PATH_MAX], rootfs[PATH_MAX], codeint_rootfs[PATH_MAX];
};

/*
 * This node's files of image `hash` (node_images). KILN_E_CONFLICT, with a message naming the
 * node and the image (and the file, when one of them is gone), when it has none.
 */
enum kiln_err images_find(struct pg *pg, const char *node_id, const char *hash,
			  struct node_image *out, struct kiln_error *err);

/*
 * Checks that the files `kernel`, `initrd` (may be NULL or empty) and `rootfs` (may be NULL)
 * of image `hash` are readable here: KILN_E_CONFLICT naming the image and the missing file.
 */
enum kiln_err images_check(const char *node_id, const char *hash, const char *kernel,
			   const char *initrd, const char *rootfs, struct kiln_error *err);

/*
 * The parsed manifest.json of snapshot directory `dir`, driver's fields included (a new reference
 * the caller drops with json_decref), or NULL when it is missing, too large or does not parse.
 */
json_t *images_manifest(const char *dir);

/*
 * The image snapshot directory `dir` was taken on: its manifest's image_hash (`fallback` for a
 * manifest without one) into `hash`, after checking that the files the VMM's part names (kernel,
 * initramfs, the disk chain's base) are here. KILN_E_CONFLICT naming the image and the missing
 * file when this node lacks one; KILN_E_INVALID for an unreadable manifest.
 */
enum kiln_err images_of_snapshot(const char *node_id, const char *dir, const char *fallback,
				 char *hash, size_t len, struct kiln_error *err);

/*
 * The hash of this node's image whose kernel is `kernel` (a VM an earlier run left, whose image
 * only its files tell) into `hash`; `fallback` when none is recorded or Postgres does not answer.
 */
void images_hash_of_kernel(struct pg *pg, const char *node_id, const char *kernel,
			   const char *fallback, char *hash, size_t len);

struct node;

/* Records the node's configured image in node_images (at each start). */
enum kiln_err images_register(struct node *n, struct kiln_error *err);

/*
 * Pins each of the node's images (its directories) that a snapshot not yet purged, one of the
 * node's sandboxes or its configuration still uses, and unpins the others. Errors are logged.
 */
void images_pin(struct node *n);

#endif
