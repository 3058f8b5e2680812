/*
 * fuzz_dns.c - libFuzzer target for the DNS proxy's parser: the input is tried as a query and as
 * an answer to a fixed question.
 */
#include <stdint.h>
#include <string.h>

#include "netpolicy/dns.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct kiln_dns_question q;
	if (kiln_dns_parse_query(data, size, &q) == 0) {
		uint8_t out[KILN_DNS_MAX_MSG];
		kiln_dns_make_error(data, q.end, 3, out, sizeof(out));
	}
	struct kiln_dns_question fixed = {.qtype = 1, .qclass = 1};
	strcpy(fixed.name, "a.example.com");
	struct kiln_dns_addr addrs[8];
	int rcode;
	kiln_dns_parse_answer(data, size, &fixed, addrs, 8, &rcode);
	return 0;
}
