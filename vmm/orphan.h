/*
 * orphan.h - cleaning up the VMs a previous run of this kiln-node left behind.
 *
 * When kiln-node dies (crash, kill -9, host reboot without /run being cleared), its VMs' pieces
 * stay: QEMU processes in their cgroups, run directories with sockets and jail mount points, memory
 * files in /dev/shm, uid leases. On start, before it starts any VM of its own, kiln-node calls
 * vmm_orphans_cleanup() with a callback that claims the VMs it means to keep (e.g. a sandbox Postgres
 * says is running on this node at the current generation, which it re-adopts); everything else of
 * this node id is removed. Another node id's VMs on the same host are never touched.
 *
 * What belongs to VM <id> of node <node> (docs/vmm.md, "Runtime layout"):
 *   <run_root>/<node>/<id>/                        run dir: sockets, logs, jail/ (mount points)
 *   cgroup kiln/<node>/<id>                        v1: under cpu, cpuacct, memory and pids; v2: once
 *   /dev/shm/kiln-<node>-<id>.mem                  guest memory file
 *   <run_root>/uids/<uid> holding "<node>/<id>"    uid lease (vmm_lease_owner)
 */
#ifndef KILN_VMM_ORPHAN_H
#define KILN_VMM_ORPHAN_H

#include <stdbool.h>
#include <stddef.h>

#include "common/err.h"

#define VMM_RUN_ROOT_DEFAULT "/run/kiln"
#define VMM_MEM_DIR_DEFAULT "/dev/shm"
#define VMM_ORPHANS_MAX 4096	/* leftover VMs handled in one call (the uid range is 1000) */

/*
 * Writes the owner string a uid lease of VM `id` on node `node` holds, "<node>/<id>", into `out`
 * (`len` bytes): what kiln-node passes to jail_uid_alloc() as `owner`. Returns 0, or -ENAMETOOLONG.
 */
int vmm_lease_owner(const char *node, const char *id, char *out, size_t len);

/*
 * Finds every VM of node `node_id` left on this host: run dirs under `run_root`/<node_id>/ (NULL =
 * VMM_RUN_ROOT_DEFAULT), cgroups kiln/<node_id>/<id> under `cgroup_root` (NULL = /sys/fs/cgroup;
 * v1 controllers and the v2 tree, whichever exist), and uid leases in `run_root`/uids naming
 * "<node_id>/<id>". For each one that `keep_cb(ctx, id)` does not claim (NULL: claim none):
 *  - kills its processes with SIGKILL: each pid listed in its cgroup is pinned with a pidfd, and
 *    killed only while it is still in kiln/<node_id>/<id> (its /proc/PID/cgroup) and its
 *    /proc/PID/cmdline is a VMM's (qemu-system-*, firecracker) or names the VM's run dir; any other
 *    process found there is left alone, reported, and the VM is not counted as cleaned;
 *  - removes its cgroup directories, once empty;
 *  - unmounts anything still mounted under its run dir, then removes the run dir (without crossing
 *    into other file systems);
 *  - removes /dev/shm/kiln-<node_id>-<id>.mem, unless that name could also be another node's VM
 *    that exists (node and VM ids may contain '-');
 *  - releases its uid leases.
 * The per-VM state dir (disk layer) and snapshots are not touched: they may be needed to recover.
 *
 * Returns the number of VMs cleaned completely, or -1 when `node_id` is not a valid id (`err` says
 * so). When some VM could not be cleaned completely, the count excludes it and `err` holds the first
 * problem (err->code != KILN_OK); the rest are logged. Runs as root.
 */
int vmm_orphans_cleanup(const char *node_id, const char *run_root, const char *cgroup_root,
			bool (*keep_cb)(void *ctx, const char *id), void *ctx, struct kiln_error *err);

#endif
