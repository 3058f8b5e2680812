/*
 * meter.c - kiln-meter's tick and flush (see meter.h).
 *
 * State in memory, per sandbox: its generation, the state it is billed in, the time it is billed
 * up to (last_t), the cumulative counters at last_t, its sub-µcr remainder, and the windows it
 * has charges in that are not in the ledger yet. Per tenant: the sum of those charges (its
 * `live` field in Redis) and the balance Redis answered on the last tick. Everything here can be
 * lost: the ledger's meter_sandboxes rows say where billing stands, and a fresh meter bills from
 * there with the same cumulative counters and the same clock arithmetic.
 */
#include "meter.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "auth/apikey.h"
#include "common/buf.h"
#include "common/log.h"
#include "metering/billing.h"
#include "netpolicy/policy.h"
#include "vmm/cgroup.h"

#define ID_MAX 64
#define PAUSE_RETRY_NS (10 * PRICE_NS_PER_S)	/* ask again for a pause that did not happen */
#define FLUSH_JSON_MAX (256u << 20)
#define SERIES_TRIM_EVERY_S 10
#define STEP_TOLERANCE_NS (PRICE_NS_PER_S / 2)	/* wall ahead of the label clock by more: a step */
#define STEPS_KEPT 16		/* clock steps (and gaps) remembered for the times read later */
#define STEP_KEY_SUFFIX ":step"	/* BILLING_METER_PREFIX + node + this: a forward step's gap start */
#define STEP_KEY_TTL_S "60"
#define LIVE_TTL_DEFAULT_S 30
#define LOG_KEEP_DEFAULT_S 86400
#define LOG_LATE_NS (60 * PRICE_NS_PER_S)	/* how late a change may be logged after its time */
/* How much earlier than a sandbox's change logged before it a change may be stamped (log_place()):
 * the log's times are not monotone in its sequence. A lost row is stamped greatest(heartbeat_at,
 * s.state_changed_at, ...) (migration 0019), so it inverts only against rows state_changed_at
 * does not carry (the vCPU rows, a restore's now()), by up to node_down_after_s (10 s by default)
 * and a beat: about 12 s. A transaction's rows take its start, and nothing bounds how long one
 * stays open (a resume or a create waiting on plan_check()'s tenant lock), so the tolerance
 * covers the typical gaps, not every one. The vCPU rows take the node's own clock: a step of one
 * node's clock but not the database's inverts them by the step's size, which no tolerance
 * covers. 20 s is above the known lost-row and typical transaction gaps and below the backward
 * steps the rule is for (seed 31140's: 601 s). */
#define LOG_ORDER_TOLERANCE_NS (20 * PRICE_NS_PER_S)
#define COMMIT_WAIT_DEFAULT_MS 10000
/* The application_name a flush's transaction runs under: it writes no state change, so the
 * ticks' high-water mark (commit_lag_sql) does not wait for it. */
#define FLUSH_APP_NAME "kiln-meter flush"

enum bstate { BS_NONE = 0, BS_RUN, BS_PAUSED };

static const char *const bstate_names[] = { "none", "running", "paused" };

/* One sandbox generation's charges in one window, not in the ledger yet. */
struct mwin {
	int64_t ws;		/* window start, s */
	long long gen;
	char gnode[ID_MAX];	/* the node of `gen` */
	int64_t ps, pe;		/* the part of the window billed, ns */
	long long ucr;
	uint64_t cpu_ns, rx, tx;
	unsigned __int128 mib_ns;	/* MiB x ns running */
	int64_t first_read;	/* ns: the earliest counter read in it (for the lag) */
	/* the billed-up-to point after it */
	enum bstate state;
	uint64_t cpu_at, rx_at, tx_at, rem;
	bool gen_end;		/* its point is the generation's end (sb_gen_end): the flush marks it */
	bool inflight;		/* handed to the flush, not known committed yet */
};

struct mten;

/* A generation sb_cut() left to its node's meter, or one sb_bill() left to it from the start (that
 * meter alive), watched by meter_take_tails() while the ledger has no point of it (kept in
 * meter_cut_watch too, so a restart of this meter keeps watching). */
struct mcut {
	char id[ID_MAX];
	long long gen;
};

struct msb {
	char id[ID_MAX], tenant[ID_MAX];
	long long gen;
	enum bstate state;	/* as billed at last_t */
	unsigned mem_mib, disk_gib;
	uint64_t snap_mib;	/* its pause snapshot, MiB (0: unknown, its memory is used) */
	int64_t last_t;		/* ns: billed up to */
	uint64_t cpu_at, rx_at, tx_at;	/* cumulative counters of `gen` at last_t */
	uint64_t rem;		/* fine units, < PRICE_FINE_PER_UCR */
	/* The remainder of this node's generations while `gen` is another node's (taken over):
	 * each node's generations carry their own (gen_rem_switch). */
	uint64_t rem_home;
	struct cg *cg;
	bool ended, seen;
	bool mine;		/* `gen` is this node's (a generation never changes node) */
	char gnode[ID_MAX];	/* the node `gen` runs on */
	long long seq;		/* the newest state change (sandbox_state_log.seq) applied */
	/* Tracked from its node's point in the ledger at pt_t after a restart: a change logged no
	 * later than pt_seq (the saved frame's tick_seq) placed before pt_t is in that point,
	 * whenever a tick first reads it (meter_bill_rows()). */
	long long pt_seq;
	int64_t pt_t;
	bool resync;		/* the ledger refused a window: dropped, tracked again from its point */
	int64_t pause_asked;	/* ns, 0 = never */
	long long pause_gen;	/* the generation a pause was asked for (a resume makes another) */
	struct mwin *w;
	size_t nw, capw;
	struct mten *ten;
	/* this tick, for the series */
	uint64_t t_cpu, t_rx, t_tx, t_mem;
	long long t_ucr;
	int64_t t_start;
	bool t_has;
	struct msb *hnext;
};

struct mten {
	char id[ID_MAX];
	long long pending;	/* µcr charged here, not in the ledger yet */
	long long sent;		/* what Redis last got as our live field; -1: never */
	long long balance;	/* as Redis answered on the last tick */
	bool has_balance, frozen;	/* frozen: at or below zero on the last tick (pause it) */
	int64_t unpaused_warned;	/* ns: last loud warning that nothing can pause it */
	unsigned __int128 t_burn;	/* fine units per second its sandboxes cost now */
	long long burn_sent;	/* the burn rate Redis last got */
	uint64_t t_rx, t_tx;
	int nsb;		/* sandboxes not ended */
	/*
	 * What enforcement goes by when an input fails (meter_enforce): a balance at a reference
	 * point (Redis's answer, or the ledger less this meter's unflushed charges) and this
	 * meter's charges to the tenant at that point; the estimate is that balance less the
	 * charges since, and less the burn rate over the time not billed while Postgres is away.
	 */
	long long flushed;	/* µcr of this meter's charges put in the ledger, ever */
	long long ref_bal, ref_charged;
	bool has_ref;
	int64_t bal_at;		/* label ns of the tick whose Redis answer set `balance` */
	struct mten *hnext;
};

/* The backward step of the wall clock that began a meter's frame (meter.fback; meter_clocks.back_*,
 * migrations/0056): at label `at`, the offset (label - wall) before it `off`, for the changes
 * logged with a sequence above `min` (0: any; back_min), every change logged with one at or below
 * `pre` logged before it (0: none known; back_pre). */
struct mback {
	bool set;
	int64_t at, off;
	long long min, pre;
};

/* A forward step of the wall clock a meter followed (meter.step_at[], .step_by[], .step_off[]),
 * saved with its node's clock frame (meter_clocks.step_*, migrations/0042): `back` when a backward
 * step came after it. */
struct mstep {
	bool set, back;
	int64_t at, by, off;
	/* and the label clock's gaps (meter.gap_*; meter_clocks.gaps_ns, migrations/0052) */
	int64_t gap_at[STEPS_KEPT], gap_by[STEPS_KEPT];
	int ngaps;
	struct mback fback;	/* and the frame's backward step (meter.fback) */
};

struct meter {
	struct meter_opts o;
	char node[ID_MAX];
	char cg_root[256], pin_root[256];
	char live_field[ID_MAX + 8];
	struct pg *pg;
	struct rds *rds;
	bool started;
	bool pg_started;	/* meter_start's Postgres part is done (Redis's may not be) */
	struct msb **sbs;	/* every tracked sandbox */
	size_t nsbs, capsbs;
	struct msb **sbh;	/* hash of sbs by id */
	size_t sbh_n;
	struct mten **tens;
	size_t ntens, captens;
	struct mten **tnh;
	size_t tnh_n;
	struct mcut *cuts;	/* sb_cut()'s generations, while the ledger has no point of them */
	size_t ncuts, capcuts;
	char alive_key[ID_MAX + 32];
	/* The label clock: clk_l0 at monotonic clk_m0, advancing with monotonic time. */
	bool clk_set, clk_behind;
	bool fwd_held;		/* this tick saw a forward step, billed up to it: followed at the next */
	int64_t clk_l0, clk_m0;
	int64_t start_floor;	/* ns: the newest billed-up-to point of this node at start */
	char boot[64];		/* the monotonic clock's epoch ("": none known, opts.boot_id) */
	bool resume;		/* resume_l at monotonic resume_m: the node's last saved frame */
	int64_t resume_l, resume_m;
	int64_t resume_off;	/* that frame's offset (label - wall) */
	long long resume_log_seq;	/* and the state log's seq when that offset began (0: any) */
	long long resume_tick_seq;	/* and the one read before that flush's tick (0: unknown) */
	struct mstep resume_step;	/* and the newest forward step made before it in that frame */
	int64_t clk_now_m;	/* the monotonic clock at this tick's label (clk_now_l) */
	int64_t clk_now_l;
	/* The forward steps this meter followed, oldest first: at label step_at[i] the label clock
	 * jumped by step_by[i] (a gap, gap_* below), and the offset (label - wall) in force before
	 * each, for the node's times logged before it. Those from fwd_from on came after the newest
	 * backward step. */
	int64_t step_at[STEPS_KEPT], step_by[STEPS_KEPT], step_off[STEPS_KEPT];
	int nsteps, fwd_from;
	/* The label clock's gaps, oldest first: each forward step past the label clock (step_by
	 * > 0) left the labels [gap_at[i], gap_at[i] + gap_by[i]) that no real time passed under.
	 * A label keeps the real instant it named when it was given: billing across a gap bills
	 * either side of it and nothing in it (label_len(), bill_span()), so every meter of a node
	 * labels a real instant alike, whenever it bills it (kiln-sim seed 31174). */
	int64_t gap_at[STEPS_KEPT], gap_by[STEPS_KEPT];
	int ngaps;
	/* For each forward step, where its gap begins: the label the tick that held it billed to
	 * (meter_clock()), at or before step_at. The time from there to step_at, billed after the
	 * step, is labelled past the gap: a change logged in it before the step reads there too
	 * (node_time_seq()). */
	int64_t step_gap[STEPS_KEPT];
	/* The offsets (label - wall) in force before each backward step this meter followed, and
	 * the label of each, newest last: a change logged before a step reads in its own (kiln-sim
	 * `clock`, 9110). */
	int64_t back_off[STEPS_KEPT], back_at[STEPS_KEPT];
	int nback;
	/* For each, the log sequence a change must be above to be read in the frame before it (0:
	 * any): a step made while no meter of the node ran is kept with its node's saved frame's
	 * offset for the changes logged after that frame began only (meter_clocks.log_seq); one
	 * logged before may be older than the frame's own backward step (meter_clock()). */
	long long back_min[STEPS_KEPT];
	/* For each, the log sequence at or below which every change was logged before it (0: none
	 * known): a step made while no meter of the node ran is after the tick of the node's last
	 * flush read the wall clock, so the sequence read before that (meter_clocks.tick_seq)
	 * bounds the changes logged before it (meter_clock(), node_time_logged()). */
	long long back_pre[STEPS_KEPT];
	/* The state log's sequence (its last value) at or before the backward step that gave this
	 * meter's offset its present value (0: any, none seen), saved with the frame at each flush
	 * (meter_clocks.log_seq): the one read at the last tick before that step (tick_seq); at a
	 * restarted meter's first tick, none read yet, the one this tick reads (frame_seq_due). */
	long long frame_seq;
	bool frame_seq_due;
	/* The state log's sequence read at the last tick that reached Postgres (commit_lag()),
	 * tick_seq_set once one has. */
	long long tick_seq;
	bool tick_seq_set;
	/* The one read before this tick read the wall clock (tick_seq at its start; 0: none), saved
	 * with the frame at each flush (meter_clocks.tick_seq, flush_tick_seq()): read at this
	 * tick's own commit_lag(), after meter_clock() and pg_acquire() (a wait for a pooled
	 * connection, a reconnect after an outage), a change logged after a step made in between
	 * would pass as logged before it. */
	long long tick_seq_pre;
	long long tick_seq_pre_last;	/* the last tick's tick_seq_pre */
	/* The backward step that began the frame of this meter's offset, saved with it (frame_save()):
	 * a meter that goes on in that frame reads the changes logged before that step in the frame
	 * before it, not at offset 0, a whole lead early (meter_clock(), kiln-sim seed 77018). */
	struct mback fback;
	/* For each of those steps, forward and backward: the state log's sequence (its last value)
	 * read LOG_LATE_NS or more after the step was seen (0: not yet read), at the monotonic time
	 * it was seen. A change logged with a later seq was logged that long after the step, so its
	 * time is after it, never in the frame before it (node_time_before()). */
	long long step_seq[STEPS_KEPT], back_seq[STEPS_KEPT];
	/* For each forward step, the log sequence a change must be above to be read in the frame
	 * before it (0: any): a forward step made while no meter of the node ran, kept at the first
	 * tick in the saved frame, for the changes logged after that frame began only, as back_min
	 * (node_time_seq()). */
	long long step_min[STEPS_KEPT];
	int64_t step_mono[STEPS_KEPT], back_mono[STEPS_KEPT];
	int64_t wall;		/* ns: the wall clock at this tick */
	int64_t off;		/* ns: label clock - wall clock at this tick (node times are shifted by it) */
	int64_t since;		/* ns, wall: rows changed after this are read too */
	int64_t last_tick;	/* ns */
	int64_t commit_wait_ns;	/* the longest a tick's billing waits for an open transaction (<0: never) */
	int64_t lag;		/* ns: how far this tick's billing stays behind its clock (commit_lag) */
	int64_t last_expiry_ws;
	int64_t last_trim_ws;
	bool sync_due;		/* a flush could not move its charges in Redis: do it when it is back */
	bool expiry_sync_due;	/* expiry_sync() failed: tried again at every tick until it works */
	bool rds_failed;	/* the last tick's Redis call failed (redis_tick()): held_to() tells
				 * through Postgres first */
	bool pg_failed;		/* the last tick could not read its rows: held_to() asks Postgres
				 * nothing */
	/* The flush thread (opts.flush_thread): one flush in flight at a time, under flock. */
	bool fthread;
	pthread_t fth;
	pthread_mutex_t flock;
	pthread_cond_t fcond;
	enum { FL_IDLE, FL_QUEUED, FL_DONE, FL_FAILED } fstate;
	bool fstop;
	int fevent;		/* eventfd the flush thread signals when a flush finished (meter_flush_fd) */
	struct buf fjson;	/* the queued flush's items */
	struct buf frefused;	/* the pairs its ledger refused: "<sandbox>\t<generation>\n" each */
	size_t fitems;
	int64_t ffirst_read;
	int64_t fclk_l, fclk_m;	/* the label clock and monotonic clock of the tick that queued it */
	int64_t fclk_off;	/* and its offset (label - wall) */
	long long fframe_seq;	/* and its frame_seq (-1: not read yet) */
	long long ftick_seq;	/* and its flush_tick_seq() (0: none) */
	struct mstep fstep;	/* and the newest forward step it followed (newest_step()) */
	/* The frame last saved with a flush or alone (frame_keep()): whether one was (or this
	 * meter goes on in the one it started in), its offset and frame_ver then. */
	bool frame_sent;
	int64_t sent_off;
	unsigned long frame_ver, sent_ver;	/* frame_ver: bumped by each step or gap kept */
	double fsecs;		/* how long its transaction took */
	struct kiln_error ferr;
	struct meter_stats st;
	uint64_t ticks_missed;
};

static uint64_t hash_str(const char *s)
{
	uint64_t h = 1469598103934665603ULL;

	for (; *s; s++)
		h = (h ^ (unsigned char)*s) * 1099511628211ULL;
	return h;
}

static int64_t clock_real(void *ctx)
{
	struct timespec ts;

	(void)ctx;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * PRICE_NS_PER_S + ts.tv_nsec;
}

static int64_t clock_mono(void *ctx)
{
	struct timespec ts;

	(void)ctx;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * PRICE_NS_PER_S + ts.tv_nsec;
}

/* The host's boot id (the epoch of CLOCK_MONOTONIC) into out, or "" when it cannot be read. */
static void boot_id_read(char *out, size_t n)
{
	FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");

	out[0] = '\0';
	if (!f)
		return;
	if (!fgets(out, (int)n, f))
		out[0] = '\0';
	out[strcspn(out, "\n")] = '\0';
	fclose(f);
}

/* The wall clock: labels, grant expiry, the node's timestamps. */
static int64_t now_ns(struct meter *m)
{
	return m->o.now_ns(m->o.clock_ctx);
}

/* The label clock now, without following steps (for figures between ticks). */
static int64_t label_now(struct meter *m)
{
	return m->clk_l0 + (m->o.mono_ns(m->o.clock_ctx) - m->clk_m0);
}

/* Keeps the gap [at, at + by) of the label clock (a forward step past it), unless the newest one
 * kept reaches `at` (a saved frame's gaps and its newest step name the same; overlapping gaps
 * are no real clock's, and across them label_out_of_gap() lands inside the next one, where
 * bill_span() bills labels no time passed under and shares more CPU than it measured); the
 * oldest goes when STEPS_KEPT are kept: a point from before it would bill its gap. */
static void gap_keep(struct meter *m, int64_t at, int64_t by)
{
	m->frame_ver++;
	if (by <= 0 || (m->ngaps && at < m->gap_at[m->ngaps - 1] + m->gap_by[m->ngaps - 1]))
		return;
	if (m->ngaps == STEPS_KEPT) {
		memmove(m->gap_at, m->gap_at + 1, sizeof(m->gap_at[0]) * (STEPS_KEPT - 1));
		memmove(m->gap_by, m->gap_by + 1, sizeof(m->gap_by[0]) * (STEPS_KEPT - 1));
		m->ngaps--;
	}
	m->gap_at[m->ngaps] = at;
	m->gap_by[m->ngaps++] = by;
}

/* The real time (ns) between labels t0 and t1 (t0 <= t1): the span less the gaps in it. */
static int64_t label_len(const struct meter *m, int64_t t0, int64_t t1)
{
	int64_t d = t1 - t0;

	for (int i = 0; i < m->ngaps && d > 0; i++) {
		int64_t a = m->gap_at[i] > t0 ? m->gap_at[i] : t0;
		int64_t e = m->gap_at[i] + m->gap_by[i] < t1 ? m->gap_at[i] + m->gap_by[i] : t1;

		if (e > a)
			d -= e - a;
	}
	return d > 0 ? d : 0;
}

/* The label `d` ns of real time after label `t`, over the gaps between. */
static int64_t label_add(const struct meter *m, int64_t t, int64_t d)
{
	for (int i = 0; i < m->ngaps; i++) {
		int64_t a = m->gap_at[i], e = a + m->gap_by[i];

		if (e <= t)
			continue;
		if (t >= a) {
			t = e;	/* in the gap: real time goes on at its end */
			continue;
		}
		if (t + d <= a)
			break;
		d -= a - t;
		t = e;
	}
	return t + d;
}

/* The label `d` ns of real time before label `t`, over the gaps between. */
static int64_t label_sub(const struct meter *m, int64_t t, int64_t d)
{
	for (int i = m->ngaps - 1; i >= 0; i--) {
		int64_t a = m->gap_at[i], e = a + m->gap_by[i];

		if (a >= t)
			continue;
		if (e >= t) {
			t = a;	/* in the gap, or at its end: the instant of its start */
			continue;
		}
		if (t - d >= e)
			break;
		d -= t - e;
		t = a;
	}
	return t - d;
}

/* The label `t`, or the end of the gap it falls in: where real time after it is labelled. */
static int64_t label_out_of_gap(const struct meter *m, int64_t t)
{
	for (int i = 0; i < m->ngaps; i++)
		if (t >= m->gap_at[i] && t < m->gap_at[i] + m->gap_by[i])
			return m->gap_at[i] + m->gap_by[i];
	return t;
}

/* The start of the first gap after label `t`, INT64_MAX when none. */
static int64_t gap_next(const struct meter *m, int64_t t)
{
	for (int i = 0; i < m->ngaps; i++)
		if (m->gap_at[i] > t)
			return m->gap_at[i];
	return INT64_MAX;
}

/* Keeps a forward step of the wall clock at label `at`, the label clock moved on by `by`, the
 * offset before it `off` (node_time()), its gap from `at` (fwd_gap() sets another start); the
 * oldest goes when STEPS_KEPT are kept. */
static void fwd_keep(struct meter *m, int64_t at, int64_t by, int64_t off)
{
	m->frame_ver++;
	if (m->nsteps == STEPS_KEPT) {
		memmove(m->step_at, m->step_at + 1, sizeof(m->step_at[0]) * (STEPS_KEPT - 1));
		memmove(m->step_by, m->step_by + 1, sizeof(m->step_by[0]) * (STEPS_KEPT - 1));
		memmove(m->step_off, m->step_off + 1, sizeof(m->step_off[0]) * (STEPS_KEPT - 1));
		memmove(m->step_seq, m->step_seq + 1, sizeof(m->step_seq[0]) * (STEPS_KEPT - 1));
		memmove(m->step_mono, m->step_mono + 1, sizeof(m->step_mono[0]) * (STEPS_KEPT - 1));
		memmove(m->step_min, m->step_min + 1, sizeof(m->step_min[0]) * (STEPS_KEPT - 1));
		memmove(m->step_gap, m->step_gap + 1, sizeof(m->step_gap[0]) * (STEPS_KEPT - 1));
		m->nsteps--;
		if (m->fwd_from)
			m->fwd_from--;
	}
	m->step_at[m->nsteps] = at;
	m->step_off[m->nsteps] = off;
	m->step_seq[m->nsteps] = 0;
	m->step_min[m->nsteps] = 0;
	m->step_mono[m->nsteps] = m->o.mono_ns(m->o.clock_ctx);
	m->step_gap[m->nsteps] = at;
	m->step_by[m->nsteps++] = by;
	gap_keep(m, at, by);
}

/* The newest kept forward step's gap begins at `from` (<= its step_at): the labels [from,
 * from + step_by) never passed, and the time from `from` to step_at is labelled after them. */
static void fwd_gap(struct meter *m, int64_t from)
{
	int k = m->nsteps - 1;

	m->frame_ver++;
	m->step_gap[k] = from;
	if (m->ngaps && m->gap_at[m->ngaps - 1] == m->step_at[k])
		m->ngaps--;
	gap_keep(m, from, m->step_by[k]);
}

/* Keeps a backward step of the wall clock at label `at`, seen at monotonic time `mono`, the offset
 * before it `off` for the changes logged with a sequence above `min` (0: any; node_time_logged(),
 * node_time_before()); the oldest goes when STEPS_KEPT are kept. */
static void back_keep(struct meter *m, int64_t at, int64_t off, long long min, int64_t mono)
{
	m->frame_ver++;
	if (m->nback == STEPS_KEPT) {
		memmove(m->back_off, m->back_off + 1, sizeof(m->back_off[0]) * (STEPS_KEPT - 1));
		memmove(m->back_at, m->back_at + 1, sizeof(m->back_at[0]) * (STEPS_KEPT - 1));
		memmove(m->back_seq, m->back_seq + 1, sizeof(m->back_seq[0]) * (STEPS_KEPT - 1));
		memmove(m->back_mono, m->back_mono + 1, sizeof(m->back_mono[0]) * (STEPS_KEPT - 1));
		memmove(m->back_min, m->back_min + 1, sizeof(m->back_min[0]) * (STEPS_KEPT - 1));
		memmove(m->back_pre, m->back_pre + 1, sizeof(m->back_pre[0]) * (STEPS_KEPT - 1));
		m->nback--;
	}
	m->back_min[m->nback] = min;
	m->back_pre[m->nback] = 0;
	m->back_seq[m->nback] = 0;
	m->back_mono[m->nback] = mono;
	m->back_at[m->nback] = at;
	m->back_off[m->nback++] = off;
}

/* The newest forward step this meter followed, for its node's clock frame (frame_save()). */
static struct mstep newest_step(const struct meter *m)
{
	struct mstep st = { 0 };
	int k = m->nsteps - 1;

	if (k >= 0)
		st = (struct mstep){ .set = true, .back = k < m->fwd_from, .at = m->step_at[k],
				     .by = m->step_by[k], .off = m->step_off[k] };
	memcpy(st.gap_at, m->gap_at, sizeof(st.gap_at));
	memcpy(st.gap_by, m->gap_by, sizeof(st.gap_by));
	st.ngaps = m->ngaps;
	st.fback = m->fback;
	return st;
}

/* The gaps of `st` as a bigint[] literal for meter_clocks.gaps_ns: "{at,by,...}". */
static void gaps_text(const struct mstep *st, char *out, size_t n)
{
	size_t k = (size_t)snprintf(out, n, "{");

	for (int i = 0; i < st->ngaps && k < n; i++)
		k += (size_t)snprintf(out + k, n - k, "%s%" PRId64 ",%" PRId64, i ? "," : "",
				      st->gap_at[i], st->gap_by[i]);
	if (k < n)
		snprintf(out + k, n - k, "}");
}

/* The gaps of meter_clocks.gaps_ns's text `v` ("{at,by,...}", NULL: none) into `st`. */
static void gaps_parse(struct mstep *st, const char *v)
{
	char *end;

	st->ngaps = 0;
	if (!v || *v++ != '{')
		return;
	while (*v && *v != '}' && st->ngaps < STEPS_KEPT) {
		long long at = strtoll(v, &end, 10), by;

		if (*end != ',')
			break;
		by = strtoll(end + 1, &end, 10);
		st->gap_at[st->ngaps] = at;
		st->gap_by[st->ngaps++] = by;
		v = *end == ',' ? end + 1 : end;
	}
}

/* The saved gap of the saved frame's newest forward step `rs` (where that meter's held tick
 * began it: the newest of its length starting no later than the step), -1 when none is. */
static int frame_step_gap(const struct mstep *rs)
{
	for (int i = rs->ngaps - 1; rs->set && rs->by > 0 && i >= 0; i--)
		if (rs->gap_by[i] == rs->by && rs->gap_at[i] <= rs->at)
			return i;
	return -1;
}

/* Tells the node's other meters where this meter's held tick begins the gap of a forward step of
 * `by` ns: at `from`, the second before that tick, no earlier than its last tick (held_to(); its
 * last tick when they are a second apart; a late one's own start when none was told to it), for
 * step_told(). */
static void step_tell(struct meter *m, int64_t by, int64_t from)
{
	struct kiln_error err = { 0 };
	char key[160], v[48];

	snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s" STEP_KEY_SUFFIX, m->node);
	snprintf(v, sizeof(v), "%" PRId64 " %" PRId64, by, from);
	m->st.redis_calls++;
	if (RDS(m->rds, NULL, &err, "SET", key, v, "EX", STEP_KEY_TTL_S) != KILN_OK)
		log_warn("cannot tell the forward step's gap: %s", err.msg);
}

/* The step key's value as step_tell() writes it, "<by> <from>", into *by (> 0) and *from: false
 * for text after it or a number out of range (the key is anyone's to write); strtoll()'s
 * leading blanks and sign are taken, harmless as both numbers are range-checked after. */
static bool step_parse(const char *v, long long *by, long long *from)
{
	char *end;

	errno = 0;
	*by = strtoll(v, &end, 10);
	if (errno || end == v || *end != ' ' || *by <= 0)
		return false;
	v = end + 1;
	*from = strtoll(v, &end, 10);
	return !errno && end != v && !*end;
}

/* Whether a gap start told for a forward step of `tby` ns at `tfrom` is this one's, of `by` ns
 * (the same within STEP_TOLERANCE_NS) between labels `after` and `before` (step_told(),
 * step_told_pg()); if so the start this meter takes into *from. */
static bool step_fits(long long tby, long long tfrom, int64_t by, int64_t after, int64_t before,
		      int64_t *from)
{
	if (tby < by - STEP_TOLERANCE_NS || tby > by + STEP_TOLERANCE_NS ||
	    tfrom < after - STEP_TOLERANCE_NS || tfrom > before + STEP_TOLERANCE_NS)
		return false;
	*from = tfrom > after ? tfrom : after;
	return true;
}

/* The gap start another meter of the node told (step_tell()) for a forward step of `by` ns (the
 * same within STEP_TOLERANCE_NS) that came between labels `after` and `before`, into *from:
 * false when none is told (not yet, or Redis away). Within STEP_TOLERANCE_NS either side: that
 * meter tells the second before its own tick, which comes up to that late in its second (a start
 * 0.3 s past `before` was refused, the two gaps 0.3 s apart). One before `after`, where this
 * meter's billing stands already, is taken as `after`, the nearest it can begin its gap.
 * *asked: whether Redis answered. */
static bool step_told(struct meter *m, int64_t by, int64_t after, int64_t before, int64_t *from,
		      bool *asked)
{
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	char key[160];
	long long tby, tfrom;
	bool ok;

	snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s" STEP_KEY_SUFFIX, m->node);
	m->st.redis_calls++;
	*asked = RDS(m->rds, &rep, &err, "GET", key) == KILN_OK;
	ok = *asked && rep.type == RDS_STR && step_parse(rep.str, &tby, &tfrom) &&
	     step_fits(tby, tfrom, by, after, before, from);
	rds_reply_release(&rep);
	return ok;
}

