/*
 * test_snapshot.c - snapshot manifests (write, verify, each refusal) and packed objects (round trip,
 * sparse and small, wrong tenant, truncated, altered), on real files in a temporary directory.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>
#include <openssl/evp.h>

#include "auth/crypto.h"
#include "test.h"
#include "vmm/snapshot.h"

#define MIB (1024 * 1024)
#define MEM_SIZE (64 * MIB)

static char root[PATH_MAX];
static struct auth_master_key mk;
static unsigned seq;

/* A fresh path under the test's temporary root. */
static const char *fresh(const char *what)
{
	static char paths[64][PATH_MAX];
	static unsigned slot;
	char *p = paths[slot++ % 64];

	if (snprintf(p, PATH_MAX, "%s/%s-%u", root, what, seq++) >= PATH_MAX)
		abort();
	return p;
}

static void write_file(const char *path, const void *data, size_t len)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);

	CHECK(fd >= 0);
	CHECK(write(fd, data, len) == (ssize_t)len);
	close(fd);
}

/* Writes `len` bytes of a non-zero pattern at `off` of `path` (created if absent). */
static void write_at(const char *path, off_t off, size_t len, unsigned char seed)
{
	unsigned char *b = malloc(len);
	int fd = open(path, O_WRONLY | O_CREAT, 0600);

	for (size_t i = 0; i < len; i++)
		b[i] = (unsigned char)(seed + i * 7 + (i >> 9)) | 1;
	CHECK(fd >= 0);
	CHECK(pwrite(fd, b, len, off) == (ssize_t)len);
	close(fd);
	free(b);
}

static off_t file_size(const char *path)
{
	struct stat st;

	return stat(path, &st) == 0 ? st.st_size : -1;
}

static bool exists(const char *path)
{
	struct stat st;

	return lstat(path, &st) == 0;
}

static bool same_content(const char *a, const char *b)
{
	FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
	bool same = fa && fb;
	int ca, cb;

	while (same) {
		ca = getc(fa);
		cb = getc(fb);
		if (ca != cb)
			same = false;
		if (ca == EOF || cb == EOF)
			break;
	}
	if (fa)
		fclose(fa);
	if (fb)
		fclose(fb);
	return same;
}

static void rm_rf(const char *dir)
{
	char cmd[PATH_MAX + 16];

	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	if (system(cmd) != 0)
		fprintf(stderr, "cannot remove %s\n", dir);
}

static void fill_meta(struct snapshot_meta *m)
{
	memset(m, 0, sizeof(*m));
	snprintf(m->hypervisor, sizeof(m->hypervisor), "qemu");
	snprintf(m->machine, sizeof(m->machine), "microvm");
	snprintf(m->accel, sizeof(m->accel), "tcg");
	snprintf(m->image_hash, sizeof(m->image_hash), "sha256:%064d", 7);
	m->vcpu_milli = 1500;
	m->mem_mib = MEM_SIZE / MIB;
	m->disk_gib = 2;
	m->agent_protocol = 3;
	m->created_at = 1700000000;
}

/*
 * A snapshot dir like the QEMU driver leaves it: its own manifest (hypervisor_version comes from
 * there), state, a sparse 64 MiB memory image with a few data pages, a disk layer; then the manifest
 * written by snapshot.c.
 */
static const char *make_snapshot(void)
{
	const char *dir = fresh("snap");
	char path[PATH_MAX];
	struct snapshot_meta m;
	struct kiln_error err = { 0 };
	const char *driver = "{\"format\": 1, \"hypervisor\": \"qemu\", \"hypervisor_version\": \"7.2.0\","
			     " \"memory\": \"shared\", \"disk_chain\": [\"/base.raw\"], \"net\": true}";

	CHECK(mkdir(dir, 0700) == 0);
	snprintf(path, sizeof(path), "%s/manifest.json", dir);
	write_file(path, driver, strlen(driver));
	snprintf(path, sizeof(path), "%s/state", dir);
	write_at(path, 0, 50000, 3);
	snprintf(path, sizeof(path), "%s/mem", dir);
	write_at(path, 0, 4096, 1);			/* first page */
	write_at(path, 5 * MIB + 8192, 3 * 4096, 2);	/* a few pages in the middle */
	write_at(path, 20 * MIB - 100, 200, 9);		/* across a chunk boundary */
	CHECK(truncate(path, MEM_SIZE) == 0);		/* the rest: a hole */
	snprintf(path, sizeof(path), "%s/disk.qcow2", dir);
	write_at(path, 0, MIB + 333, 5);
	fill_meta(&m);
	CHECK_INT(snapshot_manifest_write(dir, &m, &err), KILN_OK);
	if (err.code)
		fprintf(stderr, "  %s\n", err.msg);
	return dir;
}

