/*
 * test_s3.c - common/s3.c without a server: URI encoding and path-style URLs, XML values and
 * error mapping, the checks of a tenant's settings, and the multipart state file.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/s3.h"
#include "test.h"

static char *url(const char *ep, const char *bucket, const char *key, const char *query)
{
	static char out[4096];
	struct buf b;

	buf_init(&b, sizeof(out) - 1);
	if (s3_url_build(&b, ep, bucket, key, query) != 0)
		snprintf(out, sizeof(out), "(error)");
	else
		snprintf(out, sizeof(out), "%s", b.data);
	buf_release(&b);
	return out;
}

static void test_uri_encode(void)
{
	struct buf b;

	buf_init(&b, 1024);
	CHECK_INT(s3_uri_encode(&b, "a-z_0.9~/ +&=é", true), 0);
	CHECK_STR(b.data, "a-z_0.9~/%20%2B%26%3D%C3%A9");
	buf_reset(&b);
	CHECK_INT(s3_uri_encode(&b, "p/x", false), 0);
	CHECK_STR(b.data, "p%2Fx");
	buf_release(&b);
	buf_init(&b, 4);
	CHECK(s3_uri_encode(&b, "abcdef", true) != 0);	/* over the cap */
	buf_release(&b);
}

static void test_url_build(void)
{
	CHECK_STR(url("http://127.0.0.1:9000", "bkt", "p/k 1", NULL), "http://127.0.0.1:9000/bkt/p/k%201");
	CHECK_STR(url("https://s3.example.com//", "bkt", "k", "uploads="),
		  "https://s3.example.com/bkt/k?uploads=");
	CHECK_STR(url("https://h/base/", "bkt", NULL, "list-type=2&prefix=a%2F"),
		  "https://h/base/bkt?list-type=2&prefix=a%2F");
	CHECK_STR(url("http://h", "bkt", "a", ""), "http://h/bkt/a");
}

static void test_xml_value(void)
{
	static const char err[] =
		"<?xml version=\"1.0\"?><Error><Code>SignatureDoesNotMatch</Code>"
		"<Message>a &amp; b &lt;c&gt; &quot;d&quot; &#39;e&#x27;</Message>"
		"<CodeX>no</CodeX><Empty/></Error>";
	char v[64];

	CHECK(s3_xml_value(err, strlen(err), "Code", v, sizeof(v)));
	CHECK_STR(v, "SignatureDoesNotMatch");
	CHECK(s3_xml_value(err, strlen(err), "Message", v, sizeof(v)));
	CHECK_STR(v, "a & b <c> \"d\" 'e'");
	CHECK(s3_xml_value(err, strlen(err), "CodeX", v, sizeof(v)));
	CHECK_STR(v, "no");
	CHECK(s3_xml_value(err, strlen(err), "Empty", v, sizeof(v)));
	CHECK_STR(v, "");
	CHECK(!s3_xml_value(err, strlen(err), "RequestId", v, sizeof(v)));
	CHECK_STR(v, "");
	/* Truncated bodies (error bodies are capped): no closing tag, no value. */
	CHECK(!s3_xml_value(err, 30, "Code", v, sizeof(v)));
	CHECK(!s3_xml_value(NULL, 0, "Code", v, sizeof(v)));
	/* A value longer than the room is cut, and terminated. */
	CHECK(s3_xml_value(err, strlen(err), "Code", v, 5));
	CHECK_STR(v, "Sign");
	/* Attributes on the element. */
	CHECK(s3_xml_value("<R><UploadId a=\"1\">u-1</UploadId></R>", 37, "UploadId", v, sizeof(v)));
	CHECK_STR(v, "u-1");
}

static void test_error_of(void)
{
	CHECK_INT(s3_error_of(200, ""), KILN_OK);
	CHECK_INT(s3_error_of(204, NULL), KILN_OK);
	CHECK_INT(s3_error_of(404, "NoSuchKey"), KILN_E_NOT_FOUND);
	CHECK_INT(s3_error_of(404, ""), KILN_E_NOT_FOUND);
	CHECK_INT(s3_error_of(404, "NoSuchBucket"), KILN_E_INVALID);
	CHECK_INT(s3_error_of(404, "NoSuchUpload"), KILN_E_NOT_FOUND);
	CHECK_INT(s3_error_of(403, "SignatureDoesNotMatch"), KILN_E_FORBIDDEN);
	CHECK_INT(s3_error_of(403, "InvalidAccessKeyId"), KILN_E_FORBIDDEN);
	CHECK_INT(s3_error_of(403, ""), KILN_E_FORBIDDEN);
	CHECK_INT(s3_error_of(400, "BadDigest"), KILN_E_INVALID);
	CHECK_INT(s3_error_of(400, "AuthorizationHeaderMalformed"), KILN_E_INVALID);
	CHECK_INT(s3_error_of(301, "PermanentRedirect"), KILN_E_INVALID);
	CHECK_INT(s3_error_of(503, "SlowDown"), KILN_E_UNAVAILABLE);
	CHECK_INT(s3_error_of(500, ""), KILN_E_UNAVAILABLE);
	CHECK_INT(s3_error_of(429, ""), KILN_E_UNAVAILABLE);
	CHECK_INT(s3_error_of(200, "InternalError"), KILN_OK);
}

