/*
 * snapshot.c - snapshot manifests (sizes and sha256-4k-1m digests of every file, what the snapshot was
 * taken under), their verification before a restore, and the encrypted packed object a snapshot
 * becomes before it leaves the node (snapshot.h; formats in docs/snapshots.md).
 *
 * Everything streams: files are read one chunk (1 MiB) at a time, walking only their data extents
 * (SEEK_DATA/SEEK_HOLE), so a memory image of many GiB that is mostly holes costs little to hash or
 * pack, and memory use stays at a few MiB whatever the sizes.
 */
#include "common/fsutil.h"
#include "vmm/snapshot.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include "auth/crypto.h"

#define MANIFEST_NAME "manifest.json"
#define PAGE SNAPSHOT_DIGEST_PAGE	/* bytes: digest leaves; granularity of zero runs in packed objects */

/* Packed object (docs/snapshots.md, "Packed object"). Integers are big-endian. */
#define PACK_MAGIC "KILNSNAP"
#define PACK_VERSION 1
#define PACK_HEAD_LEN 24		/* bytes of the fixed header before the wrapped key */
#define PACK_WRAPPED_MAX 1024		/* bytes of the wrapped data key */
#define PACK_RECORD_MAX (1u << 20)	/* plaintext bytes of one data record, as written */
#define PACK_RECORD_LIMIT (4u << 20)	/* largest record size an object may declare */
#define PACK_REC_HEAD 8			/* bytes: type, flags, reserved(2), length(4) */
#define PACK_TAG 16			/* bytes of GCM tag after each record */
#define PACK_NONCE_PREFIX 4		/* random bytes per object; the nonce's other 8 are the seq */
#define PACK_FLAG_FINAL 0x01
#define PACK_FILE_SIZE_MAX (1ull << 50)	/* bytes of one packed file (1 PiB) */

enum pack_rec { REC_FILE = 1, REC_DATA = 2, REC_ZEROS = 3, REC_END = 4 };

/* ---- small helpers ---- */

static int write_all(int fd, const void *buf, size_t len)
{
	const unsigned char *p = buf;

	while (len > 0) {
		ssize_t n = write(fd, p, len);

		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

/* Reads up to `len` bytes; returns how many (short only at end of file) or a negative errno. */
static ssize_t read_full(int fd, void *buf, size_t len)
{
	unsigned char *p = buf;
	size_t got = 0;

	while (got < len) {
		ssize_t n = read(fd, p + got, len - got);

		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		if (n == 0)
			break;
		got += (size_t)n;
	}
	return (ssize_t)got;
}

/* pread of exactly `len` bytes at `off`; -ENODATA when the file ends first. */
static int pread_full(int fd, void *buf, size_t len, off_t off)
{
	unsigned char *p = buf;

	while (len > 0) {
		ssize_t n = pread(fd, p, len, off);

		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		if (n == 0)
			return -ENODATA;
		p += n;
		len -= (size_t)n;
		off += n;
	}
	return 0;
}

static int pwrite_all(int fd, const void *buf, size_t len, off_t off)
{
	const unsigned char *p = buf;

	while (len > 0) {
		ssize_t n = pwrite(fd, p, len, off);

		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		p += n;
		len -= (size_t)n;
		off += n;
	}
	return 0;
}

/* fsync of the directory holding `path`. */
static int fsync_parent(const char *path)
{
	char dir[PATH_MAX];
	char *slash;

	if (!fs_path(dir, "%s", path))
		return -ENAMETOOLONG;
	slash = strrchr(dir, '/');
	if (!slash)
		return fs_fsync_dir(".");
	if (slash == dir)
		slash[1] = '\0';
	else
		*slash = '\0';
	return fs_fsync_dir(dir);
}

static bool all_zero(const unsigned char *p, size_t n)
{
	return n == 0 || (p[0] == 0 && memcmp(p, p + 1, n - 1) == 0);
}

/* Next offset >= off that holds data, or `size` when only a hole is left. */
static off_t next_data(int fd, off_t off, off_t size)
{
	off_t d = lseek(fd, off, SEEK_DATA);

	if (d >= 0)
		return d < size ? d : size;
	return errno == ENXIO ? size : off;	/* no SEEK_DATA support: all data */
}

/* Next offset >= off that starts a hole (or the end of the file). */
static off_t next_hole(int fd, off_t off, off_t size)
{
	off_t h = lseek(fd, off, SEEK_HOLE);

	return h >= 0 && h < size ? h : size;
}

static void put_be16(unsigned char *p, uint16_t v)
{
	p[0] = (unsigned char)(v >> 8);
	p[1] = (unsigned char)v;
}

static void put_be32(unsigned char *p, uint32_t v)
{
	for (int i = 3; i >= 0; i--, v >>= 8)
		p[i] = (unsigned char)v;
}

static void put_be64(unsigned char *p, uint64_t v)
{
	for (int i = 7; i >= 0; i--, v >>= 8)
		p[i] = (unsigned char)v;
}

static uint16_t get_be16(const unsigned char *p)
{
	return (uint16_t)(p[0] << 8 | p[1]);
}

static uint32_t get_be32(const unsigned char *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint64_t get_be64(const unsigned char *p)
{
	uint64_t v = 0;

	for (int i = 0; i < 8; i++)
		v = v << 8 | p[i];
	return v;
}

static void hex_encode(const unsigned char *in, size_t n, char *out)
{
	static const char digits[] = "0123456789abcdef";

	for (size_t i = 0; i < n; i++) {
		out[2 * i] = digits[in[i] >> 4];
		out[2 * i + 1] = digits[in[i] & 15];
	}
	out[2 * n] = '\0';
}

/* A file name a snapshot may hold: [A-Za-z0-9._-], not starting with '.', short. */
static bool name_ok(const char *s)
{
	size_t n = strlen(s);

	if (n == 0 || n >= SNAPSHOT_NAME_MAX || s[0] == '.')
		return false;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];

		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '.' || c == '_' || c == '-'))
			return false;
	}
	return true;
}

static bool ends_with(const char *s, const char *suffix)
{
	size_t n = strlen(s), m = strlen(suffix);

	return n >= m && strcmp(s + n - m, suffix) == 0;
}

static int name_cmp(const void *a, const void *b)
{
	return strcmp((const char *)a, (const char *)b);
}

/*
 * The files of snapshot dir `dir`, sorted: regular files not starting with '.' nor ending in
 * ".tmp"; manifest.json only when `with_manifest`. Refuses anything else (subdirectories, links,
 * sockets) that is not a dot name.
 */
static enum kiln_err list_files(const char *dir, bool with_manifest,
				char names[SNAPSHOT_FILES_MAX][SNAPSHOT_NAME_MAX], unsigned *n,
				struct kiln_error *err)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	enum kiln_err rc = KILN_OK;

	*n = 0;
	if (!d)
		return fs_err(err, -errno, "cannot open snapshot dir", dir);
	while (rc == KILN_OK && (errno = 0, e = readdir(d)) != NULL) {
		struct stat st;

		if (e->d_name[0] == '.' || ends_with(e->d_name, ".tmp"))
			continue;
		if (!with_manifest && strcmp(e->d_name, MANIFEST_NAME) == 0)
			continue;
		if (!name_ok(e->d_name))
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': bad file name '%.64s'", dir,
					    e->d_name);
		else if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
			rc = fs_err(err, -errno, "cannot stat in snapshot dir", e->d_name);
		else if (!S_ISREG(st.st_mode))
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': '%s' is not a regular file",
					    dir, e->d_name);
		else if (*n == SNAPSHOT_FILES_MAX)
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': more than %d files", dir,
					    SNAPSHOT_FILES_MAX);
		else
			memcpy(names[(*n)++], e->d_name, strlen(e->d_name) + 1);	/* name_ok: fits */
	}
	if (rc == KILN_OK && errno)
		rc = fs_err(err, -errno, "cannot read snapshot dir", dir);
	closedir(d);
	if (rc == KILN_OK)
		qsort(names, *n, SNAPSHOT_NAME_MAX, name_cmp);
	return rc;
}

