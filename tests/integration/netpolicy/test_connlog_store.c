/*
 * test_connlog_store.c - the connection log's rows (node/connlog_store.c) against the real
 * Postgres of the ctest fixture "services", migrated with the real migrations (each run makes its
 * own database): a pass inserts new rows once and updates live flows' counts, losses add up, the
 * proxies' notes land on their flows' rows, and the retention sweep deletes exactly the rows past
 * it, in batches.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "migrations/migrate.h"
#include "node/connlog.h"
#include "test.h"
#include "testdb.h"

static struct pg *pg;

/* On the scratch database (testdb.h). */
#define sql(...) testdb_sql(pg, __VA_ARGS__)

/* The first column of the first row of `q`, as text ("(none)" if no row). */
static void one(const char *q, char *out, size_t len)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;

	snprintf(out, len, "(none)");
	if (pg_acquire(pg, &c, &err) != KILN_OK)
		return;
	if (PGQ0(c, &res, &err, q) == KILN_OK && pg_res_rows(res) >= 1)
		snprintf(out, len, "%s", pg_res_str(res, 0, 0));
	else if (err.code)
		fprintf(stderr, "query: %s: %s\n", q, err.msg);
	pg_res_free(res);
	pg_release(pg, c);
}

static struct kiln_conn conn(const char *addr, uint16_t port, uint8_t proto, uint64_t opened_ns,
			     bool is_new)
{
	struct kiln_conn c = { .verdict = KILN_CONN_ALLOWED, .family = 4, .proto = proto,
			       .gport = 40000, .rport = port, .opened_ns = opened_ns,
			       .last_ns = opened_ns, .is_new = is_new };
	if (strchr(addr, ':')) {
		c.family = 6;
		inet_pton(AF_INET6, addr, c.raddr);
	} else {
		inet_pton(AF_INET, addr, c.raddr);
	}
	return c;
}

static void test_pass_inserts_then_updates(void)
{
	struct kiln_error err = { 0 };
	/* wall clock = monotonic + off: 2026-01-02T03:04:05Z at opened_ns 1 s */
	int64_t off = 1767323045LL * 1000000000LL - 1000000000LL;
	struct kiln_conn c[3] = {
		conn("203.0.113.10", 443, IPPROTO_TCP, 1000000000ull, true),
		conn("2001:db8::1", 53, IPPROTO_UDP, 1500000000ull, true),
		conn("169.254.169.254", 80, IPPROTO_TCP, 1700000000ull, true),
	};
	char got[512];

	c[0].bytes_out = 1000;
	c[0].packets_out = 3;
	c[2].verdict = KILN_CONN_DENIED;
	struct connlog_batch b = { .sandbox_id = "sb_cl1", .tenant_id = "tn_cl", .conns = c,
				   .n = 3, .ring_full = 2, .over_cap = 5 };
	CHECK_INT(connlog_store(pg, "node-a", &b, 1, off, &err), KILN_OK);
	one("SELECT string_agg(concat_ws(',', rfc3339(opened_at), verdict, family, proto, host(dst), "
	    "dst_port, src_port, bytes_out, packets_out, tenant_id, node_id), ';' ORDER BY opened_at) "
	    "FROM sandbox_connections WHERE sandbox_id = 'sb_cl1'", got, sizeof(got));
	CHECK_STR(got, "2026-01-02T03:04:05Z,allowed,4,tcp,203.0.113.10,443,40000,1000,3,tn_cl,node-a;"
		       "2026-01-02T03:04:05Z,allowed,6,udp,2001:db8::1,53,40000,0,0,tn_cl,node-a;"
		       "2026-01-02T03:04:05Z,denied,4,tcp,169.254.169.254,80,40000,0,0,tn_cl,node-a");

	/* the next pass: the live TCP flow's counts grew; the same event again changes nothing */
	c[0].is_new = false;
	c[0].bytes_out = 5000;
	c[0].bytes_in = 7000;
	c[0].packets_out = 9;
	c[0].last_ns = 61000000000ull;
	struct connlog_batch b2 = { .sandbox_id = "sb_cl1", .tenant_id = "tn_cl", .conns = c,
				    .n = 2, .ring_full = 1 };
	CHECK_INT(connlog_store(pg, "node-a", &b2, 1, off, &err), KILN_OK);
	one("SELECT concat_ws(',', count(*), sum(bytes_out), sum(bytes_in), sum(packets_out), "
	    "rfc3339(max(last_seen_at))) FROM sandbox_connections WHERE sandbox_id = 'sb_cl1'",
	    got, sizeof(got));
	CHECK_STR(got, "3,5000,7000,9,2026-01-02T03:05:05Z");
	one("SELECT ring_full || ',' || over_cap FROM sandbox_connlog_lost "
	    "WHERE sandbox_id = 'sb_cl1'", got, sizeof(got));
	CHECK_STR(got, "3,5");

	/* an update from another node (the sandbox moved) does not touch this node's rows */
	c[0].bytes_out = 999999;
	CHECK_INT(connlog_store(pg, "node-b", &b2, 1, off, &err), KILN_OK);
	one("SELECT bytes_out FROM sandbox_connections WHERE sandbox_id = 'sb_cl1' AND proto = 'tcp' "
	    "AND verdict = 'allowed'", got, sizeof(got));
	CHECK_STR(got, "5000");
}

