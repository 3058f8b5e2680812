/*
 * cgroup.h - one control group per VM, on cgroup v1 or v2, chosen at run time.
 *
 * A VM's group is kiln/<node>/<vm> under each controller: on v1 under the cpu, cpuacct, memory and
 * pids hierarchies (<root>/<controller>/kiln/<node>/<vm>), on v2 under the unified hierarchy. v2 is
 * used when the unified hierarchy offers the cpu and memory controllers (<root>/cgroup.controllers,
 * or <root>/unified/cgroup.controllers on a hybrid host); v1 otherwise. Both expose the same caps and
 * the same readings through cg_read(), which kiln-meter uses every second.
 *
 * OS-facing: functions return 0 or a negative errno.
 */
#ifndef KILN_VMM_CGROUP_H
#define KILN_VMM_CGROUP_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#define CG_ROOT_DEFAULT "/sys/fs/cgroup"
#define CG_CPU_PERIOD_US 100000	/* CFS period for fractional vCPU quotas */

enum cg_version { CG_V1 = 1, CG_V2 = 2 };

struct cg_limits {
	unsigned cpu_milli;	/* CPU cap in thousandths of a CPU; 0 = no cap */
	uint64_t mem_bytes;	/* memory cap; 0 = no cap */
	unsigned pids;		/* process/thread cap; 0 = no cap */
};

struct cg_usage {
	uint64_t cpu_ns;	/* CPU time used since the group was created */
	uint64_t mem_bytes;	/* memory charged now */
	uint64_t mem_peak_bytes;	/* highest memory charged; valid when has_peak */
	bool has_peak;
};

struct cg;

/*
 * Detects the cgroup version under `root` (NULL for CG_ROOT_DEFAULT). Returns CG_V1 or CG_V2, or a
 * negative errno when neither is usable.
 */
int cg_detect(const char *root);

/*
 * Creates the group kiln/<node>/<name> (its parents as needed) under `root` (NULL for the default)
 * and applies `lim`. An existing group of that name is reused. On success *out is a handle the
 * caller releases with cg_destroy() (removes the group) or cg_free() (keeps it).
 */
int cg_create(const char *root, const char *node, const char *name, const struct cg_limits *lim,
	      struct cg **out);

/* Opens the existing group kiln/<node>/<name> without changing it (e.g. after a restart). */
int cg_open(const char *root, const char *node, const char *name, struct cg **out);

/*
 * Renames the group to kiln/<node>/<name> under every controller, with what runs in it and what
 * it was charged (rename(2) of the directories, which cgroupfs allows within their parent).
 * Files cg_read() keeps open stay valid. On failure the group keeps its old name. 0 or -errno
 * (-EEXIST/-ENOTEMPTY: a group of that name exists).
 */
int cg_rename(struct cg *cg, const char *name);

/* Moves process `pid` (all its threads) into the group. */
int cg_attach(struct cg *cg, pid_t pid);

/*
 * Reads the group's usage. Memory peak is filled where the kernel keeps it. The files read stay
 * open in the handle for the next read (up to half the process's descriptor limit), each opened
 * again by path when the group was removed since.
 */
int cg_read(struct cg *cg, struct cg_usage *u);

/*
 * Reads the group's CPU cap back: *quota_us and *period_us (quota -1 when uncapped).
 */
int cg_read_cpu_quota(const struct cg *cg, long long *quota_us, long long *period_us);

/* True when `pid` is a member of the group. */
bool cg_has_pid(const struct cg *cg, pid_t pid);

/*
 * Kills every process left in the group (SIGKILL), waits up to about two seconds for it to
 * empty, removes the group and frees the handle. Accepts NULL. Returns 0, or a negative errno if a
 * directory could not be removed (the handle is freed anyway).
 */
int cg_destroy(struct cg *cg);

/* Frees the handle and leaves the group in place. Accepts NULL. */
void cg_free(struct cg *cg);

enum cg_version cg_version(const struct cg *cg);

/*
 * The group's directory for `controller` ("cpu", "cpuacct", "memory", "pids"; on v2 every
 * controller gives the one directory). NULL for an unknown controller.
 */
const char *cg_dir(const struct cg *cg, const char *controller);

#endif
