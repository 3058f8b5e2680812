/*
 * connlog_store.c - the connection log's rows in Postgres: one pass's writes and the retention
 * sweep (see connlog.h; the table is migrations/0011_connlog.sql, the proxies' columns 0022).
 */
#include "node/connlog.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "common/buf.h"
#include "common/log.h"

#define STORE_SQL_MAX (256u << 20)	/* bytes of one statement's JSON */

static const char insert_sql[] =
	"INSERT INTO sandbox_connections (sandbox_id, tenant_id, node_id, flow_key, opened_at, "
	"last_seen_at, verdict, family, proto, dst, dst_port, src_port, bytes_out, bytes_in, "
	"packets_out, packets_in) "
	"SELECT x.s, nullif(x.t, ''), $2, x.k, to_timestamp(x.o), to_timestamp(x.l), x.v, x.f, x.p, "
	"x.d::inet, x.dp, x.sp, x.bo, x.bi, x.po, x.pi "
	"FROM json_to_recordset($1::json) AS x(s text, t text, k text, o double precision, "
	"l double precision, v text, f smallint, p text, d text, dp integer, sp integer, bo bigint, "
	"bi bigint, po bigint, pi bigint) "
	"ON CONFLICT (sandbox_id, flow_key) DO UPDATE SET "
	"last_seen_at = greatest(sandbox_connections.last_seen_at, excluded.last_seen_at), "
	"bytes_out = greatest(sandbox_connections.bytes_out, excluded.bytes_out), "
	"bytes_in = greatest(sandbox_connections.bytes_in, excluded.bytes_in), "
	"packets_out = greatest(sandbox_connections.packets_out, excluded.packets_out), "
	"packets_in = greatest(sandbox_connections.packets_in, excluded.packets_in)";

static const char update_sql[] =
	"UPDATE sandbox_connections c SET "
	"last_seen_at = greatest(c.last_seen_at, to_timestamp(x.l)), "
	"bytes_out = greatest(c.bytes_out, x.bo), bytes_in = greatest(c.bytes_in, x.bi), "
	"packets_out = greatest(c.packets_out, x.po), packets_in = greatest(c.packets_in, x.pi) "
	"FROM json_to_recordset($1::json) AS x(s text, k text, l double precision, bo bigint, "
	"bi bigint, po bigint, pi bigint) "
	"WHERE c.sandbox_id = x.s AND c.flow_key = x.k AND c.node_id = $2";

static const char lost_sql[] =
	"INSERT INTO sandbox_connlog_lost (sandbox_id, node_id, ring_full, over_cap) "
	"SELECT x.s, $2, x.r, x.c FROM json_to_recordset($1::json) AS x(s text, r bigint, c bigint) "
	"ON CONFLICT (sandbox_id, node_id) DO UPDATE SET "
	"ring_full = sandbox_connlog_lost.ring_full + excluded.ring_full, "
	"over_cap = sandbox_connlog_lost.over_cap + excluded.over_cap, updated_at = now()";

