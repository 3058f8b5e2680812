/*
 * template.h - pre-booted templates: every new sandbox of a shape in use is a copy-on-write
 * restore of a VM that already booted, answered its agent and warmed Python (see template.c).
 */
#ifndef KILN_NODE_TEMPLATE_H
#define KILN_NODE_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

#include "node/node.h"

/* Retires the templates of an earlier run (or image) and starts building the default shape. */
void tpl_init(struct node *n);

/* Waits for template builds to end (they stop early once n->stopping is set). */
void tpl_exit(struct node *n);

/*
 * The ready template of a shape (of the code interpreter's image when `codeint`): its snapshot id into `out` and true, or false (and a build of it
 * starts in the background, so the next create of that shape is fast).
 */
bool tpl_lookup(struct node *n, unsigned vcpu_milli, unsigned mem_mib, unsigned disk_gib,
		bool codeint, char *out, size_t len);

/*
 * Waits at most `timeout_ms` for the base image's template of a shape, starting its build when
 * none runs: true once it is ready (a create then restores it), false when it is not (its build
 * failed or is still running, templates are off, the node is stopping). For a template build's
 * builder, which would otherwise boot cold beside the template's own boot.
 */
bool tpl_wait(struct node *n, unsigned vcpu_milli, unsigned mem_mib, unsigned disk_gib,
	      unsigned timeout_ms);

/* Marks a template broken (a restore from it failed): it is rebuilt on the next create. */
void tpl_discard(struct node *n, const char *snap_id);

/* Retires templates unused for `idle_s` seconds (their files go once nothing stands on them). */
void tpl_evict_idle(struct node *n, long idle_s);

/*
 * What builds one template of a shape on a build's thread: its snapshot's id into `snap` (of
 * AUTH_ID_MAX bytes), or an error (the template is not ready).
 */
typedef enum kiln_err tpl_make_fn(struct node *n, unsigned vcpu_milli, unsigned mem_mib,
				  unsigned disk_gib, bool codeint, char *snap,
				  struct kiln_error *err);

/*
 * Tests only: builds templates with `make` instead of booting a VM (NULL: the node's own again),
 * so that what waits for them and retires them runs without QEMU. Set while no build runs.
 */
void tpl_set_make_for_test(tpl_make_fn *make);

#endif
