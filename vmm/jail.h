/*
 * jail.h - starting a VMM process inside its jail.
 *
 * The jail (docs/vmm.md, "Isolation"):
 *  - its own mount and pid namespaces (the VMM is PID 1 of its pid namespace), and the sandbox's
 *    network namespace when one is given;
 *  - a chroot directory holding only the VM's own files: each is bind-mounted onto an empty mount
 *    point inside the VM's mount namespace only, the directory itself is remounted nosuid, nodev,
 *    noexec;
 *  - no new privileges; the cgroup joined before the program runs;
 *  - an unprivileged uid/gid of its own, from a range leased per VM (jail_uid_alloc).
 * The chroot and the uid change are the VMM's own last steps (QEMU's -chroot and -runas): it opens
 * its kernel, disks, memory file, TAP and sockets as root first, then cannot reach anything else.
 * The VMM starts with the jail root as its working directory and names the files there relative
 * to it, so the same names stay valid after its chroot (QEMU reopens disk images by name when a
 * migration hands them over).
 *
 * OS-facing: functions return 0 or a negative errno.
 */
#ifndef KILN_VMM_JAIL_H
#define KILN_VMM_JAIL_H

#include <stdbool.h>
#include <sys/types.h>

#define JAIL_MOUNTS_MAX 12
#define JAIL_UID_MIN 64000	/* default range of per-VM uids (and gids, same number) */
#define JAIL_UID_MAX 64999
#define JAIL_LEASE_DIR "/run/kiln/uids"

struct cg;

struct jail_mount {
	const char *src;	/* host file to expose */
	const char *dst;	/* mount point, an existing empty file under the jail root */
	bool ro;
};

struct jail {
	const char *root;	/* the chroot directory, owned by root */
	int netns_fd;		/* an open network namespace to join, or -1 to keep the caller's */
	struct jail_mount mounts[JAIL_MOUNTS_MAX];
	unsigned n_mounts;
	struct cg *cg;		/* group to join before exec, or NULL */
	int out_fd;		/* receives the program's stdout and stderr; -1 for /dev/null */
	int keep_fd;		/* a descriptor the program keeps, under its own number, past exec
				   (above 2; any other value: none) */
};

/*
 * Creates the jail root (mode 0755, owned by root) and an empty mount point file for each mount.
 * Idempotent.
 */
int jail_prepare(const struct jail *j);

/*
 * Starts `argv` (argv[0] an absolute path) in the jail with environment `envp`. On success *pid is
 * the process id (a child of the caller, to be reaped with waitpid) and *pidfd (when not NULL) an
 * O_CLOEXEC pidfd the caller closes. Returns once the program is executing, or with the error that
 * stopped the jail's setup or exec (the half-started child is reaped).
 */
int jail_spawn(const struct jail *j, char *const argv[], char *const envp[], pid_t *pid, int *pidfd);

/* Removes the mount point files and the jail root (which must then be empty). */
int jail_cleanup(const struct jail *j);

/*
 * Leases a free uid in [lo, hi] by creating `lease_dir`/<uid> exclusively (the file holds
 * `owner`). The gid is the same number. Returns -EAGAIN when the range is exhausted.
 */
int jail_uid_alloc(const char *lease_dir, uid_t lo, uid_t hi, const char *owner, uid_t *uid);

/*
 * Gives the lease of `uid` a new `owner` (a VM started under one name that another takes over),
 * replacing the file whole: a reader sees the old owner or the new one, never a part. -ENOENT
 * when `uid` is not leased.
 */
int jail_uid_relabel(const char *lease_dir, uid_t uid, const char *owner);

/* Ends the lease of `uid`. */
int jail_uid_release(const char *lease_dir, uid_t uid);

#endif
