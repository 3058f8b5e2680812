/*
 * s3_fuzz.c - libFuzzer target for common/s3.c's parsers of what a bucket answers: ListObjectsV2
 * pages (s3_list_parse), error bodies (<Code> through s3_xml_value to s3_error_of), the
 * multipart answers (<UploadId> of an initiate, <Code>/<ETag> of a complete) and s3_xml_value
 * itself with any tag and output size. A tenant points its storage at any endpoint it likes, so
 * every byte of these answers is hostile. Also the multipart upload's state file (s3_state_load),
 * read back from a memfd.
 *
 * Input: a mode byte, a second byte (an HTTP status, a tag and an output size), then the answer.
 * Oracle: no crash, leak or UB; every value copied out is terminated inside its buffer and no
 * longer than the answer; a listed key is within S3_KEY_MAX (prefix included) and its size a
 * real one (at most INT64_MAX); the continuation token fits; s3_error_of maps 2xx to KILN_OK
 * and anything else to an error.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/s3.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

struct listed {
	size_t len;	/* bytes of the answer */
	size_t plen;	/* bytes of the prefix */
	size_t n;	/* entries seen */
};

static enum kiln_err on_key(void *arg, const char *key, uint64_t size)
{
	struct listed *l = arg;
	size_t kl = strlen(key);

	l->n++;
	if (kl + l->plen > S3_KEY_MAX || kl > l->len) {
		fprintf(stderr, "s3 list: a key of %zu bytes from %zu bytes\n", kl, l->len);
		abort();
	}
	if (size > INT64_MAX) {
		fprintf(stderr, "s3 list: a size of %llu\n", (unsigned long long)size);
		abort();
	}
	/* every entry takes at least "<Contents><Key/><Size>0</Size></Contents>" (41 bytes) */
	if (l->n * 41 > l->len)
		abort();
	return l->n > 1000 ? KILN_E_TOO_LARGE : KILN_OK;	/* a callback's error is returned */
}

static void list(const char *xml, size_t len, const char *prefix)
{
	struct listed l = { .len = len, .plen = strlen(prefix) };
	struct kiln_error err = { 0 };
	char next[1024];
	enum kiln_err rc;

	memset(next, 'z', sizeof(next));
	rc = s3_list_parse(xml, len, prefix, on_key, &l, next, sizeof(next), &err);
	if (strnlen(next, sizeof(next)) == sizeof(next))
		abort();
	if (rc != KILN_OK && rc != KILN_E_INVALID && rc != KILN_E_NOMEM && rc != KILN_E_TOO_LARGE)
		abort();
	if (rc != KILN_OK && !err.msg[0] && rc != KILN_E_TOO_LARGE)
		abort();	/* the parser's own errors say why */
	if (rc == KILN_E_TOO_LARGE && l.n <= 1000)
		abort();
	if (rc == KILN_OK && strlen(next) > len)
		abort();
}

/* s3_xml_value into `n` bytes (n may be 0), checked. */
static void value(const char *xml, size_t len, const char *tag, size_t n)
{
	char *out = malloc(n ? n : 1);
	bool found;

	if (!out)
		return;
	if (n)
		memset(out, 'z', n);
	found = s3_xml_value(xml, len, tag, out, n);
	if (n) {
		size_t ol = strnlen(out, n);
		if (ol == n || ol > len)
			abort();
		if (!found && ol)
			abort();
	}
	free(out);
}

/* An upload state file of these bytes: what s3_state_load accepts is a usable state. */
static void state(const char *text, size_t len)
{
	struct s3_upload_state *st = NULL;
	struct kiln_error err = { 0 };
	char path[64];
	enum kiln_err rc;
	int fd = memfd_create("s3state", MFD_CLOEXEC);

	if (fd < 0)
		abort();
	if (write(fd, text, len) != (ssize_t)len)
		abort();
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	rc = s3_state_load(path, &st, &err);
	close(fd);
	if (rc != KILN_OK) {
		if (rc != KILN_E_INVALID && rc != KILN_E_NOMEM)
			abort();
		return;
	}
	if (st->nparts < 1 || st->nparts > S3_PARTS_MAX || st->part_size == 0 || !st->upload_id[0])
		abort();
	if (strnlen(st->endpoint, sizeof(st->endpoint)) == sizeof(st->endpoint) ||
	    strnlen(st->bucket, sizeof(st->bucket)) == sizeof(st->bucket) ||
	    strnlen(st->key, sizeof(st->key)) == sizeof(st->key) ||
	    strnlen(st->upload_id, sizeof(st->upload_id)) == sizeof(st->upload_id))
		abort();
	for (unsigned i = 0; i < st->nparts; i++)
		if (strnlen(st->etags[i], S3_ETAG_MAX + 1) > S3_ETAG_MAX)
			abort();
	s3_state_free(st);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static const char *const tags[] = {
		"Code", "Message", "UploadId", "ETag", "Key", "Size", "IsTruncated",
		"NextContinuationToken", "Contents", "Error",
	};
	const char *xml;
	uint8_t mode, arg;
	size_t len;

	if (size < 2)
		return 0;
	mode = data[0];
	arg = data[1];
	xml = (const char *)data + 2;
	len = size - 2;
	switch (mode % 5) {
	case 0:	/* a ListObjectsV2 page, with and without a prefix */
		list(xml, len, "");
		list(xml, len, "kiln/tn_1/");
		break;
	case 1: {	/* an error answer: HTTP status and <Code> (perform_once, answer_error) */
		static const long statuses[] = { 200, 204, 301, 400, 403, 404, 409, 429, 500, 503 };
		long status = statuses[arg % 10];
		char code[64];
		enum kiln_err e;

		value(xml, len, "Code", sizeof(code));
		s3_xml_value(xml, len, "Code", code, sizeof(code));
		e = s3_error_of(status, code);
		if ((status >= 200 && status < 300) != (e == KILN_OK))
			abort();
		if (e != KILN_OK && e != KILN_E_NOT_FOUND && e != KILN_E_INVALID &&
		    e != KILN_E_FORBIDDEN && e != KILN_E_UNAVAILABLE)
			abort();
		break;
	}
	case 2:	/* multipart: initiate's <UploadId>, complete's <Code> and <ETag> (mp_create, mp_complete) */
		value(xml, len, "UploadId", S3_UPLOAD_ID_MAX + 1);
		value(xml, len, "Code", 64);
		value(xml, len, "ETag", S3_ETAG_MAX + 1);
		break;
	case 3:	/* any tag, any output size (0 included) */
		value(xml, len, tags[arg % 10], arg / 10u);
		break;
	default:	/* the upload's state file */
		state(xml, len);
		break;
	}
	return 0;
}