/* step_tell() through Postgres (meter_step_told, migrations/0053), for a late meter of the node
 * that Redis tells nothing: the telling meter's Redis, or the late meter's own, away at the step
 * (kiln-sim seed 31233: the telling meter without Redis, one paused second lost on two
 * sandboxes). One statement; without Postgres it tells nothing here, as step_tell() without
 * Redis. */
static void step_tell_pg(struct meter *m, int64_t by, int64_t from)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	char b[24], f[24], mono[24];

	snprintf(b, sizeof(b), "%" PRId64, by);
	snprintf(f, sizeof(f), "%" PRId64, from);
	snprintf(mono, sizeof(mono), "%" PRId64, m->o.mono_ns(m->o.clock_ctx));
	m->st.pg_calls++;
	if (pg_acquire(m->pg, &c, &err) == KILN_OK) {
		PGQ(c, NULL, &err,
		    "INSERT INTO meter_step_told (node_id, by_ns, from_ns, updated_at, boot_id, "
		    "mono_ns) VALUES ($1, $2, $3, now(), NULLIF($4, ''), $5) "
		    "ON CONFLICT (node_id) DO UPDATE SET by_ns = $2, from_ns = $3, updated_at = now(), "
		    "boot_id = NULLIF($4, ''), mono_ns = $5",
		    m->node, b, f, m->boot, mono);
		pg_release(m->pg, c);
	}
	if (err.msg[0])
		log_warn("cannot tell the forward step's gap through Postgres: %s", err.msg);
}

/* step_told() from Postgres (step_tell_pg()): the row is the node's last held tick's, so one from
 * an earlier step is refused by the same checks as a stale key (step_fits()); and, as the key
 * expires after STEP_KEY_TTL_S, one written longer ago: on this host's monotonic clock when it
 * was told on this boot, no later than now on it (migrations/0058), else on the database's clock
 * as it is written (now()), which may stand or step apart from the node's (kiln-sim seed 77044:
 * a row told a second before, read as 1,148 s old, refused, the late meter's gap a second after
 * the other's, that second billed twice). The checks alone would take an earlier step's row back
 * only if the node's labels came back to it, remote but not bounded. *asked: whether Postgres
 * answered. */
static bool step_told_pg(struct meter *m, int64_t by, int64_t after, int64_t before, int64_t *from,
			 bool *asked)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	bool ok = false;

	m->st.pg_calls++;
	if (pg_acquire(m->pg, &c, &err) == KILN_OK) {
		char mono[24];

		snprintf(mono, sizeof(mono), "%" PRId64, m->o.mono_ns(m->o.clock_ctx));
		if (PGQ(c, &res, &err,
			"SELECT by_ns, from_ns FROM meter_step_told WHERE node_id = $1 AND "
			"CASE WHEN boot_id = $2 AND mono_ns <= $3::bigint "
			"THEN mono_ns > $3::bigint - " STEP_KEY_TTL_S " * 1000000000::bigint "
			"ELSE updated_at > now() - interval '" STEP_KEY_TTL_S " seconds' END",
			m->node, m->boot, mono) == KILN_OK && pg_res_rows(res) == 1)
			ok = step_fits(pg_res_int(res, 0, 0, 0), pg_res_int(res, 0, 1, 0), by, after,
				       before, from);
		pg_res_free(res);
		pg_release(m->pg, c);
	}
	*asked = !err.msg[0];
	if (err.msg[0])
		log_warn("cannot read the forward step's gap from Postgres: %s", err.msg);
	return ok;
}

/* step_tell() and step_tell_pg(), first through the channel that answered at this meter's last
 * tick: Postgres first when Redis failed there. A Redis that does not refuse but hangs (a
 * partition, a stopped host) waits out the client's timeout, and a row written after it can land
 * when the node's late meter has read already (seed 31233's loss again). In kiln-meter the
 * timeout is 1 s, the tick's period: a tick whose Redis hung overran the next second, so the held
 * tick after it is late (it tells only a start it took when none was told to it, through the
 * channels its reads just reached: held_to()); this order acts there after a Redis that failed
 * fast (refused, or answered an error). Redis is still told after it: one command,
 * bounded by that timeout, and it may answer again. Postgres is not, when the last tick could not
 * reach it: the attempt would be a new connection, up to connect_timeout (3 s) a host, before this
 * tick's own, which goes blind if it fails too. */
static void step_tell_both(struct meter *m, int64_t by, int64_t from)
{
	bool pg = !m->pg_failed;

	if (pg && m->rds_failed)
		step_tell_pg(m, by, from);
	step_tell(m, by, from);
	if (pg && !m->rds_failed)
		step_tell_pg(m, by, from);
}

/*
 * Where the held tick at label `l`, seeing a forward step of `by` ns, bills up to: the start of
 * the step's gap, which every meter of the node must place alike (the ledger's fence compares
 * labels). A meter that ticked in the second before (its last tick at clk_now_l, within the
 * step's tolerance) knows the step came in that second: it bills to the second before its held
 * tick, no earlier than its last tick (that tick when they are a second apart), and tells the
 * node's other meters, in Redis and in Postgres (step_tell_both()): a late meter may have
 * either only. A late one (it skipped a tick) cannot tell from its own two ticks in which
 * second the step came: billing to the second before, it began its gap a second or more after
 * the other meter's when the step came early between them (one real second labelled twice, the
 * step's length apart: +257 µcr on a sandbox of 257 µcr/s), and billing to its last tick,
 * before it when the step came late (kiln-sim `clock`, seed 351001013). It takes the start
 * another meter told, from its last tick to the second before its held tick (step_told():
 * within the step's tolerance), from Redis, else from Postgres (step_told_pg(): Redis first,
 * the usual channel, so Postgres is asked only when Redis told nothing, and not when this
 * meter's last tick could not reach it; with the telling meter's Redis away, Postgres alone told
 * it, seed 31233). None told, it takes the second before its held tick at once: the node's
 * meters tick on whole seconds of one monotonic clock, so the other meter has not had its held
 * tick yet, its tick a second before came before the step, and it will tell that second; or it
 * is late too, neither channel reaches both meters, or there is no other meter. Waiting for it
 * changed no start and delayed billing and enforcement (one meter, a tenant at zero just before
 * a skipped tick and a step: its pause asked two ticks later). A late one that found nothing
 * told tells its own start: another meter late too, whose held tick comes later, takes it
 * (the earliest held tick's second before is never before another's last tick, which came
 * before the step, nor after its second before), and an on-time meter's held tick comes no
 * later than this one's, with the same start when in the same second. Untold, two late meters
 * began their gaps a second apart, and the ledger kept a window of each that left that second
 * out (kiln-sim seed 77465: one skipped the tick before the step, the other the step's own;
 * -210 and -107 µcr on two paused sandboxes).
 */
static int64_t held_to(struct meter *m, int64_t l, int64_t by)
{
	int64_t p = l - PRICE_NS_PER_S > m->clk_now_l ? l - PRICE_NS_PER_S : m->clk_now_l, told;
	bool rds_asked = false, pg_asked = false;

	if (l - m->clk_now_l <= PRICE_NS_PER_S + STEP_TOLERANCE_NS) {
		step_tell_both(m, by, p);
		return p;
	}
	if (step_told(m, by, m->clk_now_l, l - PRICE_NS_PER_S, &told, &rds_asked) ||
	    (!m->pg_failed &&
	     step_told_pg(m, by, m->clk_now_l, l - PRICE_NS_PER_S, &told, &pg_asked)))
		return told;
	/* told through the channels that just answered: no new connection where one failed */
	if (rds_asked)
		step_tell(m, by, p);
	if (pg_asked)
		step_tell_pg(m, by, p);
	return p;
}

/*
 * The label clock at this tick, the time billed sandboxes are billed up to: it advances by
 * monotonic time only. Started where the node's last saved frame left it, on this host's
 * monotonic clock (meter_clocks: a meter restarted after a backward step goes on in it), else
 * at the wall clock; never before the newest billed-up-to point of the node.
 * When the wall clock is found ahead of it (a forward step), it follows at the next tick (this
 * one bills up to the second before in the frame before), leaving a gap of labels that no time
 * passed under: the step is never billed (bill_span() skips the gap). Behind it (a
 * backward step), it keeps going; node timestamps are shifted by the difference (m->off).
 * Within STEP_TOLERANCE_NS of it (no step), it is the wall clock itself.
 */
static int64_t meter_clock(struct meter *m)
{
	int64_t w = now_ns(m), mono = m->o.mono_ns(m->o.clock_ctx), l, off_before = m->off;
	bool held, framed = false;	/* framed: this first tick goes on in the saved frame */

	if (!m->clk_set) {
		/* On the host of the node's last saved frame, in that frame (a backward step of
		 * the wall clock made before this start shifts nothing); else at the wall clock. */
		m->clk_l0 = m->resume && mono >= m->resume_m ? m->resume_l + (mono - m->resume_m) : w;
		if (m->resume && mono >= m->resume_m) {
			off_before = m->resume_off;	/* the node's times before a step: that frame's */
			m->frame_seq = m->resume_log_seq;	/* the frame goes on */
			m->fback = m->resume_step.fback;
			framed = true;
			/* The frame's gaps and newest forward step, followed by the meter that
			 * saved it: a point of the ledger from before a gap is billed on over it
			 * here too (kiln-sim `clock`, seed 150252085: a meter started just after a
			 * 3,160 s step billed it as paused time from a point read from before it). */
			const struct mstep *rs = &m->resume_step;
			int g = frame_step_gap(rs), n = g == rs->ngaps - 1 ? g : rs->ngaps;

			/* Its meter's gaps, as its own, but for its step's (the newest), which
			 * fwd_keep() and fwd_gap() keep: kept here too, a frame with STEPS_KEPT
			 * gaps lost its oldest to the step's gap at its label, which fwd_gap()
			 * then took off (15 of 16 kept; a point from before it billed that gap). */
			for (int i = 0; i < n; i++)
				gap_keep(m, rs->gap_at[i], rs->gap_by[i]);
			if (rs->set) {
				fwd_keep(m, rs->at, rs->by, rs->off);
				/* Its gap, where that meter's held tick began it (migrations/0052). */
				if (g >= 0)
					fwd_gap(m, rs->gap_at[g]);
				if (rs->back)
					m->fwd_from = m->nsteps;
			}
		}
		if (m->clk_l0 < m->start_floor)
			m->clk_l0 = m->start_floor;
		m->clk_m0 = mono;
		m->clk_set = true;
		if (framed) {	/* the saved frame goes on: saved again once it changes */
			m->frame_sent = true;
			m->sent_off = m->resume_off;
			m->sent_ver = m->frame_ver;
		}
	}
	l = m->clk_l0 + (mono - m->clk_m0);
	/* A forward step seen at this tick is followed at the next: this one bills up to the
	 * step's gap start in the frame before (held_to(): the second before it, the step came in
	 * the last second, or for a late one the start the node's other meter told), so every
	 * meter of the node places the step alike, however far each had billed: kiln-sim `clock`,
	 * seed 351001013, a meter that had skipped the tick before a step moved its point, a second
	 * behind the other meter's, by the step, and billed that second again under a label no
	 * window of the other's overlaps (+1 s on three sandboxes). */
	held = m->fwd_held;
	m->fwd_held = w - l > STEP_TOLERANCE_NS && m->clk_now_l && !held;
	if (m->fwd_held) {
		int64_t p = held_to(m, l, w - l);

		mono -= l - p;
		l = p;
		w = l - off_before;
	}
	if (w - l > STEP_TOLERANCE_NS) {
		int64_t step = w - l;
		log_warn("the wall clock stepped %.3f s ahead of the meter's: not billed", (double)step / 1e9);
		/* A gap of labels: the tracked points stay where they are, and billing from them
		 * skips it (bill_span()). Moved on by the step, a point from before it labelled the
		 * real time before the step as after it: a meter without Postgres across a 2,086 s
		 * step, 111 s behind, billed a generation the node's other meter had billed live a
		 * second time, 2,086 s later on the labels, and the ledger's fence, comparing
		 * labels, took both (kiln-sim seed 31174, +37,700 µcr). */
		fwd_keep(m, l, step, off_before);
		/* Held, the step came after the held tick's label (it billed to there): the gap
		 * begins there, as every meter of the node places it, and the time since is
		 * labelled past it, as a change logged then reads (node_time_seq()). */
		if (held)
			fwd_gap(m, m->clk_now_l);
		m->clk_l0 = w;
		m->clk_m0 = mono;
		l = w;
	} else if (off_before - (l - w) > STEP_TOLERANCE_NS &&
		   (m->clk_now_l || (framed && l - w <= STEP_TOLERANCE_NS))) {
		/* Stepped forward less than the lead a backward step left (the label clock stays
		 * ahead): nothing to skip, but the node's times logged before it keep the offset
		 * then in force (kiln-sim `clock`, seed 9192). Also a first tick in the saved frame
		 * that finds the wall clock at its label clock: a step forward while no meter of
		 * the node ran took the whole lead back (one that left part of it is kept below,
		 * after the backward step from offset 0 such a tick takes it for). */
		fwd_keep(m, l, 0, off_before);
		if (framed)	/* for the changes logged in the frame only (below) */
			m->step_min[m->nsteps - 1] = m->resume_log_seq;
		if (l - w <= STEP_TOLERANCE_NS) {
			m->clk_l0 = w;
			m->clk_m0 = mono;
			l = w;
		}
	} else if (l - w <= STEP_TOLERANCE_NS) {
		/* No step (NTP slews both clocks alike): the wall clock itself labels, to the ns
		 * of the node's timestamps. */
		m->clk_l0 = w;
		m->clk_m0 = mono;
		l = w;
	} else if (l - w - m->off > STEP_TOLERANCE_NS) {
		/* Stepped back (again): the offset in force before it, for the changes logged
		 * before it that this meter has not read yet. */
		if (!m->clk_behind)
			log_warn("the wall clock stepped %.3f s back: the meter's clock keeps going",
				 (double)(l - w) / 1e9);
		back_keep(m, l, m->off, 0, mono);
		/* The first tick in the saved frame: that frame's own backward step, the offset before
		 * it, as the meter that saved it followed it. A change logged before it stood by that
		 * offset; with offset 0 alone, the one before a frame the node's meters had kept since
		 * its first step, it stood the whole lead early (kiln-sim seed 77018: a running
		 * sandbox's start, logged a second before a -270 s step, read 3,097 s early by the
		 * meter restarted a second after the step, inside the ledger's point and dropped; its
		 * running time to a pause after the step billed in no state, -45,367 µcr). Every
		 * change logged no later than the sequence read before that step (pre) is read in
		 * it. */
		if (framed && m->resume_step.fback.set) {
			const struct mback *fb = &m->resume_step.fback;

			back_keep(m, fb->at, fb->off, fb->min, mono);
			m->back_pre[m->nback - 1] = fb->pre;
		}
		/* The first tick in the saved frame finds the wall clock further behind the label
		 * clock than that frame's offset: it stepped back while no meter of the node ran.
		 * The node's times logged before that step, while the meter was down, were logged
		 * in the frame: its offset is kept as the one before the newest step, after the
		 * offset 0 for the older times (node_time_logged() tries the newest first). With
		 * offset 0 alone, a change logged in the frame stood the frame's offset early
		 * (kiln-sim seed 31120: a running sandbox's deletion read 2,807 s early, before
		 * the ledger's point, and taken as in it; the generation billed as running past
		 * it, +4,348,463 µcr). Only for the changes logged after the frame's offset
		 * began (meter_clocks.log_seq): one logged before may be older than the frame's
		 * own backward step, and read in the frame it stood that step's size late, past
		 * the ledger's point, and was applied again (a pause before a -100 s step, the
		 * frame's, read 100 s late: +965 µcr in 200 s). */
		if (framed && off_before - m->off > STEP_TOLERANCE_NS &&
		    l - w - off_before > STEP_TOLERANCE_NS)
			back_keep(m, l, off_before, m->resume_log_seq, mono);
		/* That step came after the tick that saved the node's last frame read the wall clock,
		 * and that frame kept the log's sequence read before then (meter_clocks.tick_seq): a
		 * change logged no later than that read was logged before the step, whatever its
		 * time reads against this tick (see node_time_logged()). A first tick keeps no step
		 * before these. */
		if (framed && l - w - off_before > STEP_TOLERANCE_NS)
			for (int b = 0; b < m->nback; b++)
				m->back_pre[b] = m->resume_tick_seq;
		m->fwd_from = m->nsteps;
		/* The first tick in the saved frame finds the wall clock nearer to the label clock
		 * than that frame's offset: it stepped forward within the lead while no meter of
		 * the node ran. The node's times logged before it keep the frame's offset, as for
		 * such a step seen running. Read with the offset after it, a change logged while
		 * the meter was down stood the step's size early (kiln-sim seed 31049: a paused
		 * sandbox's deletion read 257 s early, before the ledger's point, and its
		 * generation ended there, 11 s of paused time unbilled). Only for the changes
		 * logged after the frame began, as for a backward step: one logged before it,
		 * older than the frame's own backward step, takes offset 0, this tick's before the
		 * step (node_time_seq(); read in the frame, a pause logged before the frame's
		 * -100 s step stood 100 s late and was applied again: 14,730 µcr for 13,765). */
		if (framed && off_before - (l - w) > STEP_TOLERANCE_NS) {
			fwd_keep(m, l, 0, off_before);
			m->step_min[m->nsteps - 1] = m->resume_log_seq;
		}
	}
	/* A backward step grew the offset: a new frame, whose changes are those logged after the
	 * last tick before the step read the log's sequence (a bound no later than the step: read
	 * at the first tick after it that reached Postgres, every change logged in the frame
	 * before that read lost the frame's offset at a restart and read it early, before the
	 * ledger's point, taken as in it: 5,140 µcr for 5,654). A change of the older frame logged
	 * in between reads in this one, late by the step, as it did before the frame kept a
	 * sequence. A forward step within the lead keeps the frame: the changes logged after the
	 * backward step and before it keep the frame's offset, not offset 0, a whole lead early.
	 * A restarted meter's first tick has read none: it takes the one it reads (meter_tick()).
	 * Not an offset that drifts less than a step's tolerance a tick. */
	if (l - w - off_before > STEP_TOLERANCE_NS) {
		/* The sequence after which the frame before it began (not read yet: the one read
		 * before the last tick read the wall clock; 0, none read, any) */
		long long began = m->frame_seq_due ? m->tick_seq_pre_last : m->frame_seq;

		m->frame_seq = m->tick_seq;
		m->frame_seq_due = !m->tick_seq_set;
		/* Its step, saved with it: the frame before it, for the changes logged after that
		 * frame began only (one logged before is older than that frame's own step: read in
		 * it, a stop before two backward steps stood the first's size late at a restart
		 * long after them, +25,700 µcr). Seen live, after the last tick read the wall
		 * clock, so every change logged no later than the sequence read before that read
		 * was logged before it; made while no meter of the node ran, after the saved
		 * frame's tick (resume_tick_seq), the frame before it the saved frame. */
		if (!framed)
			m->fback = (struct mback){ .set = true, .at = l, .off = off_before,
						   .min = began, .pre = m->tick_seq_pre_last };
		else
			m->fback = (struct mback){ .set = true, .at = l, .off = off_before,
						   .min = m->resume_log_seq,
						   .pre = m->resume_tick_seq };
	}
	if (l - w <= STEP_TOLERANCE_NS)
		m->fback.set = false;	/* offset 0: no backward step's frame to save */
	m->clk_behind = l - w > STEP_TOLERANCE_NS;
	m->wall = w;
	m->off = l - w;
	m->clk_now_l = l;
	m->clk_now_m = mono;
	return l;
}

/* --- the two tables: sandboxes and tenants, arrays with a chained hash by id --- */

static int sb_rehash(struct meter *m, size_t nb)
{
	struct msb **h = calloc(nb, sizeof(*h));

	if (!h)
		return -ENOMEM;
	for (size_t i = 0; i < m->nsbs; i++) {
		struct msb *s = m->sbs[i];
		size_t k = hash_str(s->id) % nb;
		s->hnext = h[k];
		h[k] = s;
	}
	free(m->sbh);
	m->sbh = h;
	m->sbh_n = nb;
	return 0;
}

static struct msb *sb_find(struct meter *m, const char *id)
{
	if (!m->sbh_n)
		return NULL;
	for (struct msb *s = m->sbh[hash_str(id) % m->sbh_n]; s; s = s->hnext)
		if (strcmp(s->id, id) == 0)
			return s;
	return NULL;
}

static struct mten *ten_find(struct meter *m, const char *id)
{
	if (!m->tnh_n)
		return NULL;
	for (struct mten *t = m->tnh[hash_str(id) % m->tnh_n]; t; t = t->hnext)
		if (strcmp(t->id, id) == 0)
			return t;
	return NULL;
}

static int ten_rehash(struct meter *m, size_t nb)
{
	struct mten **h = calloc(nb, sizeof(*h));

	if (!h)
		return -ENOMEM;
	for (size_t i = 0; i < m->ntens; i++) {
		struct mten *t = m->tens[i];
		size_t k = hash_str(t->id) % nb;
		t->hnext = h[k];
		h[k] = t;
	}
	free(m->tnh);
	m->tnh = h;
	m->tnh_n = nb;
	return 0;
}

static struct mten *ten_get(struct meter *m, const char *id)
{
	struct mten *t = ten_find(m, id);

	if (t)
		return t;
	if (m->ntens == m->captens) {
		size_t cap = m->captens ? m->captens * 2 : 64;
		struct mten **a = realloc(m->tens, cap * sizeof(*a));
		if (!a)
			return NULL;
		m->tens = a;
		m->captens = cap;
	}
	t = calloc(1, sizeof(*t));
	if (!t)
		return NULL;
	snprintf(t->id, sizeof(t->id), "%s", id);
	t->sent = -1;
	m->tens[m->ntens++] = t;
	if (m->ntens * 2 > m->tnh_n) {
		if (ten_rehash(m, m->ntens * 4)) {
			m->ntens--;
			free(t);
			return NULL;
		}
	} else {
		size_t k = hash_str(id) % m->tnh_n;
		t->hnext = m->tnh[k];
		m->tnh[k] = t;
	}
	return t;
}

static struct msb *sb_add(struct meter *m, const char *id, const char *tenant)
{
	struct msb *s;

	if (m->nsbs == m->capsbs) {
		size_t cap = m->capsbs ? m->capsbs * 2 : 64;
		struct msb **a = realloc(m->sbs, cap * sizeof(*a));
		if (!a)
			return NULL;
		m->sbs = a;
		m->capsbs = cap;
	}
	s = calloc(1, sizeof(*s));
	if (!s)
		return NULL;
	s->ten = ten_get(m, tenant);
	if (!s->ten) {
		free(s);
		return NULL;
	}
	snprintf(s->id, sizeof(s->id), "%s", id);
	snprintf(s->tenant, sizeof(s->tenant), "%s", tenant);
	m->sbs[m->nsbs++] = s;
	if (m->nsbs * 2 > m->sbh_n) {
		if (sb_rehash(m, m->nsbs * 4)) {
			m->nsbs--;
			free(s);
			return NULL;
		}
	} else {
		size_t k = hash_str(id) % m->sbh_n;
		s->hnext = m->sbh[k];
		m->sbh[k] = s;
	}
	s->ten->nsb++;
	return s;
}

static void sb_free(struct msb *s)
{
	cg_free(s->cg);
	free(s->w);
	free(s);
}

/* --- billing arithmetic over time --- */

/* The window entry of `s` for (gen, ws), made when missing; NULL when out of memory. */
static struct mwin *win_get(struct msb *s, long long gen, int64_t ws, int64_t t0)
{
	struct mwin *w;

	for (size_t i = s->nw; i-- > 0;)
		if (s->w[i].ws == ws && s->w[i].gen == gen)
			return &s->w[i];
	if (s->nw == s->capw) {
		size_t cap = s->capw ? s->capw * 2 : 4;
		struct mwin *a = realloc(s->w, cap * sizeof(*a));
		if (!a)
			return NULL;
		s->w = a;
		s->capw = cap;
	}
	w = &s->w[s->nw++];
	memset(w, 0, sizeof(*w));
	w->ws = ws;
	w->gen = gen;
	snprintf(w->gnode, sizeof(w->gnode), "%s", s->gnode);
	w->ps = t0;
	return w;
}

/*
 * Bills `s` for [t0, t1) in state `st`, with `cpu` ns of CPU and rx/tx bytes measured over it,
 * split at window boundaries (the measured amounts in proportion to time), less the label
 * clock's gaps in it (forward steps: no time passed there, no window holds them). Advances
 * last_t and the counters. `read_at` is when the counters were read.
 */
static void bill_span(struct meter *m, struct msb *s, int64_t t0, int64_t t1, enum bstate st,
		      uint64_t cpu, uint64_t rx, uint64_t tx, int64_t read_at)
{
	const int64_t wns = m->o.window_s * PRICE_NS_PER_S;

	if (label_len(m, t0, t1) == 0) {
		s->cpu_at += cpu;
		s->rx_at += rx;
		s->tx_at += tx;
		return;
	}
	while ((t0 = label_out_of_gap(m, t0)) < t1) {
		int64_t ws = price_window_start(t0, m->o.window_s);
		int64_t pe = ws * PRICE_NS_PER_S + wns < t1 ? ws * PRICE_NS_PER_S + wns : t1;
		int64_t g = gap_next(m, t0);
		uint64_t num, den = (uint64_t)label_len(m, t0, t1);
		bool last;
		uint64_t c, r, x;

		if (g < pe)
			pe = g;	/* up to the gap; on from its end */
		num = (uint64_t)(pe - t0);
		last = num == den;	/* the rest of the span: what is left of the amounts */
		c = last ? cpu : price_share(cpu, num, den);
		r = last ? rx : price_share(rx, num, den);
		x = last ? tx : price_share(tx, num, den);
		struct price_usage u = {
			.run_ns = st == BS_RUN ? num : 0,
			.paused_ns = st == BS_PAUSED ? num : 0,
			.cpu_ns = st == BS_RUN ? c : 0,
			.mem_mib = s->mem_mib,
			.disk_gib = s->disk_gib,
			/* The pause snapshot's size as the node recorded it; before it is known,
			 * the guest's memory (the image that dominates it). */
			.snap_mib = s->snap_mib ? s->snap_mib : s->mem_mib,
		};
		unsigned __int128 fine = st == BS_NONE ? 0 : price_fine(&m->o.card, &u);
		/* Charged at any balance: below zero it is the tenant's debt (the overdraft). */
		long long ucr = price_take(&s->rem, fine);
		struct mwin *w;

		cpu -= c;
		rx -= r;
		tx -= x;
		s->cpu_at += c;
		s->rx_at += r;
		s->tx_at += x;
		s->last_t = pe;
		s->ten->pending += ucr;
		s->ten->t_rx += r;
		s->ten->t_tx += x;
		s->t_cpu += u.cpu_ns;
		s->t_rx += r;
		s->t_tx += x;
		s->t_ucr += ucr;
		w = win_get(s, s->gen, ws, t0);
		if (!w) {
			/* Out of memory: the charge stays in `pending` and in Redis; the ledger
			 * gets it when the next window of this sandbox is flushed. */
			log_error("out of memory billing sandbox \"%s\"", s->id);
			t0 = pe;
			continue;
		}
		w->pe = pe;
		w->ucr += ucr;
		w->cpu_ns += u.cpu_ns;
		w->rx += r;
		w->tx += x;
		if (st == BS_RUN)
			w->mib_ns += (unsigned __int128)s->mem_mib * num;
		if (!w->first_read || read_at < w->first_read)
			w->first_read = read_at;
		w->state = st;
		w->gen_end = false;	/* billed on: not where its generation ended */
		w->cpu_at = s->cpu_at;
		w->rx_at = s->rx_at;
		w->tx_at = s->tx_at;
		w->rem = s->rem;
		t0 = pe;
	}
}

/* A state change of a sandbox (a row of sandbox_state_log): from `at` on, `gen` is in `st`. */
struct ment {
	long long seq;
	long long gen;
	enum bstate st;
	int64_t at;		/* ns, on the label clock (log_place()) */
	int64_t w;		/* ns, the node's wall-clock time it was logged at */
	const char *boot;	/* its witness (witness_time()): the boot id of its node's host, */
	int64_t mono;		/* and that host's CLOCK_MONOTONIC at it; boot NULL: none */
	bool exact;		/* `at` placed by that witness (log_place()) */
	const char *node;	/* its node ("" when none) */
	bool mine;		/* billed by this meter: on this node, or on a node whose meter is
				 * dead while the sandbox is here now */
	bool has_cpu;
	uint64_t cpu;		/* the generation's CPU counter at `at` (a pause's vCPU stop) */
	uint64_t snap_mib;	/* a pause: its generation's snapshot, MiB (0: unknown) */
};

/* A row of the tick's query. */
struct mrow {
	const char *id, *tenant, *state;
	long long gen;
	unsigned mem_mib, disk_gib;
	uint64_t snap_mib;
	int64_t changed, deleted, created;	/* ns; deleted 0 when not deleted */
	int64_t w_changed, w_deleted, w_created;	/* the same on the node's wall clock */
	bool here;		/* the sandbox is on this node now */
	bool has_m;
	long long m_gen;
	const char *m_state;
	const char *m_node;
	bool m_mine;		/* the billed-up-to point's generation is billed by this meter */
	int64_t m_last;
	uint64_t m_cpu, m_rx, m_tx, m_rem;
	uint64_t m_snap_mib;	/* m_gen's pause snapshot when m_gen < gen, MiB (0: none known) */
	bool m_billed;		/* m_gen marked ended or billed (its point in "none": its end) */
	/* A node whose meter is gone, with generations here taken over: its newest point's
	 * remainder, where its next generation goes on (gen_rem_switch). */
	char tk_node[ID_MAX];
	uint64_t tk_rem;
	/* The points in the ledger of the generations of such nodes: rows tk_at to tk_at + tk_n
	 * of tk_res (take_over_rems); a taken-over generation goes on from its own (tk_point). */
	const struct pg_res *tk_res;
	int tk_at, tk_n;
	const struct ment *e;	/* its state changes from its billed-up-to point on, in order */
	size_t ne;
	bool end_in_point;	/* it ends at its billed-up-to point (end_in_point_mark()) */
};