/* ---- sha256-4k-1m digests ---- */

static bool sha256(const void *p, size_t n, unsigned char out[32])
{
	return SHA256(p, n, out) != NULL;
}

/*
 * The extent of a file that holds one offset: [start, end), data or hole. Each extent is looked up
 * once (SEEK_HOLE on tmpfs walks the page cache up to the next hole: asking per chunk would make a
 * large all-data file quadratic).
 */
struct extent {
	off_t start, end;
	bool data;
};

static void extent_find(int fd, off_t pos, off_t size, struct extent *e)
{
	off_t d;

	if (pos >= e->start && pos < e->end)
		return;
	d = next_data(fd, pos, size);
	e->start = pos;
	if (d > pos) {
		e->end = d;
		e->data = false;
	} else {
		e->end = next_hole(fd, pos, size);
		if (e->end <= pos)
			e->end = size;	/* no SEEK_HOLE answer: data to the end */
		e->data = true;
	}
}

/*
 * Reads `len` bytes at `off` into `buf`, reading only the data extents: holes are filled with zeros
 * without a read (reading a hole costs on some file systems). *all_hole tells that nothing was read.
 * Returns 0 or a negative errno (-ENODATA when the file ends early).
 */
static int read_extents(int fd, unsigned char *buf, size_t len, off_t off, off_t size, struct extent *e,
			bool *all_hole)
{
	off_t pos = off, end = off + (off_t)len;

	*all_hole = true;
	while (pos < end) {
		off_t stop;
		int r;

		extent_find(fd, pos, size, e);
		stop = e->end < end ? e->end : end;
		if (!e->data) {
			if (stop == end && pos == off) {
				pos = end;	/* the whole range is a hole: leave `buf` alone */
				break;
			}
			memset(buf + (pos - off), 0, (size_t)(stop - pos));
		} else {
			if (*all_hole && pos > off)
				memset(buf, 0, (size_t)(pos - off));
			*all_hole = false;
			if ((r = pread_full(fd, buf + (pos - off), (size_t)(stop - pos), pos)) < 0)
				return r;
		}
		pos = stop;
	}
	return 0;
}

/* Digests of an all-zero page and an all-zero full chunk, computed once per digest_fd call. */
struct zero_digests {
	unsigned char page[32], chunk[32];
};

static void zero_digests_init(struct zero_digests *z)
{
	static const unsigned char zeros[PAGE];
	unsigned char pages[SNAPSHOT_DIGEST_CHUNK / PAGE][32];

	sha256(zeros, sizeof(zeros), z->page);
	for (size_t i = 0; i < SNAPSHOT_DIGEST_CHUNK / PAGE; i++)
		memcpy(pages[i], z->page, 32);
	sha256(pages, sizeof(pages), z->chunk);
}

/*
 * The digest of one chunk of `len` bytes: SHA-256 over the SHA-256 of each of its 4 KiB pages (the
 * last may be shorter). `buf` NULL means the chunk is a hole. Zero pages use the precomputed digest.
 */
static void chunk_digest(const unsigned char *buf, size_t len, const struct zero_digests *z,
			 unsigned char out[32])
{
	static const unsigned char zeros[PAGE];
	unsigned char pages[SNAPSHOT_DIGEST_CHUNK / PAGE][32];
	size_t n = 0;

	if (len == SNAPSHOT_DIGEST_CHUNK && (!buf || all_zero(buf, len))) {
		memcpy(out, z->chunk, 32);
		return;
	}
	for (size_t off = 0; off < len; off += PAGE, n++) {
		size_t plen = len - off < PAGE ? len - off : PAGE;

		if (!buf || all_zero(buf + off, plen)) {
			if (plen == PAGE)
				memcpy(pages[n], z->page, 32);
			else
				sha256(zeros, plen, pages[n]);
		} else {
			sha256(buf + off, plen, pages[n]);
		}
	}
	sha256(pages, n * 32, out);
}

/*
 * The sha256-4k-1m digest of the `size` bytes of open file `fd` (snapshot.h). A chunk inside a
 * hole is not read; zero pages and zero chunks are not hashed.
 */
static enum kiln_err digest_fd(int fd, const char *name, uint64_t size, char hex[65],
			       struct kiln_error *err)
{
	unsigned char *buf = malloc(SNAPSHOT_DIGEST_CHUNK);
	unsigned char d[32];
	struct zero_digests z;
	EVP_MD_CTX *outer = EVP_MD_CTX_new();
	enum kiln_err rc = KILN_OK;
	struct extent ext = { 0, 0, false };
	uint64_t off = 0;
	unsigned int dlen;

	if (!buf || !outer || EVP_DigestInit_ex(outer, EVP_sha256(), NULL) != 1) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory hashing '%s'", name);
		goto out;
	}
	zero_digests_init(&z);
	while (off < size) {
		size_t len = size - off < SNAPSHOT_DIGEST_CHUNK ? (size_t)(size - off) : SNAPSHOT_DIGEST_CHUNK;
		bool hole;
		int r = read_extents(fd, buf, len, (off_t)off, (off_t)size, &ext, &hole);

		if (r < 0) {
			rc = r == -ENODATA ? kiln_error_set(err, KILN_E_IO, "file '%s' shrank while being hashed", name)
					   : fs_err(err, r, "cannot read", name);
			goto out;
		}
		chunk_digest(hole ? NULL : buf, len, &z, d);
		if (EVP_DigestUpdate(outer, d, sizeof(d)) != 1) {
			rc = kiln_error_set(err, KILN_E_INTERNAL, "sha-256 failed");
			goto out;
		}
		off += len;
	}
	if (EVP_DigestFinal_ex(outer, d, &dlen) != 1) {
		rc = kiln_error_set(err, KILN_E_INTERNAL, "sha-256 failed");
		goto out;
	}
	hex_encode(d, sizeof(d), hex);
out:
	EVP_MD_CTX_free(outer);
	free(buf);
	return rc;
}

/*
 * Digests already computed in this process, by file identity (snapshot.h, "digest cache"): a
 * template's image is verified at every create from it, and hashing its GiBs each time made a
 * create's time grow with the image's size. An entry holds while the file's device, inode, size,
 * mtime and ctime are unchanged: write(2) and chmod move the ctime, but a write through a shared
 * mapping to a page already dirty does not (docs/security.md, "Not yet limited"). It is kept only
 * when the file's ctime is older than the clock the kernel stamps files with
 * (CLOCK_REALTIME_COARSE) read before hashing: a write in that same tick would leave the times as
 * they were.
 */
#define DIGEST_CACHE_SLOTS 256

struct digest_entry {
	dev_t dev;
	ino_t ino;
	off_t size;
	struct timespec mtime, ctime;
	char hex[65];
};

static struct {
	pthread_mutex_t lock;
	struct digest_entry e[DIGEST_CACHE_SLOTS];
	unsigned next;		/* slot the next new entry takes (round robin) */
} digest_cache = { .lock = PTHREAD_MUTEX_INITIALIZER };

