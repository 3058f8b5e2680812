/*
 * imageref.h - a container image reference to pull from a registry, checked before anything is
 * contacted: `host[:port]/name[:tag][@sha256:<64 hex>]`, the grammar of the distribution spec
 * (docker/distribution's reference package), with the registry's host always written out.
 *
 * - host: a DNS name (labels of [A-Za-z0-9-], not starting or ending with '-', at most 253
 *   bytes), an IPv4 address, or an IPv6 address in brackets; `port` 1 to 65535.
 * - name: one or more components joined by '/', each [a-z0-9]+ with single '.', one or two '_',
 *   or runs of '-' between alphanumerics; at most 255 bytes.
 * - tag: [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}; digest: sha256 and 64 lowercase hex digits. Neither:
 *   the tag `latest`.
 *
 * The first component names a registry only when it holds '.' or ':' or is `localhost`, as Docker
 * reads it: `alpine:3.20` and `library/alpine` are refused (they would mean Docker Hub without
 * saying so); write `docker.io/library/alpine:3.20`.
 */
#ifndef KILN_IMAGEREF_H
#define KILN_IMAGEREF_H

#include "common/err.h"

#define IMAGEREF_MAX 512		/* bytes of a whole reference */
#define IMAGEREF_HOST_MAX 253
#define IMAGEREF_NAME_MAX 255
#define IMAGEREF_TAG_MAX 128

struct imageref {
	char host[IMAGEREF_HOST_MAX + 1];	/* as written; an IPv6 address without brackets */
	unsigned port;				/* 0: none written (443) */
	char name[IMAGEREF_NAME_MAX + 1];
	char tag[IMAGEREF_TAG_MAX + 1];		/* "" when a digest is given without a tag */
	char digest[72];			/* "sha256:<hex>" or "" */
	char registry[IMAGEREF_HOST_MAX + 9];	/* host[:port], brackets kept: the auth file's key */
	char canonical[800];			/* registry/name[:tag][@digest], what is pulled */
};

/*
 * Parses `s` into `out`. KILN_E_INVALID with a message naming the part that is wrong (the host,
 * the port, the name, the tag, the digest) otherwise; `out` is then unspecified.
 */
enum kiln_err imageref_parse(const char *s, struct imageref *out, struct kiln_error *err);

#endif
