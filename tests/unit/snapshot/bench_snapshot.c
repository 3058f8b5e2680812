/*
 * bench_snapshot.c - how fast snapshot.c hashes and packs a memory image: a 256 MiB file fully
 * written (every page data), and the same size as a sparse file with 1% data pages. Prints MiB/s of
 * logical size. Not a test: run it by hand from a non-sanitized build (docs/snapshots.md).
 *   bench_snapshot [dir]    (default $TMPDIR or /tmp)
 */
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "auth/crypto.h"
#include "vmm/snapshot.h"

#define MIB (1024 * 1024)
#define SIZE (256 * MIB)

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void run(const char *label, const char *dir, const struct auth_master_key *mk)
{
	char mem[PATH_MAX], obj[PATH_MAX], out[PATH_MAX], hex[65], cmd[PATH_MAX + 16];
	struct kiln_error err = { 0 };
	struct stat st;
	double t0, t1, t2, t3;

	snprintf(mem, sizeof(mem), "%s/mem", dir);
	snprintf(obj, sizeof(obj), "%s.obj", dir);
	snprintf(out, sizeof(out), "%s.out", dir);
	t0 = now();
	if (snapshot_file_digest(mem, hex, NULL, &err) != KILN_OK)
		goto fail;
	t1 = now();
	if (snapshot_pack(dir, mk, "bench", obj, &err) != KILN_OK)
		goto fail;
	t2 = now();
	if (snapshot_unpack(obj, mk, "bench", out, &err) != KILN_OK)
		goto fail;
	t3 = now();
	stat(obj, &st);
	printf("%-22s hash %7.0f MiB/s (%.3f s)  pack %7.0f MiB/s (%.3f s)  unpack %7.0f MiB/s (%.3f s)  object %lld bytes\n",
	       label, SIZE / MIB / (t1 - t0), t1 - t0, SIZE / MIB / (t2 - t1), t2 - t1,
	       SIZE / MIB / (t3 - t2), t3 - t2, (long long)st.st_size);
	unlink(obj);
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", out);
	if (system(cmd) != 0)
		fprintf(stderr, "cannot remove %s\n", out);
	return;
fail:
	fprintf(stderr, "%s: %s\n", label, err.msg);
	exit(1);
}

int main(int argc, char **argv)
{
	const char *base = argc > 1 ? argv[1] : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
	char root[1024], full[1100], sparse[1100], path[PATH_MAX], cmd[PATH_MAX + 16];
	unsigned char *buf = malloc(MIB);
	struct auth_master_key mk;
	struct kiln_error err = { 0 };
	int fd;

	snprintf(root, sizeof(root), "%s/kiln-snapshot-bench-XXXXXX", base);
	if (!buf || !mkdtemp(root) || auth_master_key_generate(&mk, &err) != KILN_OK)
		return 1;
	snprintf(full, sizeof(full), "%s/full", root);
	snprintf(sparse, sizeof(sparse), "%s/sparse", root);
	mkdir(full, 0700);
	mkdir(sparse, 0700);

	for (size_t i = 0; i < MIB; i++)
		buf[i] = (unsigned char)(i * 2654435761u >> 13) | 1;
	snprintf(path, sizeof(path), "%s/mem", full);
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	for (int k = 0; k < SIZE / MIB; k++) {
		buf[0] = (unsigned char)k | 1;
		if (write(fd, buf, MIB) != MIB)
			return 1;
	}
	close(fd);

	snprintf(path, sizeof(path), "%s/mem", sparse);
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	for (int page = 0; page < SIZE / 4096; page += 100)	/* 1% of pages hold data */
		if (pwrite(fd, buf, 4096, (off_t)page * 4096) != 4096)
			return 1;
	if (ftruncate(fd, SIZE) < 0)
		return 1;
	close(fd);

	run("256 MiB all data", full, &mk);
	run("256 MiB 1% data pages", sparse, &mk);
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
	free(buf);
	return system(cmd) == 0 ? 0 : 1;
}