static bool ts_eq(const struct timespec *a, const struct timespec *b)
{
	return a->tv_sec == b->tv_sec && a->tv_nsec == b->tv_nsec;
}

static bool ts_before(const struct timespec *a, const struct timespec *b)
{
	return a->tv_sec < b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec < b->tv_nsec);
}

static bool digest_entry_of(const struct digest_entry *e, const struct stat *st)
{
	return e->hex[0] && e->dev == st->st_dev && e->ino == st->st_ino && e->size == st->st_size &&
	       ts_eq(&e->mtime, &st->st_mtim) && ts_eq(&e->ctime, &st->st_ctim);
}

static bool digest_cached(const struct stat *st, char hex[65])
{
	bool hit = false;

	pthread_mutex_lock(&digest_cache.lock);
	for (unsigned i = 0; i < DIGEST_CACHE_SLOTS && !hit; i++)
		if (digest_entry_of(&digest_cache.e[i], st)) {
			memcpy(hex, digest_cache.e[i].hex, 65);
			hit = true;
		}
	pthread_mutex_unlock(&digest_cache.lock);
	return hit;
}

static void digest_remember(const struct stat *st, const struct timespec *hashed_from,
			    const char hex[65])
{
	struct digest_entry *e;
	unsigned i;

	if (!ts_before(&st->st_ctim, hashed_from) || !ts_before(&st->st_mtim, hashed_from))
		return;
	/* times in whole seconds (a file system that keeps no more): a write later in that second
	 * would leave them as they are */
	if (!st->st_ctim.tv_nsec && !st->st_mtim.tv_nsec &&
	    hashed_from->tv_sec <= st->st_mtim.tv_sec + 1)
		return;
	pthread_mutex_lock(&digest_cache.lock);
	for (i = 0; i < DIGEST_CACHE_SLOTS; i++)
		if (digest_cache.e[i].dev == st->st_dev && digest_cache.e[i].ino == st->st_ino)
			break;
	if (i == DIGEST_CACHE_SLOTS)
		i = digest_cache.next++ % DIGEST_CACHE_SLOTS;
	e = &digest_cache.e[i];
	*e = (struct digest_entry){ .dev = st->st_dev, .ino = st->st_ino, .size = st->st_size,
				    .mtime = st->st_mtim, .ctime = st->st_ctim };
	memcpy(e->hex, hex, 65);
	pthread_mutex_unlock(&digest_cache.lock);
}

/*
 * Reads into `from` the clock the hashing starts at. A file written in the kernel's current tick
 * (a pause's files, hashed into its manifest as soon as QEMU has written them) could not be
 * remembered: first wait for the clock to pass its times, at most DIGEST_SETTLE_MS, stat it again,
 * so the hash it gets now serves the verify of its resume too.
 */
#define DIGEST_SETTLE_MS 20
static unsigned long digests_hashed;

unsigned long snapshot_digests_hashed(void)
{
	return __atomic_load_n(&digests_hashed, __ATOMIC_RELAXED);
}

static void digest_settle(int fd, struct stat *st, struct timespec *from)
{
	const struct timespec ms = { 0, 1000 * 1000 };

	clock_gettime(CLOCK_REALTIME_COARSE, from);
	if (ts_before(&st->st_ctim, from) && ts_before(&st->st_mtim, from))
		return;
	for (int i = 0; i < DIGEST_SETTLE_MS; i++) {
		nanosleep(&ms, NULL);
		clock_gettime(CLOCK_REALTIME_COARSE, from);
		if (ts_before(&st->st_ctim, from) && ts_before(&st->st_mtim, from))
			break;
	}
	/* a write in the wait moves the times: not remembered then; nothing is when it fails */
	if (fstat(fd, st) != 0)
		from->tv_sec = from->tv_nsec = 0;
}

/*
 * After the node's own link or unlink of a file, which moves its ctime and nlink and nothing else:
 * the entry that held `before` holds `after` too when nothing but those two moved in between. A
 * write in between moves the mtime; setting the mtime back takes write access to the node's files.
 */
static void digest_relinked(const struct stat *before, const struct stat *after)
{
	pthread_mutex_lock(&digest_cache.lock);
	for (unsigned i = 0; i < DIGEST_CACHE_SLOTS; i++) {
		struct digest_entry *e = &digest_cache.e[i];

		if (digest_entry_of(e, before) && after->st_dev == before->st_dev &&
		    after->st_ino == before->st_ino && after->st_size == before->st_size &&
		    after->st_mode == before->st_mode && ts_eq(&after->st_mtim, &before->st_mtim) &&
		    after->st_nlink != before->st_nlink) {
			e->ctime = after->st_ctim;
			break;
		}
	}
	pthread_mutex_unlock(&digest_cache.lock);
}

int snapshot_file_link(const char *path, const char *to)
{
	struct stat before, after;
	int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	bool known = fd >= 0 && fstat(fd, &before) == 0 && S_ISREG(before.st_mode);
	int r = (to ? link(path, to) : unlink(path)) < 0 ? -errno : 0;

	if (r == 0 && known && fstat(fd, &after) == 0)
		digest_relinked(&before, &after);
	if (fd >= 0)
		close(fd);
	return r;
}

enum kiln_err snapshot_file_digest(const char *path, char hex[65], uint64_t *size,
				   struct kiln_error *err)
{
	struct stat st;
	struct timespec from;
	enum kiln_err rc;
	int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);

	if (fd < 0)
		return fs_err(err, -errno, "cannot open", path);
	if (fstat(fd, &st) < 0) {
		rc = fs_err(err, -errno, "cannot stat", path);
		close(fd);
		return rc;
	}
	if (!S_ISREG(st.st_mode)) {
		close(fd);
		return kiln_error_set(err, KILN_E_INVALID, "'%s' is not a regular file", path);
	}
	if (digest_cached(&st, hex)) {
		rc = KILN_OK;
	} else {
		digest_settle(fd, &st, &from);
		__atomic_add_fetch(&digests_hashed, 1, __ATOMIC_RELAXED);
		rc = digest_fd(fd, path, (uint64_t)st.st_size, hex, err);
		if (rc == KILN_OK)
			digest_remember(&st, &from, hex);
	}
	if (rc == KILN_OK && size)
		*size = (uint64_t)st.st_size;
	close(fd);
	return rc;
}

/* ---- manifest ---- */

/* Reads `path` whole when it is at most `max` bytes: -EFBIG when larger. *out is NUL-terminated. */
static int read_capped(const char *path, size_t max, char **out, size_t *len)
{
	int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	char *buf;
	ssize_t n;

	*out = NULL;
	if (fd < 0)
		return -errno;
	buf = malloc(max + 1);
	if (!buf) {
		close(fd);
		return -ENOMEM;
	}
	n = read_full(fd, buf, max + 1);
	close(fd);
	if (n < 0 || (size_t)n > max) {
		free(buf);
		return n < 0 ? (int)n : -EFBIG;
	}
	buf[n] = '\0';
	*out = buf;
	*len = (size_t)n;
	return 0;
}

/* The fields snapshot.c owns in manifest.json; every other key belongs to the driver. */
static const char *const owned_keys[] = {
	"format", "digest_alg", "hypervisor", "hypervisor_version", "machine", "accel", "image_hash",
	"vcpu_milli", "mem_mib", "disk_gib", "agent_protocol", "created_at", "files",
};

