/*
 * test_agent_proto.c - unit tests of the agent wire codec (vmm/guest/agent_proto.c): header
 * round trip and validation, the incremental decoder over uneven slices, the bounded readers and
 * writers, and the decoders of the guest's replies.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"
#include "vmm/guest/agent_proto.h"

static uint8_t payload_buf[AGENT_MAX_PAYLOAD];

/* Builds a frame into `out`; returns its size. */
static size_t make_frame(uint8_t *out, uint8_t type, uint32_t id, const void *p, uint32_t len)
{
	struct agent_hdr h = { AGENT_PROTO_VERSION, type, 0, id, len };

	agent_hdr_encode(&h, out);
	memcpy(out + AGENT_HDR_SIZE, p, len);
	return AGENT_HDR_SIZE + len;
}

static void header_round_trip_keeps_every_field(void)
{
	struct agent_hdr h = { AGENT_PROTO_VERSION, AGENT_T_EXEC, 0x0001, 0xdeadbeef, 1234 }, g;
	uint8_t b[AGENT_HDR_SIZE];

	agent_hdr_encode(&h, b);
	CHECK(memcmp(b, "KLNA", 4) == 0);
	CHECK_INT(agent_hdr_decode(b, &g), 0);
	CHECK_INT(g.type, AGENT_T_EXEC);
	CHECK_INT(g.flags, 1);
	CHECK_INT(g.id, 0xdeadbeef);
	CHECK_INT(g.len, 1234);
}

static void header_rejects_bad_magic_version_type_and_size(void)
{
	struct agent_hdr h = { AGENT_PROTO_VERSION, AGENT_T_OK, 0, 1, 8 }, g;
	uint8_t b[AGENT_HDR_SIZE];

	agent_hdr_encode(&h, b);
	b[0] = 'X';
	CHECK_INT(agent_hdr_decode(b, &g), -EPROTO);
	agent_hdr_encode(&h, b);
	b[4] = 9;
	CHECK_INT(agent_hdr_decode(b, &g), -EPROTO);
	h.type = 0x7f;
	agent_hdr_encode(&h, b);
	CHECK_INT(agent_hdr_decode(b, &g), -EPROTO);
	h.type = AGENT_T_OK;
	h.len = AGENT_MAX_PAYLOAD + 1;
	agent_hdr_encode(&h, b);
	CHECK_INT(agent_hdr_decode(b, &g), -EMSGSIZE);
	h.len = AGENT_MAX_PAYLOAD;
	agent_hdr_encode(&h, b);
	CHECK_INT(agent_hdr_decode(b, &g), 0);
}

static void decoder_reassembles_frames_fed_byte_by_byte(void)
{
	uint8_t stream[256];
	size_t n = 0, off = 0;
	struct agent_decoder d;
	int frames = 0;

	n += make_frame(stream + n, AGENT_T_STDOUT, 7, "hello", 5);
	n += make_frame(stream + n, AGENT_T_OK, 8, "", 0);
	n += make_frame(stream + n, AGENT_T_STDERR, 9, "ab", 2);
	agent_decoder_init(&d, payload_buf);
	while (off < n) {
		size_t used;
		int rc = agent_decoder_feed(&d, stream + off, 1, &used);

		CHECK_INT(used, 1);
		off += used;
		if (rc == 1) {
			frames++;
			if (frames == 1) {
				CHECK_INT(d.hdr.id, 7);
				CHECK(memcmp(d.payload, "hello", 5) == 0);
			} else if (frames == 2) {
				CHECK_INT(d.hdr.type, AGENT_T_OK);
				CHECK_INT(d.hdr.len, 0);
			} else {
				CHECK_INT(d.hdr.id, 9);
			}
		}
	}
	CHECK_INT(frames, 3);
}

static void decoder_returns_each_frame_of_one_buffer(void)
{
	uint8_t stream[256];
	size_t n = 0, off = 0;
	struct agent_decoder d;
	int frames = 0;

	n += make_frame(stream + n, AGENT_T_STDOUT, 1, "x", 1);
	n += make_frame(stream + n, AGENT_T_STDOUT, 2, "yy", 2);
	agent_decoder_init(&d, payload_buf);
	while (off < n) {
		size_t used;
		int rc = agent_decoder_feed(&d, stream + off, n - off, &used);

		off += used;
		if (rc == 1)
			CHECK_INT(d.hdr.id, (uint32_t)++frames);
	}
	CHECK_INT(frames, 2);
}

