/*
 * hv.h - the hypervisor interface of kiln-node: one VM spec, one table of driver operations
 * (`struct hv_ops`, implemented by QEMU now and Firecracker later) and the `vmm_` functions the
 * node calls, which dispatch to the driver a VM was started with.
 *
 * Lifecycle (docs/vmm.md):
 *   vmm_create            cold boot: jailed VMM, cgroup, disk overlay, file-backed shared memory
 *   vmm_pause/vmm_resume  stop and continue the vCPUs (the process stays)
 *   vmm_snapshot          stop, save device state (and memory) into a snapshot directory; in
 *                         VMM_SNAP_SHARED mode the memory file and disk layer move into the
 *                         snapshot and the VMM process ends
 *   vmm_restore           a new VMM process from a snapshot directory (product: resume, fork, create
 *                         from template), with its memory mapped privately or owned
 *   vmm_restore_begin/end the same in two steps: a VMM started ahead, waiting for its state, then
 *                         loaded and run, under another name if asked
 *   vmm_destroy           kill, reap, remove cgroup and files
 *   vmm_adopt             take over a VM an earlier run of the node left (its VMM may still run)
 *   vmm_snapshot_finish   complete a VMM_SNAP_SHARED snapshot whose VMM ended inside it
 * Every function returns an enum kiln_err and fills `err` (first error wins) on failure.
 */
#ifndef KILN_VMM_HV_H
#define KILN_VMM_HV_H

#include <stdbool.h>
#include <sys/types.h>

#include "common/err.h"
#include "vmm/cgroup.h"

#define VMM_VCPU_MILLI_MIN 250
#define VMM_VCPU_MILLI_MAX 8000
#define VMM_MEM_MIB_MIN 64
#define VMM_MEM_MIB_MAX 65536
#define VMM_DISK_GIB_MAX 1024
#define VMM_ID_MAX 40			/* bytes of a VM id: [A-Za-z0-9_-] */
#define VMM_RUN_DIR_MAX 80		/* bytes: leaves room for "/agent.sock" within 107 */
#define VMM_GUEST_MAC "06:00:ac:10:00:02"	/* the same in every sandbox (own netns each) */

/* What a VM is made of. Strings are borrowed for the duration of the call only. */
struct vmm_spec {
	const char *id;		/* unique on the host; [A-Za-z0-9_-]{1,40} */
	const char *node;	/* node id: names the cgroup kiln/<node>/<id> */
	unsigned vcpu_milli;	/* 250..8000 thousandths of a vCPU; the guest sees ceil(/1000) */
	unsigned mem_mib;	/* guest memory, MiB */
	unsigned disk_gib;	/* virtual disk size, GiB; 0 = the base image's (or snapshot's)
				   size. A restore grows the snapshot's disk to it once the VM
				   runs; below the snapshot's is KILN_E_INVALID */
	const char *kernel;	/* guest kernel (bzImage) */
	const char *initrd;	/* initramfs, or NULL */
	const char *rootfs;	/* base root file system image (raw), or NULL for no disk */
	const char *cmdline_extra;	/* appended to the kernel command line, or NULL */
	const char *netns_path;	/* network namespace to run in (/run/netns/NAME), or NULL: no NIC */
	const char *tap;	/* TAP device inside that namespace; required with netns_path */
	const char *run_dir;	/* per-VM runtime dir (sockets, logs, jail), <= VMM_RUN_DIR_MAX */
	const char *state_dir;	/* per-VM dir for the disk layer, on a disk (not tmpfs) */
	const char *mem_dir;	/* where the guest memory file lives; NULL = /dev/shm */
	uid_t uid;		/* unprivileged uid/gid the VMM runs as (jail_uid_alloc) */
	gid_t gid;
	const char *cgroup_root;	/* NULL = /sys/fs/cgroup */
	const char *hv_binary;	/* NULL = the driver's default (/usr/bin/qemu-system-x86_64) */
	unsigned tb_size_mib;	/* TCG translation cache, MiB; 0 = default */
	unsigned long long console_max;	/* bytes of guest console kept on disk (serial.log and
					   serial.log.old, under state_dir); 0 = VMM_CONSOLE_MAX_DEFAULT */
	unsigned disk_iops;		/* the disk's I/O operations per second (read + write); 0 = none */
	unsigned long long disk_bps;	/* the disk's bytes per second (read + write); 0 = none */
	bool free_page_reporting;	/* a booted VM gets a virtio-balloon whose guest hands free
					   memory back (a restore: as its snapshot was); QEMU only */
};

#define VMM_CONSOLE_MAX_DEFAULT (1ull << 20)
#define VMM_CONSOLE_MAX_MIN (64ull << 10)
#define VMM_CONSOLE_MAX_MAX (1ull << 30)

