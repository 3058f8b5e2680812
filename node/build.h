/*
 * build.h - template builds on this node (docs/templates.md): a version's build context arrives
 * as a tar streamed to disk, then a builder sandbox of the tenant runs the version's Dockerfile
 * through the agent and its memory and disk become the version's warm image (see build.c).
 */
#ifndef KILN_NODE_BUILD_H
#define KILN_NODE_BUILD_H

#include "common/http.h"
#include "node/node.h"

/*
 * PUT /v1/builds/{id}/source?version=N, the body: the build context of version N of template
 * {id} of `tenant`, which the gateway moved to building on this node. Written to a file of the
 * node chunk by chunk, at most template_source_max_bytes (KILN_E_TOO_LARGE past it);
 * KILN_E_NOT_FOUND when the version is not building here for the tenant.
 */
enum kiln_err build_source_sink(struct http_req *req, const char *tenant, const char *data,
				size_t len);

/*
 * The route's handler once the body ended: 202 and the build starts in the background, or the
 * error (the version goes back to pending: nothing changed).
 */
void build_source_done(struct http_req *req, const char *tenant);

/* Fails the builds an earlier run of this node left building (their builder VMs are gone). */
void build_init(struct node *n);

/*
 * Drops this node's cached layers (of `tenant`, or of every tenant when NULL) that no build will
 * use again: of a template since deleted, of another guest image than the node's, or whose
 * snapshot is deleted. Their files go in snap_gc once nothing stands on them.
 */
void build_layers_gc(struct node *n, const char *tenant);

/* Waits for the running builds to end (they stop early once n->stopping is set). */
void build_exit(struct node *n);

#endif