static bool msg_has(const struct kiln_error *err, const char *s)
{
	if (strstr(err->msg, s))
		return true;
	fprintf(stderr, "  message \"%s\" lacks \"%s\"\n", err->msg, s);
	return false;
}

/*
 * The sha256-4k-1m digest computed the plain way: read every byte; per 1 MiB chunk, hash the
 * digests of its 4 KiB pages; hash the chunks' digests.
 */
static void reference_digest(const char *path, char hex[65])
{
	unsigned char *buf = malloc(MIB), d[32];
	EVP_MD_CTX *outer = EVP_MD_CTX_new();
	FILE *f = fopen(path, "rb");
	size_t n;
	unsigned len;

	EVP_DigestInit_ex(outer, EVP_sha256(), NULL);
	while ((n = fread(buf, 1, MIB, f)) > 0) {
		unsigned char pages[256][32];
		size_t k = 0;

		for (size_t off = 0; off < n; off += 4096, k++)
			EVP_Digest(buf + off, n - off < 4096 ? n - off : 4096, pages[k], NULL, EVP_sha256(), NULL);
		EVP_Digest(pages, k * 32, d, NULL, EVP_sha256(), NULL);
		EVP_DigestUpdate(outer, d, 32);
	}
	EVP_DigestFinal_ex(outer, d, &len);
	for (int i = 0; i < 32; i++)
		sprintf(hex + 2 * i, "%02x", d[i]);
	fclose(f);
	EVP_MD_CTX_free(outer);
	free(buf);
}

