/*
 * hv.c - the driver-independent part of the hypervisor layer: spec checks, shape arithmetic and the
 * vmm_ functions that dispatch to a VM's driver.
 */
#include "vmm/hv.h"

#include <stdlib.h>
#include <string.h>

struct vmm_vm {
	const struct hv_ops *ops;
	struct hv_vm *hv;
};

extern const struct hv_ops hv_firecracker_ops;	/* vmm/firecracker.c */
static const struct hv_ops *const drivers[] = { &hv_qemu_ops, &hv_firecracker_ops };

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