/* How a snapshot holds memory. */
enum vmm_snap_mode {
	VMM_SNAP_SHARED,	/* x-ignore-shared: state file + the memory file itself (moved in);
				   the VMM process ends. Milliseconds. Same-node restores. */
	VMM_SNAP_FULL,		/* memory inside the state stream; the VM stays, paused. Portable:
				   for moving to another node. Seconds (scales with memory). */
};

/* Where a restored VM's memory comes from (VMM_SNAP_SHARED snapshots). */
enum vmm_mem_from {
	VMM_MEM_PRIVATE,	/* map the snapshot's image copy-on-write (share=off): fork children,
				   templates. The image must stay frozen while any such VM lives;
				   QEMU opens it read-only (vmm/qemu_memro.c). */
	VMM_MEM_MOVE,		/* take the image as the VM's own memory file (share=on); the
				   snapshot loses it. Resume after pause. */
	VMM_MEM_COPY,		/* copy the image to a memory file of its own (share=on). The
				   parent after a fork; resume from a kept snapshot. */
	VMM_MEM_COPY_LATE,	/* COPY, the image copied in by vmm_restore_end(): a VMM begun
				   ahead holds none of the guest's memory while it waits (a
				   paused sandbox's, node/warm.c). Otherwise as COPY. */
};

struct vmm_status {
	bool alive;		/* the VMM process exists */
	bool running;		/* vCPUs running (alive and not paused) */
	pid_t pid;		/* VMM process id on the host; 0 once it is gone */
	int exit_status;	/* waitpid status once it exited */
};

struct hv_vm;

struct hv_ops {
	const char *name;
	enum kiln_err (*create)(const struct vmm_spec *spec, struct hv_vm **out, struct kiln_error *err);
	enum kiln_err (*restore)(const struct vmm_spec *spec, const char *snap_dir,
				 enum vmm_mem_from from, struct hv_vm **out, struct kiln_error *err);
	enum kiln_err (*pause)(struct hv_vm *vm, struct kiln_error *err);
	enum kiln_err (*resume)(struct hv_vm *vm, struct kiln_error *err);
	enum kiln_err (*snapshot)(struct hv_vm *vm, const char *snap_dir, enum vmm_snap_mode mode,
				  struct kiln_error *err);
	enum kiln_err (*status)(struct hv_vm *vm, struct vmm_status *st, struct kiln_error *err);
	enum kiln_err (*usage)(struct hv_vm *vm, struct cg_usage *u, struct kiln_error *err);
	enum kiln_err (*destroy)(struct hv_vm *vm, struct kiln_error *err);	/* frees vm */
	/* optional: NULL where the driver cannot take VMs over */
	enum kiln_err (*adopt)(const char *state_dir, struct hv_vm **out, struct kiln_error *err);
	enum kiln_err (*snapshot_finish)(struct hv_vm *vm, const char *snap_dir, struct kiln_error *err);
	/* optional: a restore in two steps (vmm_restore_begin) */
	enum kiln_err (*restore_begin)(const struct vmm_spec *spec, const char *snap_dir,
				       enum vmm_mem_from from, struct hv_vm **out, struct kiln_error *err);
	enum kiln_err (*restore_end)(struct hv_vm *vm, const struct vmm_spec *spec, struct kiln_error *err);
	const char *(*agent_socket)(const struct hv_vm *vm);
	const char *(*serial_log)(const struct hv_vm *vm);
};

extern const struct hv_ops hv_qemu_ops;
extern const struct hv_ops hv_firecracker_ops;
extern const struct hv_ops hv_hostagent_ops;	/* a bench and test hook (vmm/hostagent.c) */

/* The driver called `name` ("qemu"), or NULL. */
const struct hv_ops *hv_find(const char *name);

/* Whole vCPUs the guest sees for `vcpu_milli` thousandths: ceil(vcpu_milli / 1000). */
unsigned vmm_vcpus_whole(unsigned vcpu_milli);

/*
 * Whether the guest kernel command line `cmdline` (NULL: none) turns init_on_free on (its last
 * word `init_on_free=` read as the kernel reads a boolean). Such a guest zeroes pages as it frees
 * them and so skips zeroing them on allocation: a page the balloon discards from a private map
 * of a shared image reads back as the image, not as zeros (vmm/qemu_memro.c), which it would take
 * as zeroed. kiln-node refuses it with free page reporting.
 */
bool vmm_cmdline_inits_on_free(const char *cmdline);

/* Memory cap of the VM's cgroup: guest memory plus the VMM's overhead, bytes. */
unsigned long long vmm_mem_limit_bytes(const struct vmm_spec *spec);

/* Checks the spec's fields and ranges; KILN_E_INVALID names the field. */
enum kiln_err vmm_spec_check(const struct vmm_spec *spec, struct kiln_error *err);

/* A VM under a driver. */
struct vmm_vm;

/*
 * A new VMM process, booted (vmm_create) or from a snapshot (vmm_restore). KILN_E_UNAVAILABLE:
 * the VMM started but did not answer within its start-up deadline (a busy host); nothing of the
 * VM is left and the same call may succeed later.
 */