/* `mine` when set, else the string of the same key in `base`, else "". */
static const char *pick_str(const char *mine, json_t *base, const char *key)
{
	const char *s;

	if (mine[0])
		return mine;
	s = json_string_value(json_object_get(base, key));
	return s ? s : "";
}

enum kiln_err snapshot_manifest_write(const char *dir, const struct snapshot_meta *meta,
				      struct kiln_error *err)
{
	char names[SNAPSHOT_FILES_MAX][SNAPSHOT_NAME_MAX];
	char path[PATH_MAX], tmp[PATH_MAX];
	const char *hv, *hv_ver, *machine, *accel, *image;
	json_t *base = NULL, *files = NULL, *m;
	char *text = NULL;
	size_t len;
	unsigned n;
	enum kiln_err rc;
	int r, fd = -1;

	if (!fs_path(path, "%s/%s", dir, MANIFEST_NAME) || !fs_path(tmp, "%s/%s.tmp", dir, MANIFEST_NAME))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", dir);
	if ((rc = list_files(dir, false, names, &n, err)) != KILN_OK)
		return rc;

	/* the driver's manifest, if any: its fields stay */
	r = read_capped(path, SNAPSHOT_MANIFEST_MAX, &text, &len);
	if (r == 0) {
		json_error_t jerr;

		base = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
		free(text);
		text = NULL;
		if (!json_is_object(base)) {
			json_decref(base);
			return kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': existing manifest does not parse",
					      dir);
		}
	} else if (r != -ENOENT) {
		return fs_err(err, r, "cannot read", path);
	} else if (!(base = json_object())) {
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}

	hv = pick_str(meta->hypervisor, base, "hypervisor");
	hv_ver = pick_str(meta->hypervisor_version, base, "hypervisor_version");
	machine = pick_str(meta->machine, base, "machine");
	accel = pick_str(meta->accel, base, "accel");
	image = pick_str(meta->image_hash, base, "image_hash");
	if (!*hv || !*hv_ver || !*machine || !*accel || !*image || !meta->vcpu_milli || !meta->mem_mib ||
	    !meta->agent_protocol) {
		rc = kiln_error_set(err, KILN_E_INVALID,
				    "snapshot '%s': manifest needs hypervisor, hypervisor_version, machine, accel, "
				    "image_hash, vcpu_milli, mem_mib and agent_protocol", dir);
		goto out;
	}
	/* pick_str may point into base: build the new object before dropping keys from it */
	m = json_pack("{s:i, s:s, s:s, s:s, s:s, s:s, s:s, s:I, s:I, s:I, s:I, s:I}",
			      "format", SNAPSHOT_FORMAT, "digest_alg", SNAPSHOT_DIGEST_ALG, "hypervisor", hv,
			      "hypervisor_version", hv_ver, "machine", machine, "accel", accel,
			      "image_hash", image, "vcpu_milli", (json_int_t)meta->vcpu_milli,
			      "mem_mib", (json_int_t)meta->mem_mib, "disk_gib", (json_int_t)meta->disk_gib,
			      "agent_protocol", (json_int_t)meta->agent_protocol, "created_at",
			      (json_int_t)(meta->created_at ? meta->created_at : (int64_t)time(NULL)));
	files = json_object();
	if (!m || !files) {
		json_decref(m);
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto out;
	}
	for (size_t k = 0; k < sizeof(owned_keys) / sizeof(owned_keys[0]); k++)
		json_object_del(base, owned_keys[k]);
	if (json_object_update(base, m) < 0) {
		json_decref(m);
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto out;
	}
	json_decref(m);

	for (unsigned i = 0; i < n; i++) {
		char fpath[PATH_MAX], hex[65];
		uint64_t size;

		if (!fs_path(fpath, "%s/%s", dir, names[i])) {
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", dir);
			goto out;
		}
		if ((rc = snapshot_file_digest(fpath, hex, &size, err)) != KILN_OK)
			goto out;
		if (json_object_set_new(files, names[i],
					json_pack("{s:I, s:s}", "size", (json_int_t)size, "digest", hex)) < 0) {
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			goto out;
		}
	}
	if (json_object_set(base, "files", files) < 0 ||
	    !(text = json_dumps(base, JSON_INDENT(2) | JSON_SORT_KEYS))) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto out;
	}

	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (fd < 0) {
		rc = fs_err(err, -errno, "cannot create", tmp);
		goto out;
	}
	if ((r = write_all(fd, text, strlen(text))) < 0 || (r = write_all(fd, "\n", 1)) < 0 ||
	    (fsync(fd) < 0 && (r = -errno) < 0)) {
		rc = fs_err(err, r, "cannot write", tmp);
		goto out;
	}
	close(fd);
	fd = -1;
	if (rename(tmp, path) < 0) {
		rc = fs_err(err, -errno, "cannot rename", tmp);
		goto out;
	}
	if ((r = fs_fsync_dir(dir)) < 0)
		rc = fs_err(err, r, "cannot sync", dir);
out:
	if (fd >= 0) {
		close(fd);
		unlink(tmp);
	}
	free(text);
	json_decref(files);
	json_decref(base);
	return rc;
}

/* Copies string field `key` of `m` into out (SNAPSHOT_STR_MAX). */
static enum kiln_err get_str(json_t *m, const char *key, char *out, const char *dir,
			     struct kiln_error *err)
{
	const char *s = json_string_value(json_object_get(m, key));

	if (!s || !*s || strlen(s) >= SNAPSHOT_STR_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': manifest field '%s' missing or not a string",
				      dir, key);
	memcpy(out, s, strlen(s) + 1);
	return KILN_OK;
}

static enum kiln_err get_uint(json_t *m, const char *key, unsigned *out, const char *dir,
			      struct kiln_error *err)
{
	json_t *v = json_object_get(m, key);

	if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > UINT_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': manifest field '%s' missing or not a count",
				      dir, key);
	*out = (unsigned)json_integer_value(v);
	return KILN_OK;
}

static enum kiln_err expect_str(const char *dir, const char *what, const char *have, const char *want,
				struct kiln_error *err)
{
	if (!want || strcmp(have, want) == 0)
		return KILN_OK;
	return kiln_error_set(err, KILN_E_INVALID, "snapshot '%s' was taken with %s '%s', this node needs '%s'",
			      dir, what, have, want);
}

/* Parses manifest.json of `dir` into `meta` (fields and file list), no checks against the node. */
static enum kiln_err manifest_load(const char *dir, struct snapshot_meta *meta, struct kiln_error *err)
{
	char path[PATH_MAX];
	json_error_t jerr;
	json_t *m, *files, *v, *fmt;
	const char *key, *alg;
	char *text;
	size_t len;
	enum kiln_err rc = KILN_OK;
	int r;