static const char notes_sql[] =
	"WITH x AS (SELECT * FROM json_to_recordset($1::json) AS x(s text, f smallint, d text, "
	"dp integer, sp integer, a double precision, i integer, nm text, dc text, rq jsonb)), "
	"g AS (SELECT s, f, d, dp, sp, max(a) AS a, "
	"(array_agg(nm ORDER BY i DESC) FILTER (WHERE dc IS NOT NULL AND nm IS NOT NULL))[1] AS nm, "
	"(array_agg(dc ORDER BY i DESC) FILTER (WHERE dc IS NOT NULL))[1] AS dc, "
	"jsonb_agg(rq ORDER BY i) FILTER (WHERE rq IS NOT NULL) AS rq FROM x "
	"GROUP BY s, f, d, dp, sp), "
	"t AS (SELECT g.*, (SELECT c.id FROM sandbox_connections c WHERE c.sandbox_id = g.s "
	"AND c.node_id = $2 AND c.proto = 'tcp' AND c.family = g.f AND c.dst = g.d::inet "
	"AND c.dst_port = g.dp AND c.src_port = g.sp "
	"AND c.opened_at <= to_timestamp(g.a) + interval '1 second' "
	"ORDER BY c.opened_at DESC, c.id DESC LIMIT 1) AS id FROM g) "
	"UPDATE sandbox_connections c SET dns_name = coalesce(t.nm, c.dns_name), "
	"proxy_decision = CASE WHEN t.dc IS NULL THEN c.proxy_decision "
	"WHEN t.dc = 'allowed' AND c.proxy_decision IS NOT NULL THEN c.proxy_decision "
	"ELSE t.dc END, "
	"verdict = CASE WHEN t.dc IS NOT NULL AND t.dc NOT IN ('allowed', 'cut') THEN 'denied' "
	"ELSE c.verdict END, "
	"requests = CASE WHEN t.rq IS NULL THEN c.requests "
	"ELSE coalesce(c.requests, '[]'::jsonb) || t.rq END "
	"FROM t WHERE c.id = t.id";

/* Appends s as a JSON string. */
static int json_str(struct buf *b, const char *s)
{
	int rc = buf_appends(b, "\"");
	for (; *s && !rc; s++) {
		unsigned char ch = (unsigned char)*s;
		if (ch == '"' || ch == '\\')
			rc = buf_appendf(b, "\\%c", ch);
		else if (ch < 0x20)
			rc = buf_appendf(b, "\\u%04x", ch);
		else
			rc = buf_append(b, s, 1);
	}
	return rc ? rc : buf_appends(b, "\"");
}

/* Wall-clock seconds of a CLOCK_MONOTONIC time, as "s.uuuuuu". */
static void wall(char *out, size_t len, uint64_t mono, int64_t off)
{
	int64_t ns = (int64_t)mono + off;
	if (ns < 0)
		ns = 0;
	snprintf(out, len, "%lld.%06lld", (long long)(ns / 1000000000), (long long)(ns % 1000000000 / 1000));
}

/* Appends s as a JSON string that stays valid whatever a guest sent: bytes of 0x7f and above
 * are escaped one by one (as U+0000 to U+00FF), so no byte sequence breaks the pass. */
static int json_str_strict(struct buf *b, const char *s)
{
	int rc = buf_appends(b, "\"");
	for (; *s && !rc; s++) {
		unsigned char ch = (unsigned char)*s;
		if (ch == '"' || ch == '\\')
			rc = buf_appendf(b, "\\%c", ch);
		else if (ch < 0x20 || ch >= 0x7f)
			rc = buf_appendf(b, "\\u%04x", ch);
		else
			rc = buf_append(b, s, 1);
	}
	return rc ? rc : buf_appends(b, "\"");
}

/* One note as a row of notes_sql's input; `seq` orders a pass's notes. */
static int note_row(struct buf *b, const char *sandbox_id, const struct kiln_conn_note *n,
		    int64_t off, size_t seq, bool first)
{
	char a[32], addr[INET6_ADDRSTRLEN];
	int rc;

	if (!inet_ntop(n->family == 4 ? AF_INET : AF_INET6, n->raddr, addr, sizeof(addr)))
		return -EINVAL;
	wall(a, sizeof(a), n->at_ns, off);
	if ((rc = buf_appends(b, first ? "{\"s\":" : ",{\"s\":")) || (rc = json_str(b, sandbox_id)))
		return rc;
	rc = buf_appendf(b, ",\"f\":%u,\"d\":\"%s\",\"dp\":%u,\"sp\":%u,\"a\":%s,\"i\":%zu",
			 n->family, addr, n->rport, n->gport, a, seq);
	if (rc)
		return rc;
	if (n->kind == KILN_NOTE_DECISION) {
		if ((rc = buf_appends(b, ",\"dc\":\"")) ||
		    (rc = buf_appends(b, kiln_proxy_decision_name(n->decision))))
			return rc;
		/* the limit's name: the proxy's own constant (letters and '_' only) */
		if (n->decision == KILN_PROXY_OVER_CAP && n->detail[0] &&
		    strspn(n->detail, "abcdefghijklmnopqrstuvwxyz_") == strlen(n->detail) &&
		    ((rc = buf_appends(b, ":")) || (rc = buf_appends(b, n->detail))))
			return rc;
		if ((rc = buf_appends(b, "\"")))
			return rc;
		if (n->name[0] && ((rc = buf_appends(b, ",\"nm\":")) ||
				   (rc = json_str_strict(b, n->name))))
			return rc;
		return buf_appends(b, "}");
	}
	if ((rc = buf_appends(b, ",\"rq\":{\"method\":")) || (rc = json_str_strict(b, n->method)) ||
	    (rc = buf_appends(b, ",\"host\":")) || (rc = json_str_strict(b, n->name)) ||
	    (rc = buf_appends(b, ",\"path\":")) || (rc = json_str_strict(b, n->path)))
		return rc;
	return buf_appendf(b, ",\"status\":%d,\"secret\":%s}}", n->status,
			   n->secret ? "true" : "false");
}