static struct kiln_conn_note decision(const char *addr, uint16_t port, uint16_t gport,
				      uint64_t at_ns, enum kiln_proxy_decision d, const char *name)
{
	struct kiln_conn_note n = { .kind = KILN_NOTE_DECISION, .family = 4, .rport = port,
				    .gport = gport, .at_ns = at_ns, .decision = d };
	inet_pton(AF_INET, addr, n.raddr);
	snprintf(n.name, sizeof(n.name), "%s", name);
	return n;
}

static struct kiln_conn_note request(const char *addr, uint16_t port, uint16_t gport,
				     uint64_t at_ns, const char *method, const char *host,
				     const char *path, int status, bool secret)
{
	struct kiln_conn_note n = { .kind = KILN_NOTE_REQUEST, .family = 4, .rport = port,
				    .gport = gport, .at_ns = at_ns, .status = status,
				    .secret = secret };
	inet_pton(AF_INET, addr, n.raddr);
	snprintf(n.method, sizeof(n.method), "%s", method);
	snprintf(n.name, sizeof(n.name), "%s", host);
	snprintf(n.path, sizeof(n.path), "%s", path);
	return n;
}

/* The proxies' notes land on their flows' rows: name, decision (a refusal denies), requests. */
static void test_notes_name_decision_and_requests(void)
{
	struct kiln_error err = { 0 };
	int64_t off = 1767323045LL * 1000000000LL - 1000000000LL;
	const uint64_t s = 1000000000ull;
	struct kiln_conn c[4] = {
		conn("203.0.113.10", 443, IPPROTO_TCP, 1 * s, true),
		conn("203.0.113.10", 80, IPPROTO_TCP, 1 * s, true),
		conn("203.0.113.11", 443, IPPROTO_TCP, 2 * s, true),
		conn("203.0.113.12", 443, IPPROTO_TCP, 2 * s, true),
	};
	char got[1024];

	c[0].gport = 40001;
	c[1].gport = 40002;
	c[2].gport = 40003;
	c[3].gport = 40004;
	struct kiln_conn_note n[] = {
		decision("203.0.113.10", 443, 40001, 1 * s + 5000, KILN_PROXY_ALLOWED,
			 "sub.example.com"),
		request("203.0.113.10", 443, 40001, 2 * s, "GET", "sub.example.com", "/a", 200,
			true),
		request("203.0.113.10", 443, 40001, 3 * s, "POST", "other.example.com", "/b\xff\"",
			201, false),
		decision("203.0.113.10", 80, 40002, 1 * s + 7000, KILN_PROXY_NOT_ANSWERED,
			 "twin.example.com"),
		decision("203.0.113.11", 443, 40003, 2 * s, KILN_PROXY_OVER_CAP, ""),
		decision("203.0.113.12", 443, 40004, 2 * s, KILN_PROXY_ALLOWED, "a.example.com"),
		decision("203.0.113.12", 443, 40004, 3 * s, KILN_PROXY_CUT, "a.example.com"),
		/* no row for this flow (over the log's cap): nothing changes, nothing fails */
		decision("203.0.113.99", 443, 40009, 2 * s, KILN_PROXY_NO_RULE, "x.example.com"),
	};
	snprintf(n[4].detail, sizeof(n[4].detail), "sniproxy_conns_per_sandbox");
	struct connlog_batch b = { .sandbox_id = "sb_cln", .tenant_id = "tn_cl", .conns = c,
				   .n = 4, .notes = n, .nnotes = sizeof(n) / sizeof(n[0]) };
	CHECK_INT(connlog_store(pg, "node-a", &b, 1, off, &err), KILN_OK);
	one("SELECT string_agg(concat_ws(',', src_port, verdict, coalesce(dns_name, '-'), "
	    "coalesce(proxy_decision, '-'), coalesce(requests::text, '-')), ';' ORDER BY src_port) "
	    "FROM sandbox_connections WHERE sandbox_id = 'sb_cln'", got, sizeof(got));
	CHECK_STR(got, "40001,allowed,sub.example.com,allowed,"
		       "[{\"host\": \"sub.example.com\", \"path\": \"/a\", \"method\": \"GET\", "
		       "\"secret\": true, \"status\": 200}, {\"host\": \"other.example.com\", "
		       "\"path\": \"/b\u00ff\\\"\", \"method\": \"POST\", \"secret\": false, "
		       "\"status\": 201}];"
		       "40002,denied,twin.example.com,not_answered,-;"
		       "40003,denied,-,over_cap:sniproxy_conns_per_sandbox,-;"
		       "40004,allowed,a.example.com,cut,-");

	/* a later pass appends; a later refusal on the same connection (HTTP keep-alive) denies;
	 * a new flow on the same ports gets the notes made after it opened */
	struct kiln_conn c2[1] = { conn("203.0.113.10", 443, IPPROTO_TCP, 100 * s, true) };
	c2[0].gport = 40002;
	c2[0].rport = 80;
	struct kiln_conn_note n2[] = {
		request("203.0.113.10", 443, 40001, 10 * s, "DELETE", "sub.example.com", "/c", 403,
			false),
		decision("203.0.113.10", 80, 40002, 101 * s, KILN_PROXY_ALLOWED, "sub.example.com"),
	};
	struct connlog_batch b2 = { .sandbox_id = "sb_cln", .tenant_id = "tn_cl", .conns = c2,
				    .n = 1, .notes = n2, .nnotes = 2 };
	CHECK_INT(connlog_store(pg, "node-a", &b2, 1, off, &err), KILN_OK);
	one("SELECT jsonb_array_length(requests) || ',' || (requests->2->>'method') FROM "
	    "sandbox_connections WHERE sandbox_id = 'sb_cln' AND src_port = 40001", got,
	    sizeof(got));
	CHECK_STR(got, "3,DELETE");
	one("SELECT string_agg(concat_ws(',', rfc3339(opened_at), verdict, dns_name, "
	    "proxy_decision), ';' ORDER BY opened_at) FROM sandbox_connections "
	    "WHERE sandbox_id = 'sb_cln' AND src_port = 40002", got, sizeof(got));
	CHECK_STR(got, "2026-01-02T03:04:05Z,denied,twin.example.com,not_answered;"
		       "2026-01-02T03:05:44Z,allowed,sub.example.com,allowed");
}