	memset(meta, 0, sizeof(*meta));
	if (!fs_path(path, "%s/%s", dir, MANIFEST_NAME))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", dir);
	r = read_capped(path, SNAPSHOT_MANIFEST_MAX, &text, &len);
	if (r == -ENOENT)
		return kiln_error_set(err, KILN_E_INVALID, "snapshot '%s' has no manifest", dir);
	if (r == -EFBIG)
		return kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': manifest larger than %d bytes", dir,
				      SNAPSHOT_MANIFEST_MAX);
	if (r < 0)
		return fs_err(err, r, "cannot read", path);
	m = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
	free(text);
	if (!json_is_object(m)) {
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': manifest does not parse (line %d: %s)", dir,
				    jerr.line, m ? "not an object" : jerr.text);
		json_decref(m);
		return rc;
	}
	fmt = json_object_get(m, "format");
	alg = json_string_value(json_object_get(m, "digest_alg"));
	if (!json_is_integer(fmt) || json_integer_value(fmt) != SNAPSHOT_FORMAT) {
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': unknown manifest format %lld (this node reads %d)",
				    dir, json_is_integer(fmt) ? (long long)json_integer_value(fmt) : -1LL,
				    SNAPSHOT_FORMAT);
		goto out;
	}
	meta->format = SNAPSHOT_FORMAT;
	if (!alg || strcmp(alg, SNAPSHOT_DIGEST_ALG) != 0) {
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': unknown digest '%.32s' (this node reads %s)",
				    dir, alg ? alg : "", SNAPSHOT_DIGEST_ALG);
		goto out;
	}
	if ((rc = get_str(m, "hypervisor", meta->hypervisor, dir, err)) != KILN_OK ||
	    (rc = get_str(m, "hypervisor_version", meta->hypervisor_version, dir, err)) != KILN_OK ||
	    (rc = get_str(m, "machine", meta->machine, dir, err)) != KILN_OK ||
	    (rc = get_str(m, "accel", meta->accel, dir, err)) != KILN_OK ||
	    (rc = get_str(m, "image_hash", meta->image_hash, dir, err)) != KILN_OK ||
	    (rc = get_uint(m, "vcpu_milli", &meta->vcpu_milli, dir, err)) != KILN_OK ||
	    (rc = get_uint(m, "mem_mib", &meta->mem_mib, dir, err)) != KILN_OK ||
	    (rc = get_uint(m, "disk_gib", &meta->disk_gib, dir, err)) != KILN_OK ||
	    (rc = get_uint(m, "agent_protocol", &meta->agent_protocol, dir, err)) != KILN_OK)
		goto out;
	v = json_object_get(m, "created_at");
	if (!json_is_integer(v)) {
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': manifest field 'created_at' missing", dir);
		goto out;
	}
	meta->created_at = json_integer_value(v);
	files = json_object_get(m, "files");
	if (!json_is_object(files) || json_object_size(files) > SNAPSHOT_FILES_MAX) {
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': manifest field 'files' missing or too long",
				    dir);
		goto out;
	}
	json_object_foreach(files, key, v) {
		struct snapshot_file *f = &meta->files[meta->n_files];
		json_t *size = json_object_get(v, "size");
		const char *hex = json_string_value(json_object_get(v, "digest"));

		if (!name_ok(key) || strcmp(key, MANIFEST_NAME) == 0 || !json_is_integer(size) ||
		    json_integer_value(size) < 0 || !hex || strlen(hex) != 64 ||
		    strspn(hex, "0123456789abcdef") != 64) {
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': manifest entry of file '%.64s' is malformed",
					    dir, key);
			goto out;
		}
		snprintf(f->name, sizeof(f->name), "%s", key);
		f->size = (uint64_t)json_integer_value(size);
		memcpy(f->digest, hex, 65);
		meta->n_files++;
	}
out:
	json_decref(m);
	return rc;
}

enum kiln_err snapshot_verify(const char *dir, const struct snapshot_expect *expect,
			      struct snapshot_meta *out, struct kiln_error *err)
{
	struct snapshot_meta *meta = malloc(sizeof(*meta));
	enum kiln_err rc;

	if (!meta)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if ((rc = manifest_load(dir, meta, err)) != KILN_OK)
		goto out;
	if (expect) {
		char want_proto[16], have_proto[16];

		snprintf(want_proto, sizeof(want_proto), "%u", expect->agent_protocol);
		snprintf(have_proto, sizeof(have_proto), "%u", meta->agent_protocol);
		if ((rc = expect_str(dir, "hypervisor", meta->hypervisor, expect->hypervisor, err)) != KILN_OK ||
		    (rc = expect_str(dir, "hypervisor version", meta->hypervisor_version,
				     expect->hypervisor_version, err)) != KILN_OK ||
		    (rc = expect_str(dir, "machine", meta->machine, expect->machine, err)) != KILN_OK ||
		    (rc = expect_str(dir, "accelerator", meta->accel, expect->accel, err)) != KILN_OK ||
		    (rc = expect_str(dir, "image", meta->image_hash, expect->image_hash, err)) != KILN_OK ||
		    (rc = expect_str(dir, "agent protocol", have_proto,
				     expect->agent_protocol ? want_proto : NULL, err)) != KILN_OK)
			goto out;
	}
	/* cheap checks on every file before hashing any */
	for (unsigned i = 0; i < meta->n_files; i++) {
		const struct snapshot_file *f = &meta->files[i];
		char path[PATH_MAX];
		struct stat st;

		if (!fs_path(path, "%s/%s", dir, f->name)) {
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", dir);
			goto out;
		}
		if (lstat(path, &st) < 0) {
			rc = errno == ENOENT ? kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': file '%s' is missing",
							      dir, f->name)
					     : fs_err(err, -errno, "cannot stat", path);
			goto out;
		}
		if (!S_ISREG(st.st_mode)) {
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': '%s' is not a regular file", dir, f->name);
			goto out;
		}
		if ((uint64_t)st.st_size < f->size) {
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "snapshot '%s': file '%s' is truncated (%" PRIu64 " of %" PRIu64 " bytes)",
					    dir, f->name, (uint64_t)st.st_size, f->size);
			goto out;
		}
		if ((uint64_t)st.st_size != f->size) {
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "snapshot '%s': file '%s' has %" PRIu64 " bytes, the manifest says %" PRIu64,
					    dir, f->name, (uint64_t)st.st_size, f->size);
			goto out;
		}
	}
	for (unsigned i = 0; i < meta->n_files; i++) {
		const struct snapshot_file *f = &meta->files[i];
		char path[PATH_MAX], hex[65];
		uint64_t size;

		fs_path(path, "%s/%s", dir, f->name);
		if ((rc = snapshot_file_digest(path, hex, &size, err)) != KILN_OK)
			goto out;
		if (size != f->size || strcmp(hex, f->digest) != 0) {
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "snapshot '%s': file '%s' is corrupt (its digest differs from the manifest)",
					    dir, f->name);
			goto out;
		}
	}
	if (out)
		*out = *meta;
out:
	free(meta);
	return rc;
}

/* ---- packed objects ---- */

/* One object being written or read: the data key, the nonce prefix and the record counter. */
struct pack_ctx {
	EVP_CIPHER_CTX *cipher;
	unsigned char key[AUTH_DATA_KEY_LEN];
	unsigned char prefix[PACK_NONCE_PREFIX];
	unsigned char head_digest[32];	/* SHA-256 of the header, in every record's AAD */
	uint64_t seq;			/* next record's sequence number */
	int fd;
	const char *path;		/* for messages */
};

static void pack_ctx_release(struct pack_ctx *p)
{
	EVP_CIPHER_CTX_free(p->cipher);
	p->cipher = NULL;
	OPENSSL_cleanse(p->key, sizeof(p->key));
}