static int row(struct buf *b, const struct connlog_batch *sb, const struct kiln_conn *c,
	       int64_t off, bool first)
{
	char key[65], o[32], l[32], addr[INET6_ADDRSTRLEN], pb[8];
	int rc;

	kiln_conn_key(c, key);
	wall(o, sizeof(o), c->opened_ns, off);
	wall(l, sizeof(l), c->last_ns, off);
	if ((rc = buf_appends(b, first ? "{\"s\":" : ",{\"s\":")) || (rc = json_str(b, sb->sandbox_id)))
		return rc;
	if (c->is_new) {
		if (!inet_ntop(c->family == 4 ? AF_INET : AF_INET6, c->raddr, addr, sizeof(addr)))
			return -EINVAL;
		if ((rc = buf_appends(b, ",\"t\":")) || (rc = json_str(b, sb->tenant_id)))
			return rc;
		rc = buf_appendf(b, ",\"o\":%s,\"v\":\"%s\",\"f\":%u,\"p\":\"%s\",\"d\":\"%s\","
				 "\"dp\":%u,\"sp\":%u", o,
				 c->verdict == KILN_CONN_DENIED ? "denied" : "allowed", c->family,
				 kiln_conn_proto(c->proto, pb), addr, c->rport, c->gport);
		if (rc)
			return rc;
	}
	return buf_appendf(b, ",\"k\":\"%s\",\"l\":%s,\"bo\":%llu,\"bi\":%llu,\"po\":%llu,"
			   "\"pi\":%llu}", key, l, (unsigned long long)c->bytes_out,
			   (unsigned long long)c->bytes_in, (unsigned long long)c->packets_out,
			   (unsigned long long)c->packets_in);
}

