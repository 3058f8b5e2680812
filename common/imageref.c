/*
 * imageref.c - container image references (imageref.h): a pure parser, no I/O.
 */
#include "common/imageref.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool lower_alnum(char c)
{
	return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
}

/* A DNS name: labels of letters, digits and '-', none empty, none starting or ending with '-'. */
static bool dns_name_ok(const char *s, size_t len)
{
	size_t label = 0;

	if (len == 0 || len > IMAGEREF_HOST_MAX)
		return false;
	for (size_t i = 0; i < len; i++) {
		char c = s[i];

		if (c == '.') {
			if (label == 0 || s[i - 1] == '-')
				return false;
			label = 0;
		} else if (isalnum((unsigned char)c) || c == '-') {
			if (label == 0 && c == '-')
				return false;
			if (++label > 63)
				return false;
		} else {
			return false;
		}
	}
	return label > 0 && s[len - 1] != '-';
}

/* One path component: [a-z0-9]+ ((\.|_|__|-+)[a-z0-9]+)* */
static bool component_ok(const char *s, size_t len)
{
	size_t i = 0;

	if (len == 0 || !lower_alnum(s[0]) || !lower_alnum(s[len - 1]))
		return false;
	while (i < len) {
		if (lower_alnum(s[i])) {
			i++;
			continue;
		}
		if (s[i] == '.' || s[i] == '_') {
			size_t run = 0;
			char c = s[i];

			while (i < len && s[i] == c)
				run++, i++;
			if (run > (c == '_' ? 2u : 1u))
				return false;
		} else if (s[i] == '-') {
			while (i < len && s[i] == '-')
				i++;
		} else {
			return false;
		}
		if (i >= len || !lower_alnum(s[i]))
			return false;
	}
	return true;
}

static bool tag_ok(const char *s)
{
	size_t len = strlen(s);

	if (len == 0 || len > IMAGEREF_TAG_MAX || !(isalnum((unsigned char)s[0]) || s[0] == '_'))
		return false;
	for (size_t i = 1; i < len; i++)
		if (!isalnum((unsigned char)s[i]) && s[i] != '_' && s[i] != '.' && s[i] != '-')
			return false;
	return true;
}

static bool digest_ok(const char *s)
{
	if (strncmp(s, "sha256:", 7) != 0 || strlen(s) != 7 + 64)
		return false;
	for (const char *p = s + 7; *p; p++)
		if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f')))
			return false;
	return true;
}

/* host[:port] of `s` (`len` bytes) into out. */
static enum kiln_err parse_registry(const char *s, size_t len, struct imageref *out,
				    struct kiln_error *err)
{
	const char *port = NULL;
	size_t hlen = len;

	if (s[0] == '[') {
		const char *close = memchr(s, ']', len);
		char a[64];
		unsigned char bin[16];

		if (!close || (size_t)(close - s) - 1 >= sizeof(a))
			return kiln_error_set(err, KILN_E_INVALID, "image: the registry's host is not "
					      "a valid IPv6 address");
		memcpy(a, s + 1, (size_t)(close - s) - 1);
		a[close - s - 1] = '\0';
		if (inet_pton(AF_INET6, a, bin) != 1)
			return kiln_error_set(err, KILN_E_INVALID, "image: the registry's host is not "
					      "a valid IPv6 address");
		snprintf(out->host, sizeof(out->host), "%s", a);
		hlen = (size_t)(close - s) + 1;
		if (hlen < len && s[hlen] != ':')
			return kiln_error_set(err, KILN_E_INVALID, "image: the registry's host is not "
					      "a valid IPv6 address");
		port = hlen < len ? s + hlen + 1 : NULL;
	} else {
		const char *colon = memchr(s, ':', len);

		if (colon) {
			hlen = (size_t)(colon - s);
			port = colon + 1;
		}
		if (!dns_name_ok(s, hlen))
			return kiln_error_set(err, KILN_E_INVALID,
					      "image: the registry's host is not a valid host name or "
					      "address");
		memcpy(out->host, s, hlen);
		out->host[hlen] = '\0';
	}
	if (port) {
		size_t plen = len - (size_t)(port - s);
		unsigned long v = 0;

		if (plen == 0 || plen > 5)
			return kiln_error_set(err, KILN_E_INVALID, "image: the registry's port must "
					      "be 1 to 65535");
		for (size_t i = 0; i < plen; i++) {
			if (port[i] < '0' || port[i] > '9')
				return kiln_error_set(err, KILN_E_INVALID, "image: the registry's port "
						      "must be 1 to 65535");
			v = v * 10 + (unsigned long)(port[i] - '0');
		}
		if (v < 1 || v > 65535)
			return kiln_error_set(err, KILN_E_INVALID, "image: the registry's port must "
					      "be 1 to 65535");
		out->port = (unsigned)v;
	}
	snprintf(out->registry, sizeof(out->registry), "%.*s", (int)len, s);
	return KILN_OK;
}

