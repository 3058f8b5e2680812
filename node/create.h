/*
 * create.h - the create of a sandbox on this node: its capacity, its record under the tenant's
 * plan, and its VM (from a named snapshot, a template, or booted cold).
 */
#ifndef KILN_NODE_CREATE_H
#define KILN_NODE_CREATE_H

#include "node/node.h"
#include "node/secrets.h"

/* A create as the route parsed it. */
struct create_req {
	const char *id;
	const char *tenant_id;
	const char *template_name;
	const char *metadata;		/* JSON object text */
	const char *from_snap;		/* a named snapshot of the tenant on this node, or NULL */
	unsigned vcpu_milli, mem_mib;	/* ignored with from_snap: the snapshot's */
	unsigned disk_gib;		/* with from_snap: at least the snapshot's (else 422) */
	long long timeout_s;
	struct sb_init init;
	struct secrets_set *secrets;	/* checked against init.egress, or NULL (node/secrets.h) */
	bool own_memory;		/* a template's builder: restored into a memory file of its
					   own (VMM_MEM_COPY), never a private map, so that its
					   snapshots keep memory in a file a create maps */
};

/*
 * Creates sandbox r->id and starts it. KILN_OK: it runs and is recorded running. Otherwise the
 * code to reply with and `err` the message; nothing of it is left on this node, and its record,
 * if one was made, is recorded as a failed create (gone for the user).
 */
enum kiln_err create_sandbox(struct node *n, const struct create_req *r, struct kiln_error *err);

/*
 * The node's own disk admission of `disk_gib` more GiB of guest disk, inside the transaction that
 * records the new sandboxes (create, fork): under a per-node lock held to the end of it (so
 * creates and forks on this node are admitted one after the other), the disk_gib of the node's
 * live sandboxes (creating, running, or paused: a paused one resumes here into a new layer of its
 * full size) plus `disk_gib` must fit n->disk_gib. KILN_E_NO_CAPACITY naming the disk when not.
 */
enum kiln_err create_disk_admit(struct node *n, struct pg_conn *c, unsigned long long disk_gib,
				struct kiln_error *err);

#endif