/* Whether the sandbox of `r` is done for good: stopped, failed or deleted. */
static bool row_terminal(const struct mrow *r)
{
	return r->deleted || strcmp(r->state, "stopped") == 0 || strcmp(r->state, "error") == 0;
}

static enum bstate bstate_of(const char *state)
{
	if (strcmp(state, "running") == 0)
		return BS_RUN;
	if (strcmp(state, "paused") == 0)
		return BS_PAUSED;
	return BS_NONE;
}

/* The end of the sandbox of `r` on the label clock, its deletion or its last change, whichever
 * came first; INT64_MAX while it goes on. */
static int64_t row_end(const struct mrow *r)
{
	int64_t end = INT64_MAX;

	if (!row_terminal(r))
		return end;
	if (r->deleted)
		end = r->deleted;
	if (bstate_of(r->state) == BS_NONE && r->changed < end)
		end = r->changed;
	return end;
}

/*
 * Starts tracking the sandbox of `r` from the ledger's billed-up-to point when there is one, else
 * from its creation: its state changes (r->e) say what it did since.
 */
/*
 * node_time() of a change logged with sequence `seq` (0: unknown, any): not in the frame before a
 * forward step kept for the changes logged above step_min only, when logged no later, but at
 * offset 0, where the first tick that kept that step stood before it (a change older than the
 * saved frame, logged in the frame before that frame's own backward step).
 */
static int64_t node_time_seq(const struct meter *m, int64_t w, long long seq)
{
	int64_t t = w + m->off;
	int k = m->nsteps;

	while (k > m->fwd_from && w + m->step_off[k - 1] < m->step_at[k - 1])
		k--;
	if (k < m->nsteps) {
		t = w + (seq && seq <= m->step_min[k] ? 0 : m->step_off[k]);
		if (m->step_by[k] > 0 && t >= m->step_gap[k])
			t += m->step_by[k];	/* in the held tick's time: labelled past the gap */
	}
	/* A label in the gap of a forward step this meter kept at its own first tick (made while
	 * it was down: the gap begins at that tick's label, not at a held tick's): logged after
	 * the step and before that tick, when this meter's label clock stood before the gap. Read
	 * in the gap, a restarted meter billed a paused generation up to the gap's start, past the
	 * move that ended it (kiln-sim seed 31218, 0.777 s). */
	for (int i = m->fwd_from; i < m->nsteps; i++)
		if (m->step_by[i] > 0 && m->step_gap[i] == m->step_at[i] && t >= m->step_at[i] &&
		    t < m->step_at[i] + m->step_by[i])
			t -= m->step_by[i];
	/* A label in a gap never passed: read with the offset after a backward step that came
	 * after the gap's forward step, the change was logged before both (the wall clock's times
	 * repeat after a backward step), in the frame before the newest forward step it precedes.
	 * Read in the gap, a meter without Postgres across +600 and -200 s steps billed its point
	 * from before the forward step as running up to the gap (35 s, refused by the fence). */
	for (int i = m->fwd_from - 1; i >= 0 && label_out_of_gap(m, t) != t; i--) {
		int64_t x = w + (seq && seq <= m->step_min[i] ? 0 : m->step_off[i]);

		if (x >= m->step_at[i])
			continue;	/* not before that step in the frame before it */
		if (m->step_by[i] > 0 && x >= m->step_gap[i])
			x += m->step_by[i];
		t = x;
	}
	return t;
}

/*
 * The node's wall-clock time `w` (ns) on this meter's label clock: shifted by the offset in force
 * now, or, when it was logged before forward steps this meter followed (since its last backward
 * step), in the frame in force before the oldest of them: the label it had then, before the
 * steps' gaps, the one the node's meters gave that instant live (kiln-sim `clock`, seed 9119: a
 * sandbox created while its node's meter was down, just before a 2,918 s forward step, was
 * billed from its creation read in the new frame, the step's time with it, +2,194,336 µcr;
 * seed 31174: moved on by the step, as points once were, a generation billed live by the node's
 * other meter was billed again 2,086 s later on the labels). A time after a forward step reads
 * later than where it landed, a time before it earlier than where it left (by the step).
 */
static int64_t node_time(const struct meter *m, int64_t w)
{
	return node_time_seq(m, w, 0);
}

/* The earliest wall-clock time the node may have logged for label time `t` (node_time's
 * inverse at its widest: the log is read from there). */
static int64_t node_wall_from(const struct meter *m, int64_t t)
{
	int64_t w = t - m->off;

	for (int i = m->nsteps - 1; i >= m->fwd_from; i--)
		if (t - m->step_off[i] < w)
			w = t - m->step_off[i];
	return w;
}

/* Whether a change logged with sequence `seq` (0: unknown, its log row not read) may be read in
 * the frame before the kept backward step `b` (back_min: a frame kept for the changes logged
 * after it began only). Unknown, it may, as every change did before frames kept a sequence: a
 * row's time whose log row is older than the log read, or trimmed, or a deletion logged at
 * another time than the row's. */
static bool back_usable(const struct meter *m, int b, long long seq)
{
	return !m->back_min[b] || !seq || seq > m->back_min[b];
}

/*
 * The frame a change logged with sequence `seq` (0: unknown) is read in because it was logged no
 * later than a sequence read before a kept backward step (back_pre, a restarted meter's saved
 * tick_seq): the newest frame at or before the newest such step that back_usable() allows; -1
 * when no kept step bounds it, or none of those frames allows it.
 */
static int back_covering(const struct meter *m, long long seq)
{
	int b = m->nback - 1;

	if (!seq)
		return -1;
	while (b >= 0 && !(m->back_pre[b] && seq <= m->back_pre[b]))
		b--;
	while (b >= 0 && !back_usable(m, b, seq))
		b--;
	return b;
}

/*
 * The node's wall-clock time `w` of a change already logged (ns), with log sequence `seq` (0:
 * unknown), on this meter's label clock, at the tick labelled `now`: node_time(), but
 *  - logged no later than the sequence a restarted meter's saved frame read before its flush's
 *    tick (back_pre, a backward step made while no meter of the node ran since that tick), it was
 *    logged before that step: read in the covering frame (back_covering()), never in one after
 *    it, whatever it then reads against the tick;
 *  - read ahead of the tick by more than a step's tolerance after a backward step, it was logged
 *    before that step, in the frame then in force (the newest that puts it no later than the
 *    tick and that the change may be read in: back_usable()).
 */
static int64_t node_time_logged(const struct meter *m, int64_t w, long long seq, int64_t now)
{
	int64_t t = node_time_seq(m, w, seq);
	int b = m->fwd_held ? -1 : back_covering(m, seq);

	/* Kiln-sim seed 31150: a paused sandbox's changes, logged 440 s before a -433 s step made
	 * while this meter was down, read by the tick alone in the frame after the step, past the
	 * ledger's point, and its running time billed again (+9,974 µcr). A change at or below the
	 * saved frame's tick_seq was logged before the step, so it is read in the frame before it.
	 * In a frame begun at a restart, a change at or below its log_seq may have been logged after
	 * that frame's own step and is read early: in the point, except one logged in the window
	 * that restart's meter had not closed when it crashed (docs/metering.md, Clocks, open); by
	 * the tick alone it read the later step's size late and was billed again. A forward step
	 * followed after the step moves it no more than any other (a gap of labels). */
	if (b >= 0)
		t = w + m->back_off[b];
	for (b = b >= 0 ? b - 1 : m->nback - 1;
	     b >= 0 && !m->fwd_held && t > now + STEP_TOLERANCE_NS; b--)
		if (w + m->back_off[b] <= now + STEP_TOLERANCE_NS && back_usable(m, b, seq))
			t = w + m->back_off[b];
	return t;
}

/*
 * A change's own witness (migrations/0051, record/record.h): logged on this meter's host since
 * its boot (`boot`, the boot id it was logged with, is this meter's), at `mono` on the monotonic
 * clock, it stands on the label clock at the tick's label less the monotonic time since, and less
 * the gaps the label clock jumped since (the forward steps this meter followed, or its saved
 * frame's meter did), into *t: where it happened, whatever steps the wall clock took since, the
 * label the node's meters gave that instant live. The wall-clock time
 * alone cannot place a change logged while no meter of the node ran between two steps: a
 * restarted meter sees only their net step and read such a change in a frame it never saw, a
 * step's size early, before the ledger's point, taken as in it (kiln-sim seeds 31117, a
 * deletion and a resume logged between a -2,134 s and a +123 s step, read 123 s early: -47,509
 * µcr; 31167, a deletion between two backward steps, -58,776 µcr; 31169, a resume between two
 * backward steps, +63,819 / -50,806 µcr). False when the change has no witness or one of
 * another boot (another host, a row from before 0051, a change recorded by a process with no
 * clock set): the frames read it (node_time_logged() and friends).
 */
static bool witness_time(const struct meter *m, const char *boot, int64_t mono, int64_t *t)
{
	if (!boot || !m->boot[0] || strcmp(boot, m->boot) != 0 || !m->clk_now_l)
		return false;
	*t = m->clk_now_l - (m->clk_now_m - mono);
	for (int i = m->ngaps - 1; i >= 0; i--)
		if (*t < m->gap_at[i] + m->gap_by[i])
			*t -= m->gap_by[i];	/* before the jump over this gap */
	return true;
}

/* The boot whose witnesses witness_time() reads (NULL: none, this tick): log_sql reads the
 * rows witnessed on it by their monotonic time too. */
static const char *witness_boot(const struct meter *m)
{
	return m->boot[0] && m->clk_now_l ? m->boot : NULL;
}

/* witness_time() of the witness in column `col` of row `i` of `res` ("boot_id mono_ns":
 * WITNESS_SQL; NULL, or `col` -1: none). */
static bool witness_col(const struct meter *m, const struct pg_res *res, int i, int col,
			int64_t *t)
{
	const char *v = col >= 0 ? pg_res_get(res, i, col) : NULL;
	char boot[64];
	long long mono;

	if (!v || sscanf(v, "%63s %lld", boot, &mono) != 2)
		return false;
	return witness_time(m, boot, mono, t);
}

/*
 * The change `e`, read at `t` (node_time_logged() at the tick), placed no later than `later`, the
 * time of a change of its sandbox logged after it, by more than LOG_ORDER_TOLERANCE_NS: in the
 * newest frame before a backward step this meter followed that puts it there and before that
 * step, when it was not logged LOG_LATE_NS or more after the step (its sequence past back_seq);
 * else at the earliest witnessed change logged after it (`later_exact`) when it reads past that
 * one by more than the tolerance too; else at `t`. Both checks are node_time_before()'s:
 * back_seq is read only at a tick that reaches Postgres LOG_LATE_NS or more after the step, so
 * for a meter without Postgres across the step the changes logged before it comes back have no
 * sequence bound, and only the step's
 * instant keeps a change logged after the step out of the frame before it (a pause at 120 s
 * after a step at 5 s, the meter down from 3 s to 130 s: 14,100 µcr for 23,130). Only past the
 * tolerance: the log's times are not monotone in its sequence, and moved by the step's
 * tolerance, a pause at 30 s that a stop logged after it but stamped 28 s (its node's clock) put
 * in the frame before a 100 s backward step stood 100 s early, raised to the point at 20 s: 8 s
 * of running time billed as paused.
 */
static int64_t log_time_before(const struct meter *m, const struct ment *e, int64_t t,
			       int64_t later, int64_t later_exact)
{
	if (m->fwd_held || t <= later + LOG_ORDER_TOLERANCE_NS)
		return t;
	for (int b = m->nback - 1; b >= 0; b--) {
		int64_t x = e->w + m->back_off[b];

		if (x >= m->back_at[b])
			continue;	/* not before that step in the frame before it */
		if (!back_usable(m, b, e->seq))
			continue;	/* a frame kept for the changes logged after it began */
		if (m->back_seq[b] && e->seq > m->back_seq[b])
			continue;	/* logged well after that step */
		if (x <= later + LOG_ORDER_TOLERANCE_NS)
			return x;
	}
	/* No frame kept puts it there (one of a step this meter did not follow, or another node's
	 * change without a witness this meter can read): at the earliest witnessed change logged
	 * after it (`later_exact`, exact, so it came before that), when it reads past that one
	 * too; a later change placed by the frames may itself stand a step early, so only a
	 * witnessed one bounds it here. Left where it read, it stood past every tick's billing
	 * end, and the pieces, which stop at the first change past the end, never reached the
	 * changes after it (kiln-sim seed 31460: another node's pause placed 3,403 s late, the
	 * sandbox's start on this node, witnessed and logged after it, never billed,
	 * -85,901 µcr). */
	if (later_exact != INT64_MAX && t > later_exact + LOG_ORDER_TOLERANCE_NS)
		return later_exact;
	return t;
}

/*
 * Places a sandbox's changes `e` (`n` of them, in the log's order) on the label clock at this
 * tick, the newest first: each witnessed on this meter's boot exactly (witness_time(), moved by
 * no frame), each without such a witness at node_time_logged() at the tick's label (clk_now_l, as
 * gen_point() and tail_bill() read times), then no later than the changes logged after it: in a
 * kept backward-step frame that allows it, else no later than the earliest witnessed one
 * (log_time_before()). Not at the tick's billing end (the
 * label less m->lag): a change read between the two was logged in this frame, and placed by
 * the end it was moved into the frame before a backward step, the step's size early.
 * One sandbox's changes are logged in the order they happen, and the wall clock's times repeat
 * after a backward step, so a change logged before the step that the offset after it puts
 * before the tick can still read after the sandbox's later changes: it was logged in the frame
 * before. Read by the tick alone, a resume on another node logged 434 s before a 601 s backward
 * step stood 30.5 s past the sandbox's move to this node, and the moved generation was billed
 * from there (kiln-sim seed 31140: node 1's meter, down across the move, first read the
 * sandbox 176 s after the step; -13,657 µcr); a meter that tracked a sandbox again from a
 * generation left short of its end in the ledger, 395 s after a 443 s backward step it followed,
 * read that generation's pause, logged 107 s before the step, 443 s late, past the point, and
 * billed the generation again (kiln-sim seed 31121, +161,538 µcr). The log's times are not
 * monotone in its sequence (LOG_ORDER_TOLERANCE_NS): a change is moved only when it reads past a
 * later one by more than that, and only among the changes read. `later` is the earliest of all
 * the changes logged after e[k], so one later change placed a step early (a wrong offset before
 * a step) places every earlier change not yet applied no later than itself, where the tick
 * alone misread that one change only. A witnessed change is never moved, so a change without
 * one placed a step early could stand before a witnessed change logged before it (a paused
 * sandbox deleted by kiln-gateway, record_delete_unheld(); nodes_mark_down()): each change
 * without a witness stands no earlier than the latest witnessed change logged before it, and is
 * kept there before it bounds the changes logged before it (`later`).
 */
static void log_place(const struct meter *m, struct ment *e, size_t n)
{
	int64_t later = INT64_MAX;	/* the earliest of the changes logged after e[k] */
	int64_t later_exact = INT64_MAX;	/* ... of those witnessed */
	int64_t seen = INT64_MIN;	/* the latest witnessed change logged before e[k] */

	/* The witnessed first, in the log's order: a change without one holds, until placed
	 * below, the floor it stands no earlier than. */
	for (size_t k = 0; k < n; k++) {
		e[k].exact = witness_time(m, e[k].boot, e[k].mono, &e[k].at);
		if (!e[k].exact)
			e[k].at = seen;
		else if (e[k].at > seen)
			seen = e[k].at;
	}
	/* Then newest first, each change without a witness kept at its floor before it bounds the
	 * earlier ones: unclamped, a change placed a step early after a witnessed one moved an
	 * earlier change into an earlier frame, though the witnessed one between bounds it. */
	for (size_t k = n; k-- > 0;) {
		if (!e[k].exact) {
			int64_t floor = e[k].at;

			e[k].at = node_time_logged(m, e[k].w, e[k].seq, m->clk_now_l);
			if (later != INT64_MAX)
				e[k].at = log_time_before(m, &e[k], e[k].at, later, later_exact);
			if (e[k].at < floor)
				e[k].at = floor;
		} else if (e[k].at < later_exact) {
			later_exact = e[k].at;
		}
		if (e[k].at < later)
			later = e[k].at;
	}
}

/*
 * The node's wall-clock time `w` of a generation's start, logged in a frame of this meter's clock
 * before the one node_time() takes (the wall clock's times repeat after a backward step), on the
 * label clock, such that what is billed of the generation from there (`billed`, ns) ends no later
 * than its end (`end`, on the label clock): the latest of the frames before a forward or a
 * backward step this meter followed that puts `w` before that step; else `end` less `billed`
 * (all of the generation is billed; real time, over the label clock's gaps: label_sub()).
 * Not the frame before a step when the start was logged LOG_LATE_NS or more after it (its log
 * sequence `seq` past the one read then, step_seq/back_seq): its time is after the step. Moved
 * there, a point past its end because the end was logged late (the writer billed past it), not
 * because the start was read in the wrong frame, stood the step's size early, and the generation
 * was billed again from there (a step of -320 s 67 s before the start, the end logged 2 s before
 * the writer's last flushed tick: 92,006 µcr for 10,280).
 */
static int64_t node_time_before(const struct meter *m, int64_t w, long long seq, int64_t billed,
				int64_t end)
{
	int64_t best = label_sub(m, end, billed);
	bool found = false;

	for (int k = 0; k < m->nsteps + m->nback; k++) {
		bool fwd = k < m->nsteps;
		int64_t x, p;
		long long after = fwd ? m->step_seq[k] : m->back_seq[k - m->nsteps];

		/* In the frame before a forward step as node_time_seq() reads it: kept for the
		 * changes logged above step_min only, an older one at offset 0. */
		x = w + (!fwd ? m->back_off[k - m->nsteps] :
			 seq && seq <= m->step_min[k] ? 0 : m->step_off[k]);
		if (x >= (fwd ? m->step_at[k] : m->back_at[k - m->nsteps]))
			continue;	/* not before that step in the frame before it */
		if (seq && after && seq > after)
			continue;	/* logged well after that step */
		if (!fwd && !back_usable(m, k - m->nsteps, seq))
			continue;	/* logged before the frame kept for that step began */
		p = x;
		/* In the held tick's time, labelled past the gap (node_time_seq()): left at its
		 * label before the gap, inside it, label_add() began it at the gap's end, up to
		 * the held tick's length early. */
		if (fwd && m->step_by[k] > 0 && x >= m->step_gap[k])
			p += m->step_by[k];
		if (label_add(m, p, billed) <= end && (!found || p > best)) {
			best = p;
			found = true;
		}
	}
	return best;
}

/*
 * A point in the ledger of a generation (columns `col`, its first state change's time, µs, and
 * `col` + 1, how far its billed time reaches past its first window's start, ns: GEN_START_SQL,
 * GEN_BILLED_SQL; `end_col`, when not -1, the first change of a later generation, µs, NULL while
 * there is none: GEN_END_SQL; `seq_col`, that first change's log sequence: GEN_START_SEQ_SQL, and
 * `seq_col` + 1, when `end_col` is not -1, the end's: GEN_END_SEQ_SQL) on this meter's label
 * clock, into *t: where this meter places the generation's start, plus what is
 * billed of it. The point itself is a label of the clock of the
 * meter that wrote it, which may run far from this one's (one followed a clock step, the other,
 * restarted without its frame, did not): read as a label here, a generation taken over from
 * another node was billed again from its start, under labels 281 s from the other meter's, which
 * the ledger's fence, comparing labels, took (kiln-sim `clock`, seed 524333160, +106,769 µcr). A
 * generation's billed time is a prefix of it, and its length (its windows' billed periods,
 * GEN_BILLED_SQL) is the same on every clock, real time: the point is that far past the start
 * over the gaps of this meter's label clock between (label_add()). The windows hold no time of
 * a gap of their writer's, but for the part of one inside a window the writer billed on both
 * sides of it (a step shorter than a window): counted as billed, the point stands that much
 * late (open).
 * Not the point less its first window's start on the writer's labels: those jumped by each
 * forward step the writer followed, so a step both meters followed counted twice. A generation
 * taken over across steps of +3,247 and +1,184 s read as billed 4,429 s past its end, and the
 * next generation, billed from there, was charged nothing (kiln-sim `clock`, seed 796674514,
 * -105,506 µcr). The point never stands past the generation's end: placed there, the start was
 * logged in an earlier frame (node_time_before()). A start logged before a forward step that a
 * larger backward step then followed reads, with the offset after both, in the frame after the
 * backward step, the difference of the two steps late: node 0's meter took over a generation of
 * node 1 started before steps of +2,070 and -2,267 s and placed its point 134.6 s past its end,
 * and the next generation, billed from there, was charged nothing (kiln-sim seed 31014, one hour
 * of make test's kinds, -90,397 µcr). A point past the end by no more than a step's tolerance
 * is the end: the writer billed past it (an end logged late, after its tick flushed the time), no
 * start read in another frame; moved into an earlier frame, the point stood a backward step's size
 * early and the generation was billed again from there. False when the generation has no window
 * or no change logged. The start and the end are placed by their witnesses first
 * (witness_time(): `wit_col` the start's, GEN_START_WIT_SQL, and `wit_col` + 1, when `end_col` is
 * not -1, the end's, GEN_END_WIT_SQL; -1: none read), by the frames when they have none.
 * Open: with the start witnessed and the end not, an end the frames place a step early pulls
 * the exactly placed start's point back to it (`exact && *t > end`), and the search of
 * node_time_before() is no better (docs/metering.md, Clocks).
 */
static bool gen_point(const struct meter *m, const struct pg_res *res, int i, int col, int end_col,
		      int seq_col, int wit_col, int64_t *t)
{
	int64_t w, billed, end;
	long long seq;
	bool exact;

	if (!pg_res_get(res, i, col) || !pg_res_get(res, i, col + 1))
		return false;
	w = pg_res_int(res, i, col, 0) * 1000;
	billed = pg_res_int(res, i, col + 1, 0);
	seq = pg_res_int(res, i, seq_col, 0);
	exact = witness_col(m, res, i, wit_col, t);
	if (!exact)
		*t = node_time_logged(m, w, seq, m->clk_now_l);
	*t = label_add(m, *t, billed);
	if (end_col >= 0 && pg_res_get(res, i, end_col)) {
		if (!witness_col(m, res, i, wit_col >= 0 ? wit_col + 1 : -1, &end))
			end = node_time_logged(m, pg_res_int(res, i, end_col, 0) * 1000,
					       pg_res_int(res, i, seq_col + 1, 0), m->clk_now_l);
		if (exact && *t > end)
			*t = end;	/* a start placed exactly: billed past the end, no frame */
		else if (*t > end + STEP_TOLERANCE_NS)
			*t = label_add(m, node_time_before(m, w, seq, billed, end), billed);
		else if (*t > end)
			*t = end;	/* billed past it, not read in another frame */
	}
	return true;
}

/*
 * The ledger's point of generation `gen` of `r`, taken over from `node` (take_over_rems), on this
 * meter's label clock (gen_point()) into *t, with its CPU counter and remainder: false when it
 * has none (its node's meter never flushed it). A taken-over generation goes on from there: what
 * that node's meter billed is in the ledger.
 */
static bool tk_point(const struct meter *m, const struct mrow *r, long long gen, const char *node,
		     int64_t *t, uint64_t *cpu, uint64_t *rem)
{
	for (int k = r->tk_at; k < r->tk_at + r->tk_n; k++)
		if (pg_res_int(r->tk_res, k, 3, 0) == gen &&
		    strcmp(pg_res_str(r->tk_res, k, 1), node) == 0) {
			if (!gen_point(m, r->tk_res, k, 4, 7, 8, 10, t))
				return false;
			*cpu = (uint64_t)pg_res_int(r->tk_res, k, 6, 0);
			*rem = (uint64_t)pg_res_int(r->tk_res, k, 2, 0) % PRICE_FINE_PER_UCR;
			return true;
		}
	return false;
}

static struct msb *sb_track(struct meter *m, const struct mrow *r, int64_t now)
{
	struct msb *s = sb_add(m, r->id, r->tenant);

	(void)now;
	if (!s)
		return NULL;
	s->mem_mib = r->mem_mib;
	s->disk_gib = r->disk_gib;
	snprintf(s->gnode, sizeof(s->gnode), "%s", m->node);
	if (r->has_m && r->m_mine && r->m_gen <= r->gen) {
		/* Its generation's billed-up-to point (of this node's, or taken over). */
		snprintf(s->gnode, sizeof(s->gnode), "%s", r->m_node);
		s->gen = r->m_gen;
		s->state = bstate_of(r->m_state);
		s->mine = r->m_mine;
		s->last_t = r->m_last;	/* a label: the gaps since are skipped as it is billed on */
		s->cpu_at = r->m_cpu;
		s->rx_at = r->m_rx;
		s->tx_at = r->m_tx;
		s->rem = r->m_rem % PRICE_FINE_PER_UCR;
		/* An earlier generation's paused time still to bill: at its snapshot's size (a
		 * meter that never saw it, restarted after the resume, reads it here). */
		if (r->m_gen < r->gen)
			s->snap_mib = r->m_snap_mib;
		return s;
	}
	/* Never billed here: from its creation, in no state until its first change says one
	 * (another node's point is not where this node's time stands). */
	s->gen = r->e && r->ne ? r->e[0].gen : r->gen;
	if (r->e && r->ne && *r->e[0].node)
		snprintf(s->gnode, sizeof(s->gnode), "%s", r->e[0].node);
	s->rem = 0;
	s->state = BS_NONE;
	s->mine = r->e && r->ne ? r->e[0].mine : r->here;
	s->last_t = r->e && r->ne && r->e[0].at < r->created ? r->e[0].at : r->created;
	return s;
}

/* Reads the cumulative counters of `s`: false for each that cannot be read. */
static void sb_read(struct meter *m, struct msb *s, bool *has_cpu, uint64_t *cpu, uint64_t *mem,
		    bool *has_net, uint64_t *rx, uint64_t *tx)
{
	struct cg_usage u;
	struct kiln_counters k;
	struct kiln_error err = { 0 };

	*has_cpu = *has_net = false;
	*cpu = *mem = *rx = *tx = 0;
	if (!s->cg && cg_open(m->cg_root[0] ? m->cg_root : NULL, m->node, s->id, &s->cg) < 0)
		s->cg = NULL;
	if (s->cg) {
		if (cg_read(s->cg, &u) == 0) {
			*has_cpu = true;
			*cpu = u.cpu_ns;
			*mem = u.mem_bytes;
		} else {
			cg_free(s->cg);
			s->cg = NULL;
		}
	}
	if (m->pin_root[0] != '-' &&
	    kiln_counters_read_pinned(m->pin_root[0] ? m->pin_root : NULL, m->node, s->id, &k, &err) ==
		    KILN_OK) {
		*has_net = true;
		/* From the sandbox's point of view: what it received and what it sent. */
		*rx = k.rx_bytes;
		*tx = k.tx_bytes;
	}
}

/* A stretch of a sandbox's time in one generation and state, between two of its changes. */
struct mpiece {
	int64_t t0, t1;
	long long gen;
	const char *node;	/* the node of `gen` */
	enum bstate st;
	bool mine;
	bool has_cpu;		/* the generation's CPU counter at t1 is known */
	uint64_t cpu;
};

#define PIECES_MAX 64

/* The pause snapshot of `r`'s ended generation `gen` as its changes name it, MiB (0: unknown). */
static uint64_t row_gen_snap(const struct mrow *r, long long gen)
{
	for (size_t i = 0; i < r->ne; i++)
		if (r->e[i].gen == gen && r->e[i].snap_mib)
			return r->e[i].snap_mib;
	return 0;
}

/*
 * The sub-µcr remainder as `s` (of row `r`) goes on to a generation of `node`: a sandbox's
 * generations on one node carry one remainder from each to the next, whichever meter bills them
 * (a meter that starts from the ledger takes its node's newest point's). A generation of another
 * node this meter takes over starts from that node's newest point's remainder (r->tk_rem: kiln-sim
 * `clock`, seed 9244: a generation taken over from zero was charged 1 µcr less than that node's
 * meter would have), and the remainder of this node's generations waits for the next one of
 * them: a taken-over generation never moves it.
 */
static void gen_rem_switch(struct meter *m, struct msb *s, const struct mrow *r, const char *node)
{
	bool home = strcmp(s->gnode, m->node) == 0, home_next = strcmp(node, m->node) == 0;
	uint64_t other = strcmp(node, r->tk_node) == 0 ? r->tk_rem : 0;

	if (home && !home_next) {
		s->rem_home = s->rem;
		s->rem = other;
	} else if (!home && home_next) {
		s->rem = s->rem_home;
		s->rem_home = 0;
	} else if (!home && strcmp(s->gnode, node) != 0) {
		s->rem = other;
	}
}

/*
 * Records the end of the generation `s` bills (s->gen, this meter's) at s->last_t as billed state
 * "none", so the ledger knows that generation is done: when the sandbox ends, and when its next
 * generation is billed in the same tick (a generation left in its last state was read again by
 * every tick as one that went on on another node without its end: rows_sql). With nothing
 * unflushed, in the window that starts at its end or holds it: the window before an end on a
 * boundary is in the ledger already, and meter_flush() would skip it whole, leaving the sandbox
 * billed as running and read again on every tick. The window is marked as the generation's
 * end, which the flush records with its point (meter_sandboxes.ended) and the tick's query asks
 * for: a generation of no length or priced 0 is ended as well as one that billed something.
 * Call before s->gen moves on.
 */