static void test_sweep_deletes_old_rows_in_batches(void)
{
	struct kiln_error err = { 0 };
	long long gone = -1;
	char got[64];

	sql("DELETE FROM sandbox_connections");
	sql("INSERT INTO sandbox_connections (sandbox_id, node_id, flow_key, opened_at, "
	    "last_seen_at, verdict, family, proto, dst, dst_port, src_port) "
	    "SELECT 'sb_old', 'node-a', 'k' || i, now() - make_interval(days => 31, secs => i), now() "
	    "- interval '31 days', 'allowed', 4, 'tcp', '203.0.113.1', 80, 1000 + i "
	    "FROM generate_series(1, 25) i");
	sql("INSERT INTO sandbox_connections (sandbox_id, node_id, flow_key, opened_at, "
	    "last_seen_at, verdict, family, proto, dst, dst_port, src_port) "
	    "SELECT 'sb_old', 'node-a', 'n' || i, now() - make_interval(days => 29), now(), "
	    "'allowed', 4, 'tcp', '203.0.113.1', 80, 2000 + i FROM generate_series(1, 4) i");
	CHECK_INT(connlog_sweep(pg, 30, 10, &gone, &err), KILN_OK);
	CHECK_INT(gone, 25);
	one("SELECT count(*) FROM sandbox_connections WHERE sandbox_id = 'sb_old'", got,
	    sizeof(got));
	CHECK_STR(got, "4");
	CHECK_INT(connlog_sweep(pg, 30, 10, &gone, &err), KILN_OK);
	CHECK_INT(gone, 0);
}

int main(void)
{
	struct testdb db;
	int rc;

	log_init("test_connlog_store", KLOG_WARN, false);
	if (testdb_open(&db, "connlog") != 0)
		return 1;
	pg = db.pg;

	TEST(test_pass_inserts_then_updates);
	TEST(test_notes_name_decision_and_requests);
	TEST(test_sweep_deletes_old_rows_in_batches);

	rc = test_summary();
	testdb_close(&db);
	return rc;
}
