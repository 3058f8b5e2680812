/*
 * s3.h - a small S3 client over libcurl, for the tenants' own snapshot buckets (S3, R2, MinIO).
 *
 * Requests are signed by libcurl's SigV4 support (CURLOPT_AWS_SIGV4, "aws:amz:<region>:s3") and
 * addressed path-style (`<endpoint>/<bucket>/<key>`), which every S3-compatible service accepts.
 * Every body sent carries Content-MD5 and its real SHA-256 in x-amz-content-sha256 (so the
 * signature covers the payload even over plain HTTP). Responses that are parsed are read under a
 * hard cap; error bodies are truncated. No request follows a redirect or goes through a proxy.
 *
 * The endpoint is a tenant's choice, so where it leads is checked (common/netaddr.h): its host is
 * resolved once per client (again after a failure to connect) and every address must be public
 * and not this host's, unless the operator's allow list (s3_opts.allow) names the host or the
 * address; the checked addresses are then pinned for the client's connections (CURLOPT_RESOLVE),
 * and every socket is checked again before it connects, so a name that resolves elsewhere the
 * second time (DNS rebinding) gains nothing.
 *
 * Objects larger than one part are sent as a multipart upload (Content-MD5 on every part). The
 * upload's state (upload id, the ETags of the parts done) lives in a small file beside the local
 * file, `<path>.s3upload`, rewritten atomically after each part: a retry after a failure sends only
 * the parts still missing. A failure the service will not get over (credentials, a bad digest)
 * aborts the upload and removes the state; an unreachable service keeps both for the next try.
 *
 * Keys passed to the s3_* calls are relative to the target's prefix, which is prepended as it is
 * (a prefix "kiln/" gives "kiln/<key>"). Errors (enum kiln_err, message in `err`):
 *   KILN_E_UNAVAILABLE  the endpoint cannot be reached, timed out, or answered 5xx/SlowDown
 *   KILN_E_NOT_FOUND    no such key (404), or no such multipart upload
 *   KILN_E_FORBIDDEN    credentials refused (InvalidAccessKeyId, SignatureDoesNotMatch, AccessDenied)
 *   KILN_E_INVALID      the endpoint resolves to a refused address, or a bucket or request problem
 *                       (NoSuchBucket, wrong region, bad digest, a malformed answer)
 *   KILN_E_IO           the local file could not be read or written
 * Messages are `s3 <METHOD> "<key>": ` and one of a fixed set of phrases ("the bucket could not be
 * reached", "the bucket refused the credentials", …), followed by the S3 error code in parentheses
 * only when it is one this client knows. Nothing of the answer's body is repeated, and a closed
 * port reads as a silent one: a tenant cannot use the client to probe what answers where. The
 * details (curl's error, the HTTP status) go to the debug log. Messages never hold credentials.
 *
 * A client is not shared between threads; make one per thread (it is cheap). curl_global_init()
 * must have run before the first client is made (the daemons do it at start).
 */
#ifndef KILN_S3_H
#define KILN_S3_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "common/err.h"
#include "common/netaddr.h"

#define S3_ENDPOINT_MAX 2048	/* bytes of an endpoint URL */
#define S3_BUCKET_MIN 3
#define S3_BUCKET_MAX 63
#define S3_REGION_MAX 64
#define S3_PREFIX_MAX 512
#define S3_KEY_ID_MAX 256
#define S3_SECRET_MAX 256
#define S3_KEY_MAX 1024		/* bytes of a full object key (prefix included), as S3 allows */
#define S3_UPLOAD_ID_MAX 1024	/* bytes of a multipart upload id */
#define S3_ETAG_MAX 128		/* bytes of an ETag, quotes included */

#define S3_PART_MIN (5u << 20)		/* bytes: S3's smallest part (but the last) */
#define S3_PART_DEFAULT (8u << 20)	/* bytes */
#define S3_PARTS_MAX 10000		/* S3's most parts in one upload */

/* Where a tenant's objects go. The secret is wiped by s3_target_wipe(). */
struct s3_target {
	char endpoint[S3_ENDPOINT_MAX + 1];	/* http(s)://host[:port][/path] */
	char bucket[S3_BUCKET_MAX + 1];
	char region[S3_REGION_MAX + 1];
	char prefix[S3_PREFIX_MAX + 1];		/* may be "" */
	char access_key_id[S3_KEY_ID_MAX + 1];
	char secret_access_key[S3_SECRET_MAX + 1];
};

