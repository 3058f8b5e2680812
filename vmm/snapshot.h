/*
 * snapshot.h - what makes a snapshot directory trustworthy and portable: its manifest (what it was
 * taken under, and a digest of every file in it), the checks a restore runs before using it, and the
 * encrypted single-object form a snapshot takes when it leaves the node.
 *
 * A snapshot directory (docs/vmm.md) holds `state`, `mem` (shared mode), `disk.qcow2` and
 * `manifest.json`. The hypervisor driver writes the directory and its own manifest fields (memory
 * mode, disk chain, devices); snapshot_manifest_write() then adds the fields of docs/snapshots.md
 * ("Lifecycle") and the size and digest of every file, keeping the driver's fields. A restore calls
 * snapshot_verify() first. Before an upload, snapshot_pack() turns the directory into one object
 * encrypted with a per-object data key wrapped by the master key for one tenant; snapshot_unpack()
 * turns such an object back into a directory. docs/snapshots.md describes the formats.
 *
 * File digests are "sha256-4k-1m", a two-level SHA-256 tree: each 1 MiB chunk's digest is the
 * SHA-256 of the SHA-256 digests of its 4 KiB pages, the file's digest the SHA-256 of its chunks'
 * digests (last page and chunk may be shorter; an empty file gives SHA-256 of nothing). Zero pages
 * and zero chunks have fixed digests, so holes are never read and zero pages never hashed.
 *
 * Every function returns an enum kiln_err and fills `err` (first error wins) on failure.
 */
#ifndef KILN_VMM_SNAPSHOT_H
#define KILN_VMM_SNAPSHOT_H

#include <stdint.h>

#include "common/err.h"

#define SNAPSHOT_FORMAT 1			/* manifest format this code writes and reads */
#define SNAPSHOT_DIGEST_ALG "sha256-4k-1m"
#define SNAPSHOT_DIGEST_CHUNK (1u << 20)	/* bytes per chunk of the digest tree */
#define SNAPSHOT_DIGEST_PAGE 4096u		/* bytes per leaf of the digest tree */
#define SNAPSHOT_FILES_MAX 16			/* files in one snapshot directory */
#define SNAPSHOT_NAME_MAX 64			/* bytes of a file name, terminator included */
#define SNAPSHOT_STR_MAX 128			/* bytes of a manifest string, terminator included */
#define SNAPSHOT_MANIFEST_MAX (256 * 1024)	/* bytes of manifest.json accepted */

struct snapshot_file {
	char name[SNAPSHOT_NAME_MAX];	/* plain name inside the directory: [A-Za-z0-9._-], no '/' */
	uint64_t size;			/* bytes */
	char digest[65];		/* sha256-4k-1m, lowercase hex */
};

/*
 * What a snapshot was taken under. For snapshot_manifest_write() the caller fills the strings and
 * numbers (a string left empty is taken from the driver's manifest.json already in the directory,
 * e.g. hypervisor_version); `format` and `files` are ignored there. snapshot_verify() fills all of
 * it from the manifest.
 */
struct snapshot_meta {
	unsigned format;			/* SNAPSHOT_FORMAT */
	char hypervisor[SNAPSHOT_STR_MAX];	/* driver name: "qemu", "firecracker" */
	char hypervisor_version[SNAPSHOT_STR_MAX];	/* e.g. "7.2.0" */
	char machine[SNAPSHOT_STR_MAX];		/* machine type: "microvm" */
	char accel[SNAPSHOT_STR_MAX];		/* "kvm" or "tcg" */
	char image_hash[SNAPSHOT_STR_MAX];	/* the guest image's identity, e.g. "sha256:<hex>" */
	unsigned vcpu_milli;			/* thousandths of a vCPU */
	unsigned mem_mib;			/* guest memory, MiB */
	unsigned disk_gib;			/* virtual disk size, GiB; 0 = the base image's */
	unsigned agent_protocol;		/* kiln-agent protocol version inside the guest */
	int64_t created_at;			/* unix seconds; 0 at write = now */
	unsigned n_files;
	struct snapshot_file files[SNAPSHOT_FILES_MAX];
};

/*
 * What a restore requires. NULL strings and zero numbers are not checked; shape is the caller's
 * business (it may restore into a larger shape).
 */
