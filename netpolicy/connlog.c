/*
 * connlog.c - reads a sandbox's connection log from its pinned eBPF maps (see connlog.h).
 */
#include "netpolicy/connlog.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <bpf/bpf.h>
#include <bpf/libbpf.h>

#include "bpf/policy.h"
#include "netpolicy/policy.h"

#define DEDUP_SLOTS 4096	/* refused destinations remembered within one read */

struct kiln_connlog {
	int ring_fd, flows_fd, counters_fd;
	struct ring_buffer *rb;
	uint32_t max_per_minute;
	uint64_t win_start_ns;	/* the current minute */
	uint32_t win_count;	/* events delivered in it */
	uint64_t over_cap;
	/* the read in progress */
	struct kiln_conn *out;
	size_t n, cap;
	bool oom;
	uint64_t *dedup;	/* hashes of refused destinations seen in this read (0 = empty) */
};

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void kiln_connlog_close(struct kiln_connlog *l)
{
	if (!l)
		return;
	ring_buffer__free(l->rb);
	if (l->ring_fd >= 0)
		close(l->ring_fd);
	if (l->flows_fd >= 0)
		close(l->flows_fd);
	if (l->counters_fd >= 0)
		close(l->counters_fd);
	free(l->dedup);
	free(l);
}

static struct kiln_conn *push(struct kiln_connlog *l)
{
	if (l->n == l->cap) {
		size_t nc = l->cap ? l->cap * 2 : 64;
		struct kiln_conn *p = realloc(l->out, nc * sizeof(*p));
		if (!p) {
			l->oom = true;
			return NULL;
		}
		l->out = p;
		l->cap = nc;
	}
	struct kiln_conn *c = &l->out[l->n++];
	memset(c, 0, sizeof(*c));
	return c;
}

static void from_key(struct kiln_conn *c, const struct np_flow_key *k)
{
	c->family = k->family;
	c->proto = k->proto;
	c->gport = ntohs(k->gport);
	c->rport = ntohs(k->rport);
	memcpy(c->raddr, k->raddr, 16);
}

static void from_val(struct kiln_conn *c, const struct np_flow_val *v)
{
	c->opened_ns = v->opened_ns;
	c->last_ns = v->last_ns > v->opened_ns ? v->last_ns : v->opened_ns;
	c->bytes_out = v->bytes_out;
	c->bytes_in = v->bytes_in;
	c->packets_out = v->packets_out;
	c->packets_in = v->packets_in;
}

/* FNV-1a of a refused destination; never 0. */
static uint64_t key_hash(const struct np_flow_key *k)
{
	const uint8_t *b = (const uint8_t *)k;
	uint64_t h = 1469598103934665603ull;
	for (size_t i = 0; i < sizeof(*k); i++)
		h = (h ^ b[i]) * 1099511628211ull;
	return h ? h : 1;
}

/* Whether a refused destination was already delivered in this read (and remembers it). */
static bool dedup_seen(struct kiln_connlog *l, const struct np_flow_key *k)
{
	uint64_t h = key_hash(k);
	for (size_t i = 0; i < DEDUP_SLOTS; i++) {
		uint64_t *s = &l->dedup[(h + i) % DEDUP_SLOTS];
		if (*s == h)
			return true;
		if (*s == 0) {
			*s = h;
			return false;
		}
	}
	return false;	/* full: deliver (the cap still bounds it) */
}

static bool within_cap(struct kiln_connlog *l)
{
	uint64_t now = mono_ns();
	if (now - l->win_start_ns >= 60ull * 1000000000ull) {
		l->win_start_ns = now;
		l->win_count = 0;
	}
	if (l->win_count >= l->max_per_minute) {
		l->over_cap++;
		return false;
	}
	l->win_count++;
	return true;
}

static int on_event(void *ctx, void *data, size_t size)
{
	struct kiln_connlog *l = ctx;
	struct np_conn_event ev;

	if (size < sizeof(ev))
		return 0;
	memcpy(&ev, data, sizeof(ev));
	if (ev.verdict == NP_CONN_DENIED && dedup_seen(l, &ev.key))
		return 0;
	if (!within_cap(l))
		return 0;
	struct kiln_conn *c = push(l);
	if (!c)
		return -ENOMEM;
	from_key(c, &ev.key);
	c->verdict = ev.verdict == NP_CONN_DENIED ? KILN_CONN_DENIED : KILN_CONN_ALLOWED;
	c->opened_ns = c->last_ns = ev.ts_ns;
	c->is_new = true;
	struct np_flow_val v;
	if (c->verdict == KILN_CONN_ALLOWED && bpf_map_lookup_elem(l->flows_fd, &ev.key, &v) == 0 &&
	    v.opened_ns == ev.ts_ns)
		from_val(c, &v);
	return 0;
}

enum kiln_err kiln_connlog_open(const char *pin_root, const char *node_id,
				const char *sandbox_id, uint32_t max_per_minute,
				struct kiln_connlog **out, struct kiln_error *err)
{
	static const char *const names[3] = { "connlog", "flows", "counters" };
	char path[320];
	enum kiln_err e = KILN_OK;
	struct kiln_connlog *l = calloc(1, sizeof(*l));

