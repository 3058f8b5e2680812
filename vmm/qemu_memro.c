/*
 * qemu_memro.c - preloaded into a QEMU that maps a snapshot's memory image privately (a create
 * from a template, a VMM started ahead on one, a fork child): the image, shared by every such VM,
 * is opened read-only, and a page the guest gives back through the balloon is dropped from the
 * VM's private copy only.
 *
 * QEMU 7.2 opens a memory backend's file read-write even with share=off, and discards a page the
 * free page reporting balloon hands it with fallocate(PUNCH_HOLE) on that file before
 * madvise(MADV_DONTNEED): in a private map the punch reaches the shared image, which every other
 * VM mapping it then reads as zeros. Later QEMUs still punch there (with a warning), or, given
 * the file read-only (8.2's readonly=on,rom=off), discard nothing. Built on its own
 * (vmm/CMakeLists.txt, no sanitizer: QEMU has none), carried inside kiln-node
 * (qemu_memro_blob.c) and given to QEMU as a sealed memfd (vmm/qemu.c).
 *
 *   KILN_QEMU_MEM_RO   the memory backend's mem-path exactly as QEMU opens it ("mem")
 *
 * An open() of that path for reading and writing opens it read-only; fallocate(PUNCH_HOLE) on
 * the descriptor it returned does nothing and answers success, so QEMU goes on to its madvise,
 * which drops the private pages: they read as the image again, not as zeros, which a page the
 * guest reported free may unless the guest zeroes pages as it frees them (init_on_free, which
 * kiln-node refuses with the balloon: vmm_cmdline_inits_on_free()). Any other call passes
 * through unchanged. The jail binds the image read-only besides (vmm/qemu.c, jail_layout()): a
 * QEMU this is not loaded into cannot open it for writing and fails to start instead of punching
 * it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

typedef int (*open_fn)(const char *, int, ...);
typedef int (*open2_fn)(const char *, int);
typedef int (*fallocate_fn)(int, int, off_t, off_t);
typedef int (*close_fn)(int);

static const char *ro_path;
static volatile int ro_fd = -1;
static open_fn real_open64;
static open2_fn real_open64_2;
static fallocate_fn real_fallocate64;
static close_fn real_close;

/* The next definitions of what this wraps; again on a call made before the constructor ran. */
static void memro_resolve(void)
{
	real_open64 = (open_fn)dlsym(RTLD_NEXT, "open64");
	real_open64_2 = (open2_fn)dlsym(RTLD_NEXT, "__open64_2");
	real_fallocate64 = (fallocate_fn)dlsym(RTLD_NEXT, "fallocate64");
	real_close = (close_fn)dlsym(RTLD_NEXT, "close");
}

/* Before QEMU's own code runs, and before its seccomp filter is in place. */
__attribute__((constructor)) static void memro_init(void)
{
	memro_resolve();
	ro_path = getenv("KILN_QEMU_MEM_RO");
	/* nothing QEMU starts gets it */
	unsetenv("LD_PRELOAD");
}

/* The flags to open `path` with: read-only for the image when asked for reading and writing. */
static int memro_flags(const char *path, int flags)
{
	if (ro_path && path && strcmp(path, ro_path) == 0 && (flags & O_ACCMODE) == O_RDWR)
		return (flags & ~O_ACCMODE) | O_RDONLY;
	return flags;
}

static int memro_opened(const char *path, int fd)
{
	if (fd >= 0 && ro_path && path && strcmp(path, ro_path) == 0)
		ro_fd = fd;
	return fd;
}

int open64(const char *path, int flags, ...)
{
	mode_t mode = 0;

	if (!real_open64)
		memro_resolve();
	if ((flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE) {
		va_list ap;

		va_start(ap, flags);
		mode = va_arg(ap, mode_t);
		va_end(ap);
	}
	return memro_opened(path, real_open64(path, memro_flags(path, flags), mode));
}

int open(const char *path, int flags, ...) __attribute__((alias("open64")));

int __open64_2(const char *path, int flags)
{
	if (!real_open64_2)
		memro_resolve();
	return memro_opened(path, real_open64_2(path, memro_flags(path, flags)));
}

int __open_2(const char *path, int flags) __attribute__((alias("__open64_2")));

int fallocate64(int fd, int mode, off_t offset, off_t len)
{
	if (fd >= 0 && fd == ro_fd && (mode & FALLOC_FL_PUNCH_HOLE))
		return 0;
	if (!real_fallocate64)
		memro_resolve();
	return real_fallocate64(fd, mode, offset, len);
}

int fallocate(int fd, int mode, off_t offset, off_t len) __attribute__((alias("fallocate64")));

/* A descriptor of that number opened later is another file's. */
int close(int fd)
{
	if (fd >= 0 && fd == ro_fd)
		ro_fd = -1;
	if (!real_close)
		memro_resolve();
	return real_close(fd);
}