enum kiln_err connlog_store(struct pg *pg, const char *node_id, const struct connlog_batch *b,
			    size_t nb, int64_t real_minus_mono_ns, struct kiln_error *err)
{
	struct buf ins, upd, lost, notes;
	size_t nins = 0, nupd = 0, nlost = 0, nnotes = 0;
	struct pg_conn *c = NULL;
	enum kiln_err e = KILN_OK;
	int rc = 0;

	buf_init(&ins, STORE_SQL_MAX);
	buf_init(&upd, STORE_SQL_MAX);
	buf_init(&lost, 1u << 20);
	buf_init(&notes, STORE_SQL_MAX);
	rc = buf_appends(&ins, "[");
	if (!rc)
		rc = buf_appends(&notes, "[");
	if (!rc)
		rc = buf_appends(&upd, "[");
	if (!rc)
		rc = buf_appends(&lost, "[");
	for (size_t i = 0; i < nb && !rc; i++) {
		for (size_t j = 0; j < b[i].n && !rc; j++) {
			const struct kiln_conn *cn = &b[i].conns[j];
			if (cn->is_new)
				rc = row(&ins, &b[i], cn, real_minus_mono_ns, nins++ == 0);
			else
				rc = row(&upd, &b[i], cn, real_minus_mono_ns, nupd++ == 0);
		}
		for (size_t j = 0; j < b[i].nnotes && !rc; j++)
			if (b[i].notes[j].family == 4 || b[i].notes[j].family == 6) {
				rc = note_row(&notes, b[i].sandbox_id, &b[i].notes[j],
					      real_minus_mono_ns, nnotes, nnotes == 0);
				nnotes++;
			}
		if (!rc && (b[i].ring_full || b[i].over_cap)) {
			rc = buf_appends(&lost, nlost++ ? ",{\"s\":" : "{\"s\":");
			if (!rc)
				rc = json_str(&lost, b[i].sandbox_id);
			if (!rc)
				rc = buf_appendf(&lost, ",\"r\":%llu,\"c\":%llu}",
						 (unsigned long long)b[i].ring_full,
						 (unsigned long long)b[i].over_cap);
		}
	}
	if (!rc)
		rc = buf_appends(&ins, "]");
	if (!rc)
		rc = buf_appends(&upd, "]");
	if (!rc)
		rc = buf_appends(&lost, "]");
	if (!rc)
		rc = buf_appends(&notes, "]");
	if (rc) {
		e = kiln_error_set(err, rc == -ENOMEM ? KILN_E_NOMEM : KILN_E_INTERNAL,
				   "connection log rows: %s", strerror(-rc));
		goto cleanup;
	}
	if (!nins && !nupd && !nlost && !nnotes)
		goto cleanup;
	if ((e = pg_acquire(pg, &c, err)) != KILN_OK)
		goto cleanup;
	if (nins && (e = PGQ(c, NULL, err, insert_sql, ins.data, node_id)) != KILN_OK)
		goto cleanup;
	if (nupd && (e = PGQ(c, NULL, err, update_sql, upd.data, node_id)) != KILN_OK)
		goto cleanup;
	if (nnotes && (e = PGQ(c, NULL, err, notes_sql, notes.data, node_id)) != KILN_OK)
		goto cleanup;
	if (nlost && (e = PGQ(c, NULL, err, lost_sql, lost.data, node_id)) != KILN_OK)
		goto cleanup;
cleanup:
	if (c)
		pg_release(pg, c);
	buf_release(&ins);
	buf_release(&upd);
	buf_release(&lost);
	buf_release(&notes);
	return e;
}

enum kiln_err connlog_sweep(struct pg *pg, long long days, long long batch, long long *deleted,
			    struct kiln_error *err)
{
	char d[24], n[24];
	struct pg_conn *c = NULL;
	struct pg_res *res = NULL;
	enum kiln_err e;
	long long total = 0, got;

	snprintf(d, sizeof(d), "%lld", days);
	snprintf(n, sizeof(n), "%lld", batch > 0 ? batch : 1);
	if ((e = pg_acquire(pg, &c, err)) != KILN_OK)
		return e;
	do {
		e = PGQ(c, &res, err,
			"WITH old AS (SELECT id FROM sandbox_connections WHERE opened_at < "
			"now() - make_interval(days => $1::int) ORDER BY opened_at LIMIT $2::int), "
			"gone AS (DELETE FROM sandbox_connections s USING old WHERE s.id = old.id "
			"RETURNING 1) SELECT count(*) FROM gone",
			d, n);
		got = e == KILN_OK ? pg_res_int(res, 0, 0, 0) : 0;
		pg_res_free(res);
		res = NULL;
		total += got;
	} while (e == KILN_OK && got >= (batch > 0 ? batch : 1));
	if (e == KILN_OK)
		e = PGQ(c, NULL, err,
			"DELETE FROM sandbox_connlog_lost WHERE updated_at < "
			"now() - make_interval(days => $1::int)", d);
	pg_release(pg, c);
	if (deleted)
		*deleted = total;
	return e;
}