static void decoder_error_is_sticky(void)
{
	uint8_t junk[32] = "this is not a frame at all......";
	struct agent_decoder d;
	size_t used;

	agent_decoder_init(&d, payload_buf);
	CHECK(agent_decoder_feed(&d, junk, sizeof(junk), &used) < 0);
	CHECK(agent_decoder_feed(&d, junk, sizeof(junk), &used) < 0);
	CHECK_INT(used, 0);
}

static void reader_fails_past_the_end_and_on_oversized_strings(void)
{
	uint8_t b[64];
	struct agent_wr w;
	struct agent_rd r;

	agent_wr_init(&w, b, sizeof(b));
	agent_wr_u32(&w, 42);
	agent_wr_str(&w, "abc");
	CHECK(!w.overflow);
	agent_rd_init(&r, b, w.len);
	CHECK_INT(agent_rd_u32(&r), 42);
	struct agent_bytes s = agent_rd_text(&r, 2);	/* 3 > max 2 */

	CHECK(r.bad);
	CHECK(s.p == NULL);
	CHECK_INT(agent_rd_u64(&r), 0);
	CHECK(!agent_rd_done(&r));

	/* A length prefix larger than what is left. */
	agent_wr_init(&w, b, sizeof(b));
	agent_wr_u32(&w, 1000);
	agent_rd_init(&r, b, w.len);
	agent_rd_bytes(&r, AGENT_MAX_PAYLOAD);
	CHECK(r.bad);
}

static void text_with_nul_is_rejected(void)
{
	uint8_t b[16];
	struct agent_wr w;
	struct agent_rd r;

	agent_wr_init(&w, b, sizeof(b));
	agent_wr_bytes(&w, "a\0b", 3);
	agent_rd_init(&r, b, w.len);
	agent_rd_text(&r, 100);
	CHECK(r.bad);
}

static void writer_counts_without_a_buffer_and_flags_overflow(void)
{
	uint8_t b[6];
	struct agent_wr w;

	agent_wr_init(&w, NULL, 0);
	agent_wr_str(&w, "hello");
	agent_wr_u64(&w, 1);
	CHECK_INT(w.len, 4 + 5 + 8);
	CHECK(!w.overflow);
	agent_wr_init(&w, b, sizeof(b));
	agent_wr_str(&w, "hello");
	CHECK(w.overflow);
}

static void exit_decoder_validates_fields(void)
{
	uint8_t b[32];
	struct agent_wr w;
	struct agent_exit_msg m;

	agent_wr_init(&w, b, sizeof(b));
	agent_wr_u32(&w, 127);
	agent_wr_u32(&w, 0);
	agent_wr_u8(&w, 1);
	agent_wr_u64(&w, 1500);
	CHECK_INT(agent_parse_exit(b, w.len, &m), 0);
	CHECK_INT(m.exit_code, 127);
	CHECK(m.timed_out);
	CHECK_INT(m.duration_ms, 1500);
	CHECK_INT(agent_parse_exit(b, w.len - 1, &m), -EBADMSG);	/* short */
	b[3] = 0xff;	/* exit code 255 still fine */
	CHECK_INT(agent_parse_exit(b, w.len, &m), 0);
	b[2] = 0x01;	/* 0x1ff: out of range */
	CHECK_INT(agent_parse_exit(b, w.len, &m), -EBADMSG);
	b[2] = 0;
	b[8] = 2;	/* timed_out must be 0 or 1 */
	CHECK_INT(agent_parse_exit(b, w.len, &m), -EBADMSG);
}

