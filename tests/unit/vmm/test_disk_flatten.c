/*
 * disk_flatten keeps what every layer of a chain holds: a base, three layers each writing its own
 * region (and one overwriting another's), flattened into one layer over the base, must read back
 * exactly as the chain did (qemu-img compare).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"
#include "vmm/disk.h"

static char dir[64];

/* Runs `cmd` with the shell in the test's directory; returns its exit status. */
static int sh(const char *cmd)
{
	char line[1024];

	snprintf(line, sizeof(line), "cd %s && %s", dir, cmd);
	return system(line);
}

static void flatten_keeps_every_layers_writes(void)
{
	char chain[3][128], top[128], tmp[128], cmp[512];
	const char *chain_ptrs[3];

	/* base (raw, jail name "base"), layer1 and layer2 (qcow2), top over layer2 */
	CHECK_INT(sh("qemu-img create -q -f raw base 8M && "
		     "qemu-io -f raw -c 'write -P 0x11 0 1M' base >/dev/null"), 0);
	CHECK_INT(sh("qemu-img create -q -f qcow2 -F raw -b base layer1 && "
		     "qemu-io -c 'write -P 0x22 1M 1M' layer1 >/dev/null"), 0);
	CHECK_INT(sh("qemu-img create -q -f qcow2 -F qcow2 -b layer1 layer2 && "
		     "qemu-io -c 'write -P 0x33 2M 1M' -c 'write -P 0x44 1M 512k' layer2 >/dev/null"), 0);
	CHECK_INT(sh("qemu-img create -q -f qcow2 -F qcow2 -b layer2 top && "
		     "qemu-io -c 'write -P 0x55 3M 1M' top >/dev/null && cp top top.orig"), 0);
	for (int k = 0; k < 3; k++) {
		snprintf(chain[k], sizeof(chain[k]), "%s/%s", dir, k == 0 ? "base" : k == 1 ? "layer1" : "layer2");
		chain_ptrs[k] = chain[k];
	}
	snprintf(top, sizeof(top), "%s/top", dir);
	snprintf(tmp, sizeof(tmp), "%s/flat.tmp", dir);
	CHECK_INT(disk_flatten(top, chain_ptrs, 3, tmp), 0);
	/* the flattened layer stands on the base alone and reads like the old chain */
	CHECK_INT(sh("qemu-img info top | grep -q 'backing file: base$'"), 0);
	snprintf(cmp, sizeof(cmp), "cd %s && qemu-img compare -q top.orig top", dir);
	CHECK_INT(system(cmp), 0);
	CHECK_INT(sh("qemu-io -c 'read -P 0x44 1M 512k' -c 'read -P 0x22 1536k 512k' "
		     "-c 'read -P 0x33 2M 1M' -c 'read -P 0x55 3M 1M' top | grep -c 'read ' | "
		     "grep -qx 4"), 0);
}

int main(void)
{
	char cmp[128];
	int rc;

	snprintf(dir, sizeof(dir), "/tmp/kiln-flatten-XXXXXX");
	if (!mkdtemp(dir))
		return 1;
	TEST(flatten_keeps_every_layers_writes);
	rc = test_summary();
	snprintf(cmp, sizeof(cmp), "rm -rf %s", dir);
	if (system(cmp) != 0)
		rc = 1;
	return rc;
}