/* GCM over `buf` in place; AAD = header digest || seq || record header. */
static bool record_crypt(struct pack_ctx *p, bool enc, const unsigned char head[PACK_REC_HEAD],
			 unsigned char *buf, size_t len, unsigned char tag[PACK_TAG])
{
	unsigned char nonce[12], aad[32 + 8 + PACK_REC_HEAD];
	int outl;
	bool ok;

	memcpy(nonce, p->prefix, PACK_NONCE_PREFIX);
	put_be64(nonce + PACK_NONCE_PREFIX, p->seq);
	memcpy(aad, p->head_digest, 32);
	put_be64(aad + 32, p->seq);
	memcpy(aad + 40, head, PACK_REC_HEAD);
	ok = EVP_CipherInit_ex(p->cipher, EVP_aes_256_gcm(), NULL, NULL, NULL, enc) == 1 &&
	     EVP_CIPHER_CTX_ctrl(p->cipher, EVP_CTRL_GCM_SET_IVLEN, sizeof(nonce), NULL) == 1 &&
	     EVP_CipherInit_ex(p->cipher, NULL, NULL, p->key, nonce, enc) == 1 &&
	     EVP_CipherUpdate(p->cipher, NULL, &outl, aad, sizeof(aad)) == 1 &&
	     (len == 0 || EVP_CipherUpdate(p->cipher, buf, &outl, buf, (int)len) == 1);
	if (ok && !enc)
		ok = EVP_CIPHER_CTX_ctrl(p->cipher, EVP_CTRL_GCM_SET_TAG, PACK_TAG, tag) == 1;
	if (ok)
		ok = EVP_CipherFinal_ex(p->cipher, buf + len, &outl) == 1;
	if (ok && enc)
		ok = EVP_CIPHER_CTX_ctrl(p->cipher, EVP_CTRL_GCM_GET_TAG, PACK_TAG, tag) == 1;
	p->seq++;
	return ok;
}

/* Encrypts `buf` (len bytes, in place) as one record of `type` and appends it to the object. */
static enum kiln_err record_write(struct pack_ctx *p, enum pack_rec type, unsigned char *buf, size_t len,
				  struct kiln_error *err)
{
	unsigned char head[PACK_REC_HEAD] = { (unsigned char)type, type == REC_END ? PACK_FLAG_FINAL : 0 };
	unsigned char tag[PACK_TAG];
	int r;

	put_be32(head + 4, (uint32_t)len);
	if (!record_crypt(p, true, head, buf, len, tag))
		return kiln_error_set(err, KILN_E_INTERNAL, "aes-256-gcm failed");
	if ((r = write_all(p->fd, head, sizeof(head))) < 0 || (r = write_all(p->fd, buf, len)) < 0 ||
	    (r = write_all(p->fd, tag, sizeof(tag))) < 0)
		return fs_err(err, r, "cannot write", p->path);
	return KILN_OK;
}

/* Pending output of one file: a data run or a zero run (never both). */
struct pack_file {
	unsigned char *data;	/* PACK_RECORD_MAX bytes (+ room for nothing: GCM is in place) */
	size_t data_len;
	uint64_t zeros;		/* bytes of a pending zero run */
};

static enum kiln_err flush_data(struct pack_ctx *p, struct pack_file *f, struct kiln_error *err)
{
	enum kiln_err rc = KILN_OK;

	if (f->data_len)
		rc = record_write(p, REC_DATA, f->data, f->data_len, err);
	f->data_len = 0;
	return rc;
}

static enum kiln_err flush_zeros(struct pack_ctx *p, struct pack_file *f, struct kiln_error *err)
{
	unsigned char b[8];
	enum kiln_err rc = KILN_OK;

	if (f->zeros) {
		put_be64(b, f->zeros);
		rc = record_write(p, REC_ZEROS, b, sizeof(b), err);
	}
	f->zeros = 0;
	return rc;
}

static enum kiln_err add_zeros(struct pack_ctx *p, struct pack_file *f, uint64_t n, struct kiln_error *err)
{
	enum kiln_err rc = flush_data(p, f, err);

	f->zeros += n;
	return rc;
}

static enum kiln_err add_data(struct pack_ctx *p, struct pack_file *f, const unsigned char *b, size_t n,
			      struct kiln_error *err)
{
	enum kiln_err rc = flush_zeros(p, f, err);

	while (rc == KILN_OK && n > 0) {
		size_t k = PACK_RECORD_MAX - f->data_len < n ? PACK_RECORD_MAX - f->data_len : n;

		memcpy(f->data + f->data_len, b, k);
		f->data_len += k;
		b += k;
		n -= k;
		if (f->data_len == PACK_RECORD_MAX)
			rc = flush_data(p, f, err);
	}
	return rc;
}

/* Appends file `name` of `dir`: a FILE record, then DATA and ZEROS records covering its bytes. */
static enum kiln_err pack_one(struct pack_ctx *p, const char *dir, const char *name, unsigned char *rbuf,
			      struct pack_file *f, uint64_t *total, struct kiln_error *err)
{
	unsigned char rec[8 + 4 + 2 + SNAPSHOT_NAME_MAX];
	char path[PATH_MAX];
	struct stat st;
	enum kiln_err rc = KILN_OK;
	size_t nlen = strlen(name);
	uint64_t off = 0, size;
	int fd;

	if (!fs_path(path, "%s/%s", dir, name))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", dir);
	fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return fs_err(err, -errno, "cannot open", path);
	if (fstat(fd, &st) < 0) {
		rc = fs_err(err, -errno, "cannot stat", path);
		goto out;
	}
	size = (uint64_t)st.st_size;
	if (size > PACK_FILE_SIZE_MAX) {
		rc = kiln_error_set(err, KILN_E_TOO_LARGE, "'%s' is too large to pack", path);
		goto out;
	}
	put_be64(rec, size);
	put_be32(rec + 8, (uint32_t)(st.st_mode & 0777));
	put_be16(rec + 12, (uint16_t)nlen);
	memcpy(rec + 14, name, nlen);
	if ((rc = record_write(p, REC_FILE, rec, 14 + nlen, err)) != KILN_OK)
		goto out;

	f->data_len = 0;
	f->zeros = 0;
	while (rc == KILN_OK && off < size) {
		off_t data = next_data(fd, (off_t)off, (off_t)size);

		if ((uint64_t)data > off) {
			rc = add_zeros(p, f, (uint64_t)data - off, err);
			off = (uint64_t)data;
			continue;
		}
		uint64_t end = (uint64_t)next_hole(fd, (off_t)off, (off_t)size);

		while (rc == KILN_OK && off < end) {
			size_t n = end - off < PACK_RECORD_MAX ? (size_t)(end - off) : PACK_RECORD_MAX;
			int r = pread_full(fd, rbuf, n, (off_t)off);

			if (r < 0) {
				rc = r == -ENODATA ? kiln_error_set(err, KILN_E_IO, "'%s' shrank while being packed", path)
						   : fs_err(err, r, "cannot read", path);
				break;
			}
			/* page by page: zero pages join zero runs, the rest is data */
			for (size_t i = 0; rc == KILN_OK && i < n;) {
				size_t plen = n - i < PAGE ? n - i : PAGE;
				bool zero = all_zero(rbuf + i, plen);
				size_t j = i + plen;

				while (j < n) {	/* extend over pages of the same kind */
					size_t q = n - j < PAGE ? n - j : PAGE;

					if (all_zero(rbuf + j, q) != zero)
						break;
					j += q;
				}
				rc = zero ? add_zeros(p, f, j - i, err) : add_data(p, f, rbuf + i, j - i, err);
				i = j;
			}
			off += n;
		}
	}
	if (rc == KILN_OK)
		rc = flush_data(p, f, err);
	if (rc == KILN_OK)
		rc = flush_zeros(p, f, err);
	*total += size;
out:
	close(fd);
	return rc;
}