static void test_digest_equals_plain_reading(void)
{
	const char *path = fresh("digest");
	char hex[65], ref[65];
	uint64_t size = 0;
	struct kiln_error err = { 0 };

	write_at(path, 3 * MIB + 17, 10000, 4);
	CHECK(truncate(path, 9 * MIB + 12345) == 0);	/* a partial last chunk and page, in a hole */
	write_at(path, 9 * MIB + 4096, 5, 6);	/* a data page in the last chunk */
	{
		/* written zeros in a data extent hash like a hole */
		int fd = open(path, O_WRONLY);
		char *z = calloc(1, MIB);

		CHECK(pwrite(fd, z, MIB, 6 * MIB) == MIB);
		close(fd);
		free(z);
	}
	CHECK_INT(snapshot_file_digest(path, hex, &size, &err), KILN_OK);
	reference_digest(path, ref);
	CHECK_STR(hex, ref);
	CHECK_INT(size, 9 * MIB + 12345);

	/* the empty file: SHA-256 of nothing */
	path = fresh("empty");
	write_file(path, "", 0);
	CHECK_INT(snapshot_file_digest(path, hex, &size, &err), KILN_OK);
	CHECK_STR(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

/* Flips one bit of the byte at `off` of `path`, in place. */
static void flip_byte(const char *path, off_t off)
{
	unsigned char c;
	int fd = open(path, O_RDWR);

	CHECK(pread(fd, &c, 1, off) == 1);
	c ^= 0x20;
	CHECK(pwrite(fd, &c, 1, off) == 1);
	close(fd);
}

/*
 * The digest cache (snapshot.h): a file hashed once, its times older than the hashing, is
 * remembered; a byte changed in place right after, same size, within the same clock tick or not,
 * still gives the new digest, and a verify after it refuses the file.
 */
static void test_digest_cache_sees_a_change_in_place(void)
{
	const char *dir = make_snapshot();
	char path[PATH_MAX], first[65], again[65], changed[65], ref[65];
	struct timespec pause = { 0, 50 * 1000 * 1000 };
	struct kiln_error err = { 0 };

	snprintf(path, sizeof(path), "%s/mem", dir);
	nanosleep(&pause, NULL);	/* the file's times now older than any hashing's start */
	CHECK_INT(snapshot_file_digest(path, first, NULL, &err), KILN_OK);
	CHECK_INT(snapshot_file_digest(path, again, NULL, &err), KILN_OK);	/* from the cache */
	CHECK_STR(again, first);
	CHECK_INT(snapshot_verify(dir, NULL, NULL, &err), KILN_OK);
	for (int round = 0; round < 3; round++) {
		flip_byte(path, 5 * MIB + 8200);
		CHECK_INT(snapshot_file_digest(path, changed, NULL, &err), KILN_OK);
		reference_digest(path, ref);
		CHECK_STR(changed, ref);
		if (round % 2 == 0)
			CHECK(strcmp(changed, first) != 0);
		else
			CHECK_STR(changed, first);	/* flipped back: the first content again */
		nanosleep(&pause, NULL);
	}
	CHECK_INT(snapshot_verify(dir, NULL, NULL, &err), KILN_E_INVALID);	/* flipped 3 times */
	CHECK(msg_has(&err, "file 'mem' is corrupt"));
	rm_rf(dir);
}

/*
 * A file hashed in the clock tick it was last written in (a pause's files, hashed into the manifest
 * as soon as they are written) is remembered all the same: its verify at the resume reads nothing.
 */
static void test_digest_cache_keeps_a_file_hashed_as_soon_as_written(void)
{
	const char *dir = make_snapshot();
	char path[PATH_MAX], first[65], again[65], ref[65];
	struct kiln_error err = { 0 };
	unsigned long hashed;

	snprintf(path, sizeof(path), "%s/mem", dir);
	flip_byte(path, 3 * MIB);	/* written now: its times in the current tick */
	hashed = snapshot_digests_hashed();
	CHECK_INT(snapshot_file_digest(path, first, NULL, &err), KILN_OK);
	CHECK(snapshot_digests_hashed() == hashed + 1);
	reference_digest(path, ref);
	CHECK_STR(first, ref);
	CHECK_INT(snapshot_file_digest(path, again, NULL, &err), KILN_OK);
	CHECK_STR(again, first);
	CHECK(snapshot_digests_hashed() == hashed + 1);	/* from the cache */
	flip_byte(path, 3 * MIB);	/* and a write after it is still seen */
	CHECK_INT(snapshot_file_digest(path, again, NULL, &err), KILN_OK);
	CHECK(strcmp(again, first) != 0);
	CHECK(snapshot_digests_hashed() == hashed + 2);
	rm_rf(dir);
}

/*
 * The node's own links of a file (an upload's staging, snapshot_file_link) keep its digest: made and
 * removed, the next digest reads nothing. A link made otherwise, or a write after the node's link,
 * is hashed again.
 */
static void test_digest_cache_keeps_a_file_across_the_nodes_links(void)
{
	const char *dir = make_snapshot();
	char path[PATH_MAX], other[PATH_MAX], first[65], again[65], ref[65];
	struct timespec pause = { 0, 50 * 1000 * 1000 };
	struct kiln_error err = { 0 };
	unsigned long hashed;

	snprintf(path, sizeof(path), "%s/mem", dir);
	snprintf(other, sizeof(other), "%s/mem.link", dir);
	nanosleep(&pause, NULL);
	CHECK_INT(snapshot_file_digest(path, first, NULL, &err), KILN_OK);	/* hashed or cached */
	hashed = snapshot_digests_hashed();
	nanosleep(&pause, NULL);	/* the link's ctime in a later tick than the hashing's */
	CHECK_INT(snapshot_file_link(path, other), 0);
	CHECK_INT(snapshot_file_digest(path, again, NULL, &err), KILN_OK);
	CHECK_STR(again, first);
	CHECK_INT(snapshot_file_digest(other, again, NULL, &err), KILN_OK);	/* the same file */
	CHECK_STR(again, first);
	nanosleep(&pause, NULL);
	CHECK_INT(snapshot_file_link(other, NULL), 0);
	CHECK_INT(snapshot_file_digest(path, again, NULL, &err), KILN_OK);
	CHECK_STR(again, first);
	CHECK(snapshot_digests_hashed() == hashed);	/* all from the cache */
	CHECK_INT(snapshot_file_link(path, path), -EEXIST);	/* a failed link changes nothing */
	CHECK_INT(snapshot_file_link(other, NULL), -ENOENT);
	CHECK_INT(snapshot_file_digest(path, again, NULL, &err), KILN_OK);
	CHECK(snapshot_digests_hashed() == hashed);

	/* a link made without it moves the ctime alone: hashed again */
	nanosleep(&pause, NULL);
	CHECK_INT(link(path, other), 0);
	CHECK_INT(snapshot_file_digest(path, again, NULL, &err), KILN_OK);
	CHECK_STR(again, first);
	CHECK(snapshot_digests_hashed() == hashed + 1);

	/* a write after the node's link, same size, the next tick or the same: seen */
	nanosleep(&pause, NULL);
	CHECK_INT(snapshot_file_link(other, NULL), 0);
	flip_byte(path, 2 * MIB);
	CHECK_INT(snapshot_file_digest(path, again, NULL, &err), KILN_OK);
	reference_digest(path, ref);
	CHECK_STR(again, ref);
	CHECK(strcmp(again, first) != 0);
	CHECK(snapshot_digests_hashed() == hashed + 2);
	rm_rf(dir);
}

static void test_manifest_written_and_verified(void)
{
	const char *dir = make_snapshot();
	struct snapshot_meta out;
	struct snapshot_expect ex = { .hypervisor = "qemu", .hypervisor_version = "7.2.0",
				      .machine = "microvm", .accel = "tcg", .agent_protocol = 3 };
	struct kiln_error err = { 0 };
	char path[PATH_MAX];
	json_t *m;

	CHECK_INT(snapshot_verify(dir, &ex, &out, &err), KILN_OK);
	CHECK_STR(out.hypervisor_version, "7.2.0");	/* taken from the driver's manifest */
	CHECK_INT(out.format, SNAPSHOT_FORMAT);
	CHECK_INT(out.mem_mib, 64);
	CHECK_INT(out.vcpu_milli, 1500);
	CHECK_INT(out.disk_gib, 2);
	CHECK_INT(out.created_at, 1700000000);
	CHECK_INT(out.n_files, 3);	/* disk.qcow2, mem, state; not the manifest itself */
	for (unsigned i = 0; i < out.n_files; i++)
		if (strcmp(out.files[i].name, "mem") == 0)
			CHECK_INT(out.files[i].size, MEM_SIZE);
	/* the driver's own fields are kept */
	snprintf(path, sizeof(path), "%s/manifest.json", dir);
	m = json_load_file(path, 0, NULL);
	CHECK(m != NULL);
	CHECK_STR(json_string_value(json_object_get(m, "memory")), "shared");
	CHECK(json_is_array(json_object_get(m, "disk_chain")));
	CHECK_STR(json_string_value(json_object_get(m, "digest_alg")), "sha256-4k-1m");
	json_decref(m);
	snprintf(path, sizeof(path), "%s/manifest.json.tmp", dir);
	CHECK(!exists(path));
	rm_rf(dir);
}

static void test_manifest_refuses_missing_fields(void)
{
	const char *dir = fresh("bare");
	char path[PATH_MAX];
	struct snapshot_meta m;
	struct kiln_error err = { 0 };

	CHECK(mkdir(dir, 0700) == 0);
	snprintf(path, sizeof(path), "%s/state", dir);
	write_at(path, 0, 100, 1);
	fill_meta(&m);	/* no driver manifest: hypervisor_version unknown */
	CHECK_INT(snapshot_manifest_write(dir, &m, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "hypervisor_version"));
	rm_rf(dir);
}

static void test_verify_refuses_truncated_file(void)
{
	const char *dir = make_snapshot();
	char path[PATH_MAX];
	struct kiln_error err = { 0 };

	snprintf(path, sizeof(path), "%s/mem", dir);
	CHECK(truncate(path, MEM_SIZE - 4096) == 0);
	CHECK_INT(snapshot_verify(dir, NULL, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "file 'mem' is truncated"));
	rm_rf(dir);
}

static void test_verify_refuses_flipped_byte(void)
{
	const char *dir = make_snapshot();
	char path[PATH_MAX];
	struct kiln_error err = { 0 };

	snprintf(path, sizeof(path), "%s/mem", dir);
	flip_byte(path, 5 * MIB + 8200);
	CHECK_INT(snapshot_verify(dir, NULL, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "file 'mem' is corrupt"));
	rm_rf(dir);

	/* a byte written into what was a hole is caught as well */
	dir = make_snapshot();
	kiln_error_clear(&err);
	snprintf(path, sizeof(path), "%s/mem", dir);
	write_at(path, 40 * MIB, 1, 1);
	CHECK_INT(snapshot_verify(dir, NULL, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "corrupt"));
	rm_rf(dir);
}

static void test_verify_refuses_missing_file(void)
{
	const char *dir = make_snapshot();
	char path[PATH_MAX];
	struct kiln_error err = { 0 };

	snprintf(path, sizeof(path), "%s/disk.qcow2", dir);
	CHECK(unlink(path) == 0);
	CHECK_INT(snapshot_verify(dir, NULL, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "file 'disk.qcow2' is missing"));
	rm_rf(dir);
}

static void test_verify_refuses_other_hypervisor_version(void)
{
	const char *dir = make_snapshot();
	struct snapshot_expect ex = { .hypervisor = "qemu", .hypervisor_version = "8.2.1" };
	struct kiln_error err = { 0 };

	CHECK_INT(snapshot_verify(dir, &ex, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "hypervisor version '7.2.0', this node needs '8.2.1'"));
	kiln_error_clear(&err);
	ex = (struct snapshot_expect){ .accel = "kvm" };
	CHECK_INT(snapshot_verify(dir, &ex, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "accelerator 'tcg'"));
	kiln_error_clear(&err);
	ex = (struct snapshot_expect){ .agent_protocol = 4 };
	CHECK_INT(snapshot_verify(dir, &ex, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "agent protocol '3', this node needs '4'"));
	rm_rf(dir);
}

static void test_verify_refuses_other_image(void)
{
	const char *dir = make_snapshot();
	char want[80];
	struct snapshot_expect ex = { .image_hash = want };
	struct kiln_error err = { 0 };

	snprintf(want, sizeof(want), "sha256:%064d", 8);
	CHECK_INT(snapshot_verify(dir, &ex, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "taken with image 'sha256:"));
	rm_rf(dir);
}

/* Rewrites one field of the manifest (`value` as JSON text). */
static void manifest_set(const char *dir, const char *key, const char *value)
{
	char path[PATH_MAX];
	json_t *m;

	snprintf(path, sizeof(path), "%s/manifest.json", dir);
	m = json_load_file(path, 0, NULL);
	CHECK(m != NULL);
	json_object_set_new(m, key, json_loads(value, JSON_DECODE_ANY, NULL));
	CHECK(json_dump_file(m, path, 0) == 0);
	json_decref(m);
}

static void test_verify_refuses_unknown_format(void)
{
	const char *dir = make_snapshot();
	struct kiln_error err = { 0 };
	char path[PATH_MAX];

	manifest_set(dir, "format", "99");
	CHECK_INT(snapshot_verify(dir, NULL, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "unknown manifest format 99"));

	kiln_error_clear(&err);
	manifest_set(dir, "format", "1");
	manifest_set(dir, "digest_alg", "\"md5\"");
	CHECK_INT(snapshot_verify(dir, NULL, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "unknown digest"));

	kiln_error_clear(&err);
	snprintf(path, sizeof(path), "%s/manifest.json", dir);
	write_file(path, "{\"format\": 1, ", 14);
	CHECK_INT(snapshot_verify(dir, NULL, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "manifest does not parse"));

	kiln_error_clear(&err);
	unlink(path);
	CHECK_INT(snapshot_verify(dir, NULL, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "has no manifest"));
	rm_rf(dir);
}

static void test_verify_refuses_bad_file_entry(void)
{
	const char *dir = make_snapshot();
	struct kiln_error err = { 0 };

	/* a name that would leave the directory */
	manifest_set(dir, "files", "{\"../etc/passwd\": {\"size\": 1, \"digest\": "
				   "\"0000000000000000000000000000000000000000000000000000000000000000\"}}");
	CHECK_INT(snapshot_verify(dir, NULL, NULL, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "malformed"));
	rm_rf(dir);
}

static const char *pack(const char *dir, const char *tenant)
{
	const char *obj = fresh("obj");
	struct kiln_error err = { 0 };

	CHECK_INT(snapshot_pack(dir, &mk, tenant, obj, &err), KILN_OK);
	if (err.code)
		fprintf(stderr, "  %s\n", err.msg);
	return obj;
}

static void test_pack_round_trip_sparse_and_small(void)
{
	const char *dir = make_snapshot();
	const char *obj = pack(dir, "tenant-a");
	const char *out = fresh("unpacked");
	const char *names[] = { "manifest.json", "state", "mem", "disk.qcow2" };
	struct kiln_error err = { 0 };
	char a[PATH_MAX], b[PATH_MAX];
	struct stat st;

	/* data: 50000 (state) + 4 pages + 200 B (mem) + 1 MiB (disk) + the manifest; 64 MiB of zeros free */
	fprintf(stderr, "  packed object: %lld bytes for a %d MiB memory image\n", (long long)file_size(obj),
		MEM_SIZE / MIB);
	CHECK(file_size(obj) < 1200 * 1024);
	snprintf(a, sizeof(a), "%s.tmp", obj);
	CHECK(!exists(a));

	CHECK_INT(snapshot_unpack(obj, &mk, "tenant-a", out, &err), KILN_OK);
	if (err.code)
		fprintf(stderr, "  %s\n", err.msg);
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		snprintf(a, sizeof(a), "%s/%s", dir, names[i]);
		snprintf(b, sizeof(b), "%s/%s", out, names[i]);
		CHECK(same_content(a, b));
	}
	snprintf(b, sizeof(b), "%s/mem", out);
	CHECK(stat(b, &st) == 0);
	CHECK_INT(st.st_size, MEM_SIZE);
	CHECK((long long)st.st_blocks * 512 < 1024 * 1024);	/* zero runs stayed holes */
	CHECK_INT(snapshot_verify(out, NULL, NULL, &err), KILN_OK);
	snprintf(b, sizeof(b), "%s.tmp", out);
	CHECK(!exists(b));

	/* unpacking over an existing directory is refused */
	kiln_error_clear(&err);
	CHECK_INT(snapshot_unpack(obj, &mk, "tenant-a", out, &err), KILN_E_CONFLICT);
	rm_rf(dir);
	rm_rf(out);
	unlink(obj);
}

static void test_pack_written_zero_pages_cost_nothing(void)
{
	const char *dir = fresh("zeros");
	char path[PATH_MAX];
	const char *obj, *out = fresh("zeros-out");
	char *z = calloc(1, 16 * MIB);
	struct kiln_error err = { 0 };

	CHECK(mkdir(dir, 0700) == 0);
	snprintf(path, sizeof(path), "%s/mem", dir);
	write_file(path, z, 16 * MIB);	/* written zeros, not holes */
	write_at(path, 7 * MIB + 4096, 4096, 3);
	free(z);
	obj = pack(dir, "t");
	CHECK(file_size(obj) < 16 * 1024);
	CHECK_INT(snapshot_unpack(obj, &mk, "t", out, &err), KILN_OK);
	snprintf(path, sizeof(path), "%s/mem", out);
	{
		char a[PATH_MAX];

		snprintf(a, sizeof(a), "%s/mem", dir);
		CHECK(same_content(a, path));
	}
	rm_rf(dir);
	rm_rf(out);
	unlink(obj);
}

static void test_unpack_refuses_wrong_tenant(void)
{
	const char *dir = make_snapshot();
	const char *obj = pack(dir, "tenant-a");
	const char *out = fresh("wrong-tenant");
	struct auth_master_key other;
	struct kiln_error err = { 0 };
	char tmp[PATH_MAX];

	snprintf(tmp, sizeof(tmp), "%s.tmp", out);
	CHECK_INT(snapshot_unpack(obj, &mk, "tenant-b", out, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "not packed for tenant 'tenant-b'"));
	CHECK(!exists(out));
	CHECK(!exists(tmp));

	kiln_error_clear(&err);
	auth_master_key_generate(&other, &err);
	CHECK_INT(snapshot_unpack(obj, &other, "tenant-a", out, &err), KILN_E_INVALID);
	CHECK(!exists(out));
	rm_rf(dir);
	unlink(obj);
}

/* Copies the first `len` bytes of `src` to a new file. */
static const char *copy_prefix(const char *src, off_t len)
{
	const char *dst = fresh("cut");
	char cmd[3 * PATH_MAX];

	snprintf(cmd, sizeof(cmd), "head -c %lld '%s' > '%s'", (long long)len, src, dst);
	CHECK(system(cmd) == 0);
	return dst;
}

static void test_unpack_refuses_truncated_object(void)
{
	const char *dir = make_snapshot();
	const char *obj = pack(dir, "tenant-a");
	off_t size = file_size(obj);
	off_t cuts[] = { 10, 100, size / 2, size - 36, size - 1 };	/* size - 36: just the end record gone */
	struct kiln_error err = { 0 };

	for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
		const char *cut = copy_prefix(obj, cuts[i]);
		const char *out = fresh("cut-out");
		char tmp[PATH_MAX];

		kiln_error_clear(&err);
		CHECK_INT(snapshot_unpack(cut, &mk, "tenant-a", out, &err), KILN_E_INVALID);
		CHECK(msg_has(&err, "truncated"));
		snprintf(tmp, sizeof(tmp), "%s.tmp", out);
		CHECK(!exists(out));
		CHECK(!exists(tmp));
		unlink(cut);
	}
	rm_rf(dir);
	unlink(obj);
}

