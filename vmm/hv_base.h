/*
 * hv_base.h - what the hypervisor drivers (qemu.c, firecracker.c) share behind struct hv_ops: the
 * VM's cgroup, its VMM process held by a pidfd (spawned into the cgroup through the jail, or taken
 * over by pid), killing and reaping that process, the last line of the VMM's log, and the JSON
 * records a driver keeps beside a VM or a snapshot (vm.json, manifest.json), written atomically.
 *
 * OS-facing functions return 0 or a negative errno; hv_base_cgroup returns enum kiln_err.
 */
#ifndef KILN_VMM_HV_BASE_H
#define KILN_VMM_HV_BASE_H

#include <jansson.h>
#include <stdbool.h>
#include <sys/types.h>

#include "common/err.h"
#include "vmm/hv.h"
#include "vmm/jail.h"

/* A VMM process. Zeroed then hv_proc_init: none. */
struct hv_proc {
	pid_t pid;		/* 0 when there is none, or once it has ended */
	int pidfd;		/* open while pid is set, else -1 */
	bool child;		/* our child: reaped with waitpid, so its exit status is known */
	int exit_status;	/* waitpid status of an ended child; 0 for a process not ours */
};

/* Sets `p` to no process. */
void hv_proc_init(struct hv_proc *p);

/*
 * Creates the VM's cgroup kiln/<node>/<id> under spec->cgroup_root with the spec's CPU share, its
 * memory cap (vmm_mem_limit_bytes) and `pids_max` tasks. KILN_E_IO/NOMEM naming the VM.
 */
enum kiln_err hv_base_cgroup(const struct vmm_spec *s, unsigned pids_max, struct cg **out,
			     struct kiln_error *err);

/*
 * Starts `argv` in the jail `j` (jail_spawn), in the cgroup j->cg before it runs anything, as our
 * child held by a pidfd. `p` must hold no process. 0 or -errno (nothing left running).
 */
int hv_proc_spawn(struct hv_proc *p, const struct jail *j, char *const argv[], char *const envp[]);

/*
 * Holds the running process `pid`, not our child (a VMM a jailer started, or one an earlier run of
 * the node left), by a pidfd from here on. `p` must hold no process. 0 or -errno (-ESRCH: gone).
 */
int hv_proc_open(struct hv_proc *p, pid_t pid);

/* True while the process runs; an ended one is reaped (a child) and forgotten. */
bool hv_proc_alive(struct hv_proc *p);

/* Waits up to `ms` (-1: no limit) for the process to end; true when it has (or there is none). */
bool hv_proc_ended(const struct hv_proc *p, int ms);

/*
 * Ends the process: SIGKILL through the pidfd unless it already ended, then reaps it. A child is
 * waited for until it is gone; a process not ours up to `wait_ms` (-1: no limit). Afterwards `p`
 * holds no process. Nothing to do when it holds none.
 */
void hv_proc_kill(struct hv_proc *p, int wait_ms);

/* Lets go of the process without ending it (closes the pidfd); `p` holds none afterwards. */
void hv_proc_release(struct hv_proc *p);

/*
 * The last line of the log file `path` (at most 150 bytes, control characters shown as '?'), or ""
 * when there is none. Points to a per-thread buffer, valid until the next call on the thread.
 */
const char *hv_base_log_tail(const char *path);

/*
 * Writes `doc` (json_dump_file `flags`) to `path` atomically: into "<path>.tmp", synced, then
 * renamed over `path`. A failure leaves `path` as it was and no temporary file. 0 or -errno.
 */
int hv_base_json_write(const char *path, const json_t *doc, size_t flags);

#endif