/* Builds the object's header into `head` (PACK_HEAD_LEN + wrapped bytes). */
static void header_build(unsigned char *head, const unsigned char prefix[PACK_NONCE_PREFIX],
			 const char *wrapped, size_t wlen)
{
	memset(head, 0, PACK_HEAD_LEN);
	memcpy(head, PACK_MAGIC, 8);
	put_be16(head + 8, PACK_VERSION);
	put_be16(head + 10, (uint16_t)wlen);
	put_be32(head + 12, PACK_RECORD_MAX);
	memcpy(head + 16, prefix, PACK_NONCE_PREFIX);
	memcpy(head + PACK_HEAD_LEN, wrapped, wlen);
}

enum kiln_err snapshot_pack(const char *dir, const struct auth_master_key *mk, const char *tenant_id,
			    const char *out_path, struct kiln_error *err)
{
	char names[SNAPSHOT_FILES_MAX][SNAPSHOT_NAME_MAX];
	char tmp[PATH_MAX];
	struct pack_ctx p = { .fd = -1, .path = out_path };
	struct pack_file f = { 0 };
	unsigned char head[PACK_HEAD_LEN + PACK_WRAPPED_MAX];
	unsigned char *rbuf = NULL;
	unsigned char end[12];
	char *wrapped = NULL;
	uint64_t total = 0;
	size_t wlen;
	unsigned n;
	enum kiln_err rc;
	int r;

	if (!tenant_id || !*tenant_id)
		return kiln_error_set(err, KILN_E_INVALID, "snapshot pack needs a tenant id");
	if (!fs_path(tmp, "%s.tmp", out_path))
		return kiln_error_set(err, KILN_E_INVALID, "path '%s' too long", out_path);
	if ((rc = list_files(dir, true, names, &n, err)) != KILN_OK)
		return rc;
	if ((rc = auth_data_key_new(mk, tenant_id, strlen(tenant_id), p.key, &wrapped, err)) != KILN_OK)
		return rc;
	wlen = strlen(wrapped);
	rbuf = malloc(PACK_RECORD_MAX);
	f.data = malloc(PACK_RECORD_MAX);
	p.cipher = EVP_CIPHER_CTX_new();
	if (wlen > PACK_WRAPPED_MAX || !rbuf || !f.data || !p.cipher) {
		rc = kiln_error_set(err, wlen > PACK_WRAPPED_MAX ? KILN_E_INTERNAL : KILN_E_NOMEM,
				    "cannot set up snapshot encryption");
		goto out;
	}
	if (RAND_bytes(p.prefix, sizeof(p.prefix)) != 1) {
		rc = kiln_error_set(err, KILN_E_INTERNAL, "random generator failed");
		goto out;
	}
	header_build(head, p.prefix, wrapped, wlen);
	if (!sha256(head, PACK_HEAD_LEN + wlen, p.head_digest)) {
		rc = kiln_error_set(err, KILN_E_INTERNAL, "sha-256 failed");
		goto out;
	}
	p.fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (p.fd < 0) {
		rc = fs_err(err, -errno, "cannot create", tmp);
		goto out;
	}
	if ((r = write_all(p.fd, head, PACK_HEAD_LEN + wlen)) < 0) {
		rc = fs_err(err, r, "cannot write", tmp);
		goto out;
	}
	for (unsigned i = 0; i < n; i++)
		if ((rc = pack_one(&p, dir, names[i], rbuf, &f, &total, err)) != KILN_OK)
			goto out;
	put_be32(end, n);
	put_be64(end + 4, total);
	if ((rc = record_write(&p, REC_END, end, sizeof(end), err)) != KILN_OK)
		goto out;
	if (fsync(p.fd) < 0) {
		rc = fs_err(err, -errno, "cannot write", tmp);
		goto out;
	}
	close(p.fd);
	p.fd = -1;
	if (rename(tmp, out_path) < 0) {
		rc = fs_err(err, -errno, "cannot rename", tmp);
		unlink(tmp);
		goto out;
	}
	if ((r = fsync_parent(out_path)) < 0)
		rc = fs_err(err, r, "cannot sync the directory of", out_path);
out:
	if (p.fd >= 0) {
		close(p.fd);
		unlink(tmp);
	}
	pack_ctx_release(&p);
	free(wrapped);
	free(rbuf);
	free(f.data);
	return rc;
}

/* Removes a flat directory that unpack made (regular files only), if it exists. */
static int remove_flat(const char *dir)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	int r = 0;

	if (!d)
		return errno == ENOENT ? 0 : -errno;
	while ((e = readdir(d)) != NULL) {
		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
			continue;
		if (unlinkat(dirfd(d), e->d_name, 0) < 0 && r == 0)
			r = -errno;
	}
	closedir(d);
	if (rmdir(dir) < 0 && r == 0)
		r = -errno;
	return r;
}

/* The file being unpacked. */
struct unpack_file {
	int fd;
	char name[SNAPSHOT_NAME_MAX];
	uint64_t size, off;
	mode_t mode;
};

/* Finishes the current file: every byte accounted for, size set (trailing holes), synced. */
static enum kiln_err unpack_close(struct unpack_file *u, const char *in_path, struct kiln_error *err)
{
	enum kiln_err rc = KILN_OK;

	if (u->fd < 0)
		return KILN_OK;
	if (u->off != u->size)
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot object '%s' is corrupt: file '%s' incomplete",
				    in_path, u->name);
	else if (ftruncate(u->fd, (off_t)u->size) < 0 || fchmod(u->fd, u->mode) < 0 || fsync(u->fd) < 0)
		rc = fs_err(err, -errno, "cannot write unpacked file", u->name);
	close(u->fd);
	u->fd = -1;
	return rc;
}

static enum kiln_err truncated(const char *in_path, struct kiln_error *err)
{
	return kiln_error_set(err, KILN_E_INVALID, "snapshot object '%s' is truncated", in_path);
}

