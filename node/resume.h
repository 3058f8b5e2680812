/*
 * resume.h - the resume of a paused sandbox on this node, from its pause snapshot here or, when
 * it was paused on another node, fetched from the tenant's bucket.
 */
#ifndef KILN_NODE_RESUME_H
#define KILN_NODE_RESUME_H

#include "node/node.h"

/*
 * Resumes the tenant's paused sandbox `id` on this node. KILN_OK: it runs here, recorded at its
 * next generation. Otherwise the code to reply with and `err` the message; the sandbox stays
 * paused, its snapshot whole.
 */
enum kiln_err resume_sandbox(struct node *n, const char *id, const char *tenant,
			     struct kiln_error *err);

#endif