enum kiln_err imageref_parse(const char *s, struct imageref *out, struct kiln_error *err)
{
	const char *slash, *at, *rest, *colon;
	char path[IMAGEREF_MAX + 1];
	size_t len;
	enum kiln_err rc;

	memset(out, 0, sizeof(*out));
	if (!s || !*s)
		return kiln_error_set(err, KILN_E_INVALID, "image: a reference is required");
	len = strlen(s);
	if (len > IMAGEREF_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "image: longer than %d bytes", IMAGEREF_MAX);
	slash = strchr(s, '/');
	if (!slash || !(memchr(s, '.', (size_t)(slash - s)) || memchr(s, ':', (size_t)(slash - s)) ||
			((size_t)(slash - s) == 9 && strncmp(s, "localhost", 9) == 0) || s[0] == '['))
		return kiln_error_set(err, KILN_E_INVALID,
				      "image: the reference must name its registry, as in "
				      "docker.io/library/alpine:3.20");
	rc = parse_registry(s, (size_t)(slash - s), out, err);
	if (rc != KILN_OK)
		return rc;
	rest = slash + 1;
	at = strchr(rest, '@');
	if (at) {
		if (!digest_ok(at + 1))
			return kiln_error_set(err, KILN_E_INVALID,
					      "image: the digest must be sha256: and 64 lowercase hex "
					      "digits");
		snprintf(out->digest, sizeof(out->digest), "%s", at + 1);
	}
	len = at ? (size_t)(at - rest) : strlen(rest);
	memcpy(path, rest, len);
	path[len] = '\0';
	/* a tag follows the last ':' after the last '/' */
	colon = strrchr(path, ':');
	if (colon && !strchr(colon, '/')) {
		if (!tag_ok(colon + 1))
			return kiln_error_set(err, KILN_E_INVALID,
					      "image: the tag must be 1 to 128 of A-Z a-z 0-9 _ . - "
					      "(not starting with . or -)");
		snprintf(out->tag, sizeof(out->tag), "%s", colon + 1);
		path[colon - path] = '\0';
	}
	if (strlen(path) > IMAGEREF_NAME_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "image: the name is longer than %d bytes",
				      IMAGEREF_NAME_MAX);
	for (char *c = path, *end; ; c = end + 1) {
		end = strchr(c, '/');
		if (!component_ok(c, end ? (size_t)(end - c) : strlen(c)))
			return kiln_error_set(err, KILN_E_INVALID,
					      "image: the name must be lowercase components of a-z 0-9 "
					      "joined by / (with . _ __ or - inside a component)");
		if (!end)
			break;
	}
	memcpy(out->name, path, strlen(path) + 1);	/* at most IMAGEREF_NAME_MAX, checked above */
	if (!out->tag[0] && !out->digest[0])
		snprintf(out->tag, sizeof(out->tag), "latest");
	snprintf(out->canonical, sizeof(out->canonical), "%s/%s%s%s%s%s", out->registry, out->name,
		 out->tag[0] ? ":" : "", out->tag, out->digest[0] ? "@" : "", out->digest);
	return KILN_OK;
}
