/*
 * inject.h - the injecting proxy: a sandbox uses a secret without ever holding it
 * (docs/network-policy.md, "Secrets").
 *
 * A tenant binds a secret to an exact host rule of a sandbox as a header to add
 * (PUT /v1/sandboxes/{id}/secrets). kiln-node keeps each sandbox's set in memory here (opened
 * from Postgres, secrets.h), never in the guest. The name-checking proxy hands each connection
 * whose name it has checked to inject_handoff(); for a host of the sandbox with secrets, on port
 * 443, the injector takes it: it terminates TLS with a leaf certificate of the tenant's CA
 * (tenantca.h) for that host, speaks HTTP/1.1 only, and relays each request of the keep-alive
 * connection over its own TLS connection to the upstream address, which it verifies against the
 * node's trust store (inject_ca_file for tests) and the host name. Each request whose Host is the
 * bound host gets the secret headers (any the guest sent of the same name are dropped); TRACE,
 * CONNECT and Upgrade are refused (403); redirects are passed through, never followed; bodies
 * stream both ways (Content-Length and chunked). An upstream whose certificate does not verify:
 * the guest gets 502 and nothing is sent.
 */
#ifndef KILN_INJECT_H
#define KILN_INJECT_H

#include <stddef.h>
#include <sys/socket.h>

#include "common/err.h"
#include "netpolicy/rules.h"
#include "node/tenantca.h"

#define INJECT_HEADER_MAX 64		/* bytes of a header name */
#define INJECT_HEAD_MAX 65536		/* bytes of a request's or response's head */

struct inject;
struct node;

struct inject_opts {
	const char *ca_file;	/* upstream trust: this PEM file, or NULL for the system's store */
	int connections_max;	/* connections relayed at once by this node (0: 256) */
	int per_sandbox_max;	/* of which one sandbox's (0: 32) */
	int idle_timeout_s;	/* seconds either side may stay silent (0: 60) */
	int connect_timeout_s;	/* seconds to reach and verify the upstream (0: 10) */
	unsigned short port;	/* the upstream port whose connections it takes (0: 443) */
	const struct kiln_cidr *deny;	/* upstream addresses never dialled (egress_deny), copied */
	size_t ndeny;
};

/* One secret, as the injector keeps it in memory. */
struct inject_secret {
	char host[TENANTCA_HOST_MAX + 1];	/* lowercase */
	char header[INJECT_HEADER_MAX + 1];
	char *value;				/* malloc'd; wiped when dropped */
	size_t value_len;
};

/*
 * Makes the injector. It dials upstreams from the network namespace of the thread that calls
 * this (kiln-node's start: the host's), whichever namespace a hand-off comes from.
 */
enum kiln_err inject_new(const struct inject_opts *o, struct inject **out, struct kiln_error *err);
/* Frees the injector once no connection is relayed any more. Accepts NULL. */
void inject_free(struct inject *inj);

/*
 * Replaces the sandbox's secrets with the `n` of `s` (their values move to the injector, which
 * wipes them when dropped; `s` is left with NULL values) and its tenant's CA (a reference is
 * taken). n == 0 drops the sandbox's set. Connections already relayed use the new set from their
 * next request on.
 */
enum kiln_err inject_set(struct inject *inj, const char *sandbox_id, struct tenant_ca *ca,
			 struct inject_secret *s, size_t n, struct kiln_error *err);

/* Forgets the sandbox's set (delete, pause). */
void inject_drop(struct inject *inj, const char *sandbox_id);

/* Whether the sandbox has a set in force. */
bool inject_has(struct inject *inj, const char *sandbox_id);

/* Wipes and frees the values of `n` secrets (those inject_set did not take). */
void inject_secrets_wipe(struct inject_secret *s, size_t n);

/*
 * The hand-off from the name-checking proxy: the guest's connection `guest_fd` to `host` at
 * `upstream`, of which `pre` (`pre_len` bytes, may be 0) were already read. Returns 1 when the
 * injector took it: it owns and closes guest_fd, and it closes it at once, logged, when the
 * upstream address is in a denied range, or inject_opts.connections_max connections (or
 * per_sandbox_max of this sandbox's) are relayed already. Returns 0 when the sandbox has no secret for `host` or the port is not
 * inject_opts.port (443): the caller keeps guest_fd.
 */
int inject_connection(struct inject *inj, const char *sandbox_id, int guest_fd, const void *pre,
		      size_t pre_len, const char *host, const struct sockaddr_storage *upstream);

/* The same for kiln-node: its injector (struct node's). 0 when the node runs none. */
int inject_handoff(struct node *n, const char *sandbox_id, int guest_fd, const void *pre,
		   size_t pre_len, const char *host, const struct sockaddr_storage *upstream);

/*
 * Checks a header name a secret may set: 1 to INJECT_HEADER_MAX token characters (RFC 9110), not
 * Host, Content-Length, Transfer-Encoding, Connection, Upgrade, TE, Trailer, Keep-Alive,
 * Proxy-Connection, Expect.
 */
bool inject_header_ok(const char *name);

#endif