static void sb_gen_end(struct meter *m, struct msb *s, int64_t now)
{
	struct mwin *w = s->nw && !s->w[s->nw - 1].inflight && s->w[s->nw - 1].gen == s->gen
			       ? &s->w[s->nw - 1]
			       : win_get(s, s->gen, price_window_start(s->last_t, m->o.window_s),
					 s->last_t);

	if (!w)
		return;
	if (!w->pe) {
		w->pe = s->last_t;
		w->first_read = now;
		w->cpu_at = s->cpu_at;
		w->rx_at = s->rx_at;
		w->tx_at = s->tx_at;
		w->rem = s->rem;
	}
	w->state = BS_NONE;
	w->gen_end = true;
}

/* Generation `gen` of sandbox `id` watched (m->cuts), once. */
static void cut_watch(struct meter *m, const char *id, long long gen)
{
	for (size_t k = 0; k < m->ncuts; k++)
		if (m->cuts[k].gen == gen && strcmp(m->cuts[k].id, id) == 0)
			return;
	if (m->ncuts == m->capcuts) {
		size_t cap = m->capcuts ? m->capcuts * 2 : 8;
		struct mcut *a = realloc(m->cuts, cap * sizeof(*a));
		if (!a) {
			log_error("out of memory watching sandbox \"%s\" generation %lld", id, gen);
			return;
		}
		m->cuts = a;
		m->capcuts = cap;
	}
	m->cuts[m->ncuts] = (struct mcut){ .gen = gen };
	snprintf(m->cuts[m->ncuts].id, sizeof(m->cuts[m->ncuts].id), "%s", id);
	m->ncuts++;
}

/*
 * A generation `s` took over from another node stopped being its own part-way (sb_bill()'s
 * `cut`): its window holding that point is dropped unflushed, so that the ledger's point of the
 * generation stays at the end of a whole window (or there is none) and whoever bills the rest
 * (its node's meter, or the tails path from the ledger's point) bills it from there into windows
 * of its own. Flushed, that window held only part of its time, and the rest, billed later under
 * the same window start, was dropped by the flush (a window's start is written once). One being
 * flushed stays (the commit decides). The generation is watched (m->cuts): when that window was
 * all this meter billed of it and its node's meter dies again before flushing any of it, the
 * ledger has no point of it for the tails path, which then bills it from its start
 * (meter_take_tails()).
 */
static void sb_cut(struct meter *m, struct msb *s)
{
	int64_t ws = price_window_start(s->last_t, m->o.window_s);
	size_t keep = 0;

	for (size_t k = 0; k < s->nw; k++) {
		if (s->w[k].gen == s->gen && s->w[k].ws == ws && !s->w[k].inflight) {
			s->ten->pending -= s->w[k].ucr;
			continue;
		}
		s->w[keep++] = s->w[k];
	}
	s->nw = keep;
	cut_watch(m, s->id, s->gen);
}

/*
 * Whether the change `e` (read where the pieces `pc` reach, or earlier) ends a generation `gen`
 * of this node later than the one `s` bills, begun in this tick's changes and with no piece yet: a generation of no length on the label clock (its next change placed at or before its
 * start after a backward step, or two restores in one transaction). It gets a piece of no
 * length, so its end is recorded like any other's (sb_gen_end()); skipped, it had no point in the
 * ledger, and the tick's query read its stretch again on every tick (rows_sql).
 */
static bool gen_of_no_length(const struct meter *m, const struct msb *s, const struct mpiece *pc,
			     size_t np, const struct ment *e, long long gen, bool mine, const char *node)
{
	return e->gen != gen && gen > s->gen && mine && strcmp(node, m->node) == 0 &&
	       (np == 0 || pc[np - 1].gen != gen);
}

/*
 * Bills the sandbox `s` of row `r` up to `now`, piece by piece over its state changes since its
 * billed-up-to point (r->e): each piece in its own state, under its own generation, when that
 * generation is this node's (another node's meter bills the others). CPU is the cumulative
 * counter's delta: up to a change that recorded the counter (a pause's vCPU stop) the running
 * time before it gets exactly its delta, and what the VM used after (writing the snapshot) is
 * left out; the current generation's running time since gets what the cgroup shows now. Time
 * between a change and the moment it is recorded is billed when it is recorded, in the right
 * state, as long as its window is not in the ledger yet.
 */
static void sb_bill(struct meter *m, struct msb *s, const struct mrow *r, int64_t now)
{
	struct mpiece pc[PIECES_MAX];
	int64_t end = now, t, from = INT64_MIN;	/* from: a taken-over generation's ledger point */
	enum bstate cur_st = s->state;
	long long cur_gen = s->gen;
	const char *cur_node = s->gnode;
	bool cur_mine = s->mine;
	uint64_t cpu = 0, mem = 0, rx = 0, tx = 0;
	bool has_cpu = false, has_net = false, ended = false;
	/* cut: the generation this meter took over from another node stopped being its own
	 * part-way, at a change of it logged by that node whose meter is alive again: that meter
	 * bills the rest and records the end, or, dead again, the tails path bills it from the
	 * ledger's point (meter_take_tails()); this meter's window holding the cut is dropped
	 * (sb_cut()). With Redis unreadable the take-over goes on (meter_take_over()). Before, the
	 * pieces after such a change were billed with those before it and the end recorded where
	 * this meter stopped: the other meter, its copy refused, billed on from that point and
	 * took it for the end (1,140 µcr for 1,412:
	 * test_a_taken_over_generation_its_meter_takes_back_part_way_is_billed_once); and the
	 * ledger refuses a window of a generation after its end (migrations/0055). */
	bool cut = false;
	size_t np = 0;

	s->mem_mib = r->mem_mib;
	s->disk_gib = r->disk_gib;
	/* A generation has one pause snapshot at most; a resume (a new generation) drops it from
	 * the row, so an earlier generation's paused time still to bill keeps the size seen, or
	 * takes the one its pause row names: a meter that could not read while the generation
	 * paused and ended (its Postgres away) never saw it in the row. */
	if (r->gen == s->gen) {
		s->snap_mib = r->snap_mib;
	} else {
		uint64_t g = row_gen_snap(r, s->gen);
		if (g)
			s->snap_mib = g;
	}
	if (row_terminal(r)) {
		/* It ends at its deletion or its last change, whichever came first; a time still
		 * ahead of this meter's clock (clocks of two hosts differ) is waited for, unless
		 * the end's log row is in the point (end_in_point_mark()): then it ends there. */
		int64_t tend = r->end_in_point ? s->last_t : row_end(r);
		if (tend <= now) {
			end = tend;
			ended = true;
		}
	}
	if (end < s->last_t)
		end = s->last_t;
	/* The pieces: from last_t to each change (in the state before it), then to `end`. */
	t = s->last_t;
	for (size_t i = 0; i < r->ne; i++) {
		const struct ment *e = &r->e[i];
		if (e->at > end)
			break;
		if (np == PIECES_MAX - 1) {
			/* More changes than pieces: the rest next tick, from this one on. */
			end = t;
			ended = false;
			break;
		}
		if (e->seq > s->seq)
			s->seq = e->seq;
		if (e->gen == s->gen && !e->mine && s->mine && strcmp(s->gnode, m->node) != 0)
			cut = true;	/* even with no piece after it */
		if (e->at > t) {
			pc[np++] = (struct mpiece){ .t0 = t, .t1 = e->at, .gen = cur_gen, .st = cur_st,
						    .mine = cur_mine, .node = cur_node,
						    .has_cpu = e->has_cpu && e->gen == cur_gen,
						    .cpu = e->cpu };
			t = e->at;
		} else if (np && e->has_cpu && e->gen == pc[np - 1].gen && e->at == pc[np - 1].t1) {
			pc[np - 1].has_cpu = true;
			pc[np - 1].cpu = e->cpu;
		}
		if (gen_of_no_length(m, s, pc, np, e, cur_gen, cur_mine, cur_node))
			pc[np++] = (struct mpiece){ .t0 = t, .t1 = t, .gen = cur_gen, .st = cur_st,
						    .mine = true, .node = cur_node };
		cur_gen = e->gen;
		cur_st = e->st;
		cur_mine = e->mine;
		cur_node = *e->node ? e->node : m->node;
	}
	if (end > t || np == 0)
		pc[np++] = (struct mpiece){ .t0 = t, .t1 = end > t ? end : t, .gen = cur_gen,
					    .st = cur_st, .mine = cur_mine, .node = cur_node };
	/* The cgroup of this node holds the counters of the generation it runs now; one that
	 * ended since the last read holds its final counter while the group is still there. A
	 * tick that holds a forward step, billed to the second before, leaves a running
	 * sandbox's counters to the next: they hold the time after it too. */
	if (r->here && cur_mine && cur_gen == r->gen && (!m->fwd_held || ended)) {
		if (cur_gen != s->gen) {
			cg_free(s->cg);
			s->cg = NULL;
		}
		sb_read(m, s, &has_cpu, &cpu, &mem, &has_net, &rx, &tx);
		/* A counter logged at the piece's end (a deletion's) is the VM's own; the group
		 * read after it may hold the teardown's CPU too, or be gone. */
		if (!pc[np - 1].has_cpu) {
			pc[np - 1].has_cpu = has_cpu;
			pc[np - 1].cpu = cpu;
		}
	}
	s->t_mem = mem;
	for (size_t i = 0; i < np;) {
		/* A group: pieces of one generation, all this meter's or none, up to one whose end
		 * counter is known. */
		size_t j = i;
		uint64_t dcpu = 0, drx = 0, dtx = 0, run = 0, all = 0;
		while (j + 1 < np && pc[j + 1].gen == pc[i].gen && pc[j + 1].mine == pc[i].mine &&
		       !pc[j].has_cpu)
			j++;
		if (!pc[i].mine) {
			/* Another node's generation: its meter bills it (one this meter took over
			 * follows the change that set `cut`). An earlier one of a sandbox here is
			 * watched as a cut one is: when that meter dies again before it flushed any
			 * of it, nobody else bills it (a restart of this meter lost what it had
			 * taken over: test_a_generation_left_to_its_meter_after_the_takers_restart_is_billed_once). */
			if (r->here && pc[i].gen < r->gen && strcmp(pc[i].node, m->node) != 0)
				cut_watch(m, s->id, pc[i].gen);
			i = j + 1;
			continue;
		}
		if (pc[i].gen != s->gen) {
			/* A new generation (restored, moved): its counters start from zero; the
			 * generation before, when this meter billed it, ended where it stands (not
			 * recorded again when its point says so already). */
			if (s->mine && s->state != BS_NONE && !cut)
				sb_gen_end(m, s, now);
			else if (cut)
				sb_cut(m, s);
			cut = false;
			s->gen = pc[i].gen;
			s->mine = true;
			gen_rem_switch(m, s, r, pc[i].node);
			if (pc[i].node != s->gnode)
				snprintf(s->gnode, sizeof(s->gnode), "%s", pc[i].node);
			s->cpu_at = s->rx_at = s->tx_at = 0;
			s->snap_mib = pc[i].gen == r->gen ? r->snap_mib : row_gen_snap(r, pc[i].gen);
			/* Taken over from another node: from its own point in the ledger when its
			 * node's meter flushed it (that meter billed the time before). */
			from = INT64_MIN;
			if (strcmp(pc[i].node, m->node) != 0)
				tk_point(m, r, pc[i].gen, pc[i].node, &from, &s->cpu_at, &s->rem);
		}
		if (from > pc[i].t0) {
			for (size_t k = i; k <= j; k++)
				if (pc[k].t0 < from)
					pc[k].t0 = pc[k].t1 < from ? pc[k].t1 : from;
			if (pc[j].t1 <= from) {
				/* All of it in the ledger before the point. A generation a later one
				 * ended is its own node's meter's to end: this meter billed none of
				 * it, and an end recorded here at its stale point would overlap
				 * that meter's windows and be refused at every flush. */
				s->state = pc[j].gen != r->gen ? BS_NONE : pc[j].st;
				i = j + 1;
				continue;
			}
		}
		if (pc[j].has_cpu) {
			if (pc[j].cpu < s->cpu_at)
				s->cpu_at = 0;	/* restarted: the counter began again */
			dcpu = pc[j].cpu - s->cpu_at;
		}
		if (j == np - 1 && has_net) {
			if (rx < s->rx_at || tx < s->tx_at)
				s->rx_at = s->tx_at = 0;
			drx = rx - s->rx_at;
			dtx = tx - s->tx_at;
		}
		for (size_t k = i; k <= j; k++) {	/* real time: no gap's labels */
			all += (uint64_t)label_len(m, pc[k].t0, pc[k].t1);
			if (pc[k].st == BS_RUN)
				run += (uint64_t)label_len(m, pc[k].t0, pc[k].t1);
		}
		{
			uint64_t c_left = dcpu, r_left = drx, x_left = dtx;
			for (size_t k = i; k <= j; k++) {
				uint64_t d = (uint64_t)label_len(m, pc[k].t0, pc[k].t1), c = 0, rr, xx;
				bool last_run = true;
				for (size_t q = k + 1; q <= j; q++)
					if (pc[q].st == BS_RUN)
						last_run = false;
				if (pc[k].st == BS_RUN)
					c = last_run ? c_left : (run ? price_share(dcpu, d, run) : 0);
				rr = k == j ? r_left : (all ? price_share(drx, d, all) : 0);
				xx = k == j ? x_left : (all ? price_share(dtx, d, all) : 0);
				c_left -= c;
				r_left -= rr;
				x_left -= xx;
				bill_span(m, s, pc[k].t0, pc[k].t1, pc[k].st, c, rr, xx, now);
				s->state = pc[k].st;
			}
			/* CPU measured while not running (booting, writing a pause snapshot) moves
			 * the counter unbilled. */
			s->cpu_at += c_left;
			s->rx_at += r_left;
			s->tx_at += x_left;
		}
		i = j + 1;
	}
	if (cur_mine && cur_gen != s->gen) {
		/* Back on this node under a new generation at `end` exactly: billed from there.
		 * The pieces before it were another node's (none billed here moved last_t), so
		 * the point still stood where tracking began, the sandbox's creation when it was
		 * never billed here: a sandbox moved here at the instant of this meter's tick was
		 * billed from its creation under its new generation, the time the old node's meter
		 * billed again (15,420 µcr for 10,280:
		 * test_a_sandbox_moved_at_the_new_nodes_tick_is_billed_from_the_move). */
		if (s->mine && s->state != BS_NONE && !cut)
			sb_gen_end(m, s, now);
		else if (cut)
			sb_cut(m, s);
		cut = false;
		if (s->last_t < end)
			s->last_t = end;
		s->gen = cur_gen;
		s->mine = true;
		gen_rem_switch(m, s, r, cur_node);
		if (cur_node != s->gnode)
			snprintf(s->gnode, sizeof(s->gnode), "%s", cur_node);
		s->cpu_at = s->rx_at = s->tx_at = 0;
		s->snap_mib = cur_gen == r->gen ? r->snap_mib : row_gen_snap(r, cur_gen);
	}
	if (cur_mine)
		s->state = cur_st;
	if (!cur_mine && !ended) {
		/* Its generation now is another node's: this meter's part ends at its last piece. */
		ended = true;
	}
	if (!ended && s->state != BS_NONE) {
		/* What it costs now, per second: its allocation, and CPU at this tick's pace. */
		int64_t span = end > s->t_start ? label_len(m, s->t_start, end) : end - s->t_start;
		struct price_usage u = {
			.run_ns = s->state == BS_RUN ? (uint64_t)PRICE_NS_PER_S : 0,
			.paused_ns = s->state == BS_PAUSED ? (uint64_t)PRICE_NS_PER_S : 0,
			.cpu_ns = s->state == BS_RUN && span > 0
					  ? price_share(s->t_cpu, (uint64_t)PRICE_NS_PER_S, (uint64_t)span)
					  : 0,
			.mem_mib = s->mem_mib,
			.disk_gib = s->disk_gib,
			.snap_mib = s->snap_mib ? s->snap_mib : s->mem_mib,
		};
		if (span > 0 && (uint64_t)span < (uint64_t)PRICE_NS_PER_S && u.cpu_ns > s->t_cpu * 4)
			u.cpu_ns = s->t_cpu;	/* a sliver of a tick says little about the pace */
		s->ten->t_burn += price_fine(&m->o.card, &u);
	}
	if (ended && (!s->mine || cut)) {
		/* None of its time was this node's, or the rest of it is not: nothing to record.
		 * Cut, the rest is not this meter's to bill when the sandbox is read again. */
		if (cut) {
			sb_cut(m, s);
			s->mine = false;
		}
		s->ended = true;
		s->state = BS_NONE;
		s->ten->nsb--;
		cg_free(s->cg);
		s->cg = NULL;
	} else if (ended) {
		sb_gen_end(m, s, now);
		s->ended = true;
		s->state = BS_NONE;
		s->ten->nsb--;
		cg_free(s->cg);
		s->cg = NULL;
	}
}

/*
 * The pause snapshot (MiB) of generation G of sandbox X: the one recorded with that generation
 * (snapshots.generation, written with the snapshot in the pause's transaction: migrations/0041).
 * Not by time: after a backward step of the wall clock between a pause and the resume, the
 * resume reads earlier than the snapshot (kiln-sim `clock`, seeds 627238415 and 497680908: the
 * paused time billed at the guest's memory, +553 and +1,091 µcr), and the pause's own log row,
 * the vCPUs' stop, is written before the snapshot's. A snapshot recorded before that column
 * (generation NULL) is found as it was then: the newest made before the next generation's first
 * change in the log's order (none while G has not ended).
 */
#define GEN_SNAP_SQL(X, G)                                                                         \
	"coalesce((SELECT (sn.size_bytes + 1048575) / 1048576 FROM snapshots sn "                  \
	"    WHERE sn.sandbox_id = " X " AND sn.kind = 'pause' AND sn.generation = " G " "         \
	"    ORDER BY sn.created_at DESC LIMIT 1), "                                                \
	"(SELECT (sn.size_bytes + 1048575) / 1048576 FROM snapshots sn "                           \
	"    WHERE sn.sandbox_id = " X " AND sn.kind = 'pause' AND sn.generation IS NULL "         \
	"    AND sn.created_at <= (SELECT n.at FROM sandbox_state_log n "                          \
	"        WHERE n.sandbox_id = " X " AND n.generation > " G " ORDER BY n.seq LIMIT 1) "     \
	"    ORDER BY sn.created_at DESC LIMIT 1))"

/* The state changes of generation G of X that the SQL condition W on `l` keeps, as tail_bill()
 * reads them: "<state> <at, µs> <cpu_ns, -1: none> <seq>" each, comma-separated, in the log's
 * order (NULL: none). */
#define GEN_CHANGES_SQL(X, G, W)                                                                   \
	"(SELECT string_agg(l.state || ' ' || ((extract(epoch FROM l.at) * 1000000)::bigint)::text " \
	"    || ' ' || coalesce(l.cpu_ns, -1)::text || ' ' || l.seq::text, ',' ORDER BY l.seq) "    \
	"    FROM sandbox_state_log l WHERE l.sandbox_id = " X " AND l.generation = " G " "         \
	"    AND " W ")"

/* The time (µs) of the first state change of generation G of X, NULL when none is logged. */
#define GEN_START_SQL(X, G)                                                                        \
	"(SELECT (extract(epoch FROM n.at) * 1000000)::bigint FROM sandbox_state_log n "           \
	"    WHERE n.sandbox_id = " X " AND n.generation = " G " ORDER BY n.seq LIMIT 1)"
/* The log sequence of the first state change of generation G of X (node_time_before()). */
#define GEN_START_SEQ_SQL(X, G)                                                                    \
	"(SELECT n.seq FROM sandbox_state_log n "                                                  \
	"    WHERE n.sandbox_id = " X " AND n.generation = " G " ORDER BY n.seq LIMIT 1)"
/* The time (µs) of the first state change of a generation of X later than G (G's end), NULL when
 * none is logged. */
#define GEN_END_SQL(X, G)                                                                          \
	"(SELECT (extract(epoch FROM n.at) * 1000000)::bigint FROM sandbox_state_log n "           \
	"    WHERE n.sandbox_id = " X " AND n.generation > " G " ORDER BY n.seq LIMIT 1)"
/* The log sequence of that first change of a later generation (node_time_logged()). */
#define GEN_END_SEQ_SQL(X, G)                                                                      \
	"(SELECT n.seq FROM sandbox_state_log n "                                                  \
	"    WHERE n.sandbox_id = " X " AND n.generation > " G " ORDER BY n.seq LIMIT 1)"
/* A log row L's witness as one text, "boot_id mono_ns", NULL when it has none (witness_col()). */
#define WITNESS_SQL(L) "(" L ".boot_id || ' ' || " L ".mono_ns)"
/* The witnesses of the first change of generation G of X, and of G's end (gen_point()). */
#define GEN_START_WIT_SQL(X, G)                                                                    \
	"(SELECT " WITNESS_SQL("n") " FROM sandbox_state_log n "                                   \
	"    WHERE n.sandbox_id = " X " AND n.generation = " G " ORDER BY n.seq LIMIT 1)"
#define GEN_END_WIT_SQL(X, G)                                                                      \
	"(SELECT " WITNESS_SQL("n") " FROM sandbox_state_log n "                                   \
	"    WHERE n.sandbox_id = " X " AND n.generation > " G " ORDER BY n.seq LIMIT 1)"
/* How far the point P (ns) of generation G of X reaches past the start of its first window, on
 * the clock of the meter that billed it: what is billed of it and the forward steps of the wall
 * clock in it, so about where the wall clock stood at P (tails_sql); NULL when it has no window. */
#define GEN_REACH_SQL(X, G, P)                                                                     \
	"(" P " - (SELECT coalesce(u.ps_ns, (extract(epoch FROM u.window_start) * 1e9)::bigint) "  \
	"    FROM usage_windows u WHERE u.sandbox_id = " X " AND u.generation = " G " "            \
	"    ORDER BY u.window_start LIMIT 1))"
/* What is billed of generation G of X, ns: the sum of its windows' billed periods, each the
 * difference of two labels of the meter that billed it, so the same on every clock, and no
 * forward step of the wall clock in it (gen_point()); NULL when it has no window. */
#define GEN_BILLED_SQL(X, G)                                                                       \
	"(SELECT sum(coalesce(u.pe_ns, (extract(epoch FROM u.window_end) * 1e9)::bigint) "         \
	"    - coalesce(u.ps_ns, (extract(epoch FROM u.window_start) * 1e9)::bigint))::bigint "    \
	"    FROM usage_windows u WHERE u.sandbox_id = " X " AND u.generation = " G ")"

/* --- Postgres: this node's sandboxes --- */

static const char rows_sql[] =
	/* `ended`: the last rule of the WHERE below, read once (a later change of each stretch
	 * found by its sandbox's key: as EXISTS, planned as a hash of the whole log). */
	"WITH ended AS MATERIALIZED (SELECT l.sandbox_id FROM sandbox_state_log l "
	"    WHERE l.node_id = $1 AND l.state IN ('running', 'paused') "
	"    AND (SELECT 1 FROM sandbox_state_log n "
	"        WHERE n.sandbox_id = l.sandbox_id AND n.seq > l.seq LIMIT 1) IS NOT NULL "
	"    AND NOT EXISTS (SELECT 1 FROM meter_sandboxes mm WHERE mm.sandbox_id = l.sandbox_id "
	"        AND mm.generation = l.generation AND (mm.ended OR (mm.state = 'none' "
	"        AND (mm.remainder_fine <> 0 OR EXISTS (SELECT 1 FROM usage_windows u "
	"            WHERE u.sandbox_id = l.sandbox_id AND u.generation = l.generation "
	"            AND (u.ucr > 0 OR u.mem_byte_s > 0))))))) "
	"SELECT s.id, s.tenant_id, s.generation, s.state, s.memory_mib, s.disk_gib, "
	"(extract(epoch FROM s.state_changed_at) * 1000000)::bigint, "
	"(extract(epoch FROM s.deleted_at) * 1000000)::bigint, "
	"(extract(epoch FROM s.created_at) * 1000000)::bigint, "
	"m.generation, m.state, m.last_t_ns, m.cpu_ns, m.rx_bytes, m.tx_bytes, m.remainder_fine, "
	"(SELECT (sn.size_bytes + 1048575) / 1048576 FROM snapshots sn WHERE sn.id = s.pause_snapshot), "
	"s.node_id IS NOT DISTINCT FROM $1, m.gnode = $1, m.gnode, "
	/* The pause snapshot of an earlier generation at the billed-up-to point (the row names the
	 * current one's only). */
	"CASE WHEN m.generation < s.generation THEN " GEN_SNAP_SQL("s.id", "m.generation") " END, "
	/* a point another node's meter wrote: where it stands on this meter's clock (gen_point()) */
	"CASE WHEN m.node_id <> $1 THEN " GEN_START_SQL("s.id", "m.generation") " END, "
	"CASE WHEN m.node_id <> $1 THEN " GEN_BILLED_SQL("s.id", "m.generation") " END, "
	/* a point in billed state "none": whether it is its generation's end, marked so
	 * (sb_gen_end(): one of no length or priced 0 billed nothing) or, a point of before the
	 * mark, anything of its generation billed (a sandbox still creating has such a point too,
	 * billed nothing, before its end); running time counts at a price of 0 too (its memory's
	 * byte-seconds) */
	"CASE WHEN m.state = 'none' THEN m.ended OR m.remainder_fine <> 0 OR EXISTS (SELECT 1 "
	"    FROM usage_windows u WHERE u.sandbox_id = s.id AND u.generation = m.generation "
	"    AND (u.ucr > 0 OR u.mem_byte_s > 0)) END, "
	/* the end of a generation whose point another node's meter wrote (gen_point()) */
	"CASE WHEN m.node_id <> $1 THEN " GEN_END_SQL("s.id", "m.generation") " END, "
	"CASE WHEN m.node_id <> $1 THEN " GEN_START_SEQ_SQL("s.id", "m.generation") " END, "
	"CASE WHEN m.node_id <> $1 THEN " GEN_END_SEQ_SQL("s.id", "m.generation") " END, "
	"CASE WHEN m.node_id <> $1 THEN " GEN_START_WIT_SQL("s.id", "m.generation") " END, "
	"CASE WHEN m.node_id <> $1 THEN " GEN_END_WIT_SQL("s.id", "m.generation") " END "
	/* The billed-up-to point of its newest generation of this node, else of its newest; but
	 * first an earlier generation of this node billed short of its end (the oldest of them):
	 * its point before the first window of the generation right after it (the first change of
	 * a later generation in the log's order), when that one is billed here too (both labels of
	 * this node's meters).
	 * Tracked from the newest, the stretch between was never billed: kiln-sim `clock`, seeds
	 * 532512775 and 106248634, a pause and a resume while both meters of the node were
	 * without Postgres, -1,630 and -30 µcr. Not a later generation of this node beyond one
	 * that ran on another node: the earlier one ended at that move, where its point stands,
	 * and taken as short it was tracked from there again and again, the generations after it
	 * billed from their start and refused at every flush (kiln-sim seed 322486188, make
	 * test's kinds, -2,656 and -4,928 µcr). `short` is computed once per point (OFFSET 0 keeps
	 * its subquery apart; pulled up, it ran once for each of the two sort keys naming it). */
	/* meter_billables (migrations/0033): the sandboxes, and the snapshots their tenants keep
	 * (named ones, templates' images and cached layers) as sandboxes paused from their keeping
	 * to their deletion, of no memory and no disk, their pause snapshot themselves. */
	"FROM meter_billables s "
	"LEFT JOIN LATERAL (SELECT mm.*, coalesce(mm.gen_node, mm.node_id) AS gnode "
	"    FROM meter_sandboxes mm CROSS JOIN LATERAL (SELECT "
	"        coalesce(mm.state <> 'none' AND coalesce(mm.gen_node, mm.node_id) = $1 "
	"        AND mm.last_t_ns < "
	"        (SELECT coalesce(u.ps_ns, (extract(epoch FROM u.window_start) * 1e9)::bigint) "
	"         FROM meter_sandboxes m2 JOIN usage_windows u ON u.sandbox_id = m2.sandbox_id "
	"             AND u.generation = m2.generation "
	"         WHERE m2.sandbox_id = mm.sandbox_id AND m2.generation = "
	"             (SELECT n.generation FROM sandbox_state_log n "
	"              WHERE n.sandbox_id = mm.sandbox_id AND n.generation > mm.generation "
	"              ORDER BY n.seq LIMIT 1) "
	"         AND coalesce(m2.gen_node, m2.node_id) = $1 "
	"         ORDER BY u.window_start LIMIT 1), false) AS short OFFSET 0) f "
	"    WHERE mm.sandbox_id = s.id "
	"    ORDER BY coalesce(mm.gen_node, mm.node_id) = $1 DESC, f.short DESC, "
	"    CASE WHEN f.short THEN mm.generation END, mm.generation DESC LIMIT 1) m "
	"    ON true "
	/* Only the rows the rules below can keep, found by index (migrations/0054), each rule's in
	 * turn: this node's sandboxes not deleted; deleted ones changed or deleted since $2
	 * (greatest() of the two: either after it); deleted ones with an open point (of any
	 * generation: from the open points, each sandbox read by its key); this node's kept
	 * snapshots; `ended`. An array, so that each row is read by its key (LIMIT 1 and the
	 * array keep the planner from hashing whole tables instead: its estimates of these
	 * lookups are far off). Read whole, meter_billables is every sandbox ever made on any
	 * node, each joined to its points before the rules could drop it: the tick's cost grew with
	 * the history of the whole deployment (bench/metering/meter.sh, docs/benchmarks.md). The
	 * rules are applied to what they find unchanged. */
	"WHERE s.id = ANY (ARRAY("
	"    SELECT x.id FROM sandboxes x WHERE x.node_id = $1 AND x.deleted_at IS NULL "
	"    UNION SELECT x.id FROM sandboxes x WHERE x.node_id = $1 "
	"        AND greatest(x.state_changed_at, x.deleted_at) > to_timestamp($2::bigint / 1e6) "
	"    UNION SELECT mm.sandbox_id FROM meter_sandboxes mm "
	"        CROSS JOIN LATERAL (SELECT 1 FROM sandboxes x WHERE x.id = mm.sandbox_id "
	"            AND x.node_id = $1 AND x.deleted_at IS NOT NULL LIMIT 1) x "
	"        WHERE mm.state <> 'none' "
	"    UNION SELECT k.id FROM snapshots k WHERE k.kept_since IS NOT NULL AND k.node_id = $1 "
	"    UNION SELECT sandbox_id FROM ended)) "
	"AND ((s.node_id = $1 AND ((s.state IN ('running', 'paused') AND s.deleted_at IS NULL) "
	"OR s.state_changed_at > to_timestamp($2::bigint / 1e6) "
	"OR s.deleted_at > to_timestamp($2::bigint / 1e6) "
	"OR (m.state <> 'none' AND (s.state NOT IN ('running', 'paused') "
	"    OR s.deleted_at IS NOT NULL)))) "
	/* A running or paused stretch on this node, ended by a later change (in the log's order,
	 * `seq`), whose generation is not recorded as ended in the ledger: its point not marked as
	 * its end (meter_sandboxes.ended, migrations/0049: the flush writes the mark sb_gen_end()
	 * puts on the window of the end, and keeps it), nor in billed state "none" with something
	 * of its generation billed (the rule before the mark, for an end the mark misses: a point
	 * moved on past the marked window by a window of no charge, the sandbox gone and back within
	 * one window, held for good by the mark alone). The sandbox moved on before this node's
	 * meter billed it, or that meter lost it (a window refused) and it left the node.
	 * Not that rule alone (a point written while the sandbox was still creating is in "none"
	 * too, so it needs something billed): a generation of no length
	 * on the label clock, or one priced 0, matched every tick for as long as the sandbox lived,
	 * its entry never freed and its changes read from its old point each tick. One billed to
	 * its end whose "none" was never written (its meter lost before the end's flush) is still
	 * read: its point is not marked, so the stretch stays open for the meter that tracks it.
	 * Not "a window of its generation reaches the next change's time": a window's end is a
	 * label of the meter's clock, the change's time the wall clock's, and after backward steps
	 * the labels run ahead of the wall clock, so a stretch never billed read as covered
	 * (kiln-sim `clock`, seed 31121: labels 3,467 s ahead, a paused tail of 18.8 s at the
	 * ledger's point left both meters of node 0 with the sandbox on node 1, never billed). Nor
	 * those ends made wall again by the node's offset: each window was labelled in the frame in
	 * force then, and one offset is wrong across steps. The end recorded is a fact of the ledger
	 * on no clock, whoever wrote it (sb_gen_end(), when a generation ends and when the sandbox
	 * leaves the node). */
	"OR s.id IN (SELECT sandbox_id FROM ended)) "
	"ORDER BY s.id COLLATE \"C\"";

