/*
 * agent_fuzz.c - libFuzzer target for the host's decoding of what a guest sends: the incremental
 * frame decoder (vmm/guest/agent_proto.c) fed in uneven slices, then every payload decoder the
 * host client applies to a frame of that type, and the guest's reading of the optional user field
 * of a FILE_READ. Built and run briefly by tests/fuzz/CMakeLists.txt.
 *
 * Input: byte 0 picks the slice size (1..256 bytes), the rest is the stream from the "guest".
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vmm/guest/agent_proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint8_t payload[AGENT_MAX_PAYLOAD];

static void check_payload(const struct agent_hdr *h, const uint8_t *p)
{
	struct agent_hello_msg hello;
	struct agent_exit_msg ex;
	struct agent_error_msg em;
	uint64_t v;

	if (h->len > AGENT_MAX_PAYLOAD)
		abort();
	switch (h->type) {
	case AGENT_T_HELLO_OK:
		if (agent_parse_hello_ok(p, h->len, &hello) == 0 &&
		    (hello.kernel_release.len > 256 ||
		     memchr(hello.kernel_release.p, 0, hello.kernel_release.len)))
			abort();
		break;
	case AGENT_T_EXIT:
		if (agent_parse_exit(p, h->len, &ex) == 0 && (ex.exit_code < 0 || ex.exit_code > 255))
			abort();
		break;
	case AGENT_T_ERROR:
		if (agent_parse_error(p, h->len, &em) == 0 && em.message.len > AGENT_MAX_TEXT)
			abort();
		break;
	case AGENT_T_OK:
	case AGENT_T_FILE_END:
		agent_parse_u64(p, h->len, &v);
		break;
	case AGENT_T_PROC_ENTRY: {
		/* a process list entry: every string of its lists within the payload, none with NUL */
		struct agent_proc_entry_msg pe;
		struct agent_rd r;

		if (agent_parse_proc_entry(p, h->len, &pe) != 0)
			break;
		if (pe.tag.len > AGENT_MAX_TAG || pe.argc > AGENT_MAX_ARGS || pe.envc > AGENT_MAX_ENV ||
		    (pe.running && pe.exit_code != -1))
			abort();
		agent_rd_init(&r, pe.argv_raw.p, pe.argv_raw.len);
		for (uint32_t i = 0; i < pe.argc; i++) {
			struct agent_bytes b = agent_list_next(&r);

			if (r.bad || (b.len && memchr(b.p, 0, b.len)))
				abort();
		}
		if (!agent_rd_done(&r))
			abort();
		break;
	}
	case AGENT_T_FILE_READ: {
		/* the guest's reading of a host frame: str path, optional str user */
		struct agent_rd r;
		struct agent_bytes user;

		agent_rd_init(&r, p, h->len);
		agent_rd_text(&r, AGENT_MAX_PATH);
		if (agent_rd_user(&r, &user) && user.len &&
		    (user.len > AGENT_MAX_USER || !agent_user_ok((const char *)user.p, user.len)))
			abort();
		break;
	}
	default:
		break;
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct agent_decoder d;
	size_t off = 1, slice;

	if (size < 1)
		return 0;
	slice = (size_t)data[0] + 1;
	agent_decoder_init(&d, payload);
	while (off < size) {
		size_t n = size - off < slice ? size - off : slice, used = 0;
		int rc = agent_decoder_feed(&d, data + off, n, &used);

		if (used > n)
			abort();
		off += used;
		if (rc < 0)
			break;
		if (rc == 1)
			check_payload(&d.hdr, d.payload);
		else if (used == 0)
			abort();	/* no progress without a frame */
	}
	return 0;
}