	if (!l)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	l->ring_fd = l->flows_fd = l->counters_fd = -1;
	l->max_per_minute = max_per_minute;
	l->win_start_ns = mono_ns();
	l->dedup = calloc(DEDUP_SLOTS, sizeof(*l->dedup));
	if (!l->dedup) {
		e = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto fail;
	}
	int *fds[3] = { &l->ring_fd, &l->flows_fd, &l->counters_fd };
	for (int i = 0; i < 3; i++) {
		snprintf(path, sizeof(path), "%s/%s/%s/%s", pin_root ? pin_root : KILN_PIN_ROOT,
			 node_id, sandbox_id, names[i]);
		*fds[i] = bpf_obj_get(path);
		if (*fds[i] < 0) {
			e = kiln_error_set(err, errno == ENOENT ? KILN_E_NOT_FOUND : KILN_E_IO,
					   "open \"%s\": %s", path, strerror(errno));
			goto fail;
		}
	}
	l->rb = ring_buffer__new(l->ring_fd, on_event, l, NULL);
	if (!l->rb) {
		e = kiln_error_set(err, KILN_E_IO, "ring buffer of \"%s\": %s", sandbox_id,
				   strerror(errno));
		goto fail;
	}
	*out = l;
	return KILN_OK;
fail:
	kiln_connlog_close(l);
	return e;
}

enum kiln_err kiln_connlog_read(struct kiln_connlog *l, uint64_t since_ns, struct kiln_conn **out,
				size_t *n, struct kiln_error *err)
{
	enum kiln_err e = KILN_OK;
	struct np_flow_key k, next;
	struct np_flow_val v;
	void *prev = NULL;

	l->out = NULL;
	l->n = l->cap = 0;
	l->oom = false;
	memset(l->dedup, 0, DEDUP_SLOTS * sizeof(*l->dedup));
	int rc = ring_buffer__consume(l->rb);
	if (rc < 0 && !l->oom) {
		e = kiln_error_set(err, KILN_E_IO, "read the connection log: %s", strerror(-rc));
		goto cleanup;
	}
	while (!l->oom && bpf_map_get_next_key(l->flows_fd, prev, &next) == 0) {
		k = next;
		prev = &k;
		if (bpf_map_lookup_elem(l->flows_fd, &k, &v) < 0)
			continue;	/* evicted meanwhile: its opening was logged from the ring */
		if (v.opened_ns == 0 || (since_ns && v.last_ns < since_ns))
			continue;
		struct kiln_conn *c = push(l);
		if (!c)
			break;
		from_key(c, &k);
		from_val(c, &v);
		c->verdict = KILN_CONN_ALLOWED;
	}
	if (l->oom)
		e = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
cleanup:
	if (e) {
		free(l->out);
		l->out = NULL;
		l->n = 0;
	}
	*out = l->out;
	*n = l->n;
	l->out = NULL;
	l->n = l->cap = 0;
	return e;
}

void kiln_connlog_lost(struct kiln_connlog *l, uint64_t *ring_full, uint64_t *over_cap)
{
	int ncpu = libbpf_num_possible_cpus();
	uint32_t k = 0;

	*ring_full = 0;
	*over_cap = l->over_cap;
	if (ncpu <= 0)
		return;
	struct np_counters *v = calloc((size_t)ncpu, sizeof(*v));
	if (!v)
		return;
	if (bpf_map_lookup_elem(l->counters_fd, &k, v) == 0)
		for (int i = 0; i < ncpu; i++)
			*ring_full += v[i].connlog_lost;
	free(v);
}

void kiln_conn_key(const struct kiln_conn *c, char out[65])
{
	uint8_t b[30];
	b[0] = c->family;
	b[1] = c->proto;
	b[2] = (uint8_t)(c->gport >> 8);
	b[3] = (uint8_t)c->gport;
	b[4] = (uint8_t)(c->rport >> 8);
	b[5] = (uint8_t)c->rport;
	memcpy(b + 6, c->raddr, 16);
	for (int i = 0; i < 8; i++)
		b[22 + i] = (uint8_t)(c->opened_ns >> (56 - 8 * i));
	for (int i = 0; i < 30; i++)
		snprintf(out + 2 * i, 3, "%02x", b[i]);
}

const char *kiln_conn_proto(uint8_t proto, char buf[8])
{
	switch (proto) {
	case IPPROTO_TCP:
		return "tcp";
	case IPPROTO_UDP:
		return "udp";
	case IPPROTO_ICMP:
		return "icmp";
	case IPPROTO_ICMPV6:
		return "icmpv6";
	}
	snprintf(buf, 8, "%u", proto);
	return buf;
}

const char *kiln_proxy_decision_name(enum kiln_proxy_decision d)
{
	switch (d) {
	case KILN_PROXY_ALLOWED:
		return "allowed";
	case KILN_PROXY_NO_RULE:
		return "no_rule";
	case KILN_PROXY_NOT_ANSWERED:
		return "not_answered";
	case KILN_PROXY_DENIED_RANGE:
		return "denied_range";
	case KILN_PROXY_UNSUPPORTED:
		return "unsupported";
	case KILN_PROXY_NO_NAME:
		return "no_name";
	case KILN_PROXY_OVER_CAP:
		return "over_cap";
	case KILN_PROXY_CUT:
		return "cut";
	}
	return "unknown";
}