static void test_checks(void)
{
	struct kiln_error e = { 0 };
	char big[S3_PREFIX_MAX + 2];

	CHECK_INT(s3_check_endpoint("https://s3.eu-west-1.amazonaws.com", NULL), KILN_OK);
	CHECK_INT(s3_check_endpoint("http://127.0.0.1:9000/", NULL), KILN_OK);
	CHECK_INT(s3_check_endpoint("http://[::1]:9000", NULL), KILN_OK);
	CHECK_INT(s3_check_endpoint("", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_endpoint("ftp://h", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_endpoint("file:///etc/passwd", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_endpoint("http://u:p@h", &e), KILN_E_INVALID);
	CHECK(strstr(e.msg, "endpoint") != NULL);
	CHECK_INT(s3_check_endpoint("http://h/?x=1", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_endpoint("http://h/#f", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_endpoint("http://h x", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_endpoint("http://", NULL), KILN_E_INVALID);

	CHECK_INT(s3_check_bucket("my-bucket.1", NULL), KILN_OK);
	CHECK_INT(s3_check_bucket("ab", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_bucket("Upper", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_bucket("-abc", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_bucket("a..b", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_bucket("192.168.1.1", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_bucket("a/b/c", NULL), KILN_E_INVALID);

	CHECK_INT(s3_check_region("auto", NULL), KILN_OK);
	CHECK_INT(s3_check_region("eu-west-1", NULL), KILN_OK);
	CHECK_INT(s3_check_region("", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_region("a:b", NULL), KILN_E_INVALID);	/* would break "aws:amz:<r>:s3" */

	CHECK_INT(s3_check_prefix("", NULL), KILN_OK);
	CHECK_INT(s3_check_prefix("tenants/acme/", NULL), KILN_OK);
	CHECK_INT(s3_check_prefix("/abs", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_prefix("a//b", NULL), KILN_E_INVALID);
	CHECK_INT(s3_check_prefix("a\nb", NULL), KILN_E_INVALID);
	memset(big, 'a', sizeof(big) - 1);
	big[sizeof(big) - 1] = '\0';
	CHECK_INT(s3_check_prefix(big, NULL), KILN_E_INVALID);

	kiln_error_clear(&e);
	CHECK_INT(s3_check_secret("has space", &e), KILN_E_INVALID);
	CHECK(strstr(e.msg, "secret_access_key") != NULL);
	CHECK(strstr(e.msg, "has space") == NULL);	/* never quoted */
	CHECK_INT(s3_check_secret("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", NULL), KILN_OK);
	CHECK_INT(s3_check_access_key_id("AKIAIOSFODNN7EXAMPLE", NULL), KILN_OK);
	CHECK_INT(s3_check_access_key_id("", NULL), KILN_E_INVALID);
}

static char *tmp_path(void)
{
	static char p[64];

	snprintf(p, sizeof(p), "/tmp/kiln-s3-state-XXXXXX");
	close(mkstemp(p));
	return p;
}

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");

	fputs(text, f);
	fclose(f);
}

static void test_state_roundtrip(void)
{
	struct s3_upload_state *st = s3_state_new(3), *back = NULL;
	struct kiln_error e = { 0 };
	char *p = tmp_path();

	CHECK(st != NULL);
	snprintf(st->endpoint, sizeof(st->endpoint), "http://127.0.0.1:9000/base");
	snprintf(st->bucket, sizeof(st->bucket), "bkt");
	snprintf(st->key, sizeof(st->key), "odd prefix/é/k+1 %%");
	st->size = 20ull << 20;
	st->mtime_ns = 1700000000123456789ll;
	st->part_size = 8u << 20;
	snprintf(st->upload_id, sizeof(st->upload_id), "VXBsb2FkIElE/+= x");
	snprintf(st->etags[0], S3_ETAG_MAX + 1, "\"0123abcd\"");
	snprintf(st->etags[2], S3_ETAG_MAX + 1, "\"ffff-3\"");
	CHECK_INT(s3_state_save(p, st, &e), KILN_OK);
	CHECK_INT(s3_state_load(p, &back, &e), KILN_OK);
	if (back) {
		CHECK_STR(back->endpoint, st->endpoint);
		CHECK_STR(back->bucket, "bkt");
		CHECK_STR(back->key, st->key);
		CHECK_STR(back->upload_id, st->upload_id);
		CHECK(back->size == st->size && back->mtime_ns == st->mtime_ns &&
		      back->part_size == st->part_size);
		CHECK_INT(back->nparts, 3);
		CHECK_STR(back->etags[0], "\"0123abcd\"");
		CHECK_STR(back->etags[1], "");
		CHECK_STR(back->etags[2], "\"ffff-3\"");
	}
	s3_state_free(back);
	s3_state_free(st);
	unlink(p);
	back = NULL;
	CHECK_INT(s3_state_load(p, &back, &e), KILN_E_NOT_FOUND);
	CHECK(back == NULL);
}

static void test_state_malformed(void)
{
	static const char *const bad[] = {
		"",
		"kiln-s3-upload 2\n",
		"kiln-s3-upload 1\nendpoint http://h\n",	/* torn */
		"kiln-s3-upload 1\nbucket b\nendpoint http://h\nkey k\nsize 1\nmtime_ns 1\n"
		"part_size 5\nnparts 1\nupload_id u\n",		/* order */
		"kiln-s3-upload 1\nendpoint http://h\nbucket b\nkey k\nsize 1\nmtime_ns 1\n"
		"part_size 5\nnparts 2\nupload_id u\npart 3 %22e%22\n",	/* part out of range */
		"kiln-s3-upload 1\nendpoint http://h\nbucket b\nkey k\nsize 1\nmtime_ns 1\n"
		"part_size 5\nnparts 0\nupload_id u\n",		/* no parts */
		"kiln-s3-upload 1\nendpoint http://h\nbucket b\nkey k\nsize x\nmtime_ns 1\n"
		"part_size 5\nnparts 1\nupload_id u\n",		/* size */
		"kiln-s3-upload 1\nendpoint http://h\nbucket b\nkey k%2\nsize 1\nmtime_ns 1\n"
		"part_size 5\nnparts 1\nupload_id u\n",		/* escape */
		"kiln-s3-upload 1\nendpoint http://h\nbucket b\nkey k%00\nsize 1\nmtime_ns 1\n"
		"part_size 5\nnparts 1\nupload_id u\n",		/* NUL */
		"kiln-s3-upload 1\nendpoint http://h\nbucket b\nkey k\nsize 1\nmtime_ns 1\n"
		"part_size 5\nnparts 99999\nupload_id u\n",	/* too many parts */
		"kiln-s3-upload 1\nendpoint http://h\nbucket b\nkey k\nsize 1\nmtime_ns 1\n"
		"part_size 5\nnparts 1\nupload_id u\npart 1\n",	/* no etag */
	};
	const char *good = "kiln-s3-upload 1\nendpoint http://h\nbucket b\nkey k\nsize 1\nmtime_ns 1\n"
			   "part_size 5\nnparts 1\nupload_id u\npart 1 %22e%22\n";
	struct s3_upload_state *st = NULL;
	char *p = tmp_path();

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct kiln_error e = { 0 };
		write_file(p, bad[i]);
		st = NULL;
		if (s3_state_load(p, &st, &e) != KILN_E_INVALID) {
			fprintf(stderr, "case %zu was accepted\n", i);
			CHECK(0);
		}
		CHECK(st == NULL);
		s3_state_free(st);
	}
	write_file(p, good);
	CHECK_INT(s3_state_load(p, &st, NULL), KILN_OK);
	if (st)
		CHECK_STR(st->etags[0], "\"e\"");
	s3_state_free(st);
	unlink(p);
}

static void test_client_refuses_a_bad_target(void)
{
	struct s3_target t;
	struct kiln_error e = { 0 };

	memset(&t, 0, sizeof(t));
	snprintf(t.endpoint, sizeof(t.endpoint), "http://127.0.0.1:1");
	snprintf(t.bucket, sizeof(t.bucket), "B");
	snprintf(t.region, sizeof(t.region), "us-east-1");
	snprintf(t.access_key_id, sizeof(t.access_key_id), "id");
	snprintf(t.secret_access_key, sizeof(t.secret_access_key), "secret");
	CHECK(s3_client_new(&t, NULL, &e) == NULL);
	CHECK_INT(e.code, KILN_E_INVALID);
	CHECK(strstr(e.msg, "bucket") != NULL);
	s3_target_wipe(&t);
	CHECK_STR(t.secret_access_key, "");
}

int main(void)
{
	TEST(test_uri_encode);
	TEST(test_url_build);
	TEST(test_xml_value);
	TEST(test_error_of);
	TEST(test_checks);
	TEST(test_state_roundtrip);
	TEST(test_state_malformed);
	TEST(test_client_refuses_a_bad_target);
	return test_summary();
}