struct snapshot_expect {
	const char *hypervisor;
	const char *hypervisor_version;
	const char *machine;
	const char *accel;
	const char *image_hash;
	unsigned agent_protocol;
};

/*
 * Writes `dir`/manifest.json from `meta` and the driver's fields already in that file (kept, except
 * those named in `meta`), with the size and digest of every regular file of `dir` except the manifest
 * and names starting with '.' or ending in ".tmp". Atomic: a temporary file, fsync, rename, fsync of
 * the directory. Refuses (KILN_E_INVALID) a directory holding anything else than regular files (other
 * than dot names), more than SNAPSHOT_FILES_MAX files, a bad file name, or a meta whose hypervisor,
 * hypervisor_version, machine, accel, image_hash, vcpu_milli, mem_mib or agent_protocol is still
 * empty or zero. Reads the files sequentially, holes and all-zero chunks not hashed.
 */
enum kiln_err snapshot_manifest_write(const char *dir, const struct snapshot_meta *meta,
				      struct kiln_error *err);

/*
 * Checks that `dir` is a snapshot this node can restore: the manifest parses and has this format,
 * the fields named in `expect` (may be NULL) match, and every file it lists is there with its size
 * and digest. On KILN_OK, `out` (may be NULL) holds the manifest's values. Refusals are
 * KILN_E_INVALID with a message naming the cause (unknown format, which field differs and both
 * values, which file is missing, truncated or corrupt); I/O errors reading a file are KILN_E_IO.
 */
enum kiln_err snapshot_verify(const char *dir, const struct snapshot_expect *expect,
			      struct snapshot_meta *out, struct kiln_error *err);

/*
 * Computes the sha256-4k-1m digest of the file at `path` into `hex` (65 bytes) and its size into
 * `*size` (may be NULL). Streams one chunk at a time; holes are not read, zero pages not hashed.
 * Digest cache: a digest this process computed before is given again without reading the file while
 * the file's device, inode, size, mtime and ctime are those it had then (at most 256 files; only
 * for files whose times were older than the hashing's start, so a write in the same clock tick is
 * never missed: a file written in the current tick is hashed once the clock has passed its times,
 * a wait of a few ms at most). A template's image is verified at each create, a pause's files at
 * its resume on the same node; each is hashed once.
 */
enum kiln_err snapshot_file_digest(const char *path, char hex[65], uint64_t *size,
				   struct kiln_error *err);

/*
 * link(2) of `path` at `to`, or unlink(2) of `path` when `to` is NULL, keeping the file's entry in
 * the digest cache: the link moves the file's ctime, which alone would make its next digest hash it
 * again. 0 or -errno.
 */
int snapshot_file_link(const char *path, const char *to);

/* How many files this process has hashed in full (the digest cache's misses). */
unsigned long snapshot_digests_hashed(void);

struct auth_master_key;

/*
 * Writes the regular files of snapshot directory `dir` (manifest included; dot names and *.tmp
 * skipped) into one encrypted object at `out_path` (via `out_path`.tmp, fsync, rename). A fresh data
 * key (auth_data_key_new) wrapped by `mk` and bound to `tenant_id` heads the object; the files follow
 * as AES-256-GCM records of at most 1 MiB, each authenticated with its sequence number, and runs of
 * zero pages (holes or written zeros) become "zeros" records of a few bytes. Bounded memory
 * (about 3 MiB) whatever the file sizes.
 */
enum kiln_err snapshot_pack(const char *dir, const struct auth_master_key *mk, const char *tenant_id,
			    const char *out_path, struct kiln_error *err);

/*
 * Reverses snapshot_pack: decrypts the object at `in_path` for `tenant_id` into the new directory
 * `dir` (which must not exist), writing `dir`.tmp first and renaming it at the end, so that `dir`
 * appears complete or not at all. Zero runs become holes. Refuses (KILN_E_INVALID, nothing left
 * behind) an object that is not a snapshot, was packed for another tenant or under another master
 * key, is truncated, has trailing bytes, or was altered anywhere. Does not check the manifest: call
 * snapshot_verify() on `dir` next.
 */
enum kiln_err snapshot_unpack(const char *in_path, const struct auth_master_key *mk,
			      const char *tenant_id, const char *dir, struct kiln_error *err);

#endif