static void hello_and_error_decoders_reject_trailing_bytes(void)
{
	uint8_t b[128];
	struct agent_wr w;
	struct agent_hello_msg h;
	struct agent_error_msg e;

	agent_wr_init(&w, b, sizeof(b));
	agent_wr_u16(&w, 1);
	agent_wr_str(&w, "6.1.0-57-cloud-amd64");
	agent_wr_str(&w, "boot");
	agent_wr_str(&w, "kiln-agent/1");
	agent_wr_u64(&w, 99);
	CHECK_INT(agent_parse_hello_ok(b, w.len, &h), 0);
	CHECK_INT(h.kernel_release.len, 20);
	CHECK_INT(h.uptime_ms, 99);
	CHECK_INT(agent_parse_hello_ok(b, w.len + 1, &h), -EBADMSG);

	agent_wr_init(&w, b, sizeof(b));
	agent_wr_u32(&w, AGENT_S_NOT_FOUND);
	agent_wr_u32(&w, ENOENT);
	agent_wr_str(&w, "no such file");
	CHECK_INT(agent_parse_error(b, w.len, &e), 0);
	CHECK_INT(e.status, AGENT_S_NOT_FOUND);
	CHECK_INT(agent_parse_error(b, w.len - 1, &e), -EBADMSG);
}

static void path_hostname_and_env_checks(void)
{
	CHECK(agent_path_ok("/tmp/x", 6));
	CHECK(!agent_path_ok("tmp/x", 5));
	CHECK(!agent_path_ok("", 0));
	CHECK(!agent_path_ok("/a\0b", 4));
	CHECK(agent_hostname_ok("sbx-1.kiln", 10));
	CHECK(!agent_hostname_ok("-x", 2));
	CHECK(!agent_hostname_ok("a b", 3));
	CHECK(agent_env_ok("A=1", 3));
	CHECK(agent_env_ok("A=", 2));
	CHECK(!agent_env_ok("=1", 2));
	CHECK(!agent_env_ok("A", 1));
}

static void user_names_follow_the_gateways_rule(void)
{
	CHECK(agent_user_ok("user", 4));
	CHECK(agent_user_ok("_svc-1.x", 8));
	CHECK(agent_user_ok("abcdefghijklmnopqrstuvwxyz012345", 32));
	CHECK(!agent_user_ok("abcdefghijklmnopqrstuvwxyz0123456", 33));
	CHECK(!agent_user_ok("", 0));
	CHECK(!agent_user_ok("-x", 2));
	CHECK(!agent_user_ok("1x", 2));
	CHECK(!agent_user_ok("../etc", 6));
	CHECK(!agent_user_ok("a b", 3));
	CHECK(!agent_user_ok("a/b", 3));
	CHECK(!agent_user_ok("a\0b", 3));
	CHECK(!agent_user_ok("r\xc3\xb6ot", 5));
}

/* A FILE_READ payload: str path, then (when `user` is not NULL) str user. */
static size_t read_payload(uint8_t *b, size_t cap, const char *user)
{
	struct agent_wr w;

	agent_wr_init(&w, b, cap);
	agent_wr_str(&w, "/home/user/x");
	if (user)
		agent_wr_bytes(&w, user, strlen(user));
	return w.len;
}

static void optional_user_field_is_root_when_absent_and_checked_when_present(void)
{
	uint8_t b[128];
	struct agent_rd r;
	struct agent_bytes path, user;
	size_t n;

	/* an old host's frame: nothing after the path means root */
	n = read_payload(b, sizeof(b), NULL);
	agent_rd_init(&r, b, n);
	path = agent_rd_text(&r, AGENT_MAX_PATH);
	CHECK_INT(path.len, 12);
	CHECK(agent_rd_user(&r, &user));
	CHECK_INT(user.len, 0);
	CHECK(agent_rd_done(&r));

	n = read_payload(b, sizeof(b), "user");
	agent_rd_init(&r, b, n);
	agent_rd_text(&r, AGENT_MAX_PATH);
	CHECK(agent_rd_user(&r, &user));
	CHECK_INT(user.len, 4);
	CHECK(memcmp(user.p, "user", 4) == 0);
	CHECK(agent_rd_done(&r));

	/* a present but bad field is refused, never taken for root */
	const char *bad[] = { "", "-x", "a b", "abcdefghijklmnopqrstuvwxyz0123456", "../x" };

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		n = read_payload(b, sizeof(b), bad[i]);
		agent_rd_init(&r, b, n);
		agent_rd_text(&r, AGENT_MAX_PATH);
		CHECK(!agent_rd_user(&r, &user));
		CHECK_INT(user.len, 0);
		CHECK(!agent_rd_done(&r));
	}
	/* a user with NUL inside, a length past the payload, a cut length, bytes after the field */
	n = read_payload(b, sizeof(b), "us_r");
	b[n - 2] = '\0';
	agent_rd_init(&r, b, n);
	agent_rd_text(&r, AGENT_MAX_PATH);
	CHECK(!agent_rd_user(&r, &user));
	n = read_payload(b, sizeof(b), "user");
	agent_rd_init(&r, b, n - 1);
	agent_rd_text(&r, AGENT_MAX_PATH);
	CHECK(!agent_rd_user(&r, &user));
	agent_rd_init(&r, b, 16 + 2);
	agent_rd_text(&r, AGENT_MAX_PATH);
	CHECK(!agent_rd_user(&r, &user));
	n = read_payload(b, sizeof(b), "user");
	b[n] = 'x';
	agent_rd_init(&r, b, n + 1);
	agent_rd_text(&r, AGENT_MAX_PATH);
	CHECK(agent_rd_user(&r, &user));
	CHECK(!agent_rd_done(&r));
	/* a reader already bad stays bad */
	agent_rd_init(&r, b, 2);
	agent_rd_u32(&r);
	CHECK(!agent_rd_user(&r, &user));
}


