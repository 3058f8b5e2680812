/*
 * fuzz_rules.c - libFuzzer target for the egress rule parser: one rule per input line, parsed
 * alone and as a set; every accepted rule must format to text that parses back to the same rule.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "netpolicy/rules.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size > 8192)
		return 0;
	char *buf = malloc(size + 1);
	if (!buf)
		return 0;
	memcpy(buf, data, size);
	buf[size] = '\0';
	const char *lines[64];
	size_t n = 0;
	for (char *p = buf, *nl; n < 64; p = nl + 1) {
		lines[n++] = p;
		nl = strchr(p, '\n');
		if (!nl)
			break;
		*nl = '\0';
	}
	for (size_t i = 0; i < n; i++) {
		struct kiln_rule r, back;
		if (kiln_rule_parse(lines[i], &r, NULL) != KILN_OK)
			continue;
		char text[KILN_RULE_TEXT_MAX];
		if (kiln_rule_format(&r, text, sizeof(text)) < 0)
			abort();
		if (kiln_rule_parse(text, &back, NULL) != KILN_OK || !kiln_rule_equal(&r, &back))
			abort();
		uint16_t ports[8];
		kiln_rules_match_host(&(struct kiln_ruleset){.n = 1, .rules = &r}, lines[i], ports, 8);
	}
	struct kiln_ruleset rs;
	struct kiln_error err = {0};
	if (kiln_rules_parse(lines, n, &rs, &err) == KILN_OK)
		kiln_ruleset_free(&rs);
	free(buf);
	return 0;
}
