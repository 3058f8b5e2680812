/*
 * hv.c - the driver-independent part of the hypervisor layer: spec checks, shape arithmetic and the
 * vmm_ functions that dispatch to a VM's driver.
 */
#include "vmm/hv.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"

struct vmm_vm {
	const struct hv_ops *ops;
	struct hv_vm *hv;
};

extern const struct hv_ops hv_firecracker_ops;	/* vmm/firecracker.c */
static const struct hv_ops *const drivers[] = { &hv_qemu_ops, &hv_firecracker_ops, &hv_hostagent_ops };

const struct hv_ops *hv_find(const char *name)
{
	for (size_t i = 0; i < sizeof(drivers) / sizeof(drivers[0]); i++)
		if (name && strcmp(drivers[i]->name, name) == 0)
			return drivers[i];
	return NULL;
}

unsigned vmm_vcpus_whole(unsigned vcpu_milli)
{
	return (vcpu_milli + 999) / 1000;
}

bool vmm_cmdline_inits_on_free(const char *cmdline)
{
	static const char key[] = "init_on_free=";
	bool on = false;

	for (const char *p = cmdline; p && *p;) {
		size_t n;

		p += strspn(p, " \t\n");
		n = strcspn(p, " \t\n");
		if (n > sizeof(key) - 1 && strncmp(p, key, sizeof(key) - 1) == 0) {
			const char *v = p + sizeof(key) - 1;

			/* kstrtobool(): 1, y, Y, on are true; 0, n, N, off false; else unchanged */
			if (*v == '1' || *v == 'y' || *v == 'Y')
				on = true;
			else if (*v == '0' || *v == 'n' || *v == 'N')
				on = false;
			else if ((*v == 'o' || *v == 'O') && (v[1] == 'n' || v[1] == 'N'))
				on = true;
			else if ((*v == 'o' || *v == 'O') && (v[1] == 'f' || v[1] == 'F'))
				on = false;
		}
		p += n;
	}
	return on;
}

unsigned long long vmm_mem_limit_bytes(const struct vmm_spec *spec)
{
	/* the VMM itself (~40 MiB measured), TCG's translation cache, and headroom for I/O buffers */
	unsigned long long overhead_mib = 128 + (spec->tb_size_mib ? spec->tb_size_mib : 64);

	return ((unsigned long long)spec->mem_mib + overhead_mib) << 20;
}

static bool valid_name(const char *s, size_t max)
{
	size_t n = s ? strlen(s) : 0;

	if (n == 0 || n > max)
		return false;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];

		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '-' || c == '_'))
			return false;
	}
	return true;
}

static bool abs_path(const char *p)
{
	return p && p[0] == '/';
}