/* Overwrites the target (the secret above all). Accepts NULL. */
void s3_target_wipe(struct s3_target *t);

struct s3_opts {
	unsigned connect_timeout_ms;	/* 0: 5000 */
	unsigned request_timeout_s;	/* whole requests without a large body; 0: 60 */
	unsigned low_speed_s;		/* a body transfer under 1 KiB/s this long fails; 0: 30 */
	unsigned retries;		/* extra tries of a request on KILN_E_UNAVAILABLE */
	unsigned retry_delay_ms;	/* before the first retry, doubled after each; 0: 200 */
	size_t part_size;		/* bytes, >= S3_PART_MIN; 0: S3_PART_DEFAULT */
	const struct netaddr_allow *allow;	/* hosts and networks reached although private,
						   loopback or this host's (config storage_allow);
						   NULL: none. Must outlive the client. */
};

struct s3_client;

/*
 * Makes a client for `t` (copied; checked with s3_target_check) with `opts` (NULL: defaults,
 * 2 retries). Returns NULL with `err` set (KILN_E_INVALID, KILN_E_NOMEM). Free with s3_client_free.
 */
struct s3_client *s3_client_new(const struct s3_target *t, const struct s3_opts *opts,
				struct kiln_error *err);
/* Wipes the client's copy of the secret and frees it. Accepts NULL. */
void s3_client_free(struct s3_client *c);

/*
 * Resolves the endpoint's host now, checks every address it gives (netaddr_check with the
 * client's allow list) and pins them for the client's requests. The first request does it when
 * this was not called. KILN_E_INVALID naming the class of a refused address ("the endpoint's host
 * resolves to a loopback address, which is refused"), KILN_E_UNAVAILABLE when the name does not
 * resolve.
 */
enum kiln_err s3_client_resolve(struct s3_client *c, struct kiln_error *err);

/* What s3_put_file did: parts sent in this call and parts a resumed upload already had. */
struct s3_put_stats {
	unsigned parts;		/* of the object (1 for a single PUT) */
	unsigned parts_sent;
	unsigned parts_skipped;
	bool resumed;
	bool multipart;
};

/*
 * Called after each part of a multipart upload is stored (`sent` false for a part a resumed
 * upload already had). Returning anything but KILN_OK stops the upload there, state kept, and
 * s3_put_file returns that code: a node that shuts down resumes later.
 */
typedef enum kiln_err (*s3_part_cb)(void *arg, unsigned part, unsigned nparts, bool sent);

/*
 * Uploads the file at `path` as `key`, streamed from disk. A file of at most one part is one PUT;
 * a larger one a multipart upload resumed from `<path>.s3upload` when that state matches the
 * file (size, mtime), the target and the key. On KILN_OK the object is complete and the state file
 * is gone. `stats` and `cb` may be NULL.
 */
enum kiln_err s3_put_file(struct s3_client *c, const char *key, const char *path,
			  s3_part_cb cb, void *cb_arg, struct s3_put_stats *stats,
			  struct kiln_error *err);

/* Uploads `len` bytes of `data` as `key` in one PUT. */
enum kiln_err s3_put_data(struct s3_client *c, const char *key, const void *data, size_t len,
			  struct kiln_error *err);

/*
 * Downloads `key` into `path`, streamed: written to `<path>.part` (mode 0600), synced, then
 * renamed, so `path` is either absent or whole. KILN_E_NOT_FOUND when there is no such key.
 */
enum kiln_err s3_get_file(struct s3_client *c, const char *key, const char *path,
			  struct kiln_error *err);

struct s3_object_info {
	uint64_t size;			/* bytes */
	char etag[S3_ETAG_MAX + 1];
};

/* The size and ETag of `key`; KILN_E_NOT_FOUND when there is none. */
enum kiln_err s3_head(struct s3_client *c, const char *key, struct s3_object_info *info,
		      struct kiln_error *err);

/* Deletes `key`. A key that does not exist is not an error (as S3 itself answers). */
enum kiln_err s3_delete(struct s3_client *c, const char *key, struct kiln_error *err);

/*
 * Lists the keys under `prefix` (relative to the target's prefix, may be ""), calling `cb` with each
 * key (relative to the target's prefix) and its size; `cb` returns KILN_OK to go on. Pages through
 * ListObjectsV2 (each answer read under a 4 MiB cap).
 */
