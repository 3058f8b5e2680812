/*
 * accel.c - KVM or TCG, decided from /proc/cpuinfo (see accel.h for why not from /dev/kvm alone).
 */
#include "vmm/accel.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* True when the space-separated word list [s, end) contains `word`. */
static bool has_word(const char *s, const char *end, const char *word)
{
	size_t wl = strlen(word);

	while (s < end) {
		while (s < end && (*s == ' ' || *s == '\t'))
			s++;
		const char *w = s;

		while (s < end && *s != ' ' && *s != '\t')
			s++;
		if ((size_t)(s - w) == wl && memcmp(w, word, wl) == 0)
			return true;
	}
	return false;
}

bool accel_cpuinfo_has_hwvirt(const char *cpuinfo)
{
	const char *line = cpuinfo;

	while (line && *line) {
		const char *end = strchr(line, '\n');
		const char *colon;

		if (!end)
			end = line + strlen(line);
		colon = memchr(line, ':', (size_t)(end - line));
		if (strncmp(line, "flags", 5) == 0 && colon &&
		    (has_word(colon + 1, end, "vmx") || has_word(colon + 1, end, "svm")))
			return true;
		line = *end ? end + 1 : NULL;
	}
	return false;
}

enum accel accel_detect(void)
{
	FILE *f = fopen("/proc/cpuinfo", "re");
	char *line = NULL;
	size_t cap = 0;
	bool hw = false;
	int fd;

	if (!f)
		return ACCEL_TCG;
	while (!hw && getline(&line, &cap, f) > 0)
		hw = accel_cpuinfo_has_hwvirt(line);
	free(line);
	fclose(f);
	if (!hw)
		return ACCEL_TCG;
	fd = open("/dev/kvm", O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return ACCEL_TCG;
	close(fd);
	return ACCEL_KVM;
}

const char *accel_name(enum accel a)
{
	return a == ACCEL_KVM ? "kvm" : "tcg";
}

int accel_qemu_arg(enum accel a, unsigned tb_size_mib, char *out, size_t outlen)
{
	int n;

	if (a == ACCEL_KVM)
		n = snprintf(out, outlen, "kvm");
	else
		n = snprintf(out, outlen, "tcg,tb-size=%u", tb_size_mib ? tb_size_mib : ACCEL_TB_SIZE_DEFAULT);
	return n < 0 || (size_t)n >= outlen ? -ENOSPC : 0;
}

const char *accel_cpu_model(enum accel a)
{
	return a == ACCEL_KVM ? "host" : ACCEL_CPU_TCG;
}

const char *accel_cpu_legacy(enum accel a)
{
	return a == ACCEL_KVM ? "host" : ACCEL_CPU_TCG_LEGACY;
}

bool accel_cpu_valid(enum accel a, const char *cpu)
{
	return cpu && (strcmp(cpu, accel_cpu_model(a)) == 0 || strcmp(cpu, accel_cpu_legacy(a)) == 0);
}