static void test_unpack_refuses_altered_object(void)
{
	const char *dir = make_snapshot();
	const char *obj = pack(dir, "tenant-a");
	const char *out = fresh("altered-out");
	off_t size = file_size(obj);
	struct kiln_error err = { 0 };
	char tmp[PATH_MAX];
	unsigned char c;
	int fd = open(obj, O_RDWR);

	/* a byte in the middle: inside the disk layer's data records */
	CHECK(pread(fd, &c, 1, size / 2) == 1);
	c ^= 1;
	CHECK(pwrite(fd, &c, 1, size / 2) == 1);
	close(fd);
	CHECK_INT(snapshot_unpack(obj, &mk, "tenant-a", out, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "corrupt"));
	snprintf(tmp, sizeof(tmp), "%s.tmp", out);
	CHECK(!exists(out));
	CHECK(!exists(tmp));

	/* bytes after the end */
	unlink(obj);
	obj = pack(dir, "tenant-a");
	fd = open(obj, O_WRONLY | O_APPEND);
	CHECK(write(fd, "x", 1) == 1);
	close(fd);
	kiln_error_clear(&err);
	CHECK_INT(snapshot_unpack(obj, &mk, "tenant-a", out, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "after its end"));
	CHECK(!exists(out));

	/* not an object at all */
	kiln_error_clear(&err);
	snprintf(tmp, sizeof(tmp), "%s/state", dir);
	CHECK_INT(snapshot_unpack(tmp, &mk, "tenant-a", out, &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "not a snapshot object"));
	rm_rf(dir);
	unlink(obj);
}