/* The state changes of the sandboxes $2 (an array) from $3 (µs) on; $1 this node. Read from
 * LOG_LATE_NS before the oldest billed-up-to point: a change logged after a tick passed its time
 * (a pause's vCPU stop, logged milliseconds after it) is applied from the tick on. A change
 * witnessed on this meter's boot ($4, NULL: none) is read by its monotonic time from $5 (ns)
 * on too: its wall-clock time may stand a step's size before $3 (a backward and a forward step
 * made while no meter of the node ran, seen as their net step only: log_read()). Each
 * sandbox's in the order they were logged (`seq`), never by time: a change logged after a
 * backward step of the wall clock carries an earlier time than those before it. */
static const char log_sql[] =
	"SELECT sandbox_id, generation, state, (extract(epoch FROM at) * 1000000)::bigint, "
	"node_id IS NOT DISTINCT FROM $1, cpu_ns, coalesce(node_id, ''), seq, "
	/* a pause: its generation's snapshot (the sandbox's row names the current generation's
	 * only) */
	"CASE WHEN l.state = 'paused' THEN " GEN_SNAP_SQL("l.sandbox_id", "l.generation") " END, "
	/* its witness (witness_time()) */
	"l.boot_id, l.mono_ns "
	"FROM sandbox_state_log l "
	"WHERE sandbox_id = ANY ($2::text[]) AND (at >= to_timestamp($3::bigint / 1e6) "
	"    OR (l.boot_id = $4 AND l.mono_ns >= $5::bigint)) "
	"ORDER BY sandbox_id COLLATE \"C\", seq";

static void row_parse(const struct pg_res *res, int i, struct mrow *r)
{
	memset(r, 0, sizeof(*r));
	r->id = pg_res_str(res, i, 0);
	r->tenant = pg_res_str(res, i, 1);
	r->gen = pg_res_int(res, i, 2, 1);
	r->state = pg_res_str(res, i, 3);
	r->mem_mib = (unsigned)pg_res_int(res, i, 4, 0);
	r->disk_gib = (unsigned)pg_res_int(res, i, 5, 0);
	r->w_changed = pg_res_int(res, i, 6, 0) * 1000;
	r->w_deleted = pg_res_int(res, i, 7, 0) * 1000;
	r->w_created = pg_res_int(res, i, 8, 0) * 1000;
	r->snap_mib = (uint64_t)pg_res_int(res, i, 16, 0);
	r->here = pg_res_bool(res, i, 17);
	r->m_mine = pg_res_bool(res, i, 18);
	r->m_node = pg_res_str(res, i, 19);
	r->has_m = pg_res_get(res, i, 9) != NULL;
	if (r->has_m) {
		r->m_gen = pg_res_int(res, i, 9, 0);
		r->m_state = pg_res_str(res, i, 10);
		r->m_last = pg_res_int(res, i, 11, 0);
		r->m_cpu = (uint64_t)pg_res_int(res, i, 12, 0);
		r->m_rx = (uint64_t)pg_res_int(res, i, 13, 0);
		r->m_tx = (uint64_t)pg_res_int(res, i, 14, 0);
		r->m_rem = (uint64_t)pg_res_int(res, i, 15, 0);
		r->m_snap_mib = (uint64_t)pg_res_int(res, i, 20, 0);
		r->m_billed = pg_res_bool(res, i, 23);
	}
}

/* --- Redis: one round trip per tick --- */

/*
 * KEYS: per tenant its balance hash and its bandwidth hash and burn hash; then per sandbox its
 * series; then the meter's figures hash, the meters set, the node's tenants set and its alive key.
 * ARGV: live field, node, #tenants, #sandboxes, tick second, trim cutoff (or ''), series ttl,
 * burn stamp, live ttl, blind ('1': a tick without Postgres); per tenant: live, rx, tx, burn
 * rate; per sandbox: series member; then figure pairs. A blind tick sets its live field only
 * when it is missing (dropped, or Redis lost it) and never deletes it: another meter of the node
 * that reads Postgres writes the same field with the charges as of now, which a blind meter's,
 * as of its last billed tick, would hide (kiln-sim `two-meters,zero`, seeds 9170 and 9248: the
 * other node's meter read the stale charges and paused the tenant's sandbox 5 s after zero).
 * The alive key is set first; another meter's live field whose alive key is gone
 * is dropped (billing.h); a balance key of another type than a hash is dropped, its balance
 * then missing (billing.c, sync_lua). Returns {balances, missing flags}.
 */
static const char tick_lua[] =
	"local f, node = ARGV[1], ARGV[2]\n"
	"local nt, ns = tonumber(ARGV[3]), tonumber(ARGV[4])\n"
	"local t, cutoff, ttl, stamp = ARGV[5], ARGV[6], ARGV[7], ARGV[8]\n"
	"local blind = ARGV[10] == '1'\n"
	"local a = 11\n"
	"local bal, miss = {}, {}\n"
	"local tset = KEYS[3 * nt + ns + 3]\n"
	"redis.call('SET', KEYS[3 * nt + ns + 4], '1', 'EX', ARGV[9])\n"
	"for i = 1, nt do\n"
	"  local bk, wk, rk = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]\n"
	"  local ty = redis.call('TYPE', bk)['ok']\n"
	"  if ty ~= 'hash' and ty ~= 'none' then redis.call('DEL', bk) end\n"
	"  local live, rx, tx, burn = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3]\n"
	"  a = a + 4\n"
	"  if blind then\n"
	"    if live ~= '0' then redis.call('HSETNX', bk, f, live) end\n"
	"  elseif live == '0' then redis.call('HDEL', bk, f) else redis.call('HSET', bk, f, live) end\n"
	"  if rx > 0 then redis.call('HINCRBY', wk, 'rx', rx) end\n"
	"  if tx > 0 then redis.call('HINCRBY', wk, 'tx', tx) end\n"
	"  redis.call('HSET', rk, node, burn .. ':' .. stamp)\n"
	"  redis.call('EXPIRE', rk, 60)\n"
	"  local v = redis.call('HGETALL', bk)\n"
	"  local ledger, sum = nil, 0\n"
	"  for j = 1, #v, 2 do\n"
	"    if v[j] == 'ledger' then ledger = tonumber(v[j + 1])\n"
	"    elseif string.sub(v[j], 1, 5) == 'live:' then\n"
	"      if v[j] ~= f and redis.call('EXISTS', '" BILLING_METER_PREFIX "' .. string.sub(v[j], 6) .. '"
	BILLING_ALIVE_SUFFIX "') == 0 then redis.call('HDEL', bk, v[j])\n"
	"      else sum = sum + tonumber(v[j + 1]) end\n"
	"    end\n"
	"  end\n"
	"  if ledger then bal[i] = ledger - sum; miss[i] = 0 else bal[i] = 0; miss[i] = 1 end\n"
	"  if live ~= '0' then redis.call('SADD', tset, string.sub(bk, 10)) end\n"
	"end\n"
	"for i = 1, ns do\n"
	"  local k = KEYS[3 * nt + i]\n"
	"  redis.call('ZADD', k, t, ARGV[a])\n"
	"  a = a + 1\n"
	"  if cutoff ~= '' then\n"
	"    redis.call('ZREMRANGEBYSCORE', k, '-inf', cutoff)\n"
	"    redis.call('EXPIRE', k, ttl)\n"
	"  end\n"
	"end\n"
	"local mk = KEYS[3 * nt + ns + 1]\n"
	"while a + 1 <= #ARGV do redis.call('HSET', mk, ARGV[a], ARGV[a + 1]); a = a + 2 end\n"
	"redis.call('EXPIRE', mk, 300)\n"
	"redis.call('SADD', KEYS[3 * nt + ns + 2], node)\n"
	"return {bal, miss}\n";

/* Drops the live fields an earlier run of this node left: its unflushed charges died with it. */
static const char reset_lua[] =
	"local ts = redis.call('SMEMBERS', KEYS[1])\n"
	"for _, t in ipairs(ts) do redis.call('HDEL', '" BILLING_BAL_PREFIX "' .. t, ARGV[1]) end\n"
	"redis.call('DEL', KEYS[1])\n"
	"return #ts\n";

/* An argv under construction; strings are copied into one arena per tick. */
struct argv {
	const char **v;
	size_t n, cap;
	struct buf arena;
	size_t *offs;	/* offset in arena of each string, -1 for static */
};

static int argv_add(struct argv *a, const char *s, bool copy)
{
	if (a->n == a->cap) {
		size_t cap = a->cap ? a->cap * 2 : 256;
		const char **v = realloc(a->v, cap * sizeof(*v));
		size_t *o = realloc(a->offs, cap * sizeof(*o));
		if (v)
			a->v = v;
		if (o)
			a->offs = o;
		if (!v || !o)
			return -ENOMEM;
		a->cap = cap;
	}
	if (copy) {
		size_t off = a->arena.len;
		if (buf_append(&a->arena, s, strlen(s) + 1))
			return -ENOMEM;
		a->offs[a->n] = off;
		a->v[a->n++] = NULL;
	} else {
		a->offs[a->n] = (size_t)-1;
		a->v[a->n++] = s;
	}
	return 0;
}

static int argv_addf(struct argv *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int argv_addf(struct argv *a, const char *fmt, ...)
{
	char tmp[256];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(tmp, sizeof(tmp), fmt, ap);
	va_end(ap);
	return argv_add(a, tmp, true);
}

/* Points the copied strings into the arena (which no longer moves). */
static void argv_fix(struct argv *a)
{
	for (size_t i = 0; i < a->n; i++)
		if (a->offs[i] != (size_t)-1)
			a->v[i] = a->arena.data + a->offs[i];
}

static void argv_release(struct argv *a)
{
	free(a->v);
	free(a->offs);
	buf_release(&a->arena);
	memset(a, 0, sizeof(*a));
}

static enum kiln_err redis_tick(struct meter *m, int64_t now, bool blind)
{
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	struct argv a = { 0 };
	struct mten **ts = NULL;
	struct msb **ss = NULL;
	size_t nt = 0, ns = 0;
	int64_t sec = now / PRICE_NS_PER_S;
	enum kiln_err rc = KILN_E_NOMEM;
	int e = 0;

	buf_init(&a.arena, 256u << 20);
	ts = calloc(m->ntens + 1, sizeof(*ts));
	ss = calloc(m->nsbs + 1, sizeof(*ss));
	if (!ts || !ss)
		goto out;
	for (size_t i = 0; i < m->ntens; i++) {
		struct mten *t = m->tens[i];
		/* Unflushed charges go every tick: a field dropped while this meter could not
		 * reach Redis for longer than the bound comes back at once. */
		if (t->nsb > 0 || t->pending || t->pending != t->sent || t->t_rx || t->t_tx ||
		    t->burn_sent)
			ts[nt++] = t;
	}
	for (size_t i = 0; i < m->nsbs; i++)
		if (m->sbs[i]->t_has)
			ss[ns++] = m->sbs[i];
	e |= argv_add(&a, "EVAL", false);
	e |= argv_add(&a, tick_lua, false);
	e |= argv_addf(&a, "%zu", nt * 3 + ns + 4);
	for (size_t i = 0; i < nt; i++) {
		e |= argv_addf(&a, BILLING_BAL_PREFIX "%s", ts[i]->id);
		e |= argv_addf(&a, BILLING_BW_PREFIX "%s", ts[i]->id);
		e |= argv_addf(&a, BILLING_BURN_PREFIX "%s", ts[i]->id);
	}
	for (size_t i = 0; i < ns; i++)
		e |= argv_addf(&a, BILLING_USAGE_PREFIX "%s", ss[i]->id);
	e |= argv_addf(&a, BILLING_METER_PREFIX "%s", m->node);
	e |= argv_add(&a, BILLING_METERS_KEY, false);
	e |= argv_addf(&a, BILLING_METER_PREFIX "%s:tenants", m->node);
	e |= argv_add(&a, m->alive_key, false);
	e |= argv_add(&a, m->live_field, false);
	e |= argv_add(&a, m->node, false);
	e |= argv_addf(&a, "%zu", nt);
	e |= argv_addf(&a, "%zu", ns);
	e |= argv_addf(&a, "%" PRId64, sec);
	if (sec % SERIES_TRIM_EVERY_S == 0)
		e |= argv_addf(&a, "%" PRId64, sec - m->o.series_s);
	else
		e |= argv_add(&a, "", false);
	e |= argv_addf(&a, "%" PRId64, m->o.series_s + 60);
	e |= argv_addf(&a, "%" PRId64, m->wall / PRICE_NS_PER_S);	/* read against time() */
	e |= argv_addf(&a, "%" PRId64, m->o.live_ttl_s);
	e |= argv_add(&a, blind ? "1" : "0", false);
	for (size_t i = 0; i < nt; i++) {
		struct mten *t = ts[i];
		long long burn = (long long)(t->t_burn / PRICE_FINE_PER_UCR);	/* µcr/s */
		e |= argv_addf(&a, "%lld", t->pending);
		e |= argv_addf(&a, "%" PRIu64, t->t_rx);
		e |= argv_addf(&a, "%" PRIu64, t->t_tx);
		e |= argv_addf(&a, "%lld", burn);
	}
	for (size_t i = 0; i < ns; i++) {
		struct msb *s = ss[i];
		/* t:cpu_us:mem_bytes:rx:tx:ucr */
		e |= argv_addf(&a, "%" PRId64 ":%" PRIu64 ":%" PRIu64 ":%" PRIu64 ":%" PRIu64 ":%lld",
			       s->t_start / PRICE_NS_PER_S, s->t_cpu / 1000, s->t_mem, s->t_rx,
			       s->t_tx, s->t_ucr);
	}
	e |= argv_add(&a, "lag_s", false);
	e |= argv_addf(&a, "%.3f", m->st.flush_lag_s);
	e |= argv_add(&a, "ticks_missed", false);
	e |= argv_addf(&a, "%" PRIu64, m->ticks_missed + m->st.ticks_failed);
	e |= argv_add(&a, "ticks", false);
	e |= argv_addf(&a, "%" PRIu64, m->st.ticks);
	e |= argv_add(&a, "windows_flushed", false);
	e |= argv_addf(&a, "%" PRIu64, m->st.windows_flushed);
	e |= argv_add(&a, "sandboxes", false);
	e |= argv_addf(&a, "%u", m->st.sandboxes);
	e |= argv_add(&a, "last_tick", false);
	e |= argv_addf(&a, "%" PRId64, sec);
	if (e)
		goto out;
	argv_fix(&a);
	m->st.redis_calls++;
	m->st.redis_tick_calls++;
	rc = rds_command(m->rds, (int)a.n, a.v, NULL, &rep, &err);
	if (rc != KILN_OK) {
		log_warn("cannot debit in redis: %s", err.msg);
		goto out;
	}
	if (rep.type == RDS_ARRAY && rep.n == 2 && rep.elem[0].n == nt && rep.elem[1].n == nt) {
		const char **missing = calloc(nt + 1, sizeof(*missing));
		size_t nmiss = 0;
		for (size_t i = 0; i < nt; i++) {
			ts[i]->sent = ts[i]->pending;
			ts[i]->burn_sent = (long long)(ts[i]->t_burn / PRICE_FINE_PER_UCR);
			if (rep.elem[1].elem[i].integer) {
				ts[i]->has_balance = false;
				if (missing)
					missing[nmiss++] = ts[i]->id;
			} else {
				ts[i]->has_balance = true;
				ts[i]->balance = rep.elem[0].elem[i].integer;
				ts[i]->bal_at = now;
			}
		}
		if (nmiss) {
			/* Redis lost the ledger half (a restart without data, or a new tenant). */
			struct pg_conn *c;
			kiln_error_clear(&err);
			if (pg_acquire(m->pg, &c, &err) == KILN_OK) {
				m->st.pg_calls++;
				m->st.redis_calls++;
				if (billing_sync(m->rds, c, nmiss, missing, NULL, NULL, &err) != KILN_OK)
					log_warn("cannot rebuild balances in redis: %s", err.msg);
				else
					log_info("rebuilt %zu balances in redis from the ledger", nmiss);
				pg_release(m->pg, c);
			}
		}
		free(missing);
	}
out:
	rds_reply_release(&rep);
	argv_release(&a);
	free(ts);
	free(ss);
	return rc;
}

/* --- the ledger --- */

static int json_item(struct buf *b, const struct meter *m, const struct msb *s,
		     const struct mwin *w)
{
	unsigned __int128 mem_bs = w->mib_ns * 1048576u / PRICE_NS_PER_S;
	char id[AUTH_ID_MAX], idj[AUTH_ID_MAX + 2] = "null";

	/* Its first transfer's id (migrations/0044; without one, Postgres makes it). */
	if (auth_new_id("tx_", id, sizeof(id)) == KILN_OK)
		snprintf(idj, sizeof(idj), "\"%s\"", id);
	return buf_appendf(b,
			   "%s{\"sb\":\"%s\",\"tenant\":\"%s\",\"node\":\"%s\",\"gen\":%lld,"
			   "\"ws\":%" PRId64 ",\"we\":%" PRId64 ",\"ps\":%" PRId64 ",\"pe\":%" PRId64
			   ",\"ucr\":%lld,\"cpu\":%" PRIu64 ",\"mem_bs\":%llu,\"rx\":%" PRIu64
			   ",\"tx\":%" PRIu64 ",\"state\":\"%s\",\"t\":%" PRId64 ",\"cpu_at\":%" PRIu64
			   ",\"rx_at\":%" PRIu64 ",\"tx_at\":%" PRIu64 ",\"rem\":%" PRIu64 ",\"gnode\":\"%s\""
			   ",\"id\":%s,\"ended\":%s}",
			   b->len > 1 ? "," : "", s->id, s->tenant, m->node, w->gen, w->ws,
			   w->ws + m->o.window_s, w->ps, w->pe, w->ucr, w->cpu_ns,
			   (unsigned long long)mem_bs, w->rx, w->tx, bstate_names[w->state], w->pe,
			   w->cpu_at, w->rx_at, w->tx_at, w->rem, w->gnode, idj,
			   w->gen_end ? "true" : "false");
}

/*
 * Whether window `w` is over at `now` (its end is behind the clock), or holds the end of another
 * node's generation (taken over: it ended before this meter took it, and nothing more of it can
 * be billed). That end goes to the ledger with the rest of the generation, marked
 * (meter_sandboxes.ended), in the flush that writes the rest: the generation's own meter, back
 * after a forward step it was down across, gives the step's gap other labels than this one, and
 * with the end still in memory it found none recorded, tracked the generation from this meter's
 * point and billed up to its own gap under labels that no window of this meter's overlapped, so
 * the ledger's fence took both (kiln-sim seed 31218, +62 µcr).
 */
static bool win_done(const struct meter *m, const struct mwin *w, int64_t now)
{
	return (w->ws + m->o.window_s) * PRICE_NS_PER_S <= now ||
	       (w->gen_end && strcmp(w->gnode, m->node) != 0);
}

/*
 * Sets every tenant's ledger half in Redis from Postgres (on `c`) and this meter's live field to
 * its unflushed charges, in one atomic step (billing_sync). When Redis cannot take it, the next
 * tick that reaches Redis does it (sync_due): until then Redis's ledger half misses what the
 * flushes put in the ledger while this meter's live field no longer counts it.
 */
static void meter_sync(struct meter *m, struct pg_conn *c)
{
	struct kiln_error err = { 0 };
	const char **tids = calloc(m->ntens + 1, sizeof(*tids));
	long long *lives = calloc(m->ntens + 1, sizeof(*lives));

	m->sync_due = true;
	if (tids && lives) {
		for (size_t i = 0; i < m->ntens; i++) {
			tids[i] = m->tens[i]->id;
			lives[i] = m->tens[i]->pending;
		}
		m->st.redis_calls++;
		m->st.pg_calls++;
		if (billing_sync(m->rds, c, m->ntens, tids, m->live_field, lives, &err) == KILN_OK) {
			for (size_t i = 0; i < m->ntens; i++)
				m->tens[i]->sent = m->tens[i]->pending;
			m->sync_due = false;
		} else {
			log_warn("cannot move flushed charges in redis (retried): %s", err.msg);
		}
	}
	free(tids);
	free(lives);
}

/*
 * The frame of this meter's label clock at the tick whose label clock and monotonic clock read
 * `clk_l` and `clk_m`, its offset (label - wall) `clk_off`, saved on `c` for the node's next
 * meter on this host (meter_clocks, read by meter_start()), with the state log's sequence when
 * its offset began (frame_seq; not read yet, -1: the sequence now, later than that, so no change
 * logged before the frame's step is read in it), the one read before its tick read the wall
 * clock (tick_seq, flush_tick_seq(): every change logged no later was logged in this frame or an
 * older one; 0, none read: no bound) and the newest forward step it followed. A frame saved from
 * a later monotonic time on the same boot is kept.
 */
static enum kiln_err frame_save(struct meter *m, struct pg_conn *c, int64_t clk_l, int64_t clk_m,
				int64_t clk_off, long long frame_seq, long long tick_seq,
				const struct mstep *step, struct kiln_error *err)
{
	char l[24], mono[24], off[24], s_at[24], s_by[24], s_off[24], fseq[24] = "", tseq[24];
	char gaps[STEPS_KEPT * 2 * 22 + 4], b_at[24], b_off[24], b_min[24], b_pre[24];
	const struct mback *fb = &step->fback;

	snprintf(l, sizeof(l), "%" PRId64, clk_l);
	snprintf(mono, sizeof(mono), "%" PRId64, clk_m);
	snprintf(off, sizeof(off), "%" PRId64, clk_off);
	snprintf(s_at, sizeof(s_at), "%" PRId64, step->at);
	snprintf(s_by, sizeof(s_by), "%" PRId64, step->by);
	snprintf(s_off, sizeof(s_off), "%" PRId64, step->off);
	if (frame_seq >= 0)
		snprintf(fseq, sizeof(fseq), "%lld", frame_seq);
	snprintf(tseq, sizeof(tseq), "%lld", tick_seq);
	gaps_text(step, gaps, sizeof(gaps));
	snprintf(b_at, sizeof(b_at), "%" PRId64, fb->at);
	snprintf(b_off, sizeof(b_off), "%" PRId64, fb->off);
	snprintf(b_min, sizeof(b_min), "%lld", fb->min);
	snprintf(b_pre, sizeof(b_pre), "%lld", fb->pre);
	return PGQ(c, NULL, err,
		   "INSERT INTO meter_clocks AS k (node_id, boot_id, label_ns, mono_ns, off_ns, "
		   "step_at_ns, step_by_ns, step_off_ns, step_back, log_seq, tick_seq, gaps_ns, "
		   "back_at_ns, back_off_ns, back_min, back_pre) "
		   "VALUES ($1, $2, $3, $4, $5, CASE WHEN $6 THEN $7::bigint END, $8, $9, $10, "
		   "coalesce(NULLIF($11, '')::bigint, (SELECT CASE WHEN is_called THEN last_value "
		   "ELSE 0 END FROM sandbox_state_log_seq_seq)), $12::bigint, $13::bigint[], "
		   "CASE WHEN $14 THEN $15::bigint END, $16, $17, $18) "
		   "ON CONFLICT (node_id) DO UPDATE SET "
		   "boot_id = $2, label_ns = $3, mono_ns = $4, off_ns = $5, "
		   "step_at_ns = EXCLUDED.step_at_ns, step_by_ns = $8, step_off_ns = $9, "
		   "step_back = $10, log_seq = EXCLUDED.log_seq, tick_seq = $12, gaps_ns = $13, "
		   "back_at_ns = EXCLUDED.back_at_ns, back_off_ns = $16, back_min = $17, "
		   "back_pre = $18, updated_at = now() "
		   "WHERE k.boot_id <> $2 OR k.mono_ns <= $4",
		   m->node, m->boot, l, mono, off, step->set ? "true" : "false", s_at, s_by, s_off,
		   step->back ? "true" : "false", fseq, tseq, gaps, fb->set ? "true" : "false", b_at,
		   b_off, b_min, b_pre);
}

/*
 * One flush's transaction: `items` (a JSON array of windows, json_item) into the ledger with
 * meter_flush_set() (migrations/0015_flush_set.sql: a few set-based statements for all of them;
 * its newest form in migrations/0044_flush_fast.sql, which reads `items` as json)
 * on a connection of its own. KILN_OK once committed, with the (sandbox, generation) pairs the
 * ledger refused (time of them billed already: flush_apply) appended to `refused` as
 * "<sandbox>\t<generation>\n"; on failure nothing was committed (it is retried).
 */
static enum kiln_err flush_commit(struct meter *m, const char *items, size_t nitems,
				  int64_t clk_l, int64_t clk_m, int64_t clk_off, long long frame_seq,
				  long long tick_seq, const struct mstep *step, struct buf *refused,
				  struct kiln_error *err)
{
	struct pg_conn *c = NULL;
	struct pg_res *res = NULL;
	enum kiln_err rc = pg_acquire(m->pg, &c, err);

	if (rc == KILN_OK)
		rc = pg_exec(c, "BEGIN; SET LOCAL application_name = '" FLUSH_APP_NAME "'", err);
	if (rc == KILN_OK)
		rc = PGQ(c, &res, err, "SELECT * FROM meter_flush_set($1::json, $2)", items,
			 m->o.card.version);
	if (rc == KILN_OK && m->boot[0])
		rc = frame_save(m, c, clk_l, clk_m, clk_off, frame_seq, tick_seq, step, err);
	if (rc == KILN_OK && m->o.test_flush_hold_ms) {
		log_info("flush of %zu windows holding its transaction for %u ms", nitems,
			 m->o.test_flush_hold_ms);
		usleep(m->o.test_flush_hold_ms * 1000u);
	}
	if (rc == KILN_OK)
		rc = pg_exec(c, "COMMIT", err);
	if (rc != KILN_OK && c) {
		struct kiln_error ignore = { 0 };
		pg_exec(c, "ROLLBACK", &ignore);
	}
	if (rc == KILN_OK) {
		log_debug("flushed %zu windows, %d sandbox generations refused", nitems,
			  pg_res_rows(res));
		for (int i = 0; i < pg_res_rows(res); i++)
			if (buf_appendf(refused, "%s\t%lld\n", pg_res_str(res, i, 0),
					pg_res_int(res, i, 1, 0)))
				log_error("out of memory noting a refused window of \"%s\"",
					  pg_res_str(res, i, 0));
	}
	pg_res_free(res);
	if (c)
		pg_release(m->pg, c);
	return rc;
}

/* The flush thread: commits each flush the tick hands it; the tick applies the outcome. */
static void *flush_main(void *arg)
{
	struct meter *m = arg;

	pthread_mutex_lock(&m->flock);
	for (;;) {
		struct timespec t0, t1;
		struct kiln_error err = { 0 };
		enum kiln_err rc;

		while (m->fstate != FL_QUEUED && !m->fstop)
			pthread_cond_wait(&m->fcond, &m->flock);
		if (m->fstate != FL_QUEUED)
			break;
		pthread_mutex_unlock(&m->flock);
		clock_gettime(CLOCK_MONOTONIC, &t0);
		buf_reset(&m->frefused);
		rc = flush_commit(m, m->fjson.data, m->fitems, m->fclk_l, m->fclk_m, m->fclk_off,
				  m->fframe_seq, m->ftick_seq, &m->fstep, &m->frefused, &err);
		clock_gettime(CLOCK_MONOTONIC, &t1);
		pthread_mutex_lock(&m->flock);
		m->fsecs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
		m->ferr = err;
		m->fstate = rc == KILN_OK ? FL_DONE : FL_FAILED;
		if (m->fevent >= 0) {
			uint64_t one = 1;
			ssize_t w = write(m->fevent, &one, sizeof(one));
			(void)w;	/* a full counter is a wake-up already pending */
		}
	}
	pthread_mutex_unlock(&m->flock);
	return NULL;
}

/*
 * The outcome of the flush in flight, on the tick's thread: committed, its windows leave memory
 * and their charges move from `pending` to the ledger part of the balances in Redis
 * (meter_sync); failed, they are sent again by the next flush. Nothing when none finished.
 * A sandbox with a pair in `refused` (time of that generation is in the ledger already: another
 * meter billed it) is marked resync: every window this meter holds of it is dropped, and
 * meter_gc forgets it, so the next tick tracks it again from the ledger's billed-up-to point.
 */
static void flush_apply(struct meter *m, bool ok, size_t nitems, int64_t first_read, double secs,
			const char *refused)
{
	struct pg_conn *c;
	struct kiln_error err = { 0 };

	for (const char *p = ok && refused ? refused : ""; *p;) {
		const char *tab = strchr(p, '\t'), *nl = strchr(p, '\n');
		char id[ID_MAX];
		struct msb *s;

		if (!tab || !nl || tab > nl)
			break;
		snprintf(id, sizeof(id), "%.*s", (int)(tab - p), p);
		s = sb_find(m, id);
		if (s) {
			log_warn("sandbox \"%s\" generation %.*s: billed already by another meter; "
				 "billing on from the ledger", s->id, (int)(nl - tab - 1), tab + 1);
			s->resync = true;
		}
		p = nl + 1;
	}
	for (size_t i = 0; i < m->nsbs; i++) {
		struct msb *s = m->sbs[i];
		size_t keep = 0;
		for (size_t k = 0; k < s->nw; k++) {
			/* What was sent counts as put in the ledger: a refused window's time was
			 * billed by another meter, so the estimate (meter_enforce) errs low. */
			if (s->w[k].inflight && ok) {
				s->ten->pending -= s->w[k].ucr;
				s->ten->flushed += s->w[k].ucr;
				continue;
			}
			if (s->resync) {
				s->ten->pending -= s->w[k].ucr;
				continue;
			}
			s->w[k].inflight = false;
			s->w[keep++] = s->w[k];
		}
		s->nw = keep;
	}
	if (!ok)
		return;
	m->st.windows_flushed += nitems;
	m->st.flushes++;
	m->st.pg_calls += 3;
	m->st.flush_lag_s = (double)(label_now(m) - first_read) / 1e9;
	m->st.flush_s = secs;
	m->st.flush_windows = nitems;
	if (pg_acquire(m->pg, &c, &err) == KILN_OK) {
		meter_sync(m, c);
		pg_release(m->pg, c);
	} else {
		m->sync_due = true;
	}
}

static void meter_gc(struct meter *m);

/* The state log's sequence a flush saves with the frame (meter_clocks.log_seq): -1 while this
 * meter has not read it yet (frame_seq_due), so flush_commit() saves the sequence now. */
static long long flush_frame_seq(const struct meter *m)
{
	return m->frame_seq_due ? -1 : m->frame_seq;
}

/*
 * The outcome of the flush thread's flush, if it finished, applied (flush_apply); called first
 * thing in a tick, so the ledger's new windows and Redis's live field agree before the tick sends
 * anything: between the commit and this (under a tick) a balance read fresh from the ledger counts
 * those windows twice. KILN_OK, or the failed flush's error (its windows go again).
 */
static enum kiln_err flush_poll(struct meter *m, struct kiln_error *err)
{
	bool ok = false, done;
	size_t fitems;
	int64_t ffirst;
	double fsecs = 0;

	if (!m->fthread)
		return KILN_OK;
	pthread_mutex_lock(&m->flock);
	done = m->fstate == FL_DONE || m->fstate == FL_FAILED;
	if (done) {
		ok = m->fstate == FL_DONE;
		if (!ok)
			*err = m->ferr;
		fsecs = m->fsecs;
		m->fstate = FL_IDLE;
	}
	fitems = m->fitems;
	ffirst = m->ffirst_read;
	pthread_mutex_unlock(&m->flock);
	if (done) {
		flush_apply(m, ok, fitems, ffirst, fsecs, m->frefused.data);
		if (ok && m->frefused.len)
			meter_gc(m);	/* before this tick bills a refused sandbox on */
	}
	return done && !ok ? err->code : KILN_OK;
}

/* The log's sequence a flush saves with its frame (meter_clocks.tick_seq): every change logged no
 * later was logged before this tick read the wall clock, in this frame or an older one. */
static long long flush_tick_seq(const struct meter *m)
{
	return m->tick_seq_pre;
}

/* The frame this tick's flush saves (frame_keep()). */
static void frame_note(struct meter *m)
{
	m->frame_sent = true;
	m->sent_off = m->off;
	m->sent_ver = m->frame_ver;
}

/*
 * With nothing to flush, the frame of this tick's label clock is saved alone when this meter
 * never saved one or followed a step since. The node's frame was saved with a flush only, so a
 * node with nothing to bill had none, and a meter of it started then began at the wall clock:
 * after a backward step the node's other meter followed live, the two labelled every instant a
 * step apart and each billed on from the other's points in its own frame (kiln-sim seed 31569: a
 * meter restarted 4 s after a -712 s step, before the node billed any sandbox, at offset 0 beside
 * the other's 712 s; two sandboxes made later billed 712 s too long, +1,512,994 and +1,490,549
 * µcr). A meter that started in a saved frame saves only once it changed: saved at its first
 * tick, the frame lost the sequence the saved one bounded the changes before its step with
 * (`tick_seq`, none read yet). Not at a tick holding a forward step: that frame has no record of
 * it, and a meter started in it would place the step's gap at its own first tick. One
 * statement, at most once a tick and only then; Postgres unreachable: the next tick.
 */
static void frame_keep(struct meter *m)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct mstep step;

	if (!m->boot[0] || m->fwd_held ||
	    (m->frame_sent && llabs(m->off - m->sent_off) <= STEP_TOLERANCE_NS &&
	     m->frame_ver == m->sent_ver))
		return;
	if (pg_acquire(m->pg, &c, &err) != KILN_OK)
		return;
	step = newest_step(m);
	m->st.pg_calls++;
	if (frame_save(m, c, m->clk_now_l, m->clk_now_m, m->off, flush_frame_seq(m),
		       flush_tick_seq(m), &step, &err) == KILN_OK)
		frame_note(m);
	else
		log_warn("cannot save the meter's clock frame (retried): %s", err.msg);
	pg_release(m->pg, c);
}