/* Port streams: who may send which frame, the small decoders, the agent version. */
static void port_stream_types_and_versions(void)
{
	uint32_t v32;
	uint16_t v16;

	CHECK(agent_type_from_host(AGENT_T_PORT_OPEN) && !agent_type_from_guest(AGENT_T_PORT_OPEN));
	CHECK(agent_type_from_host(AGENT_T_STREAM_DATA) && agent_type_from_guest(AGENT_T_STREAM_DATA));
	CHECK(agent_type_from_host(AGENT_T_STREAM_WINDOW) &&
	      agent_type_from_guest(AGENT_T_STREAM_WINDOW));
	CHECK(agent_type_from_host(AGENT_T_STREAM_END) && agent_type_from_guest(AGENT_T_STREAM_END));
	CHECK(agent_parse_u32((const uint8_t *)"\0\1\0\0", 4, &v32) == 0 && v32 == 65536);
	CHECK(agent_parse_u32((const uint8_t *)"\0\1\0\0\0", 5, &v32) < 0);
	CHECK(agent_parse_u16((const uint8_t *)"\x1f\x90", 2, &v16) == 0 && v16 == 8080);
	CHECK(agent_parse_u16((const uint8_t *)"\x1f", 1, &v16) < 0);
	CHECK_INT(agent_version_major("kiln-agent/2"), 2);
	CHECK_INT(agent_version_major("kiln-agent/12"), 12);
	CHECK_INT(agent_version_major("kiln-agent/"), 0);
	CHECK_INT(agent_version_major("other/9"), 0);
	CHECK_INT(agent_version_major(""), 0);
}

/* Encodes a PROC_ENTRY with the given fields into buf; returns its length. */
static size_t proc_entry(uint8_t *buf, size_t cap, uint32_t pid, uint8_t running, int32_t code,
			 uint32_t argc, const char *const *argv, const char *extra, size_t extra_len)
{
	struct agent_wr w;

	agent_wr_init(&w, buf, cap);
	agent_wr_u32(&w, pid);
	agent_wr_u8(&w, running);
	agent_wr_u8(&w, 0);
	agent_wr_u32(&w, (uint32_t)code);
	agent_wr_str(&w, "tag");
	agent_wr_str(&w, "/home/user");
	agent_wr_u32(&w, argc);
	for (uint32_t i = 0; argv && argv[i]; i++)
		agent_wr_str(&w, argv[i]);
	agent_wr_u32(&w, 1);
	agent_wr_str(&w, "PATH");
	agent_wr_raw(&w, extra, extra_len);
	return w.len;
}