static void test_pack_refuses_odd_entries(void)
{
	const char *dir = fresh("odd");
	char path[PATH_MAX];
	struct kiln_error err = { 0 };

	CHECK(mkdir(dir, 0700) == 0);
	snprintf(path, sizeof(path), "%s/link", dir);
	CHECK(symlink("/etc/passwd", path) == 0);
	CHECK_INT(snapshot_pack(dir, &mk, "t", fresh("odd-obj"), &err), KILN_E_INVALID);
	CHECK(msg_has(&err, "not a regular file"));
	rm_rf(dir);
}

int main(void)
{
	struct kiln_error err = { 0 };
	const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";

	snprintf(root, sizeof(root), "%s/kiln-snapshot-test-XXXXXX", base);
	if (!mkdtemp(root)) {
		perror("mkdtemp");
		return 1;
	}
	if (auth_master_key_generate(&mk, &err) != KILN_OK) {
		fprintf(stderr, "%s\n", err.msg);
		return 1;
	}
	TEST(test_digest_equals_plain_reading);
	TEST(test_digest_cache_sees_a_change_in_place);
	TEST(test_digest_cache_keeps_a_file_hashed_as_soon_as_written);
	TEST(test_digest_cache_keeps_a_file_across_the_nodes_links);
	TEST(test_manifest_written_and_verified);
	TEST(test_manifest_refuses_missing_fields);
	TEST(test_verify_refuses_truncated_file);
	TEST(test_verify_refuses_flipped_byte);
	TEST(test_verify_refuses_missing_file);
	TEST(test_verify_refuses_other_hypervisor_version);
	TEST(test_verify_refuses_other_image);
	TEST(test_verify_refuses_unknown_format);
	TEST(test_verify_refuses_bad_file_entry);
	TEST(test_pack_round_trip_sparse_and_small);
	TEST(test_pack_written_zero_pages_cost_nothing);
	TEST(test_unpack_refuses_wrong_tenant);
	TEST(test_unpack_refuses_truncated_object);
	TEST(test_unpack_refuses_altered_object);
	TEST(test_pack_refuses_odd_entries);
	rm_rf(root);
	return test_summary();
}