/*
 * Writes every finished window to the ledger, then moves their charges from the live part of the
 * balances to the ledger part in Redis. With the flush thread (opts.flush_thread) the tick only
 * hands the thread the next one when none is in flight (so windows commit in order; the outcome
 * is applied by flush_poll at the start of a later tick): it never waits for Postgres. Else the
 * flush runs here. A flush that fails is sent again, whole, by a later tick; the ledger skips a
 * window it has already, so nothing is charged twice.
 */
static enum kiln_err meter_flush(struct meter *m, int64_t now, struct kiln_error *err)
{
	struct buf j;
	size_t nitems = 0;
	int64_t first_read = 0;
	struct timespec t_start, t_end;
	enum kiln_err rc;
	struct buf refused;
	struct mstep step;

	if (m->fthread) {
		bool busy;
		pthread_mutex_lock(&m->flock);
		busy = m->fstate != FL_IDLE;
		pthread_mutex_unlock(&m->flock);
		if (busy)
			return KILN_OK;	/* one flush in flight at a time */
	}
	buf_init(&j, FLUSH_JSON_MAX);
	if (buf_appends(&j, "["))
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	for (size_t i = 0; i < m->nsbs; i++) {
		struct msb *s = m->sbs[i];
		for (size_t k = 0; k < s->nw; k++) {
			if (!win_done(m, &s->w[k], now))
				continue;
			if (json_item(&j, m, s, &s->w[k])) {
				buf_release(&j);
				for (size_t a = 0; a < m->nsbs; a++)
					for (size_t b = 0; b < m->sbs[a]->nw; b++)
						m->sbs[a]->w[b].inflight = false;
				return kiln_error_set(err, KILN_E_NOMEM, "flush too large");
			}
			s->w[k].inflight = true;
			if (!first_read || s->w[k].first_read < first_read)
				first_read = s->w[k].first_read;
			nitems++;
		}
	}
	if (!nitems) {
		buf_release(&j);
		frame_keep(m);
		return KILN_OK;
	}
	buf_appends(&j, "]");
	frame_note(m);
	if (m->fthread) {
		pthread_mutex_lock(&m->flock);
		buf_release(&m->fjson);
		m->fjson = j;
		m->fitems = nitems;
		m->ffirst_read = first_read;
		m->fclk_l = m->clk_now_l;
		m->fclk_m = m->clk_now_m;
		m->fclk_off = m->off;
		m->fframe_seq = flush_frame_seq(m);
		m->ftick_seq = flush_tick_seq(m);
		m->fstep = newest_step(m);
		m->fstate = FL_QUEUED;
		pthread_cond_signal(&m->fcond);
		pthread_mutex_unlock(&m->flock);
		return KILN_OK;
	}
	clock_gettime(CLOCK_MONOTONIC, &t_start);
	buf_init(&refused, FLUSH_JSON_MAX);
	step = newest_step(m);
	rc = flush_commit(m, j.data, nitems, m->clk_now_l, m->clk_now_m, m->off,
			  flush_frame_seq(m), flush_tick_seq(m), &step, &refused, err);
	clock_gettime(CLOCK_MONOTONIC, &t_end);
	buf_release(&j);
	flush_apply(m, rc == KILN_OK, nitems, first_read,
		    (double)(t_end.tv_sec - t_start.tv_sec) +
			    (double)(t_end.tv_nsec - t_start.tv_nsec) / 1e9,
		    refused.data);
	buf_release(&refused);
	return rc;
}

#define EXPIRY_SYNC_BATCH 5000	/* rows of grant_expiries read at once; up to 10 batches a call */

/*
 * Gives Redis the balances of the tenants whose grant expiries it has not had (migrations/0059):
 * those of this meter's run, and of a run whose meter could not reach Redis or died before it
 * did. The rows read are marked synced, each by its identity (its account and the transaction
 * that wrote it: a reopened expiry is a new row), once Redis took the balances read after them;
 * a row written meanwhile waits for the next time. Rows of expiries that took nothing changed no
 * balance and are marked with them. On `c`; false when that could not be done.
 */
static bool expiry_sync_batch(struct meter *m, struct pg_conn *c, bool *more)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	const char **t = NULL;
	char lim[16];
	struct buf rows;
	size_t nt = 0;
	bool ok = false;
	int n;

	*more = false;
	snprintf(lim, sizeof(lim), "%d", EXPIRY_SYNC_BATCH);
	m->st.pg_calls++;
	if (PGQ(c, &res, &err,
		"SELECT a.tenant_id, e.account_id || ' ' || e.xmin::text, e.amount_ucr > 0 "
		"FROM grant_expiries e JOIN ledger_accounts a ON a.id = e.account_id "
		"WHERE NOT e.redis_synced ORDER BY 1 LIMIT $1::int",
		lim) != KILN_OK) {
		log_warn("cannot read the grant expiries Redis has not had: %s", err.msg);
		return false;
	}
	if ((n = pg_res_rows(res)) == 0) {
		pg_res_free(res);
		return true;
	}
	buf_init(&rows, 4u << 20);
	if (!(t = calloc((size_t)n + 1, sizeof(*t))) || buf_appends(&rows, "{"))
		goto out;
	for (int i = 0; i < n; i++) {
		/* an expiry that took nothing changed no balance: marked, not synced */
		if (pg_res_bool(res, i, 2) && (!nt || strcmp(t[nt - 1], pg_res_str(res, i, 0)) != 0))
			t[nt++] = pg_res_str(res, i, 0);
		if (pg_array_add(&rows, pg_res_str(res, i, 1)))
			goto out;
	}
	if (buf_appends(&rows, "}"))
		goto out;
	if (nt) {
		m->st.redis_calls++;
		m->st.pg_calls++;
		if (billing_sync(m->rds, c, nt, t, NULL, NULL, &err) != KILN_OK) {
			log_warn("cannot give Redis the balances of %zu tenants whose grants expired "
				 "(retried): %s", nt, err.msg);
			goto out;
		}
	}
	m->st.pg_calls++;
	if (PGQ(c, NULL, &err,
		"UPDATE grant_expiries SET redis_synced = true WHERE NOT redis_synced AND "
		"account_id || ' ' || xmin::text = ANY ($1::text[])",
		rows.data) != KILN_OK) {
		log_warn("cannot mark grant expiries given to Redis (retried): %s", err.msg);
		goto out;
	}
	*more = n == EXPIRY_SYNC_BATCH;
	ok = true;
out:
	buf_release(&rows);
	free(t);
	pg_res_free(res);
	return ok;
}

static bool expiry_sync(struct meter *m, struct pg_conn *c)
{
	bool more = true;

	for (int i = 0; i < 10 && more; i++)
		if (!expiry_sync_batch(m, c, &more))
			return false;
	return true;
}

/*
 * Expires the grants whose time came two windows ago, once per window; gives Redis the balances
 * they changed (expiry_sync(): and those of any earlier expiry Redis has not had, once per
 * window, and at every tick while this meter's last try failed). The windows that started
 * before a grant's expiry draw from it (ledger_draw()) only until the expiry is posted, and
 * every meter flushes such a window at its end, so the expiry waits a window more than the last
 * of them: run at the expiry, it took the grant's credits while another node's window before
 * it, flushed a moment later, was drawn from another grant or the overdraft. A forward step of
 * the wall clock passes no expiry so: the windows before the step end when it lands and are
 * flushed after it, so for two windows after it lands nothing passed by the step is due; then
 * all of it is (kiln-sim `clock`, seed 9143: a grant whose expiry a 1,018 s forward step passed
 * expired at the step's first tick, another node's window before it, flushed a moment later,
 * drawn from the overdraft).
 */
static void meter_expire(struct meter *m, int64_t now)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char at[32];
	int64_t ws = price_window_start(now, m->o.window_s);
	int64_t two = 2 * m->o.window_s * PRICE_NS_PER_S, due = now - two;

	if (m->nsteps) {
		int k = m->nsteps - 1;
		if (m->clk_now_l - (m->step_at[k] + m->step_by[k]) < two &&
		    due > m->step_at[k] - m->step_off[k] - two)
			due = m->step_at[k] - m->step_off[k] - two;	/* the wall clock when it stepped */
	}
	if (ws == m->last_expiry_ws && !m->expiry_sync_due)
		return;
	if (pg_acquire(m->pg, &c, &err) != KILN_OK)
		return;
	if (ws != m->last_expiry_ws) {
		snprintf(at, sizeof(at), "%.6f", (double)(due / 1000) / 1e6);
		m->st.pg_calls++;
		if (PGQ(c, &res, &err,
			"SELECT DISTINCT t FROM ledger_expire_grants(to_timestamp($1::float8)) t",
			at) == KILN_OK) {
			m->last_expiry_ws = ws;
			if (pg_res_rows(res) > 0)
				log_info("expired grants of %d tenants", pg_res_rows(res));
		} else {
			log_warn("cannot expire grants: %s", err.msg);
		}
		pg_res_free(res);
	}
	m->expiry_sync_due = !expiry_sync(m, c);
	pg_release(m->pg, c);
}

/*
 * Once per window: drops the state changes billed longer than `log_keep_s` ago
 * (sandbox_state_log_trim(), migrations/0014). Any meter may; a failure is retried next window.
 */
static void meter_log_trim(struct meter *m, int64_t now)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	char keep[32];
	int64_t ws = price_window_start(now, m->o.window_s);

	if (ws == m->last_trim_ws || pg_acquire(m->pg, &c, &err) != KILN_OK)
		return;
	snprintf(keep, sizeof(keep), "%lld seconds", (long long)m->o.log_keep_s);
	m->st.pg_calls++;
	if (PGQ(c, NULL, &err, "SELECT sandbox_state_log_trim($1::interval)", keep) == KILN_OK)
		m->last_trim_ws = ws;
	else
		log_warn("cannot trim the state changes: %s", err.msg);
	pg_release(m->pg, c);
}

/*
 * Reads from the ledger the balance of every tenant with a sandbox here whose balance Redis did
 * not answer at this tick (Redis unreachable, or it lost the balance): the reference becomes the
 * ledger less this meter's unflushed charges. Other meters' unflushed charges are not in it (at
 * most a window each, docs/metering.md). Nothing changes when Postgres cannot be read.
 */
static void ledger_refresh(struct meter *m, int64_t now)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	struct buf arr;
	size_t n = 0;

	buf_init(&arr, 64u << 20);
	buf_appends(&arr, "{");
	for (size_t i = 0; i < m->ntens; i++) {
		struct mten *t = m->tens[i];
		if (t->bal_at == now || t->nsb <= 0)
			continue;
		if (pg_array_add(&arr, t->id)) {
			buf_release(&arr);
			return;
		}
		n++;
	}
	buf_appends(&arr, "}");
	if (!n || pg_acquire(m->pg, &c, &err) != KILN_OK) {
		buf_release(&arr);
		return;
	}
	m->st.pg_calls++;
	if (PGQ(c, &res, &err,
		"SELECT u.t, coalesce((SELECT sum(balance_ucr) FROM ledger_account_balances b "
		"WHERE b.tenant_id = u.t), 0) FROM unnest($1::text[]) u(t)",
		arr.data) == KILN_OK) {
		for (int i = 0; i < pg_res_rows(res); i++) {
			struct mten *t = ten_find(m, pg_res_str(res, i, 0));
			if (!t)
				continue;
			t->ref_bal = pg_res_int(res, i, 1, 0) - t->pending;
			t->ref_charged = t->pending + t->flushed;
			t->has_ref = true;
		}
	} else {
		log_warn("cannot read balances from the ledger: %s", err.msg);
	}
	pg_res_free(res);
	pg_release(m->pg, c);
	buf_release(&arr);
}

/*
 * Asks for pauses of the running sandboxes of tenants at or below zero, by what this meter knows
 * at `now`: the balance Redis answered at this tick; else (Redis unreachable, or the balance
 * lost) the last reference, Redis's or the ledger's (ledger_refresh), less this meter's charges
 * since; and while Postgres cannot be read (`billed` false: nothing was billed since the last
 * tick that could), less the tenant's burn rate over the real time since that tick (its labels
 * less the gaps of forward steps between). Enforcement thus goes on whichever input is away;
 * the overdraft each fault allows is in docs/metering.md.
 */
static void meter_enforce(struct meter *m, int64_t now, bool billed)
{
	for (size_t i = 0; i < m->ntens; i++) {
		struct mten *t = m->tens[i];
		long long est;
		if (t->has_balance && t->bal_at == now) {
			t->ref_bal = t->balance;
			t->ref_charged = t->pending + t->flushed;
			t->has_ref = true;
		}
		if (!t->has_ref) {
			t->frozen = false;
			continue;
		}
		est = t->ref_bal - (t->pending + t->flushed - t->ref_charged);
		/* Over the real time since (label_len()): across a forward step the labels count
		 * its gap, and a tenant with credits for 100 s was paused after 16 s of use. */
		if (!billed && m->last_tick && now > m->last_tick)
			est -= (long long)(t->t_burn * (uint64_t)label_len(m, m->last_tick, now) /
					   PRICE_NS_PER_S / PRICE_FINE_PER_UCR);
		t->frozen = est <= 0;
		if (t->frozen && t->bal_at != now)
			t->balance = est;	/* for the log line */
	}
	for (size_t i = 0; i < m->nsbs; i++) {
		struct msb *s = m->sbs[i];
		if (s->ended || s->state != BS_RUN || !s->ten->frozen)
			continue;
		if (!m->o.pause) {
			/* No master key: it runs on, billed into debt, with nothing to bound it. */
			if (!s->ten->unpaused_warned ||
			    label_len(m, s->ten->unpaused_warned, now) >= PAUSE_RETRY_NS) {
				s->ten->unpaused_warned = now;
				log_error("tenant \"%s\" is at %lld µcr and its sandbox \"%s\" runs on: "
					  "no master key, so the meter cannot pause it; it is billed into debt",
					  s->tenant, s->ten->balance, s->id);
			}
			continue;
		}
		/* Asked again after PAUSE_RETRY_NS if it did not pause; at once when it paused and
		 * was resumed since (a new generation: kiln-sim seed 883738573, resumed 4 s after
		 * its pause, at zero a second later, asked again only 10 s after the first time).
		 * Real seconds: across a forward step the labels take in its gap. */
		if (s->pause_asked && s->pause_gen == s->gen &&
		    label_len(m, s->pause_asked, now) < PAUSE_RETRY_NS)
			continue;
		s->pause_asked = now;
		s->pause_gen = s->gen;
		m->st.pauses_asked++;
		log_info("tenant \"%s\" is out of credits (%lld µcr): pausing sandbox \"%s\"", s->tenant,
			 s->ten->balance, s->id);
		m->o.pause(m->o.pause_ctx, s->id, s->tenant);
	}
}

/*
 * A tick whose rows could not be read (Postgres away): nothing is billed (the next tick that
 * reads them bills the whole time), but the tracked sandboxes are enforced on: Redis gets this
 * meter's figures and answers the balances, and meter_enforce takes off the burn rate since the
 * last billed tick.
 */
static void meter_tick_blind(struct meter *m, int64_t now)
{
	for (size_t i = 0; i < m->nsbs; i++)
		m->sbs[i]->t_has = false;
	for (size_t i = 0; i < m->ntens; i++)
		m->tens[i]->t_rx = m->tens[i]->t_tx = 0;
	m->rds_failed = redis_tick(m, now, true) != KILN_OK;
	meter_enforce(m, now, false);
}

/* Forgets sandboxes that ended and are in the ledger, and tenants with nothing left. */
static void meter_gc(struct meter *m)
{
	size_t keep = 0;
	bool removed = false;

	for (size_t i = 0; i < m->nsbs; i++) {
		struct msb *s = m->sbs[i];
		if ((s->ended && s->nw == 0 && !s->seen) || s->resync) {
			if (!s->ended)
				s->ten->nsb--;
			sb_free(s);
			removed = true;
			continue;
		}
		m->sbs[keep++] = s;
	}
	m->nsbs = keep;
	if (removed)
		sb_rehash(m, m->sbh_n ? m->sbh_n : 64);
	keep = 0;
	removed = false;
	for (size_t i = 0; i < m->ntens; i++) {
		struct mten *t = m->tens[i];
		bool used = false;
		if (t->nsb == 0 && t->pending == 0 && t->sent == 0 && t->burn_sent == 0) {
			for (size_t k = 0; k < m->nsbs && !used; k++)
				used = m->sbs[k]->ten == t;
			if (!used) {
				free(t);
				removed = true;
				continue;
			}
		}
		m->tens[keep++] = t;
	}
	m->ntens = keep;
	if (removed)
		ten_rehash(m, m->tnh_n ? m->tnh_n : 64);
}

/* --- public --- */

int meter_pg_session(struct pg *pool)
{
	pg_set_prepared(pool, true);
	return pg_set_on_connect(pool, "SET jit = off");
}

struct meter *meter_new(const struct meter_opts *opts, struct pg *pg, struct rds *rds,
			struct kiln_error *err)
{
	struct meter *m;

	if (!opts->node_id || !*opts->node_id || strlen(opts->node_id) >= ID_MAX) {
		kiln_error_set(err, KILN_E_INVALID, "the meter needs a node id");
		return NULL;
	}
	if (opts->window_s < 1 || opts->window_s > 3600) {
		kiln_error_set(err, KILN_E_INVALID, "the window must be 1 to 3600 seconds");
		return NULL;
	}
	m = calloc(1, sizeof(*m));
	if (!m) {
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return NULL;
	}
	m->fevent = -1;
	m->o = *opts;
	if (opts->boot_id)
		snprintf(m->boot, sizeof(m->boot), "%s", opts->boot_id);
	else if (!opts->mono_ns && !opts->now_ns)
		boot_id_read(m->boot, sizeof(m->boot));
	if (!m->o.mono_ns)
		m->o.mono_ns = m->o.now_ns ? m->o.now_ns : clock_mono;
	if (!m->o.now_ns)
		m->o.now_ns = clock_real;
	if (m->o.live_ttl_s < 1)
		m->o.live_ttl_s = LIVE_TTL_DEFAULT_S;
	if (m->o.log_keep_s < 1)
		m->o.log_keep_s = LOG_KEEP_DEFAULT_S;
	m->commit_wait_ns = m->o.commit_wait_ms < 0 ? -1
			    : (m->o.commit_wait_ms ? m->o.commit_wait_ms : COMMIT_WAIT_DEFAULT_MS) *
				      (PRICE_NS_PER_S / 1000);
	if (m->o.series_s < 1)
		m->o.series_s = 900;
	snprintf(m->node, sizeof(m->node), "%s", opts->node_id);
	snprintf(m->cg_root, sizeof(m->cg_root), "%s", opts->cgroup_root ? opts->cgroup_root : "");
	if (opts->pin_root && !*opts->pin_root)
		snprintf(m->pin_root, sizeof(m->pin_root), "-");
	else
		snprintf(m->pin_root, sizeof(m->pin_root), "%s", opts->pin_root ? opts->pin_root : "");
	m->o.node_id = m->node;
	m->o.cgroup_root = NULL;
	m->o.pin_root = NULL;
	snprintf(m->live_field, sizeof(m->live_field), "live:%s", m->node);
	snprintf(m->alive_key, sizeof(m->alive_key), BILLING_METER_PREFIX "%s" BILLING_ALIVE_SUFFIX,
		 m->node);
	m->pg = pg;
	m->rds = rds;
	buf_init(&m->frefused, FLUSH_JSON_MAX);
	pthread_mutex_init(&m->flock, NULL);
	pthread_cond_init(&m->fcond, NULL);
	if (opts->flush_thread) {
		m->fevent = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
		if (m->fevent < 0) {
			kiln_error_set(err, KILN_E_NOMEM, "cannot make the flush thread's eventfd");
			meter_free(m);
			return NULL;
		}
		if (pthread_create(&m->fth, NULL, flush_main, m) != 0) {
			kiln_error_set(err, KILN_E_NOMEM, "cannot start the flush thread");
			meter_free(m);
			return NULL;
		}
		m->fthread = true;
	}
	return m;
}

void meter_free(struct meter *m)
{
	if (!m)
		return;
	if (m->fthread) {
		/* A flush in flight commits or not; either way the ledger says where billing stands. */
		pthread_mutex_lock(&m->flock);
		m->fstop = true;
		pthread_cond_signal(&m->fcond);
		pthread_mutex_unlock(&m->flock);
		pthread_join(m->fth, NULL);
	}
	if (m->fevent >= 0)
		close(m->fevent);
	buf_release(&m->fjson);
	buf_release(&m->frefused);
	pthread_mutex_destroy(&m->flock);
	pthread_cond_destroy(&m->fcond);
	for (size_t i = 0; i < m->nsbs; i++)
		sb_free(m->sbs[i]);
	for (size_t i = 0; i < m->ntens; i++)
		free(m->tens[i]);
	free(m->sbs);
	free(m->sbh);
	free(m->tens);
	free(m->tnh);
	free(m->cuts);
	free(m);
}

