/*
 * warm.h - VMMs started ahead of the creates and resumes they serve (see warm.c).
 *
 * For each ready template (template.c) the node keeps `template_warm_vms` QEMUs begun on its
 * snapshot (vmm_restore_begin): started in their jail, the template's memory mapped, a disk layer
 * made, waiting for the state. A create from that template takes one (warm_take) and only loads
 * the state and runs it (sb_restore_warm), under the sandbox's names; another is begun a moment
 * after. The `paused_warm_vms` sandboxes paused last on the node get one each on their pause
 * snapshot, begun with an empty memory file of the guest's length (VMM_MEM_COPY_LATE), which
 * their resume takes: its memory image is copied in then. A warm VM is no sandbox: it holds no
 * capacity, no record, none of the guest's memory, no network but a namespace with its TAP, and
 * nothing of the guest runs in it.
 */
#ifndef KILN_NODE_WARM_H
#define KILN_NODE_WARM_H

#include <stdbool.h>
#include <sys/types.h>

#include "auth/apikey.h"
#include "netpolicy/netns.h"
#include "node/node.h"

struct warm_vm {
	char id[KILN_NET_ID_MAX + 1];	/* "0" + 12 base32 letters: never a sandbox's net id */
	char tpl[AUTH_ID_MAX];		/* the template's snapshot, or the paused sandbox's */
	unsigned vcpu_milli, mem_mib, disk_gib;
	bool codeint;
	bool paused;			/* on a pause snapshot: its memory copied in at the take */
	dev_t state_dev;		/* the snapshot's state file when the VMM was begun on it */
	ino_t state_ino;
	uid_t uid;
	bool has_uid;			/* its lease is the warm VM's (not yet a sandbox's) */
	bool has_net;			/* its namespace's name "kiln-<id>" exists */
	struct vmm_vm *vm;		/* begun, not ended; NULL once taken or gone */
	long long begun_ms;		/* CLOCK_MONOTONIC */
};

/*
 * Keeps warm VMs of the ready template `snap` (of a shape, of the code interpreter's image when
 * `codeint`) from now on, begun on a thread of their own. Nothing when template_warm_vms is 0,
 * templates are off or the hypervisor cannot begin a restore ahead.
 */
void warm_add(struct node *n, const char *snap, unsigned vcpu_milli, unsigned mem_mib,
	      unsigned disk_gib, bool codeint);

/*
 * Keeps a warm VM on the snapshot `snap` of a sandbox just paused (of its shape), for its resume;
 * the oldest such one is removed when paused_warm_vms are kept already. Nothing when
 * paused_warm_vms is 0 or the hypervisor cannot begin a restore ahead. It goes when its resume
 * takes it (warm_take), and by itself within WARM_CHECK_MS once the sandbox's record no longer
 * holds it paused here on that snapshot (deleted, resumed elsewhere) or the snapshot's files
 * changed.
 */
void warm_add_paused(struct node *n, const char *snap, unsigned vcpu_milli, unsigned mem_mib,
		     unsigned disk_gib);

/*
 * Stops keeping warm VMs of template `snap` and removes those it has, before its row is retired:
 * a warm VM taken after would make a sandbox on files snap_gc removes. A take that began before
 * goes on: its sandbox lists the template in its lineage.
 */
void warm_drop(struct node *n, const char *snap);

/*
 * A warm VM of template `snap`, or of the pause snapshot `snap` (then none is kept for it any
 * more), now the caller's (warm_free it after use); or NULL. Never one whose snapshot's state
 * file is no longer the one it was begun on.
 */
struct warm_vm *warm_take(struct node *n, const char *snap);

/*
 * Removes what is left of `w`: its VMM unless taken, its namespace (only that name, once a
 * sandbox's network took it over), its uid lease unless a sandbox adopted it, its directories.
 * Accepts NULL.
 */
void warm_free(struct node *n, struct warm_vm *w);

/* Ends the thread beginning warm VMs and removes every warm VM (the node is stopping). */
void warm_exit(struct node *n);

/*
 * Whether a directory name under the node's VM state root is a warm VM's: a node that died with
 * warm VMs removes their namespaces by it at its next start (recovery.c).
 */
bool warm_is_id(const char *name);

#endif