enum kiln_err vmm_spec_check(const struct vmm_spec *s, struct kiln_error *err)
{
	if (!valid_name(s->id, VMM_ID_MAX))
		return kiln_error_set(err, KILN_E_INVALID, "id: 1-%d characters of [A-Za-z0-9_-]", VMM_ID_MAX);
	if (!valid_name(s->node, VMM_ID_MAX))
		return kiln_error_set(err, KILN_E_INVALID, "node: 1-%d characters of [A-Za-z0-9_-]", VMM_ID_MAX);
	if (s->vcpu_milli < VMM_VCPU_MILLI_MIN || s->vcpu_milli > VMM_VCPU_MILLI_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "vcpus: %u milli-vCPUs outside %d-%d",
				      s->vcpu_milli, VMM_VCPU_MILLI_MIN, VMM_VCPU_MILLI_MAX);
	if (s->mem_mib < VMM_MEM_MIB_MIN || s->mem_mib > VMM_MEM_MIB_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "memory: %u MiB outside %d-%d", s->mem_mib,
				      VMM_MEM_MIB_MIN, VMM_MEM_MIB_MAX);
	if (s->disk_gib > VMM_DISK_GIB_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "disk: %u GiB over %d", s->disk_gib, VMM_DISK_GIB_MAX);
	if (!abs_path(s->kernel))
		return kiln_error_set(err, KILN_E_INVALID, "kernel: an absolute path is required");
	if (s->initrd && !abs_path(s->initrd))
		return kiln_error_set(err, KILN_E_INVALID, "initrd: not an absolute path");
	if (s->rootfs && !abs_path(s->rootfs))
		return kiln_error_set(err, KILN_E_INVALID, "rootfs: not an absolute path");
	if (s->cmdline_extra && strlen(s->cmdline_extra) > 1024)
		return kiln_error_set(err, KILN_E_INVALID, "cmdline: over 1024 bytes");
	if (s->netns_path && (!abs_path(s->netns_path) || !s->tap || !*s->tap || strlen(s->tap) > 15))
		return kiln_error_set(err, KILN_E_INVALID, "network: netns path and a tap name of 1-15 bytes");
	if (!abs_path(s->run_dir) || strlen(s->run_dir) > VMM_RUN_DIR_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "run_dir: an absolute path of at most %d bytes",
				      VMM_RUN_DIR_MAX);
	if (!abs_path(s->state_dir))
		return kiln_error_set(err, KILN_E_INVALID, "state_dir: an absolute path is required");
	if (s->mem_dir && !abs_path(s->mem_dir))
		return kiln_error_set(err, KILN_E_INVALID, "mem_dir: not an absolute path");
	if (s->uid == 0 || s->gid == 0)
		return kiln_error_set(err, KILN_E_INVALID, "uid/gid: the VMM never runs as root");
	if (s->console_max && (s->console_max < VMM_CONSOLE_MAX_MIN || s->console_max > VMM_CONSOLE_MAX_MAX))
		return kiln_error_set(err, KILN_E_INVALID, "console_max: %llu bytes outside %llu-%llu",
				      s->console_max, VMM_CONSOLE_MAX_MIN, VMM_CONSOLE_MAX_MAX);
	return KILN_OK;
}

static enum kiln_err wrap(const char *driver, struct hv_vm *hv, enum kiln_err rc, struct vmm_vm **out,
			  struct kiln_error *err)
{
	struct vmm_vm *vm;

	if (rc != KILN_OK)
		return rc;
	vm = calloc(1, sizeof(*vm));
	if (!vm) {
		hv_find(driver)->destroy(hv, NULL);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	vm->ops = hv_find(driver);
	vm->hv = hv;
	*out = vm;
	return KILN_OK;
}

enum kiln_err vmm_create(const char *driver, const struct vmm_spec *spec, struct vmm_vm **out,
			 struct kiln_error *err)
{
	const struct hv_ops *ops = hv_find(driver);
	struct hv_vm *hv = NULL;
	enum kiln_err rc;

	*out = NULL;
	if (!ops)
		return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED, "hypervisor '%s' is not available",
				      driver ? driver : "(null)");
	rc = ops->create(spec, &hv, err);
	return wrap(driver, hv, rc, out, err);
}

enum kiln_err vmm_restore(const char *driver, const struct vmm_spec *spec, const char *snap_dir,
			  enum vmm_mem_from from, struct vmm_vm **out, struct kiln_error *err)
{
	const struct hv_ops *ops = hv_find(driver);
	struct hv_vm *hv = NULL;
	enum kiln_err rc;

	*out = NULL;
	if (!ops)
		return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED, "hypervisor '%s' is not available",
				      driver ? driver : "(null)");
	rc = ops->restore(spec, snap_dir, from, &hv, err);
	return wrap(driver, hv, rc, out, err);
}

enum kiln_err vmm_restore_begin(const char *driver, const struct vmm_spec *spec, const char *snap_dir,
				enum vmm_mem_from from, struct vmm_vm **out, struct kiln_error *err)
{
	const struct hv_ops *ops = hv_find(driver);
	struct hv_vm *hv = NULL;
	enum kiln_err rc;

	*out = NULL;
	if (!ops || !ops->restore_begin || !ops->restore_end)
		return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED,
				      "hypervisor '%s' cannot restore in two steps", driver ? driver : "(null)");
	rc = ops->restore_begin(spec, snap_dir, from, &hv, err);
	return wrap(driver, hv, rc, out, err);
}

enum kiln_err vmm_restore_end(struct vmm_vm *vm, const struct vmm_spec *spec, struct kiln_error *err)
{
	enum kiln_err rc = vm->ops->restore_end(vm->hv, spec, err);