enum kiln_err meter_start(struct meter *m, struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	struct rds_reply rep = { 0 };
	char cpu[24], mem[24], disk[24], snap[24], a[24], b[24], cc[24], d[24], key[160];
	enum kiln_err rc;

	if (m->pg_started)
		goto redis;	/* Postgres's part is done; Redis was away */
	rc = pg_acquire(m->pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	snprintf(cpu, sizeof(cpu), "%lld", m->o.card.cpu_ucr_cpu_s);
	snprintf(mem, sizeof(mem), "%lld", m->o.card.mem_ucr_gib_s);
	snprintf(disk, sizeof(disk), "%lld", m->o.card.disk_ucr_gib_s);
	snprintf(snap, sizeof(snap), "%lld", m->o.card.snap_ucr_gib_s);
	rc = PGQ(c, NULL, err,
		 "INSERT INTO rate_cards (version, cpu_ucr_per_cpu_s, mem_ucr_per_gib_s, "
		 "disk_ucr_per_gib_s, snapshot_ucr_per_gib_s) VALUES ($1, $2, $3, $4, $5) "
		 "ON CONFLICT (version) DO NOTHING",
		 m->o.card.version, cpu, mem, disk, snap);
	if (rc == KILN_OK && m->o.plan_max_sandboxes > 0) {
		snprintf(a, sizeof(a), "%lld", m->o.plan_max_sandboxes);
		snprintf(b, sizeof(b), "%lld", m->o.plan_max_vcpu_milli);
		snprintf(cc, sizeof(cc), "%lld", m->o.plan_max_memory_mib);
		snprintf(d, sizeof(d), "%lld", m->o.plan_max_snapshot_bytes);
		rc = PGQ(c, NULL, err,
			 "INSERT INTO plan_limits VALUES ('default', $1, $2, $3, $4) "
			 "ON CONFLICT (plan) DO UPDATE SET max_sandboxes = $1, max_vcpu_milli = $2, "
			 "max_memory_mib = $3, max_snapshot_bytes = $4",
			 a, b, cc, d);
	}
	/* Rows changed since the oldest billed-up-to point of this node are read on the first
	 * tick, so what ended while no meter ran is billed. */
	if (rc == KILN_OK)
		rc = PGQ(c, &res, err,
			 "SELECT coalesce(min(last_t_ns), 0), coalesce(max(last_t_ns), 0) "
			 "FROM meter_sandboxes WHERE node_id = $1",
			 m->node);
	if (rc == KILN_OK) {
		int64_t oldest = pg_res_int(res, 0, 0, 0);
		m->start_floor = pg_res_int(res, 0, 1, 0);
		int64_t floor_ns = now_ns(m) - 2 * m->o.window_s * PRICE_NS_PER_S;
		m->since = oldest && oldest < floor_ns ? oldest : floor_ns;
	}
	pg_res_free(res);
	res = NULL;
	/* The node's last saved frame, when it was saved on this host since its boot. */
	if (rc == KILN_OK && m->boot[0]) {
		rc = PGQ(c, &res, err,
			 "SELECT label_ns, mono_ns, off_ns, step_at_ns, step_by_ns, step_off_ns, "
			 "step_back, log_seq, tick_seq, gaps_ns, back_at_ns, back_off_ns, back_min, "
			 "back_pre FROM meter_clocks WHERE node_id = $1 AND boot_id = $2",
			 m->node, m->boot);
		m->st.pg_calls++;
		if (rc == KILN_OK && pg_res_rows(res) == 1) {
			m->resume = true;
			m->resume_l = pg_res_int(res, 0, 0, 0);
			m->resume_m = pg_res_int(res, 0, 1, 0);
			m->resume_off = pg_res_int(res, 0, 2, 0);
			m->resume_step = (struct mstep){
				.set = pg_res_get(res, 0, 3) != NULL,
				.back = strcmp(pg_res_str(res, 0, 6), "t") == 0,
				.at = pg_res_int(res, 0, 3, 0),
				.by = pg_res_int(res, 0, 4, 0),
				.off = pg_res_int(res, 0, 5, 0) };
			m->resume_log_seq = pg_res_int(res, 0, 7, 0);
			m->resume_tick_seq = pg_res_int(res, 0, 8, 0);
			gaps_parse(&m->resume_step, pg_res_get(res, 0, 9));
			m->resume_step.fback = (struct mback){
				.set = pg_res_get(res, 0, 10) != NULL,
				.at = pg_res_int(res, 0, 10, 0),
				.off = pg_res_int(res, 0, 11, 0),
				.min = pg_res_int(res, 0, 12, 0),
				.pre = pg_res_int(res, 0, 13, 0) };
		}
		pg_res_free(res);
	}
	/* The generations this node's meters cut and watch (take_cut_tails()): watched on. */
	if (rc == KILN_OK) {
		res = NULL;
		rc = PGQ(c, &res, err,
			 "SELECT sandbox_id, generation FROM meter_cut_watch WHERE node_id = $1 "
			 "ORDER BY created_at, sandbox_id, generation", m->node);
		m->st.pg_calls++;
		for (int i = 0; rc == KILN_OK && i < pg_res_rows(res); i++)
			cut_watch(m, pg_res_str(res, i, 0), pg_res_int(res, i, 1, 0));
		pg_res_free(res);
	}
	pg_release(m->pg, c);
	m->st.pg_calls += 3;
	if (rc != KILN_OK)
		return rc;
	m->pg_started = true;
redis:
	snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s:tenants", m->node);
	m->st.redis_calls++;
	rc = RDS(m->rds, &rep, err, "EVAL", reset_lua, "1", key, m->live_field);
	rds_reply_release(&rep);
	if (rc != KILN_OK)
		return rc;
	m->started = true;
	log_info("meter of node \"%s\" started: rate card \"%s\", windows of %lld s", m->node,
		 m->o.card.version, (long long)m->o.window_s);
	return KILN_OK;
}

/*
 * Reads the state changes of the sandboxes of `r` (sorted by id) logged from label time `t` on
 * into *out: by wall-clock time from node_wall_from(), LOG_LATE_NS earlier, and those witnessed
 * on this meter's boot by monotonic time from where `t` stood on the monotonic clock, as early.
 * The wall-clock bound alone misses a change logged between a backward step and a forward one
 * made while no meter of the node ran: it stands the backward step's size before where the net
 * step puts it, and one logged in the first min(back, forward) - LOG_LATE_NS after the point was
 * never read (kiln-sim seed 31117: a -2,134 s and a +123 s step, its first 63 s). The label
 * clock jumps only forward, so for a `t` this meter's clock passed the monotonic bound is never
 * later than where it passed `t`. Not so for a `t` it started past: a meter started on the same
 * boot without the node's saved frame starts its label clock at the wall clock, or at
 * start_floor when that is later, and places `t` on the monotonic clock from there, which can
 * be later than where the earlier meter's label passed it: at start_floor, by the time from
 * that meter's billing up to it to this start; at the wall clock, by a forward step made since.
 * A witnessed change logged in that stretch is read by the wall-clock bound alone.
 */
static int log_read(struct meter *m, struct mrow *r, int n, int64_t t, struct pg_res **out)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct buf ids;
	char from[24], mono[24];
	enum kiln_err rc;

	buf_init(&ids, 64u << 20);
	if (buf_appends(&ids, "{"))
		return -ENOMEM;
	for (int i = 0; i < n; i++)
		if (pg_array_add(&ids, r[i].id)) {
			buf_release(&ids);
			return -ENOMEM;
		}
	if (buf_appends(&ids, "}")) {
		buf_release(&ids);
		return -ENOMEM;
	}
	snprintf(from, sizeof(from), "%" PRId64, (node_wall_from(m, t) - LOG_LATE_NS) / 1000 - 1);
	snprintf(mono, sizeof(mono), "%" PRId64, m->clk_now_m - (m->clk_now_l - t) - LOG_LATE_NS);
	rc = pg_acquire(m->pg, &c, &err);
	if (rc == KILN_OK) {
		rc = PGQ(c, out, &err, log_sql, m->node, ids.data, from, witness_boot(m), mono);
		m->st.pg_calls++;
		pg_release(m->pg, c);
	}
	buf_release(&ids);
	if (rc != KILN_OK) {
		log_warn("cannot read the state changes: %s", err.msg);
		return -EIO;
	}
	return 0;
}

/*
 * For each sandbox here of `r` (sorted by id), the remainder of its newest point on a node of
 * `dn` (a Postgres array of nodes whose meter is gone, closed here): where a generation of that
 * node taken over by this meter goes on (gen_rem_switch); and the points of its generations on
 * those nodes (tk_point), in *out (freed by the caller). Nothing when Postgres cannot answer.
 */
static void take_over_rems(struct meter *m, struct mrow *r, int rows, struct buf *dn,
			   struct pg_res **out)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	struct buf ids;
	bool e = false;

	buf_init(&ids, 64u << 20);
	e |= buf_appends(dn, "}") != 0 || buf_appends(&ids, "{") != 0;
	for (int i = 0; i < rows; i++)
		if (r[i].here)
			e |= pg_array_add(&ids, r[i].id) != 0;
	e |= buf_appends(&ids, "}") != 0;
	if (!e && pg_acquire(m->pg, &c, &err) == KILN_OK) {
		m->st.pg_calls++;
		if (PGQ(c, &res, &err, "SELECT mm.sandbox_id, "
			"coalesce(mm.gen_node, mm.node_id), mm.remainder_fine, mm.generation, "
			GEN_START_SQL("mm.sandbox_id", "mm.generation") ", "
			GEN_BILLED_SQL("mm.sandbox_id", "mm.generation") ", "
			"mm.cpu_ns, " GEN_END_SQL("mm.sandbox_id", "mm.generation") ", "
			GEN_START_SEQ_SQL("mm.sandbox_id", "mm.generation") ", "
			GEN_END_SEQ_SQL("mm.sandbox_id", "mm.generation") ", "
			GEN_START_WIT_SQL("mm.sandbox_id", "mm.generation") ", "
			GEN_END_WIT_SQL("mm.sandbox_id", "mm.generation") " "
			"FROM meter_sandboxes mm "
			"WHERE mm.sandbox_id = ANY($1::text[]) "
			"AND coalesce(mm.gen_node, mm.node_id) = ANY($2::text[]) "
			"ORDER BY 1, 2, mm.generation DESC", ids.data, dn->data) != KILN_OK)
			log_warn("cannot read the remainders of the nodes gone: %s", err.msg);
		pg_release(m->pg, c);
	}
	for (int k = 0; k < pg_res_rows(res); k++)
		for (int i = 0; i < rows; i++) {
			if (strcmp(r[i].id, pg_res_str(res, k, 0)) != 0)
				continue;
			if (!r[i].tk_n++) {
				r[i].tk_res = res;
				r[i].tk_at = k;
			}
			/* the newest point of each node: the first of its rows */
			if (k && strcmp(pg_res_str(res, k - 1, 0), r[i].id) == 0 &&
			    strcmp(pg_res_str(res, k - 1, 1), pg_res_str(res, k, 1)) == 0)
				continue;
			snprintf(r[i].tk_node, sizeof(r[i].tk_node), "%s", pg_res_str(res, k, 1));
			r[i].tk_rem = (uint64_t)pg_res_int(res, k, 2, 0) % PRICE_FINE_PER_UCR;
		}
	*out = res;
	buf_release(&ids);
}

/*
 * With Redis unreadable, which meters live is not known this tick: a generation this meter
 * already bills, taken over from another node, stays its own (its changes read this tick are
 * marked so). Taken for alive, that node's meter would be left the rest (sb_bill()'s cut) while
 * it may still be dead, and with nothing of the generation in the ledger the tails path has no
 * point to bill it from (test_a_taken_over_generation_billed_on_while_redis_is_away).
 */
static void take_over_kept(struct meter *m, struct mrow *r, int rows)
{
	for (int i = 0; i < rows; i++) {
		const struct msb *s;

		if (!r[i].here || !(s = sb_find(m, r[i].id)) || !s->mine ||
		    strcmp(s->gnode, m->node) == 0)
			continue;
		for (size_t k = 0; k < r[i].ne; k++)
			if (r[i].e[k].gen == s->gen && strcmp(r[i].e[k].node, s->gnode) == 0)
				((struct ment *)r[i].e)[k].mine = true;
	}
}

/*
 * The sandboxes here now whose earlier generations ran on a node whose meter is dead (its alive
 * key gone from Redis, meter_live_ttl_s after its last tick): this meter bills that time (what the
 * dead meter never flushed; the ledger's fence refuses it if that meter comes back and bills it
 * first). One Redis round trip, only when such a stretch is there; Redis unreachable: nothing is
 * taken over this tick.
 */
static void meter_take_over(struct meter *m, struct mrow *r, int rows, struct pg_res **tk)
{
	static const char lua[] =
		"local out = {}\n"
		"for i = 1, #KEYS do out[i] = redis.call('EXISTS', KEYS[i]) end\n"
		"return out\n";
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	struct argv a = { 0 };
	const char **nodes = NULL;
	size_t nn = 0, cap = 0;
	struct buf dn;	/* the dead nodes, a Postgres array */
	bool dead = false;	/* out of memory */
	char nk[24];

	buf_init(&a.arena, 1u << 20);
	buf_init(&dn, 1u << 20);
	dead |= buf_appends(&dn, "{") != 0;
	for (int i = 0; i < rows; i++) {
		if (!r[i].here)
			continue;
		for (size_t k = 0; k <= r[i].ne; k++) {
			const char *nd = k < r[i].ne ? (r[i].e[k].mine ? "" : r[i].e[k].node)
						     : (r[i].has_m && !r[i].m_mine ? r[i].m_node : "");
			bool known = !*nd;
			for (size_t q = 0; q < nn && !known; q++)
				known = strcmp(nodes[q], nd) == 0;
			if (known)
				continue;
			if (nn == cap) {
				const char **g = realloc(nodes, (cap ? cap * 2 : 8) * sizeof(*g));
				if (!g)
					goto out;
				nodes = g;
				cap = cap ? cap * 2 : 8;
			}
			nodes[nn++] = nd;
		}
	}
	if (!nn)
		goto out;
	snprintf(nk, sizeof(nk), "%zu", nn);
	if (argv_add(&a, "EVAL", false) || argv_add(&a, lua, false) || argv_add(&a, nk, true))
		goto out;
	for (size_t q = 0; q < nn; q++)
		if (argv_addf(&a, BILLING_METER_PREFIX "%s" BILLING_ALIVE_SUFFIX, nodes[q]))
			goto out;
	argv_fix(&a);
	m->st.redis_calls++;
	if (rds_command(m->rds, (int)a.n, a.v, NULL, &rep, &err) != KILN_OK ||
	    rep.type != RDS_ARRAY || rep.n != nn) {
		log_warn("cannot tell which meters are alive: %s", err.msg);
		take_over_kept(m, r, rows);
		goto out;
	}
	for (size_t q = 0; q < nn; q++) {
		if (rep.elem[q].integer)
			continue;
		dead |= pg_array_add(&dn, nodes[q]) != 0;
		log_info("the meter of node \"%s\" is gone: its sandboxes here are billed here",
			 nodes[q]);
		for (int i = 0; i < rows; i++) {
			if (!r[i].here)
				continue;
			for (size_t k = 0; k < r[i].ne; k++)
				if (strcmp(r[i].e[k].node, nodes[q]) == 0)
					((struct ment *)r[i].e)[k].mine = true;
			if (r[i].has_m && strcmp(r[i].m_node, nodes[q]) == 0)
				r[i].m_mine = true;
		}
	}
	if (dn.len > 1 && !dead)
		take_over_rems(m, r, rows, &dn, tk);
out:
	buf_release(&dn);
	rds_reply_release(&rep);
	argv_release(&a);
	free(nodes);
}

/*
 * The earlier generations of this node's sandboxes that ran on another node whose meter is
 * gone for good: their billed-up-to point in the ledger is before the generation's end (the
 * first change of a later generation) and not "none". $1 this node. Each row: sandbox, tenant,
 * generation, its node, its billed state and point (ns), remainder, memory, disk, the end (µs),
 * that generation's changes between the point and the end ("<state> <µs> <CPU counter ns, -1
 * when none> <log sequence>", comma-separated), its counters at the point and its
 * pause snapshot's size (MiB, NULL when none), then the generation's start, what is billed of
 * it, its start's log sequence and its end's (gen_point()), the start's and the end's witnesses.
 * The point is on the clock of the meter that wrote it, the end and the changes on the wall
 * clock: they are compared with the generation's start plus what is billed of it (wall_ns), the
 * point itself when that is not known. The changes are read by their wall-clock time only: they
 * carry the witness of the other node's host, which this meter cannot read (witness_time()), so
 * one logged after a backward step the gone meter never saw, standing before that, is not read
 * (docs/metering.md, Clocks: open).
 * Sandboxes move rarely, so this reads a few rows of meter_sandboxes per tick.
 */
/* tails_sql's sandboxes of this node and their points, found first (the subquery `c`, OFFSET 0
 * so that it is planned apart): joined after the lateral reads of each point, the reads ran for
 * every open point of every node, 4,000 of them for a node of 100 VMs (30-50 ms a tick,
 * bench/metering/meter.sh), as a point's reads cost nothing to the planner. */
#define TAILS_WHERE                                                                                \
	"WHERE s.node_id = $1 AND mm.generation < s.generation AND mm.state <> 'none' "            \
	"AND coalesce(mm.gen_node, mm.node_id) <> $1"
static const char tails_sql[] =
	"SELECT mm.sandbox_id, s.tenant_id, mm.generation, coalesce(mm.gen_node, mm.node_id), "
	"mm.state, mm.last_t_ns, mm.remainder_fine, s.memory_mib, s.disk_gib, e.at_us, "
	GEN_CHANGES_SQL("mm.sandbox_id", "mm.generation",
			"l.at > to_timestamp(p.wall_ns / 1e9) AND l.at < to_timestamp(e.at_us / 1e6)") ", "
	"mm.cpu_ns, mm.rx_bytes, mm.tx_bytes, "
	/* its pause snapshot (a generation pauses once) */
	GEN_SNAP_SQL("mm.sandbox_id", "mm.generation") ", "
	"p.start_us, p.billed_ns, " GEN_START_SEQ_SQL("mm.sandbox_id", "mm.generation") ", e.seq, "
	GEN_START_WIT_SQL("mm.sandbox_id", "mm.generation") ", e.wit "
	"FROM (SELECT mm.sandbox_id, mm.generation FROM sandboxes s "
	"    JOIN meter_sandboxes mm ON mm.sandbox_id = s.id " TAILS_WHERE " OFFSET 0) c "
	"JOIN sandboxes s ON s.id = c.sandbox_id "
	"JOIN meter_sandboxes mm ON mm.sandbox_id = c.sandbox_id AND mm.generation = c.generation "
	"CROSS JOIN LATERAL (SELECT " GEN_START_SQL("mm.sandbox_id", "mm.generation") " AS start_us, "
	"    " GEN_BILLED_SQL("mm.sandbox_id", "mm.generation") " AS billed_ns, "
	"    " GEN_REACH_SQL("mm.sandbox_id", "mm.generation", "mm.last_t_ns") " AS reach_ns) p0 "
	"CROSS JOIN LATERAL (SELECT p0.*, coalesce(p0.start_us * 1000 + p0.reach_ns, mm.last_t_ns) "
	"    AS wall_ns) p "
	"JOIN LATERAL (SELECT (extract(epoch FROM n.at) * 1000000)::bigint AS at_us, n.seq, "
	"    " WITNESS_SQL("n") " AS wit "
	"    FROM sandbox_state_log n WHERE n.sandbox_id = mm.sandbox_id "
	"    AND n.generation > mm.generation ORDER BY n.seq LIMIT 1) e ON true "
	TAILS_WHERE " AND p.wall_ns < e.at_us * 1000 "
	"ORDER BY 1, 3";

/*
 * The remainder a point-less generation `gen` of `s` on `node` goes on from, into *rem: that of the
 * end of a generation of that node before it which this meter billed and has not flushed yet (a
 * tail billed here, its windows waiting for the flush), when the ledger's newest earlier point of
 * the node (generation `src`, 0: none; `src_end`: it is that generation's end) is older, or is
 * that generation's own but not its end yet. The newest such. False: the ledger's remainder stands
 * (flushed, that end is in the ledger; refused, the ledger's point is the one to go on from).
 */
static bool tail_rem_find(const struct msb *s, const char *node, long long gen, long long src,
			  bool src_end, uint64_t *rem)
{
	const struct mwin *best = NULL;

	for (size_t k = 0; k < s->nw; k++) {
		const struct mwin *w = &s->w[k];

		if (!w->gen_end || w->gen >= gen || strcmp(w->gnode, node) != 0)
			continue;
		if (w->gen < src || (w->gen == src && src_end))
			continue;
		if (!best || w->gen > best->gen)
			best = w;
	}
	if (best)
		*rem = best->rem;
	return best != NULL;
}

/*
 * Bills the tail of the generation of row `i` of `res` (tails_sql) into `s`: from its ledger point
 * (its remainder, or `rem0` when not NULL)
 * to its end, piece by piece over its changes, with no traffic (its counters were on the other
 * host) and the CPU its changes logged (a pause's vCPU stop: the running time up to it gets the
 * counter's delta from the ledger's point; none after the last such change), then its end recorded as billed state "none" so nobody takes it again. The
 * windows carry that generation and its node; the ledger's fence refuses them if the other
 * meter comes back and bills that time first. The end and the changes are read in the frame
 * they were logged in (node_time_logged() at the tick's label), as gen_point() reads the end:
 * read with the offset after a backward step that followed the end, the end stood the step's
 * size late and the tail was billed that much longer, past where the next generation's windows
 * start (a step of -320 s: 320 s billed twice). They are not placed by the changes logged
 * after them (log_place() is meter_bill_rows()'s only). An end witnessed on this meter's boot (the
 * next generation's start, on this node) is placed by its witness first (witness_time()); the
 * changes carry the other host's witness, so the frames place them. `s`'s own billing point is left
 * as it was.
 */
static void tail_bill(struct meter *m, struct msb *s, const struct pg_res *res, int i,
		      const uint64_t *rem0, int64_t now)
{
	struct msb save = *s;
	const char *chg = pg_res_str(res, i, 10);
	int64_t t = pg_res_int(res, i, 5, 0);
	int64_t end;
	enum bstate st = bstate_of(pg_res_str(res, i, 4));

	if (!witness_col(m, res, i, 20, &end))
		end = node_time_logged(m, pg_res_int(res, i, 9, 0) * 1000,
				       pg_res_int(res, i, 18, 0), m->clk_now_l);
	gen_point(m, res, i, 15, 9, 17, 19, &t);
	s->gen = pg_res_int(res, i, 2, 0);
	snprintf(s->gnode, sizeof(s->gnode), "%s", pg_res_str(res, i, 3));
	s->mine = true;
	s->last_t = t;
	s->state = st;
	s->rem = rem0 ? *rem0 : (uint64_t)pg_res_int(res, i, 6, 0) % PRICE_FINE_PER_UCR;
	s->mem_mib = (unsigned)pg_res_int(res, i, 7, 0);
	s->disk_gib = (unsigned)pg_res_int(res, i, 8, 0);
	s->snap_mib = (uint64_t)pg_res_int(res, i, 14, 0);	/* 0: the guest's memory */
	s->cpu_at = (uint64_t)pg_res_int(res, i, 11, 0);
	s->rx_at = (uint64_t)pg_res_int(res, i, 12, 0);
	s->tx_at = (uint64_t)pg_res_int(res, i, 13, 0);
	log_info("sandbox \"%s\" generation %lld: the meter of node \"%s\" is gone; its time from "
		 "%" PRId64 " to %" PRId64 " (ns) is billed here", s->id, s->gen, s->gnode, t, end);
	while (*chg) {
		char name[16] = "";
		long long us = 0, cpu = -1, seq = 0;
		int64_t at;
		uint64_t dcpu = 0;
		if (sscanf(chg, "%15s %lld %lld %lld", name, &us, &cpu, &seq) != 4)
			break;
		at = node_time_logged(m, us * 1000, seq, m->clk_now_l);
		if (cpu >= 0 && (uint64_t)cpu >= s->cpu_at)
			dcpu = (uint64_t)cpu - s->cpu_at;
		if (at > s->last_t && at < end) {
			/* CPU up to a logged counter: the running time's; a piece not running
			 * moves the counter unbilled (bill_span bills CPU of running time only). */
			bill_span(m, s, s->last_t, at, st, dcpu, 0, 0, now);
			s->state = st;
		} else if (dcpu) {
			s->cpu_at += dcpu;
		}
		st = bstate_of(name);
		chg = strchr(chg, ',');
		chg = chg ? chg + 1 : "";
	}
	if (end > s->last_t)
		bill_span(m, s, s->last_t, end, st, 0, 0, 0, now);
	sb_gen_end(m, s, now);	/* its end, as sb_bill records one */
	s->gen = save.gen;
	snprintf(s->gnode, sizeof(s->gnode), "%s", save.gnode);
	s->mine = save.mine;
	s->last_t = save.last_t;
	s->state = save.state;
	s->rem = save.rem;
	s->mem_mib = save.mem_mib;
	s->disk_gib = save.disk_gib;
	s->snap_mib = save.snap_mib;
	s->cpu_at = save.cpu_at;
	s->rx_at = save.rx_at;
	s->tx_at = save.tx_at;
}

/*
 * Of the rows of `res` (tails_sql's columns) not marked in `skip` (NULL: none), those whose
 * generation's node's meter is gone (its alive key not in Redis): this meter bills the
 * generation's tail (tail_bill()) unless it holds a window of that generation (it bills it
 * already, or its tail is waiting for the flush: once flushed, the ledger's point is the end).
 * One Redis round trip when a row is left; nothing billed when Redis cannot tell.
 */
static void tails_of_the_gone(struct meter *m, const struct pg_res *res, const bool *skip,
			      int src_col, int64_t now)
{
	static const char lua[] =
		"local out = {}\n"
		"for i = 1, #KEYS do out[i] = redis.call('EXISTS', KEYS[i]) end\n"
		"return out\n";
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	struct argv a = { 0 };
	int rows = pg_res_rows(res), todo = 0;
	char nk[24];

	for (int i = 0; i < rows; i++)
		todo += !skip || !skip[i];
	if (!todo)
		return;
	buf_init(&a.arena, 1u << 20);
	snprintf(nk, sizeof(nk), "%d", rows);
	if (argv_add(&a, "EVAL", false) || argv_add(&a, lua, false) || argv_add(&a, nk, true))
		goto out;
	for (int i = 0; i < rows; i++)
		if (argv_addf(&a, BILLING_METER_PREFIX "%s" BILLING_ALIVE_SUFFIX,
			      pg_res_str(res, i, 3)))
			goto out;
	argv_fix(&a);
	m->st.redis_calls++;
	if (rds_command(m->rds, (int)a.n, a.v, NULL, &rep, &err) != KILN_OK ||
	    rep.type != RDS_ARRAY || rep.n != (size_t)rows) {
		log_warn("cannot tell which meters are alive: %s", err.msg);
		goto out;
	}
	for (int i = 0; i < rows; i++) {
		const char *id = pg_res_str(res, i, 0);
		long long gen = pg_res_int(res, i, 2, 0);
		struct msb *s;
		bool taking = false;

		if ((skip && skip[i]) || rep.elem[i].integer)
			continue;	/* its meter lives: it bills its generation itself */
		s = sb_find(m, id);
		if (!s) {
			/* Not tracked (it ended here and was forgotten): tracked as ended. */
			s = sb_add(m, id, pg_res_str(res, i, 1));
			if (!s) {
				log_error("out of memory billing sandbox \"%s\"", id);
				continue;
			}
			s->ended = true;
			s->ten->nsb--;
			s->gen = pg_res_int(res, i, 2, 0);
			s->last_t = node_time(m, pg_res_int(res, i, 9, 0) * 1000);
		}
		for (size_t k = 0; k < s->nw && !taking; k++)
			taking = s->w[k].gen == gen;
		if (taking)
			continue;
		{
			/* A point-less generation after a tail billed here whose end is not in
			 * the ledger yet (cut_tails_sql's columns src_col, src_col + 1) goes on
			 * from the remainder that tail ended with (tail_rem_find()). */
			uint64_t rem;
			bool carried = src_col >= 0 && pg_res_get(res, i, src_col) &&
				       tail_rem_find(s, pg_res_str(res, i, 3), gen,
						     pg_res_int(res, i, src_col, 0),
						     pg_res_bool(res, i, src_col + 1), &rem);

			tail_bill(m, s, res, i, carried ? &rem : NULL, now);
		}
	}
out:
	rds_reply_release(&rep);
	argv_release(&a);
}

/*
 * The generations sb_cut() or sb_bill() left to their node's meter (m->cuts), in tails_sql's
 * columns: from the ledger's point when it has one, else from the generation's start with nothing
 * billed of it (the changes after the start read by their log sequence) and the remainder of the
 * newest earlier generation's point of its node, which that node's meter would have carried into
 * it (gen_rem_switch(); kiln-sim seed 77197: from zero, 1 µcr short); then whether the
 * ledger's point is one tails_sql takes (not "none") or the generation's end (marked, or "none"
 * after something billed: rows_sql), the watch's place in $1 (from 1), and, for a generation with
 * no point of its own, that earlier point's generation (0: none) and whether it is its generation's
 * end (tail_rem_find()); in (sandbox, generation) order, so that of two point-less generations of
 * one node the earlier is billed first. $1 their sandboxes,
 * $2 their generations, $3 this meter's node: the pairs are kept in meter_cut_watch
 * (migrations/0057) for a restart of it (meter_start()). The end's columns are NULL while no later
 * generation is logged.
 */
