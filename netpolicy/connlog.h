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

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

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

/*
 * What a proxy of the node adds to a flow's row (docs/network-policy.md, "Connection log"): the
 * name-checking proxy's decision about a connection it took, and each request the injecting proxy
 * relayed on one. The flow is found by the guest's side of it (family, address and port dialled,
 * the guest's port) and the note's time.
 */
enum kiln_note_kind {
	KILN_NOTE_DECISION = 1,	/* the name-checking proxy's decision (name, decision, detail) */
	KILN_NOTE_REQUEST = 2,	/* one request the injector relayed (method ... secret) */
};

/* The name-checking proxy's decisions ("allowed" lets it through; any other refuses or cuts). */
enum kiln_proxy_decision {
	KILN_PROXY_ALLOWED = 1,
	KILN_PROXY_NO_RULE,		/* no host rule covers the name for this port */
	KILN_PROXY_NOT_ANSWERED,	/* the sandbox's DNS did not answer the name with this address */
	KILN_PROXY_DENIED_RANGE,	/* the address is in an always-denied range */
	KILN_PROXY_UNSUPPORTED,		/* CONNECT, HTTP/2, h2c, ECH, bad framing, not TLS nor HTTP */
	KILN_PROXY_NO_NAME,		/* no SNI, no Host, or none within the time allowed */
	KILN_PROXY_OVER_CAP,		/* over a connection or handshake cap (detail: its name) */
	KILN_PROXY_CUT,			/* allowed, then cut by a rule change */
};

#define KILN_NOTE_NAME_MAX 253
#define KILN_NOTE_PATH_MAX 256

struct kiln_conn_note {
	enum kiln_note_kind kind;
	uint8_t family;		/* 4 or 6 */
	uint16_t gport;		/* the guest's port */
	uint16_t rport;		/* the port the guest dialled */
	uint8_t raddr[16];	/* the address the guest dialled (IPv4 in raddr[0..3]) */
	uint64_t at_ns;		/* CLOCK_MONOTONIC of the note */
	char name[KILN_NOTE_NAME_MAX + 1];	/* checked name (decision) or the request's Host */
	enum kiln_proxy_decision decision;	/* KILN_NOTE_DECISION */
	char detail[48];	/* KILN_PROXY_OVER_CAP: the limit's name; else "" */
	char method[24];	/* KILN_NOTE_REQUEST: method, path without query, status, whether */
	char path[KILN_NOTE_PATH_MAX + 1];	/* a secret header was added */
	int status;		/* the answer's status (the injector's own: 400, 403, 502), 0: none */
	bool secret;
};

/*
 * Fills the flow part of `note` (family, raddr, rport, gport, at_ns) from a connection the proxy
 * accepted: its own address is what the guest dialled, its peer the guest. 0 or -errno. (Inline:
 * the injector uses it without linking the eBPF side.)
 */
static inline int kiln_conn_note_flow(struct kiln_conn_note *note, int accepted_fd)
{
	struct sockaddr_storage me, peer;
	socklen_t ml = sizeof(me), pl = sizeof(peer);
	struct timespec ts;

	if (getsockname(accepted_fd, (struct sockaddr *)&me, &ml) < 0 ||
	    getpeername(accepted_fd, (struct sockaddr *)&peer, &pl) < 0)
		return -errno;
	if (me.ss_family == AF_INET && peer.ss_family == AF_INET) {
		note->family = 4;
		memcpy(note->raddr, &((struct sockaddr_in *)&me)->sin_addr, 4);
		note->rport = ntohs(((struct sockaddr_in *)&me)->sin_port);
		note->gport = ntohs(((struct sockaddr_in *)&peer)->sin_port);
	} else if (me.ss_family == AF_INET6 && peer.ss_family == AF_INET6) {
		note->family = 6;
		memcpy(note->raddr, &((struct sockaddr_in6 *)&me)->sin6_addr, 16);
		note->rport = ntohs(((struct sockaddr_in6 *)&me)->sin6_port);
		note->gport = ntohs(((struct sockaddr_in6 *)&peer)->sin6_port);
	} else {
		return -EAFNOSUPPORT;
	}
	clock_gettime(CLOCK_MONOTONIC, &ts);
	note->at_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	return 0;
}

/* The decision's name in the log: "allowed", "no_rule", "not_answered", "denied_range",
 * "unsupported", "no_name", "over_cap", "cut". */
const char *kiln_proxy_decision_name(enum kiln_proxy_decision d);

/* Receives notes (a proxy's hook into the connection log). `sandbox` is the id the proxy knows it by. */
typedef void (*kiln_conn_note_fn)(void *arg, const char *sandbox, const struct kiln_conn_note *note);

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