enum kiln_err vmm_create(const char *driver, const struct vmm_spec *spec, struct vmm_vm **out,
			 struct kiln_error *err);
enum kiln_err vmm_restore(const char *driver, const struct vmm_spec *spec, const char *snap_dir,
			  enum vmm_mem_from from, struct vmm_vm **out, struct kiln_error *err);
/*
 * vmm_restore() in two steps, so that the VMM's start can come before the request it serves:
 * vmm_restore_begin() does all of it up to a VMM waiting for the snapshot's state (the memory
 * prepared or copying, the disk layer made, the VMM started in its jail and answering; vmm_status
 * says alive, not running); vmm_restore_end() loads the state and runs the VM. Given a `spec`,
 * the end renames the VM to it first: its id, run and state directories, memory file and cgroup
 * become the spec's (docs/vmm.md); the shape, node, uid and network must be the begin's, and the
 * VMM stays in the network namespace it was started in. On failure the end destroys the VM (`vm`
 * is freed). A VM begun and never ended is removed whole by vmm_destroy().
 * KILN_E_NOT_IMPLEMENTED: the driver cannot.
 */
enum kiln_err vmm_restore_begin(const char *driver, const struct vmm_spec *spec, const char *snap_dir,
				enum vmm_mem_from from, struct vmm_vm **out, struct kiln_error *err);
enum kiln_err vmm_restore_end(struct vmm_vm *vm, const struct vmm_spec *spec, struct kiln_error *err);
enum kiln_err vmm_pause(struct vmm_vm *vm, struct kiln_error *err);
enum kiln_err vmm_resume(struct vmm_vm *vm, struct kiln_error *err);
enum kiln_err vmm_snapshot(struct vmm_vm *vm, const char *snap_dir, enum vmm_snap_mode mode,
			   struct kiln_error *err);
enum kiln_err vmm_status(struct vmm_vm *vm, struct vmm_status *st, struct kiln_error *err);
enum kiln_err vmm_usage(struct vmm_vm *vm, struct cg_usage *u, struct kiln_error *err);
/* Kills the VMM, reaps it, removes its cgroup and files, frees `vm`. Accepts NULL. */
enum kiln_err vmm_destroy(struct vmm_vm *vm, struct kiln_error *err);
/*
 * Takes over the VM whose state dir is `state_dir`, left by an earlier run of the node (a node
 * killed or crashed; its VMMs outlive it). A VMM still alive is left running: a migration it was
 * in (a snapshot cut short) is waited for, and stopped vCPUs are continued. A VMM that has ended
 * gives a handle good for vmm_status, vmm_snapshot_finish and vmm_destroy. KILN_E_NOT_FOUND:
 * nothing to take over there; KILN_E_NOT_IMPLEMENTED: the driver cannot.
 */
enum kiln_err vmm_adopt(const char *driver, const char *state_dir, struct vmm_vm **out,
			struct kiln_error *err);
/*
 * Completes a VMM_SNAP_SHARED snapshot into `snap_dir` whose state file the VM's VMM wrote before
 * it ended (its node was killed inside vmm_snapshot): the memory image and disk layer are moved
 * in where they are still outside, and the manifest is written. Idempotent. KILN_E_NOT_FOUND when
 * the state was never completely written (then the snapshot cannot be finished).
 */
enum kiln_err vmm_snapshot_finish(struct vmm_vm *vm, const char *snap_dir, struct kiln_error *err);
/* Path of the agent channel's Unix socket (for vmm/agent.c); valid until vmm_destroy. */
const char *vmm_agent_socket(const struct vmm_vm *vm);
/*
 * Path of the guest's serial console log; valid until vmm_destroy. It holds the newest console
 * output; older output rotates once into "<path>.old" (see hv_console_start).
 */
const char *vmm_serial_log(const struct vmm_vm *vm);

/* --- for the drivers --- */

/*
 * The guest console's drain: a thread that reads `fd` (a stream the VMM writes the guest's serial
 * output to) without end until its EOF or hv_console_stop, so the guest never waits on the host,
 * and appends what it reads to `path`. The file never grows past max/2 bytes: when it would, it
 * is renamed over "<path>.old" and a new one begun, so at most `max` bytes are on disk and at
 * least the newest max/2 are kept (newest wins). Memory: one 64 KiB buffer. Takes `fd` (closed
 * also on failure). Returns 0 or -errno.
 */
struct hv_console;
int hv_console_start(int fd, const char *path, unsigned long long max, struct hv_console **out);
/* Stops the thread, closes its descriptors and frees `c`. Accepts NULL. */
void hv_console_stop(struct hv_console *c);
/*
 * Once the VMM has ended: waits (at most 2 s) for the thread to write what was still in the stream
 * and see its EOF, then stops it and frees `c`, so the log holds all the guest wrote. Accepts NULL.
 */
void hv_console_finish(struct hv_console *c);

#endif