static const char cut_tails_sql[] =
	"WITH w AS (INSERT INTO meter_cut_watch (node_id, sandbox_id, generation) "
	"    SELECT $3, x.sb, x.gen FROM unnest($1::text[], $2::bigint[]) AS x(sb, gen) "
	"    ON CONFLICT DO NOTHING) "
	"SELECT c.sb, s.tenant_id, c.gen, coalesce(mm.gen_node, mm.node_id, g.node_id, ''), "
	"coalesce(mm.state, g.state), coalesce(mm.last_t_ns, g.at_us * 1000), "
	"coalesce(mm.remainder_fine, q.remainder_fine, 0), "
	"s.memory_mib, s.disk_gib, e.at_us, "
	GEN_CHANGES_SQL("c.sb", "c.gen",
			"CASE WHEN mm.sandbox_id IS NULL THEN l.seq > g.seq "
			"ELSE l.at > to_timestamp(p.wall_ns / 1e9) END "
			"AND l.at < to_timestamp(e.at_us / 1e6)") ", "
	"coalesce(mm.cpu_ns, 0), coalesce(mm.rx_bytes, 0), coalesce(mm.tx_bytes, 0), "
	GEN_SNAP_SQL("c.sb", "c.gen") ", g.at_us, "
	"CASE WHEN mm.sandbox_id IS NULL THEN 0::bigint ELSE p.billed_ns END, g.seq, e.seq, g.wit, "
	"e.wit, coalesce(mm.state <> 'none' OR mm.ended OR mm.remainder_fine <> 0 OR EXISTS (SELECT 1 "
	"    FROM usage_windows u WHERE u.sandbox_id = c.sb AND u.generation = c.gen "
	"    AND (u.ucr > 0 OR u.mem_byte_s > 0)), false), c.ord, "
	"CASE WHEN mm.sandbox_id IS NULL THEN coalesce(q.generation, 0) END, "
	"coalesce(q.at_end, false) "
	"FROM unnest($1::text[], $2::bigint[]) WITH ORDINALITY AS c(sb, gen, ord) "
	"JOIN sandboxes s ON s.id = c.sb "
	"JOIN LATERAL (SELECT (extract(epoch FROM n.at) * 1000000)::bigint AS at_us, n.seq, "
	"    n.state, n.node_id, " WITNESS_SQL("n") " AS wit "
	"    FROM sandbox_state_log n WHERE n.sandbox_id = c.sb AND n.generation = c.gen "
	"    ORDER BY n.seq LIMIT 1) g ON true "
	"LEFT JOIN meter_sandboxes mm ON mm.sandbox_id = c.sb AND mm.generation = c.gen "
	"LEFT JOIN LATERAL (SELECT q.generation, q.remainder_fine, "
	"    q.ended OR q.state = 'none' AS at_end FROM meter_sandboxes q "
	"    WHERE q.sandbox_id = c.sb AND q.generation < c.gen "
	"    AND coalesce(q.gen_node, q.node_id) = g.node_id ORDER BY q.generation DESC LIMIT 1) q "
	"    ON true "
	"LEFT JOIN LATERAL (SELECT (extract(epoch FROM n.at) * 1000000)::bigint AS at_us, n.seq, "
	"    " WITNESS_SQL("n") " AS wit "
	"    FROM sandbox_state_log n WHERE n.sandbox_id = c.sb AND n.generation > c.gen "
	"    ORDER BY n.seq LIMIT 1) e ON true "
	"CROSS JOIN LATERAL (SELECT " GEN_BILLED_SQL("c.sb", "c.gen") " AS billed_ns, "
	"    " GEN_REACH_SQL("c.sb", "c.gen", "mm.last_t_ns") " AS reach_ns) p0 "
	"CROSS JOIN LATERAL (SELECT p0.*, coalesce(g.at_us * 1000 + p0.reach_ns, mm.last_t_ns) "
	"    AS wall_ns) p "
	"ORDER BY c.sb, c.gen";

/* The watch of the pairs `ids` and `gens` (array literals) ended: out of meter_cut_watch. */
static void cut_watch_end(struct meter *m, const char *ids, const char *gens)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	if (pg_acquire(m->pg, &c, &err) == KILN_OK) {
		m->st.pg_calls++;
		PGQ(c, NULL, &err,
		    "DELETE FROM meter_cut_watch WHERE node_id = $1 AND (sandbox_id, generation) IN "
		    "(SELECT * FROM unnest($2::text[], $3::bigint[]))", m->node, ids, gens);
		pg_release(m->pg, c);
	}
	if (err.code != KILN_OK)
		log_warn("cannot end the watch of a generation left to its node's meter: %s",
			 err.msg);
}

/*
 * The generations sb_cut() or sb_bill() left to their node's meter, watched until the ledger has
 * a point of them the tails path takes, or their end: one whose node's meter is gone again before
 * it flushed any of it is billed here from its start to its end (tails_of_the_gone()); before,
 * nobody billed it (test_a_cut_generation_whose_meter_dies_again_unflushed_is_billed_once). One
 * with a point of no state (flushed while it was being made) is billed from there: tails_sql
 * takes no such point. Billed here, it stays watched until its windows are in the ledger (a
 * flush that refuses them drops them: watched, it is billed again from the ledger's point, if
 * any). A generation whose sandbox's row or log is gone, or whose node is not known, is watched
 * no more. One query and one
 * Redis round trip per tick while one is watched; Postgres or Redis unreachable: nothing this
 * tick. The watched pairs are kept in meter_cut_watch, written by that query and deleted here
 * when the watch ends, so a restart of this meter between the cut and the node's meter's second
 * death goes on watching (meter_start()); a pair whose delete failed is read again at a restart
 * and dropped then.
 */
static void take_cut_tails(struct meter *m, int64_t now)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	struct buf ids, gens, gone_ids, gone_gens;
	bool *skip = NULL, *keep = NULL;
	bool e = false;
	int rows;
	size_t n = 0;

	buf_init(&ids, 64u << 20);
	buf_init(&gens, 64u << 20);
	buf_init(&gone_ids, 64u << 20);
	buf_init(&gone_gens, 64u << 20);
	e |= buf_appends(&ids, "{") != 0 || buf_appends(&gens, "{") != 0;
	for (size_t k = 0; k < m->ncuts; k++)
		e |= pg_array_add(&ids, m->cuts[k].id) != 0 ||
		     buf_appendf(&gens, "%s%lld", k ? "," : "", m->cuts[k].gen) != 0;
	e |= buf_appends(&ids, "}") != 0 || buf_appends(&gens, "}") != 0;
	if (e || pg_acquire(m->pg, &c, &err) != KILN_OK)
		goto out;
	m->st.pg_calls++;
	if (PGQ(c, &res, &err, cut_tails_sql, ids.data, gens.data, m->node) != KILN_OK) {
		pg_release(m->pg, c);
		log_warn("cannot read the generations left to their nodes' meters: %s", err.msg);
		goto out;
	}
	pg_release(m->pg, c);
	rows = pg_res_rows(res);
	skip = calloc((size_t)rows + 1, sizeof(*skip));
	keep = calloc(m->ncuts, sizeof(*keep));
	if (!skip || !keep)
		goto out;
	for (int i = 0; i < rows; i++) {
		long long k = pg_res_int(res, i, 22, 0) - 1;
		bool covered = pg_res_bool(res, i, 21);

		skip[i] = covered || !pg_res_get(res, i, 9) || !*pg_res_str(res, i, 3);
		if (k >= 0 && (size_t)k < m->ncuts)	/* no node: no meter to wait for */
			keep[k] = !covered && *pg_res_str(res, i, 3);
	}
	tails_of_the_gone(m, res, skip, 23, now);
	e = buf_appends(&gone_ids, "{") != 0 || buf_appends(&gone_gens, "{") != 0;
	for (size_t k = 0; k < m->ncuts; k++) {
		if (keep[k]) {
			m->cuts[n++] = m->cuts[k];
			continue;
		}
		e |= pg_array_add(&gone_ids, m->cuts[k].id) != 0 ||
		     buf_appendf(&gone_gens, "%s%lld", gone_gens.len > 1 ? "," : "",
				 m->cuts[k].gen) != 0;
	}
	e |= buf_appends(&gone_ids, "}") != 0 || buf_appends(&gone_gens, "}") != 0;
	if (n < m->ncuts && !e)
		cut_watch_end(m, gone_ids.data, gone_gens.data);
	m->ncuts = n;
out:
	free(skip);
	free(keep);
	pg_res_free(res);
	buf_release(&ids);
	buf_release(&gens);
	buf_release(&gone_ids);
	buf_release(&gone_gens);
}

/*
 * A generation of a sandbox here now that ran on another node whose meter died for good (its
 * alive key gone from Redis) before it billed that generation to its end: this meter bills the
 * stretch from the ledger's point to the end, once (a tail in memory is not taken again; once
 * flushed, the point is the end). One query per tick and one Redis round trip when such a stretch
 * is there; Postgres or Redis unreachable: nothing is taken this tick. The generations sb_cut()
 * and sb_bill() left to their node's meter are watched after (take_cut_tails()), so that a
 * point-less one goes on from the remainder a tail of its node billed this tick ended with
 * (tail_rem_find(); kiln-sim seed 31672: billed before that tail, from the remainder of the
 * earlier generation's point before its tail, one µcr moved between two generations).
 */
static void meter_take_tails(struct meter *m, int64_t now)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;

	if (pg_acquire(m->pg, &c, &err) == KILN_OK) {
		m->st.pg_calls++;
		if (PGQ(c, &res, &err, tails_sql, m->node) != KILN_OK)
			log_warn("cannot read the generations left by other nodes: %s", err.msg);
		pg_release(m->pg, c);
		if (res)
			tails_of_the_gone(m, res, NULL, -1, now);
		pg_res_free(res);
	}
	if (m->ncuts)
		take_cut_tails(m, now);
}

/*
 * Marks the row `r` of `s` to end at its billed-up-to point (sb_bill()) when its change k,
 * dropped as in that point, is the row's end while the point says the generation goes on
 * (running or paused) and the row's own end reads ahead of the tick `now`: the log has the end
 * at or before the point, the row after the tick. They cannot both be right (the log's row of an
 * end carries the row's own time), and no reading is known to part them since both are read in
 * the frame they were logged in; before, the point's state was billed until the row's end, past
 * the run's end when it stayed ahead (kiln-sim seed 31120: the deletion read 2,807 s early from
 * the log, 2,196 s late from the row). Ended at the point, none of the time the log has after
 * the end is billed.
 */
static void end_in_point_mark(const struct msb *s, struct mrow *r, size_t k, int64_t now)
{
	const struct ment *e = &r->e[k];

	if (!row_terminal(r))
		return;	/* it goes on (or is lost): no end to part from the point */
	if (k + 1 != r->ne || !e->seq || e->st != BS_NONE || e->gen != r->gen || e->gen != s->gen ||
	    !e->mine || !s->mine || s->state == BS_NONE || row_end(r) <= now)
		return;
	log_warn("sandbox \"%s\": generation %lld's end (log seq %lld) is in its billed-up-to "
		 "point, which says it goes on, and the row's end reads %.3f s ahead: ended at the "
		 "point",
		 r->id, s->gen, e->seq, (double)(row_end(r) - now) / 1e9);
	r->end_in_point = true;
}

/* The change of `r` logged at the node's wall-clock time `w` (its newest such among the log rows
 * read), NULL when none was read. */
static const struct ment *row_time_ment(const struct mrow *r, int64_t w)
{
	const struct ment *found = NULL;

	for (size_t k = 0; k < r->ne; k++)
		if (r->e[k].w == w && (!found || r->e[k].seq > found->seq))
			found = &r->e[k];
	return found;
}

/*
 * The times of `r` (as row_parse() reads them, the node's wall clock) on the label clock at this
 * tick's label, each where the log row of the change that logged it is placed (the row's times
 * are those of its changes: state_changed_at its newest, deleted_at its deletion, created_at its
 * creation; log_place(), so that a row and the log row read with it agree), or, when that log row
 * is not among those read (before the log is read, a change older than the log read, a trimmed
 * log, a deletion logged at another time than the row's), in the frame it was logged in with no
 * sequence (node_time_logged(), read as any change: back_usable()). Read with the offset in
 * force, a time logged before a backward step stood the step's size ahead, and the row's end was
 * waited for while its state before was billed (kiln-sim seed 31120: a deletion read 2,196 s
 * late). At the label, not at the high-water mark billed up to (meter_bill_rows()).
 */
static void row_times(const struct meter *m, struct mrow *r)
{
	int64_t *t[] = { &r->changed, &r->deleted, &r->created };
	const int64_t w[] = { r->w_changed, r->w_deleted, r->w_created };

	for (size_t k = 0; k < sizeof(t) / sizeof(t[0]); k++) {
		const struct ment *e = w[k] ? row_time_ment(r, w[k]) : NULL;

		*t[k] = !w[k] ? 0 : e ? e->at : node_time_logged(m, w[k], 0, m->clk_now_l);
	}
}

/*
 * Bills every sandbox of the tick's rows `res` up to `now`: tracks the new ones, reads the state
 * changes of all since the oldest billed-up-to point among them (one query), and bills each
 * over its own. -ENOMEM, or -EIO when the changes cannot be read (nothing billed this tick).
 */
static int meter_bill_rows(struct meter *m, struct pg_res *res, int rows, int64_t now)
{
	struct mrow *r = calloc((size_t)rows, sizeof(*r));
	struct msb **sv = calloc((size_t)rows, sizeof(*sv));
	struct ment *ev = NULL;
	struct pg_res *lres = NULL, *tk = NULL;
	int64_t from = INT64_MAX;
	int ne = 0, rc = 0;

	if (!r || !sv) {
		rc = -ENOMEM;
		goto out;
	}
	for (int i = 0; i < rows; i++) {
		row_parse(res, i, &r[i]);
		row_times(m, &r[i]);	/* read again with their log rows' placed times, below */
		if (r[i].has_m)	/* written by another node's meter: placed on this clock */
			(void)gen_point(m, res, i, 21, 24, 25, 27, &r[i].m_last);
		sv[i] = sb_find(m, r[i].id);
		{
			/* Untracked: from its point, or from its creation when the point is
			 * another node's (it may be taken over below). */
			int64_t t = sv[i] ? sv[i]->last_t : r[i].has_m ? r[i].m_last : r[i].created;
			if (!sv[i] && r[i].created < t && (!r[i].m_mine || r[i].m_gen > r[i].gen))
				t = r[i].created;
			if (t < from)
				from = t;
		}
	}
	if ((rc = log_read(m, r, rows, from, &lres)) != 0)
		goto out;
	ne = pg_res_rows(lres);
	ev = calloc((size_t)ne + 1, sizeof(*ev));
	if (!ev) {
		rc = -ENOMEM;
		goto out;
	}
	/* Both sorted by id (byte order): each row's changes are a run of `ev`. */
	for (int i = 0, k = 0; k < ne; k++) {
		const char *id = pg_res_str(lres, k, 0);
		const char *st = pg_res_str(lres, k, 2);
		struct ment *e = &ev[k];

		while (i < rows && strcmp(r[i].id, id) < 0)
			i++;
		if (i == rows)
			break;
		if (strcmp(r[i].id, id) != 0)
			continue;
		e->gen = pg_res_int(lres, k, 1, 0);
		e->st = bstate_of(st);
		e->seq = pg_res_int(lres, k, 7, 0);
		e->w = pg_res_int(lres, k, 3, 0) * 1000;	/* placed by log_place(), below */
		e->mine = pg_res_bool(lres, k, 4);
		e->has_cpu = pg_res_get(lres, k, 5) != NULL;
		e->cpu = (uint64_t)pg_res_int(lres, k, 5, 0);
		e->node = pg_res_str(lres, k, 6);
		e->snap_mib = (uint64_t)pg_res_int(lres, k, 8, 0);
		e->boot = pg_res_get(lres, k, 9) && pg_res_get(lres, k, 10) ? pg_res_str(lres, k, 9)
									     : NULL;
		e->mono = pg_res_int(lres, k, 10, 0);
		if (!r[i].e)
			r[i].e = e;
		r[i].ne++;
	}
	for (int i = 0; i < rows; i++) {
		log_place(m, (struct ment *)r[i].e, r[i].ne);
		row_times(m, &r[i]);
	}
	meter_take_over(m, r, rows, &tk);
	for (int i = 0; i < rows; i++) {
		struct msb *s = sv[i];
		struct ment only;

		if (!r[i].ne && !r[i].has_m) {
			/* No change read (trimmed, or logged before the log's wall-clock bound:
			 * Clocks, open): where the row stands now, on no other node (sb_track()
			 * reads its node: without one, kiln-meter crashed). */
			only = (struct ment){ .gen = r[i].gen, .st = row_terminal(&r[i]) ? BS_NONE
									     : bstate_of(r[i].state),
					      .at = r[i].deleted ? r[i].deleted : r[i].changed,
					      .node = "", .mine = r[i].here };
			r[i].e = &only;
			r[i].ne = 1;
		}
		if (!s && m->fwd_held) {
			/* Tracked from the next tick, once the forward step seen now is followed:
			 * this tick places no change in the frame before a backward step
			 * (node_time_logged()), so a change of the ledger point's generation logged
			 * before one read past the point, was not taken as in it, and was applied
			 * again at the next tick (kiln-sim seed 31145: a paused sandbox's boot,
			 * logged before a 1,414 s backward step and read 1,414 s late by a meter of
			 * its node that began tracking it from the ledger at such a tick, billed
			 * 4.42 s of paused time as running, +1,217 µcr). */
			continue;
		}
		if (!s) {
			s = sb_track(m, &r[i], now);
			if (!s) {
				log_error("out of memory tracking sandbox \"%s\"", r[i].id);
				continue;
			}
			/* The changes before its billed-up-to point are in it; every change of its
			 * generation when that point is the generation's end (the sandbox ended in
			 * it: a backward step of the wall clock can make them read as later, and a
			 * sandbox ended lately be read again: kiln-sim `clock`, seed 9110); every
			 * change of an earlier generation (one logged before a backward step can
			 * read just past the point while the point's own generation's, logged
			 * after it, read too early to be read: kiln-sim `clock`, seed 9259). A point
			 * in no state is the end only when marked so (sb_gen_end(): migration 0049)
			 * or something of the generation was billed (m_billed): one written while
			 * the sandbox was still creating is before all of it (taken
			 * as its end, a sandbox whose meter crashed while it booted was billed its
			 * whole life in no state: kiln-sim seed 793780264, -45,951 µcr). A point of an
			 * earlier generation in no state is its end too: a later one began, so that
			 * one is over (a meter restarted in the frame after a backward step, which it
			 * never saw, read the changes of a generation that had moved away the step's
			 * length later, past its end, and billed its running time again when the
			 * sandbox came back to its node: kiln-sim seed 31012, +36,212 µcr). */
			bool in_end = r[i].has_m && r[i].m_gen == r[i].gen && s->gen == r[i].gen &&
				      s->state == BS_NONE && r[i].m_billed && row_terminal(&r[i]);
			if (r[i].has_m && r[i].m_mine && r[i].m_gen < r[i].gen &&
			    s->gen == r[i].m_gen && s->state == BS_NONE && r[i].m_billed)
				in_end = true;	/* tracked from that earlier generation's end */
			for (size_t k = 0; k < r[i].ne; k++)
				if ((r[i].e[k].at < s->last_t || r[i].e[k].gen < s->gen ||
				     (in_end && r[i].e[k].gen == s->gen)) &&
				    r[i].e[k].seq > s->seq)
					s->seq = r[i].e[k].seq;
			/* And those a later tick reads first: the log is read from a wall-clock
			 * bound that another sandbox's earlier start can lower, and its changes
			 * before the point, unread at this tick, would pass as new (seq above 0:
			 * kiln-sim seed 77085, a paused sandbox's running change, logged before a
			 * -168 s step and its pause after it, read by the meter restarted 303 s in
			 * when a moved sandbox's creation widened the read: the pause still
			 * unread, 388 s of paused time billed as running, +793,895 µcr). Those
			 * logged no later than the saved frame's tick_seq were logged before its
			 * flush: placed before the point, they are in it, as the changes this tick
			 * reads are (the same rule, so the same limit: a change logged late, past
			 * the window that wrote the point, is taken as in it too). */
			if (r[i].has_m && r[i].m_mine && r[i].m_gen <= r[i].gen &&
			    strcmp(r[i].m_node, m->node) == 0 && m->resume) {
				s->pt_seq = m->resume_tick_seq;
				s->pt_t = s->last_t;
			}
		}
		s->seen = true;
		if (s->ended) {
			/* Back after it ended (here again under a new generation): bill it again. */
			bool back = false;
			for (size_t k = 0; k < r[i].ne && !back; k++)
				back = r[i].e[k].at >= s->last_t && r[i].e[k].mine &&
				       r[i].e[k].st != BS_NONE && (r[i].e[k].gen != s->gen || !s->mine);
			if (!back)
				continue;
			s->ended = false;
			s->ten->nsb++;
		}
		/* The changes from its billed-up-to point on, and those logged since the last tick
		 * with an earlier time (billed in the old state up to the point): from the point.
		 * Never one applied already (or in the point), whatever its time reads: after a
		 * backward step of the wall clock, a change logged before it reads that much later
		 * (kiln-sim `clock`, seed 9108). One sandbox's changes are logged in the order of
		 * its row's updates, so a later `seq` is a later change. */
		{
			struct ment *e = (struct ment *)r[i].e;
			size_t w = 0;
			for (size_t k = 0; k < r[i].ne; k++) {
				if (e[k].seq ? e[k].seq <= s->seq ||
					       (e[k].seq <= s->pt_seq && e[k].at < s->pt_t)
					     : e[k].at < s->last_t) {
					end_in_point_mark(s, &r[i], k, now);
					continue;	/* (no seq: the row's own state, not logged) */
				}
				if (e[k].at < s->last_t)
					e[k].at = s->last_t;
				e[w++] = e[k];
			}
			r[i].ne = w;
		}
		s->t_start = s->last_t;
		sb_bill(m, s, &r[i], now);
		s->t_has = s->last_t > s->t_start || s->t_cpu || s->t_rx || s->t_tx;
	}
out:
	pg_res_free(lres);
	pg_res_free(tk);
	free(ev);
	free(sv);
	free(r);
	return rc;
}

int meter_flush_fd(const struct meter *m)
{
	return m->fevent;
}

void meter_flush_settle(struct meter *m)
{
	struct kiln_error err = { 0 };
	uint64_t n;

	if (m->fevent < 0)
		return;
	while (read(m->fevent, &n, sizeof(n)) > 0)
		;
	if (m->started && flush_poll(m, &err) != KILN_OK)
		log_warn("cannot flush to the ledger (will retry): %s", err.msg);
}

/*
 * How long ago (µs, on the database's clock) the oldest transaction still open in this database
 * began, at most $1 µs: a state change it writes carries that start as its time (now()) or a
 * later one, and commits after this tick reads the rows. Meters' flushes write none (they run
 * as FLUSH_APP_NAME); backends of other roles show no start without pg_read_all_stats and are
 * not waited for. Read before the rows, so a transaction that commits after their snapshot was
 * open here or began after this read.
 */
static const char commit_lag_sql[] =
	"SELECT least($1::bigint, greatest(0, coalesce((extract(epoch FROM statement_timestamp() "
	"    - min(xact_start)) * 1000000)::bigint, 0))), "
	"(SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM sandbox_state_log_seq_seq) "
	"FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
	"AND backend_type = 'client backend' AND xact_start IS NOT NULL "
	"AND application_name IS DISTINCT FROM '" FLUSH_APP_NAME "'";

/*
 * The tick's high-water mark: how far behind `now` this tick bills (m->lag). A sandbox's end (or
 * any state change) committed after the tick read its row as running carries a time no earlier
 * than the start of its transaction, open when the tick looked; billing stops at the oldest
 * such start, so no running time past an end is billed (the end is billed at its own time when
 * it is seen). Waits at most commit_wait_ns (never: 0); a transaction open longer than that
 * holds billing that far behind. With it, the state log's sequence (its last value, 0 while none
 * was taken) into m->tick_seq: the next backward step's frame begins above it (meter_clock()).
 * KILN_OK, or the error of the query (the tick fails like its rows query).
 */
static enum kiln_err commit_lag(struct meter *m, struct pg_conn *c, struct kiln_error *err)
{
	struct pg_res *res = NULL;
	char cap[24];
	enum kiln_err rc;

	m->lag = 0;
	snprintf(cap, sizeof(cap), "%" PRId64, m->commit_wait_ns < 0 ? 0 : m->commit_wait_ns / 1000);
	rc = PGQ(c, &res, err, commit_lag_sql, cap);
	m->st.pg_calls++;
	if (rc == KILN_OK && pg_res_rows(res) == 1) {
		m->lag = pg_res_int(res, 0, 0, 0) * 1000;
		m->tick_seq = pg_res_int(res, 0, 1, 0);
		m->tick_seq_set = true;
	}
	pg_res_free(res);
	return rc;
}

/*
 * Sets each of the `n` sequences still unread whose step was seen LOG_LATE_NS or more before
 * `mono` to `seq` (0: only tells whether one is due).
 */
static bool steps_seq_set(long long *seqs, const int64_t *seen, int n, int64_t mono, long long seq)
{
	bool due = false;

	for (int i = 0; i < n; i++)
		if (!seqs[i] && mono - seen[i] >= LOG_LATE_NS) {
			due = true;
			if (seq)
				seqs[i] = seq;
		}
	return due;
}

/*
 * Reads the state log's sequence for the clock steps seen LOG_LATE_NS or more ago that have none
 * yet (step_seq, back_seq): one query, only in the ticks after a step. A change logged with a
 * later seq was logged after that read, so its time is past the step. Nothing when it fails: read
 * at a later tick, later still, which only puts fewer changes after the step.
 */
static void steps_seq_read(struct meter *m, struct pg_conn *c)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	int64_t mono = m->clk_now_m;
	long long seq;

	if (!steps_seq_set(m->step_seq, m->step_mono, m->nsteps, mono, 0) &&
	    !steps_seq_set(m->back_seq, m->back_mono, m->nback, mono, 0))
		return;
	m->st.pg_calls++;
	if (PGQ0(c, &res, &err, "SELECT last_value FROM sandbox_state_log_seq_seq") != KILN_OK) {
		log_warn("cannot read the state log's sequence: %s", err.msg);
		return;
	}
	seq = pg_res_int(res, 0, 0, 0);
	pg_res_free(res);
	steps_seq_set(m->step_seq, m->step_mono, m->nsteps, mono, seq);
	steps_seq_set(m->back_seq, m->back_mono, m->nback, mono, seq);
}

enum kiln_err meter_tick(struct meter *m, struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char node_since[24];
	int64_t now, hw;
	enum kiln_err rc;
	int rows;

	if (!m->started) {
		rc = meter_start(m, err);
		if (rc != KILN_OK && !m->pg_started) {
			m->st.ticks_failed++;
			return rc;
		}
		/* Redis away at start: bill, and enforce from the ledger, until it answers. */
		kiln_error_clear(err);
	}
	if (flush_poll(m, err) != KILN_OK) {
		log_warn("cannot flush to the ledger (will retry): %s", err->msg);
		kiln_error_clear(err);
	}
	m->tick_seq_pre_last = m->tick_seq_pre;
	m->tick_seq_pre = m->tick_seq_set ? m->tick_seq : 0;	/* before meter_clock() */
	now = meter_clock(m);
	rc = pg_acquire(m->pg, &c, err);
	if (rc == KILN_OK) {
		rc = commit_lag(m, c, err);
		snprintf(node_since, sizeof(node_since), "%" PRId64, m->since / 1000);
		if (rc == KILN_OK)
			rc = PGQ(c, &res, err, rows_sql, m->node, node_since);
		m->st.pg_calls++;
		if (rc == KILN_OK)
			steps_seq_read(m, c);
		pg_release(m->pg, c);
	}
	m->pg_failed = rc != KILN_OK;
	if (rc != KILN_OK) {
		m->st.ticks_failed++;
		meter_tick_blind(m, now);
		return rc;
	}
	m->st.ticks++;
	/* A restarted meter's first tick began a frame (a backward step made while no meter of the
	 * node ran): its sequence is the one read now, none read before it (meter_clock()). */
	if (m->frame_seq_due) {
		m->frame_seq = m->tick_seq;
		m->frame_seq_due = false;
	}
	/* Billed up to the high-water mark: no transaction still open can log a change before it.
	 * The lag is real time, taken off over the gaps: the label less it fell inside a forward
	 * step's gap on the tick after it, and billing ran to the gap's start. */
	hw = m->lag > 0 ? label_sub(m, now, m->lag) : now;
	if (m->lag > PRICE_NS_PER_S / 10)
		log_debug("billing up to %.3f s behind the clock: a transaction open that long may "
			  "still change a sandbox", (double)m->lag / 1e9);
	for (size_t i = 0; i < m->nsbs; i++) {
		struct msb *s = m->sbs[i];
		s->seen = false;
		s->t_has = false;
		s->t_cpu = s->t_rx = s->t_tx = s->t_mem = 0;
		s->t_ucr = 0;
	}
	for (size_t i = 0; i < m->ntens; i++) {
		m->tens[i]->t_burn = 0;
		m->tens[i]->t_rx = m->tens[i]->t_tx = 0;
	}
	rows = pg_res_rows(res);
	if (rows > 0 && meter_bill_rows(m, res, rows, hw) != 0)
		log_error("out of memory billing this tick's sandboxes");
	pg_res_free(res);
	meter_take_tails(m, hw);
	/* Tracked but gone from the node's rows (moved, or the row vanished): billing ends. */
	for (size_t i = 0; i < m->nsbs; i++) {
		struct msb *s = m->sbs[i];
		if (!s->seen && !s->ended) {
			s->ended = true;
			s->ten->nsb--;
			cg_free(s->cg);
			s->cg = NULL;
		}
	}
	m->st.sandboxes = 0;
	for (size_t i = 0; i < m->nsbs; i++)
		m->st.sandboxes += !m->sbs[i]->ended;
	if (m->sync_due) {
		/* A flush could not reach Redis: its ledger half first, so it answers right. */
		struct pg_conn *sc;
		struct kiln_error serr = { 0 };
		if (pg_acquire(m->pg, &sc, &serr) == KILN_OK) {
			meter_sync(m, sc);
			pg_release(m->pg, sc);
		}
	}
	m->rds_failed = redis_tick(m, now, false) != KILN_OK;
	ledger_refresh(m, now);
	meter_enforce(m, now, true);
	if (meter_flush(m, hw, err) != KILN_OK) {
		log_warn("cannot flush to the ledger (will retry): %s", err->msg);
		kiln_error_clear(err);
	}
	meter_expire(m, m->wall);
	meter_log_trim(m, m->wall);
	meter_gc(m);
	m->last_tick = now;
	m->since = m->wall - 2 * m->o.window_s * PRICE_NS_PER_S;
	return KILN_OK;
}

void meter_note_missed(struct meter *m, uint64_t n)
{
	m->ticks_missed += n;
}

void meter_get_stats(const struct meter *m, struct meter_stats *out)
{
	*out = m->st;
	out->ticks_failed += m->ticks_missed;
}

size_t meter_tracked_for_test(const struct meter *m)
{
	return m->nsbs;
}

long long meter_pending(const struct meter *m, const char *tenant_id)
{
	struct mten *t = ten_find((struct meter *)m, tenant_id);

	return t ? t->pending : 0;
}

void meter_set_backends(struct meter *m, struct pg *pg, struct rds *rds)
{
	m->pg = pg;
	m->rds = rds;
}
