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

/* Marks a template broken (a restore from it failed): it is rebuilt on the next create. */
void tpl_discard(struct node *n, const char *snap_id);

/* Retires templates unused for `idle_s` seconds (their files go once nothing stands on them). */
void tpl_evict_idle(struct node *n, long idle_s);

#endif