	if (rc != KILN_OK)
		free(vm);	/* the driver destroyed its VM */
	return rc;
}

enum kiln_err vmm_adopt(const char *driver, const char *state_dir, struct vmm_vm **out,
			struct kiln_error *err)
{
	const struct hv_ops *ops = hv_find(driver);
	struct hv_vm *hv = NULL;
	enum kiln_err rc;

	*out = NULL;
	if (!ops || !ops->adopt)
		return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED, "hypervisor '%s' cannot take VMs over",
				      driver ? driver : "(null)");
	rc = ops->adopt(state_dir, &hv, err);
	return wrap(driver, hv, rc, out, err);
}

enum kiln_err vmm_snapshot_finish(struct vmm_vm *vm, const char *snap_dir, struct kiln_error *err)
{
	if (!vm->ops->snapshot_finish)
		return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED, "hypervisor '%s' cannot finish a snapshot",
				      vm->ops->name);
	return vm->ops->snapshot_finish(vm->hv, snap_dir, err);
}

enum kiln_err vmm_pause(struct vmm_vm *vm, struct kiln_error *err)
{
	return vm->ops->pause(vm->hv, err);
}

enum kiln_err vmm_resume(struct vmm_vm *vm, struct kiln_error *err)
{
	return vm->ops->resume(vm->hv, err);
}

enum kiln_err vmm_snapshot(struct vmm_vm *vm, const char *snap_dir, enum vmm_snap_mode mode,
			   struct kiln_error *err)
{
	return vm->ops->snapshot(vm->hv, snap_dir, mode, err);
}

enum kiln_err vmm_status(struct vmm_vm *vm, struct vmm_status *st, struct kiln_error *err)
{
	return vm->ops->status(vm->hv, st, err);
}

enum kiln_err vmm_usage(struct vmm_vm *vm, struct cg_usage *u, struct kiln_error *err)
{
	return vm->ops->usage(vm->hv, u, err);
}

enum kiln_err vmm_destroy(struct vmm_vm *vm, struct kiln_error *err)
{
	enum kiln_err rc;

	if (!vm)
		return KILN_OK;
	rc = vm->ops->destroy(vm->hv, err);
	free(vm);
	return rc;
}

const char *vmm_agent_socket(const struct vmm_vm *vm)
{
	return vm->ops->agent_socket(vm->hv);
}

const char *vmm_serial_log(const struct vmm_vm *vm)
{
	return vm->ops->serial_log(vm->hv);
}

/* ---- the console drain ---- */

#define CONSOLE_BUF (64u << 10)

struct hv_console {
	int fd;			/* the VMM's console stream */
	int stop_fd;		/* eventfd: hv_console_stop */
	int out_fd;		/* the current log file */
	char path[PATH_MAX], old[PATH_MAX], fresh[PATH_MAX];	/* fresh: the next file, until swapped in */
	unsigned long long half;	/* bytes one file may hold */
	unsigned long long size;	/* bytes in the current file */
	pthread_t thread;
	volatile bool done;	/* the thread saw the end of the stream */
};

/*
 * Starts a new current file, the full one becoming "<path>.old". The new empty file is swapped in
 * for the full one in one step (RENAME_EXCHANGE), so a reader never finds "<path>" missing; a file
 * system without the swap gets the two renames. 0 or -errno.
 */
