/*
 * price.h - the exact integer arithmetic of metering: prices, sub-µcr remainders, counter deltas
 * and billing windows. Pure functions, no I/O; kiln-meter (meter.c) and the tests use them.
 *
 * Amounts are micro-credits (µcr). A charge is first computed exactly in "fine" units,
 * 1 µcr = PRICE_FINE_PER_UCR fine (1e9 for the nanoseconds of a CPU-second or GiB-second, times
 * 1024 for the MiB of a GiB), then turned into whole µcr; what is left stays in a per-sandbox
 * remainder, always below one µcr, and is carried into the next charge, never rounded away.
 */
#ifndef KILN_METERING_PRICE_H
#define KILN_METERING_PRICE_H

#include <stdbool.h>
#include <stdint.h>

#define PRICE_NS_PER_S ((int64_t)1000000000)
#define PRICE_FINE_PER_UCR (1000000000ULL * 1024ULL)	/* fine units in one µcr */
#define PRICE_CARD_VERSION_MAX 96

/* The prices kiln-meter bills with; `version` names them in the ledger. */
struct rate_card {
	char version[PRICE_CARD_VERSION_MAX];
	long long cpu_ucr_cpu_s;	/* µcr per CPU-second of measured use */
	long long mem_ucr_gib_s;	/* µcr per GiB-second of memory allocated, running */
	long long disk_ucr_gib_s;	/* µcr per GiB-second of disk allocated, running */
	long long snap_ucr_gib_s;	/* µcr per GiB-second of a kept snapshot (metering.md) */
};

/* Fills `card` and derives its version from the prices ("cpu100-mem50-disk2-snap1"). */
void price_card_init(struct rate_card *card, long long cpu, long long mem, long long disk,
		     long long snap);

/* What a sandbox used over one stretch of time, as billed. */
struct price_usage {
	uint64_t run_ns;	/* time running (memory and disk billed by allocation) */
	uint64_t paused_ns;	/* time paused (snapshot storage billed) */
	uint64_t cpu_ns;	/* CPU time measured while running */
	unsigned mem_mib;	/* allocation */
	unsigned disk_gib;
	uint64_t snap_mib;	/* size of the pause snapshot, MiB */
};

/* The exact charge of `u` under `card`, in fine units (no rounding anywhere). */
unsigned __int128 price_fine(const struct rate_card *card, const struct price_usage *u);

/*
 * Adds `fine` to the remainder *rem_fine (< PRICE_FINE_PER_UCR) and takes out the whole µcr:
 * returns them, and leaves the rest in *rem_fine.
 */
long long price_take(uint64_t *rem_fine, unsigned __int128 fine);

/*
 * The increase of a cumulative counter from `prev` to `cur`. When the counter went down, or
 * `reset` is set (a new generation: the VM was restored or restarted), it started again from
 * zero, so all of `cur` is new.
 */
uint64_t price_delta(uint64_t prev, uint64_t cur, bool reset);

/* Start, in seconds since the epoch, of the aligned window of `window_s` seconds holding t_ns. */
int64_t price_window_start(int64_t t_ns, int64_t window_s);

/*
 * `part` of `total` in proportion `num`/`den` (den > 0, num <= den), rounded down; the caller
 * gives the last piece whatever is left, so the pieces always sum to `total`.
 */
uint64_t price_share(uint64_t total, uint64_t num, uint64_t den);

#endif