typedef enum kiln_err (*s3_list_cb)(void *arg, const char *key, uint64_t size);
enum kiln_err s3_list(struct s3_client *c, const char *prefix, s3_list_cb cb, void *arg,
		      struct kiln_error *err);

/*
 * Parses one ListObjectsV2 answer (`xml`, `len` bytes): calls `cb` for each <Contents> with its
 * <Key> less `prefix` and its <Size>, and sets `next` (`nnext` bytes) to the continuation token, or
 * "" on the last page. An entry without a Key or Size, a Key longer than S3_KEY_MAX or outside
 * `prefix`, a Size that is not a decimal number up to INT64_MAX, or a truncated page without a
 * token is KILN_E_INVALID ("s3 list: ..."); an error `cb` returns stops the parse and is returned.
 * `xml` may be NULL when `len` is 0. The parser of s3_list.
 */
enum kiln_err s3_list_parse(const char *xml, size_t len, const char *prefix, s3_list_cb cb,
			    void *arg, char *next, size_t nnext, struct kiln_error *err);

/* --- checks of a tenant's settings (the gateway's PUT /v1/storage uses them) --- */

/* Each returns KILN_OK or KILN_E_INVALID with a message naming the field and the rule. */
enum kiln_err s3_check_endpoint(const char *endpoint, struct kiln_error *err);
enum kiln_err s3_check_bucket(const char *bucket, struct kiln_error *err);
enum kiln_err s3_check_region(const char *region, struct kiln_error *err);
enum kiln_err s3_check_prefix(const char *prefix, struct kiln_error *err);
enum kiln_err s3_check_access_key_id(const char *id, struct kiln_error *err);
enum kiln_err s3_check_secret(const char *secret, struct kiln_error *err);
/* All of the above on `t`. */
enum kiln_err s3_target_check(const struct s3_target *t, struct kiln_error *err);

/* --- pure helpers, public for the unit tests --- */

/*
 * Appends `s` URI-encoded as SigV4 wants it: bytes other than A-Z a-z 0-9 - . _ ~ become %XX
 * (upper case); '/' stays when `keep_slash`. Returns 0 or a negative errno (buf_append's).
 */
int s3_uri_encode(struct buf *out, const char *s, bool keep_slash);

/*
 * Appends the path-style URL of `key` (already prefixed; NULL for the bucket itself) with the
 * canonical query `query` (NULL for none): `<endpoint without trailing '/'>/<bucket>/<key>?<q>`.
 */
int s3_url_build(struct buf *out, const char *endpoint, const char *bucket, const char *key,
		 const char *query);

/*
 * Copies the text of the first element `<tag>` of `xml` (`len` bytes) into `out` (`n` bytes, always
 * terminated), XML entities decoded and truncated to fit. Returns false when there is none.
 */
bool s3_xml_value(const char *xml, size_t len, const char *tag, char *out, size_t n);

/*
 * The kiln_err of an S3 answer: HTTP `status` and the error `code` of its body (may be "").
 * 2xx is KILN_OK.
 */
enum kiln_err s3_error_of(long status, const char *code);

/* The state of a multipart upload, as kept in `<path>.s3upload`. */
struct s3_upload_state {
	char endpoint[S3_ENDPOINT_MAX + 1];
	char bucket[S3_BUCKET_MAX + 1];
	char key[S3_KEY_MAX + 1];		/* full key */
	uint64_t size;				/* bytes of the local file */
	int64_t mtime_ns;			/* its modification time */
	uint64_t part_size;			/* bytes */
	char upload_id[S3_UPLOAD_ID_MAX + 1];
	unsigned nparts;
	char (*etags)[S3_ETAG_MAX + 1];		/* nparts entries; "" for a part not yet stored */
};

/* An empty state of `nparts` (1..S3_PARTS_MAX) parts; NULL when out of memory. */
struct s3_upload_state *s3_state_new(unsigned nparts);
void s3_state_free(struct s3_upload_state *st);

/*
 * Reads a state file. KILN_E_NOT_FOUND when there is none, KILN_E_INVALID when it is malformed
 * (a torn or foreign file: the caller starts afresh), KILN_E_IO otherwise. On KILN_OK the caller
 * frees *out with s3_state_free.
 */
enum kiln_err s3_state_load(const char *path, struct s3_upload_state **out, struct kiln_error *err);

/* Writes a state file atomically (temporary file, fsync, rename). KILN_OK or KILN_E_IO. */
enum kiln_err s3_state_save(const char *path, const struct s3_upload_state *st,
			    struct kiln_error *err);

#endif