static int console_rotate(struct hv_console *c)
{
	int fd, r;

	if (c->out_fd < 0)
		return -EBADF;
	fd = open(c->fresh, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
	if (fd < 0)
		return -errno;
	if (renameat2(AT_FDCWD, c->fresh, AT_FDCWD, c->path, RENAME_EXCHANGE) == 0) {
		if (rename(c->fresh, c->old) < 0)
			unlink(c->fresh);	/* the full file is dropped, the new one is in place */
	} else if ((errno != EINVAL && errno != ENOSYS) || rename(c->path, c->old) < 0 ||
		   rename(c->fresh, c->path) < 0) {
		r = -errno;
		unlink(c->fresh);
		close(fd);
		return r;
	}
	close(c->out_fd);
	c->out_fd = fd;
	c->size = 0;
	return 0;
}

/* Appends `len` bytes within the cap; on a write error the bytes are dropped (never waited on). */
static void console_put(struct hv_console *c, const char *p, size_t len)
{
	while (len > 0 && c->out_fd >= 0) {
		size_t n;
		ssize_t w;

		if (c->size >= c->half && console_rotate(c) < 0)
			return;
		n = len < c->half - c->size ? len : (size_t)(c->half - c->size);
		w = write(c->out_fd, p, n);
		if (w <= 0) {
			if (w < 0 && errno == EINTR)
				continue;
			return;
		}
		c->size += (unsigned long long)w;
		p += w;
		len -= (size_t)w;
	}
}

static void *console_main(void *arg)
{
	struct hv_console *c = arg;
	char *buf = malloc(CONSOLE_BUF);

	for (;;) {
		struct pollfd pf[2] = { { .fd = c->fd, .events = POLLIN }, { .fd = c->stop_fd, .events = POLLIN } };
		ssize_t n;

		if (!buf)
			break;
		if (poll(pf, 2, -1) < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		if (pf[1].revents)
			break;
		n = read(c->fd, buf, CONSOLE_BUF);
		if (n < 0 && (errno == EINTR || errno == EAGAIN))
			continue;
		if (n <= 0)
			break;	/* the VMM ended */
		console_put(c, buf, (size_t)n);
	}
	free(buf);
	__atomic_store_n(&c->done, true, __ATOMIC_RELEASE);
	return NULL;
}

int hv_console_start(int fd, const char *path, unsigned long long max, struct hv_console **out)
{
	struct hv_console *c = calloc(1, sizeof(*c));
	struct stat st;
	int r;

	*out = NULL;
	if (!c) {
		close(fd);
		return -ENOMEM;
	}
	c->fd = fd;
	c->out_fd = -1;
	c->half = (max ? max : VMM_CONSOLE_MAX_DEFAULT) / 2;
	c->stop_fd = eventfd(0, EFD_CLOEXEC);
	if (c->stop_fd < 0) {
		r = -errno;
		goto fail;
	}
	if (snprintf(c->path, sizeof(c->path), "%s", path) >= (int)sizeof(c->path) ||
	    snprintf(c->old, sizeof(c->old), "%s.old", path) >= (int)sizeof(c->old) ||
	    snprintf(c->fresh, sizeof(c->fresh), "%s.new", path) >= (int)sizeof(c->fresh)) {
		r = -ENAMETOOLONG;
		goto fail;
	}
	/* a file left by an earlier VMM of this VM (a restore, a taken-over VM) is continued; a
	 * next file its drain left unswapped (it ended mid-rotation) is dropped */
	unlink(c->fresh);
	c->out_fd = open(c->path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	if (c->out_fd < 0) {
		r = -errno;
		goto fail;
	}
	c->size = fstat(c->out_fd, &st) == 0 ? (unsigned long long)st.st_size : c->half;
	if ((r = pthread_create(&c->thread, NULL, console_main, c)) != 0) {
		r = -r;
		goto fail;
	}
	*out = c;
	return 0;
fail:
	if (c->stop_fd >= 0)
		close(c->stop_fd);
	if (c->out_fd >= 0)
		close(c->out_fd);
	close(fd);
	free(c);
	return r;
}

static void console_free(struct hv_console *c)
{
	uint64_t one = 1;

	if (!c)
		return;
	if (write(c->stop_fd, &one, sizeof(one)) < 0)
		log_warn("console: cannot signal its thread: %s", strerror(errno));
	pthread_join(c->thread, NULL);
	close(c->stop_fd);
	close(c->fd);
	if (c->out_fd >= 0)
		close(c->out_fd);
	free(c);
}

void hv_console_stop(struct hv_console *c)
{
	console_free(c);
}

void hv_console_finish(struct hv_console *c)
{
	/* bounded: should a process still hold the stream, stop after 2 s all the same */
	for (int i = 0; c && i < 200 && !__atomic_load_n(&c->done, __ATOMIC_ACQUIRE); i++)
		usleep(10000);
	console_free(c);
}
