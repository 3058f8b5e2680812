/*
 * accel.c - KVM or TCG, decided from /proc/cpuinfo (see accel.h for why not from /dev/kvm alone).
 */
#include "vmm/accel.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

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

#if defined(__x86_64__) || defined(__i386__)
/*
 * One (TSC, CLOCK_MONOTONIC) pair read within a few microseconds of each other, so a preemption
 * between the two reads does not skew it; false when none of a few tries was that close.
 */
static bool tsc_pair(uint64_t *tsc, int64_t *ns)
{
	for (int i = 0; i < 32; i++) {
		struct timespec ts;
		uint64_t a = __rdtsc(), b;

		clock_gettime(CLOCK_MONOTONIC, &ts);
		b = __rdtsc();
		if (b - a < 20000) {
			*tsc = a + (b - a) / 2;
			*ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
			return true;
		}
	}
	return false;
}

/* The TSC's rate over 50 ms, in kHz; 0 when it could not be read. */
static unsigned tsc_rate_once(void)
{
	const struct timespec gap = { 0, 50 * 1000 * 1000 };
	uint64_t t0, t1;
	int64_t n0, n1;

	if (!tsc_pair(&t0, &n0))
		return 0;
	nanosleep(&gap, NULL);
	if (!tsc_pair(&t1, &n1) || n1 <= n0 || t1 <= t0)
		return 0;
	return (unsigned)((t1 - t0) * 1000000 / (uint64_t)(n1 - n0));
}
#endif

static unsigned host_tsc_khz = ACCEL_TSC_KHZ_FALLBACK;
static pthread_once_t host_tsc_once = PTHREAD_ONCE_INIT;

/* The median of three measures; the fallback when one of them fails or is out of range. */
static void host_tsc_measure(void)
{
#if defined(__x86_64__) || defined(__i386__)
	unsigned r[3];

	for (int i = 0; i < 3; i++) {
		r[i] = tsc_rate_once();
		if (r[i] < 100000 || r[i] > 20000000)
			return;
	}
	for (int i = 0; i < 2; i++)	/* the largest to r[2], then the median to r[1] */
		for (int j = 0; j < 2 - i; j++)
			if (r[j] > r[j + 1]) {
				unsigned t = r[j];

				r[j] = r[j + 1];
				r[j + 1] = t;
			}
	host_tsc_khz = r[1];
#endif
}

unsigned accel_host_tsc_khz(void)
{
	pthread_once(&host_tsc_once, host_tsc_measure);
	return host_tsc_khz;
}
