/*
 * dashboard.h - the usage dashboard's files, embedded into kiln-gateway at build time
 * (api/dashboard/embed.cmake) and served by routes_dashboard.c (docs/dashboard.md).
 */
#ifndef KILN_API_DASHBOARD_H
#define KILN_API_DASHBOARD_H

#include <stddef.h>

struct dashboard_asset {
	const char *name;		/* "index.html", "dashboard.js", ... */
	const char *content_type;
	const unsigned char *data;
	size_t len;
};

extern const struct dashboard_asset dashboard_assets[];
extern const size_t dashboard_assets_count;

#endif
