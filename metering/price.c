/*
 * price.c - exact integer prices and remainders (see price.h).
 */
#include "price.h"

#include <stdio.h>

void price_card_init(struct rate_card *card, long long cpu, long long mem, long long disk,
		     long long snap)
{
	card->cpu_ucr_cpu_s = cpu;
	card->mem_ucr_gib_s = mem;
	card->disk_ucr_gib_s = disk;
	card->snap_ucr_gib_s = snap;
	snprintf(card->version, sizeof(card->version), "cpu%lld-mem%lld-disk%lld-snap%lld", cpu, mem,
		 disk, snap);
}

unsigned __int128 price_fine(const struct rate_card *card, const struct price_usage *u)
{
	typedef unsigned __int128 u128;
	u128 f = 0;

	/* µcr = cpu_ns / 1e9 * P; times 1e9 * 1024 fine per µcr. */
	f += (u128)u->cpu_ns * (u128)card->cpu_ucr_cpu_s * 1024u;
	/* µcr = mem_mib / 1024 * run_ns / 1e9 * P. */
	f += (u128)u->mem_mib * (u128)u->run_ns * (u128)card->mem_ucr_gib_s;
	/* µcr = disk_gib * run_ns / 1e9 * P. */
	f += (u128)u->disk_gib * 1024u * (u128)u->run_ns * (u128)card->disk_ucr_gib_s;
	/* µcr = snap_mib / 1024 * paused_ns / 1e9 * P. */
	f += (u128)u->snap_mib * (u128)u->paused_ns * (u128)card->snap_ucr_gib_s;
	return f;
}

long long price_take(uint64_t *rem_fine, unsigned __int128 fine)
{
	unsigned __int128 t = fine + *rem_fine;

	*rem_fine = (uint64_t)(t % PRICE_FINE_PER_UCR);
	return (long long)(t / PRICE_FINE_PER_UCR);
}

uint64_t price_delta(uint64_t prev, uint64_t cur, bool reset)
{
	if (reset || cur < prev)
		return cur;
	return cur - prev;
}

int64_t price_window_start(int64_t t_ns, int64_t window_s)
{
	int64_t w = window_s * PRICE_NS_PER_S;
	int64_t q = t_ns / w;

	if (t_ns % w < 0)	/* floor for times before the epoch */
		q--;
	return q * window_s;
}

uint64_t price_share(uint64_t total, uint64_t num, uint64_t den)
{
	return (uint64_t)((unsigned __int128)total * num / den);
}