static void proc_entry_decoder_checks_every_field(void)
{
	uint8_t buf[512];
	const char *argv[] = { "/bin/sh", "-c", "echo hi", NULL };
	struct agent_proc_entry_msg m;
	struct agent_rd r;
	size_t n;

	n = proc_entry(buf, sizeof(buf), 42, 1, -1, 3, argv, NULL, 0);
	CHECK_INT(agent_parse_proc_entry(buf, n, &m), 0);
	CHECK_INT(m.pid, 42);
	CHECK_INT(m.running, 1);
	CHECK_INT(m.exit_code, -1);
	CHECK_INT(m.argc, 3);
	CHECK_INT(m.envc, 1);
	CHECK(m.tag.len == 3 && memcmp(m.tag.p, "tag", 3) == 0);
	agent_rd_init(&r, m.argv_raw.p, m.argv_raw.len);
	struct agent_bytes b = agent_list_next(&r);

	CHECK(b.len == 7 && memcmp(b.p, "/bin/sh", 7) == 0);
	agent_list_next(&r);
	b = agent_list_next(&r);
	CHECK(b.len == 7 && memcmp(b.p, "echo hi", 7) == 0);
	CHECK(agent_rd_done(&r));
	/* an ended one carries its code */
	n = proc_entry(buf, sizeof(buf), 42, 0, 137, 3, argv, NULL, 0);
	CHECK_INT(agent_parse_proc_entry(buf, n, &m), 0);
	CHECK_INT(m.exit_code, 137);
	/* trailing bytes, a running process with a code, a code out of range, pid 0, argc past
	   the strings, argc over the cap */
	n = proc_entry(buf, sizeof(buf), 42, 1, -1, 3, argv, "x", 1);
	CHECK_INT(agent_parse_proc_entry(buf, n, &m), -EBADMSG);
	n = proc_entry(buf, sizeof(buf), 42, 1, 0, 3, argv, NULL, 0);
	CHECK_INT(agent_parse_proc_entry(buf, n, &m), -EBADMSG);
	n = proc_entry(buf, sizeof(buf), 42, 0, 256, 3, argv, NULL, 0);
	CHECK_INT(agent_parse_proc_entry(buf, n, &m), -EBADMSG);
	n = proc_entry(buf, sizeof(buf), 0, 1, -1, 3, argv, NULL, 0);
	CHECK_INT(agent_parse_proc_entry(buf, n, &m), -EBADMSG);
	n = proc_entry(buf, sizeof(buf), 42, 1, -1, 9, argv, NULL, 0);
	CHECK_INT(agent_parse_proc_entry(buf, n, &m), -EBADMSG);
	n = proc_entry(buf, sizeof(buf), 42, 1, -1, AGENT_MAX_ARGS + 1, NULL, NULL, 0);
	CHECK_INT(agent_parse_proc_entry(buf, n, &m), -EBADMSG);
	n = proc_entry(buf, sizeof(buf), 42, 2, -1, 3, argv, NULL, 0);
	CHECK_INT(agent_parse_proc_entry(buf, n, &m), -EBADMSG);
}

static void proc_types_and_versions(void)
{
	uint8_t t[] = { AGENT_T_PROC_ATTACH, AGENT_T_PROC_LIST, AGENT_T_PROC_SIGNAL,
			AGENT_T_PROC_STDIN, AGENT_T_PROC_RESIZE };

	for (size_t i = 0; i < sizeof(t); i++) {
		CHECK(agent_type_from_host(t[i]));
		CHECK(!agent_type_from_guest(t[i]));
	}
	CHECK(agent_type_from_guest(AGENT_T_PROC_ENTRY));
	CHECK(!agent_type_from_host(AGENT_T_PROC_ENTRY));
	CHECK(agent_version_major("kiln-agent/2") < AGENT_PROCS_MIN_VERSION);
	CHECK(agent_version_major("kiln-agent/3") >= AGENT_PROCS_MIN_VERSION);
	CHECK(agent_version_major("kiln-agent/3") < AGENT_WATCH_MIN_VERSION);
}

int main(void)
{
	TEST(header_round_trip_keeps_every_field);
	TEST(header_rejects_bad_magic_version_type_and_size);
	TEST(decoder_reassembles_frames_fed_byte_by_byte);
	TEST(decoder_returns_each_frame_of_one_buffer);
	TEST(decoder_error_is_sticky);
	TEST(reader_fails_past_the_end_and_on_oversized_strings);
	TEST(text_with_nul_is_rejected);
	TEST(writer_counts_without_a_buffer_and_flags_overflow);
	TEST(exit_decoder_validates_fields);
	TEST(hello_and_error_decoders_reject_trailing_bytes);
	TEST(path_hostname_and_env_checks);
	TEST(user_names_follow_the_gateways_rule);
	TEST(optional_user_field_is_root_when_absent_and_checked_when_present);
	TEST(port_stream_types_and_versions);
	TEST(proc_entry_decoder_checks_every_field);
	TEST(proc_types_and_versions);
	return test_summary();
}