/* Reads and authenticates the object's records into the directory `tmp` (already created). */
static enum kiln_err unpack_records(struct pack_ctx *p, uint32_t rec_max, const char *in_path,
				    const char *tmp, struct kiln_error *err)
{
	struct unpack_file u = { .fd = -1 };
	unsigned char *buf = malloc((size_t)rec_max + PACK_TAG);
	unsigned char head[PACK_REC_HEAD];
	unsigned n_files = 0;
	uint64_t total = 0;
	enum kiln_err rc = KILN_OK;
	bool done = false;

	if (!buf)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	while (rc == KILN_OK && !done) {
		ssize_t got = read_full(p->fd, head, sizeof(head));
		uint32_t len;
		unsigned type, flags;

		if (got < 0) {
			rc = fs_err(err, (int)got, "cannot read", in_path);
			break;
		}
		if (got < (ssize_t)sizeof(head)) {
			rc = truncated(in_path, err);
			break;
		}
		type = head[0];
		flags = head[1];
		len = get_be32(head + 4);
		if ((type == REC_FILE && (len < 15 || len > 14 + SNAPSHOT_NAME_MAX - 1)) ||
		    (type == REC_DATA && (len == 0 || len > rec_max)) || (type == REC_ZEROS && len != 8) ||
		    (type == REC_END && len != 12) || type < REC_FILE || type > REC_END || head[2] || head[3] ||
		    flags != (type == REC_END ? PACK_FLAG_FINAL : 0)) {
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot object '%s' is corrupt (record %" PRIu64 ")",
					    in_path, p->seq);
			break;
		}
		got = read_full(p->fd, buf, (size_t)len + PACK_TAG);
		if (got < 0) {
			rc = fs_err(err, (int)got, "cannot read", in_path);
			break;
		}
		if ((size_t)got < (size_t)len + PACK_TAG) {
			rc = truncated(in_path, err);
			break;
		}
		if (!record_crypt(p, false, head, buf, len, buf + len)) {
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot object '%s' is corrupt or was altered (record %" PRIu64 ")",
					    in_path, p->seq - 1);
			break;
		}
		switch (type) {
		case REC_FILE: {
			char path[PATH_MAX];
			uint16_t nlen = get_be16(buf + 12);

			if ((rc = unpack_close(&u, in_path, err)) != KILN_OK)
				break;
			if (nlen != len - 14 || n_files == SNAPSHOT_FILES_MAX) {
				rc = kiln_error_set(err, KILN_E_INVALID, "snapshot object '%s' is corrupt (file record)", in_path);
				break;
			}
			memcpy(u.name, buf + 14, nlen);
			u.name[nlen] = '\0';
			u.size = get_be64(buf);
			u.mode = get_be32(buf + 8) & 0777;
			u.off = 0;
			if (!name_ok(u.name) || u.size > PACK_FILE_SIZE_MAX) {
				rc = kiln_error_set(err, KILN_E_INVALID, "snapshot object '%s' is corrupt (file record)", in_path);
				break;
			}
			if (!fs_path(path, "%s/%s", tmp, u.name)) {
				rc = kiln_error_set(err, KILN_E_INVALID, "path '%s' too long", tmp);
				break;
			}
			u.fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
			if (u.fd < 0) {
				rc = errno == EEXIST ? kiln_error_set(err, KILN_E_INVALID, "snapshot object '%s' is corrupt (file '%s' twice)",
								      in_path, u.name)
						     : fs_err(err, -errno, "cannot create", path);
				break;
			}
			n_files++;
			total += u.size;
			break;
		}
		case REC_DATA:
		case REC_ZEROS: {
			uint64_t n = type == REC_DATA ? len : get_be64(buf);
			int r;

			if (u.fd < 0 || n == 0 || n > u.size - u.off) {
				rc = kiln_error_set(err, KILN_E_INVALID, "snapshot object '%s' is corrupt (record %" PRIu64 " out of place)",
						    in_path, p->seq - 1);
				break;
			}
			if (type == REC_DATA && (r = pwrite_all(u.fd, buf, len, (off_t)u.off)) < 0) {
				rc = fs_err(err, r, "cannot write unpacked file", u.name);
				break;
			}
			u.off += n;	/* a zero run stays a hole */
			break;
		}
		case REC_END:
			if ((rc = unpack_close(&u, in_path, err)) != KILN_OK)
				break;
			if (get_be32(buf) != n_files || get_be64(buf + 4) != total) {
				rc = kiln_error_set(err, KILN_E_INVALID, "snapshot object '%s' is corrupt (end record)", in_path);
				break;
			}
			got = read_full(p->fd, buf, 1);
			if (got != 0)
				rc = got < 0 ? fs_err(err, (int)got, "cannot read", in_path)
					     : kiln_error_set(err, KILN_E_INVALID,
							      "snapshot object '%s' has bytes after its end", in_path);
			done = true;
			break;
		}
	}
	if (u.fd >= 0)
		close(u.fd);
	OPENSSL_cleanse(buf, (size_t)rec_max + PACK_TAG);
	free(buf);
	return rc;
}

enum kiln_err snapshot_unpack(const char *in_path, const struct auth_master_key *mk,
			      const char *tenant_id, const char *dir, struct kiln_error *err)
{
	unsigned char head[PACK_HEAD_LEN + PACK_WRAPPED_MAX + 1];
	char tmp[PATH_MAX];
	struct pack_ctx p = { .fd = -1, .path = in_path };
	struct stat st;
	enum kiln_err rc;
	uint16_t wlen;
	uint32_t rec_max;
	bool made_tmp = false;
	ssize_t got;
	int r;

	if (!tenant_id || !*tenant_id)
		return kiln_error_set(err, KILN_E_INVALID, "snapshot unpack needs a tenant id");
	if (!fs_path(tmp, "%s.tmp", dir))
		return kiln_error_set(err, KILN_E_INVALID, "path '%s' too long", dir);
	if (lstat(dir, &st) == 0)
		return kiln_error_set(err, KILN_E_CONFLICT, "'%s' already exists", dir);

	p.fd = open(in_path, O_RDONLY | O_CLOEXEC);
	if (p.fd < 0)
		return fs_err(err, -errno, "cannot open", in_path);
	got = read_full(p.fd, head, PACK_HEAD_LEN);
	if (got < 0) {
		rc = fs_err(err, (int)got, "cannot read", in_path);
		goto out;
	}
	if (got < 8 || memcmp(head, PACK_MAGIC, 8) != 0) {
		rc = kiln_error_set(err, KILN_E_INVALID, "'%s' is not a snapshot object", in_path);
		goto out;
	}
	if (got < PACK_HEAD_LEN) {
		rc = truncated(in_path, err);
		goto out;
	}
	wlen = get_be16(head + 10);
	rec_max = get_be32(head + 12);
	if (get_be16(head + 8) != PACK_VERSION) {
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot object '%s' has unknown version %u", in_path,
				    (unsigned)get_be16(head + 8));
		goto out;
	}
	if (wlen == 0 || wlen > PACK_WRAPPED_MAX || rec_max < PAGE || rec_max > PACK_RECORD_LIMIT ||
	    !all_zero(head + 20, 4)) {
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot object '%s' has a malformed header", in_path);
		goto out;
	}
	got = read_full(p.fd, head + PACK_HEAD_LEN, wlen);
	if (got < 0) {
		rc = fs_err(err, (int)got, "cannot read", in_path);
		goto out;
	}
	if (got < wlen) {
		rc = truncated(in_path, err);
		goto out;
	}
	if (auth_data_key_unwrap(mk, (const char *)head + PACK_HEAD_LEN, wlen, tenant_id, strlen(tenant_id),
				 p.key, NULL) != KILN_OK) {
		rc = kiln_error_set(err, KILN_E_INVALID,
				    "snapshot object '%s' was not packed for tenant '%s' under this master key",
				    in_path, tenant_id);
		goto out;
	}
	memcpy(p.prefix, head + 16, PACK_NONCE_PREFIX);
	p.cipher = EVP_CIPHER_CTX_new();
	if (!p.cipher || !sha256(head, PACK_HEAD_LEN + (size_t)wlen, p.head_digest)) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "cannot set up snapshot decryption");
		goto out;
	}

	if ((r = remove_flat(tmp)) < 0) {	/* left by an unpack that crashed */
		rc = fs_err(err, r, "cannot remove", tmp);
		goto out;
	}
	if (mkdir(tmp, 0700) < 0) {
		rc = fs_err(err, -errno, "cannot create", tmp);
		goto out;
	}
	made_tmp = true;
	if ((rc = unpack_records(&p, rec_max, in_path, tmp, err)) != KILN_OK)
		goto out;
	if ((r = fs_fsync_dir(tmp)) < 0) {
		rc = fs_err(err, r, "cannot sync", tmp);
		goto out;
	}
	if (rename(tmp, dir) < 0) {
		rc = fs_err(err, -errno, "cannot rename", tmp);
		goto out;
	}
	made_tmp = false;
	if ((r = fsync_parent(dir)) < 0)
		rc = fs_err(err, r, "cannot sync the directory of", dir);
out:
	if (made_tmp)
		remove_flat(tmp);
	if (p.fd >= 0)
		close(p.fd);
	pack_ctx_release(&p);
	return rc;
}
