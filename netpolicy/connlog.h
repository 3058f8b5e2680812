/*
 * connlog.h - a sandbox's connection log as its eBPF programs keep it (bpf/policy.h): the
 * `connlog` ring buffer of flows opened and attempts refused, and the byte and packet counts of
 * live flows in `flows`. kiln-node's collector (node/connlog.c) reads it every few seconds and
 * writes rows to Postgres; this is the part that needs no database, so the tests drive it too.
 *
 * A handle is used by one thread at a time. The per-minute cap is the handle's: events past
 * `max_per_minute` in one minute (refused attempts and flows alike) are counted, not delivered.
 * Repeated refused attempts with the same destination in one read are delivered once.
 */
#ifndef KILN_NETPOLICY_CONNLOG_H
#define KILN_NETPOLICY_CONNLOG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

enum kiln_conn_verdict { KILN_CONN_ALLOWED = 1, KILN_CONN_DENIED = 2 };

/* One flow (or refused attempt). Ports in host order; IPv4 addresses in raddr[0..3]. */
struct kiln_conn {
	enum kiln_conn_verdict verdict;
	uint8_t family;		/* 4 or 6 */
	uint8_t proto;		/* IPPROTO_TCP, _UDP, _ICMP, _ICMPV6 */
	uint16_t gport;		/* the guest's port (ICMP: the echo id) */
	uint16_t rport;		/* the remote port (ICMP: the echo id) */
	uint8_t raddr[16];
	uint64_t opened_ns;	/* CLOCK_MONOTONIC */
	uint64_t last_ns;	/* last packet, CLOCK_MONOTONIC (to the second); opened_ns if unknown */
	uint64_t bytes_out, bytes_in, packets_out, packets_in;
	bool is_new;		/* from the ring: a row to insert; else an update of a live flow */
};

struct kiln_connlog;

/*
 * Opens the pinned `connlog`, `flows` and `counters` of a sandbox
 * (<pin_root or KILN_PIN_ROOT>/<node_id>/<sandbox_id>/). KILN_E_NOT_FOUND when it has none.
 */
enum kiln_err kiln_connlog_open(const char *pin_root, const char *node_id,
				const char *sandbox_id, uint32_t max_per_minute,
				struct kiln_connlog **out, struct kiln_error *err);
void kiln_connlog_close(struct kiln_connlog *l);

/*
 * One read: drains the ring (new rows, within the cap, each with its flow's counts when the flow
 * is still in the table), then adds the table's flows seen since `since_ns` (CLOCK_MONOTONIC; 0:
 * all) as updates. The caller frees *out. *n is how many.
 */
enum kiln_err kiln_connlog_read(struct kiln_connlog *l, uint64_t since_ns, struct kiln_conn **out,
				size_t *n, struct kiln_error *err);

/* Events lost so far: the ring was full (the programs' count), and over the per-minute cap. */
void kiln_connlog_lost(struct kiln_connlog *l, uint64_t *ring_full, uint64_t *over_cap);

/* A flow's identity in the log: family, proto, ports, address and opened_ns, as hex (64 chars). */
void kiln_conn_key(const struct kiln_conn *c, char out[65]);

/* "tcp", "udp", "icmp" or "icmpv6" (or the number). */
const char *kiln_conn_proto(uint8_t proto, char buf[8]);

#endif
