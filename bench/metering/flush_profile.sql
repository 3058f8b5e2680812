-- bench/metering/flush_profile.sql: where the time of a ledger flush goes (issue 14), run by
-- bench/metering/flush_profile.sh on a migrated database of its own. Each step writes :n transfers
-- into ledger_transfers in a transaction it rolls back, and psql's \timing prints its time:
--   1. kiln_new_id('tx_') alone, :n times (every transfer's id), against md5() of as many;
--   2. bare INSERTs of :n usage transfers from one grant (a tenant with many windows), with the
--      table's triggers; then without the balance trigger (ledger_transfers_balances, per row
--      before migration 0025, per statement since);
--      then without any trigger (session_replication_role = replica: no foreign-key checks either);
--   3. the same from :n / 10 grants of as many tenants (the bench's flush: one tenant per ten
--      sandboxes), with the triggers;
--   4. the overlap check of meter_flush_set() on :n flush items in a temporary table, as 0015
--      wrote it (one UPDATE with a correlated EXISTS over the table itself), then as two joins
--      as 0025 writes it (EXPLAIN ANALYZE's execution times);
--   5. a flush's :n items (the bench's shape, each with its transfer id) read from their text as
--      0037 read them (parsed as jsonb, then jsonb_array_elements() and jsonb_to_record()) and as
--      0044 reads them (one json_to_recordset()).
\timing on
\echo '1. ids: kiln_new_id() x :n, then md5() x :n'
SELECT count(kiln_new_id('tx_')) FROM generate_series(1, :n);
SELECT count(md5(g::text)) FROM generate_series(1, :n) g;

\echo '2a. :n transfers from one grant, every trigger'
BEGIN;
INSERT INTO tenants (id, name) VALUES ('tn_prof', 'p');
INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES ('grant:prof', 'tn_prof', 'grant');
INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, amount_ucr, tenant_id, reason)
VALUES ('tx_profg', 'g:prof', 'grant', 'system:issuance', 'grant:prof', 1000000000000, 'tn_prof', 'p');
INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, amount_ucr, tenant_id, sandbox_id, period_start, period_end, rate_card)
SELECT 'tx_p' || g, 'usage:p:' || g, 'usage', 'grant:prof', 'system:revenue', 1, 'tn_prof', 'sb_p', now(), now(), :'card'
FROM generate_series(1, :n) g;
ROLLBACK;

\echo '2b. the same without the balance trigger'
BEGIN;
INSERT INTO tenants (id, name) VALUES ('tn_prof', 'p');
INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES ('grant:prof', 'tn_prof', 'grant');
ALTER TABLE ledger_transfers DISABLE TRIGGER ledger_transfers_balances;
INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, amount_ucr, tenant_id, sandbox_id, period_start, period_end, rate_card)
SELECT 'tx_p' || g, 'usage:p:' || g, 'usage', 'grant:prof', 'system:revenue', 1, 'tn_prof', 'sb_p', now(), now(), :'card'
FROM generate_series(1, :n) g;
ROLLBACK;

\echo '2c. the same without any trigger'
BEGIN;
INSERT INTO tenants (id, name) VALUES ('tn_prof', 'p');
INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES ('grant:prof', 'tn_prof', 'grant');
SET LOCAL session_replication_role = replica;
INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, amount_ucr, tenant_id, sandbox_id, period_start, period_end, rate_card)
SELECT 'tx_p' || g, 'usage:p:' || g, 'usage', 'grant:prof', 'system:revenue', 1, 'tn_prof', 'sb_p', now(), now(), :'card'
FROM generate_series(1, :n) g;
ROLLBACK;

\echo '3. :n transfers from :n / 10 grants, every trigger'
BEGIN;
INSERT INTO tenants (id, name) SELECT 'tn_prof' || i, 'p' FROM generate_series(0, :n / 10 - 1) i;
INSERT INTO ledger_accounts (id, tenant_id, kind) SELECT 'grant:prof' || i, 'tn_prof' || i, 'grant' FROM generate_series(0, :n / 10 - 1) i;
INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, amount_ucr, tenant_id, reason)
SELECT 'tx_profg' || i, 'g:prof' || i, 'grant', 'system:issuance', 'grant:prof' || i, 1000000000000, 'tn_prof' || i, 'p'
FROM generate_series(0, :n / 10 - 1) i;
INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, amount_ucr, tenant_id, sandbox_id, period_start, period_end, rate_card)
SELECT 'tx_p' || g, 'usage:p:' || g, 'usage', 'grant:prof' || (g % (:n / 10)), 'system:revenue', 1, 'tn_prof' || (g % (:n / 10)), 'sb_p', now(), now(), :'card'
FROM generate_series(1, :n) g;
ROLLBACK;

\echo '4. meter_flush_set()''s overlap check on :n items (one sandbox per ten), as 0015 writes it, then split in two joins'
BEGIN;
CREATE TEMP TABLE mfi ON COMMIT DROP AS
SELECT 'sb_' || (g % (:n / 10)) AS sb, 1::bigint AS gen, (g / (:n / 10)) * 10 AS ws, g::bigint AS ord,
       (g / (:n / 10)) * 10000000000::bigint AS ps, ((g / (:n / 10)) * 10 + 10) * 1000000000::bigint AS pe,
       ((g / (:n / 10)) * 10 + 10)::bigint AS we, true AS first, false AS bad
FROM generate_series(0, :n - 1) g;
EXPLAIN ANALYZE UPDATE mfi f SET bad = true
WHERE EXISTS (SELECT 1 FROM usage_windows u
              WHERE u.sandbox_id = f.sb AND u.generation = f.gen
                AND u.window_start >= to_timestamp(f.ws)
                AND coalesce(u.pe_ns, (extract(epoch FROM u.window_end) * 1e9)::bigint) > f.ps)
   OR EXISTS (SELECT 1 FROM mfi j
              WHERE j.sb = f.sb AND j.gen = f.gen AND j.ord < f.ord AND j.first
                AND j.ws >= f.ws AND coalesce(j.pe, j.we * 1000000000) > f.ps);
EXPLAIN ANALYZE UPDATE mfi f SET bad = true
WHERE EXISTS (SELECT 1 FROM usage_windows u
              WHERE u.sandbox_id = f.sb AND u.generation = f.gen
                AND u.window_start >= to_timestamp(f.ws)
                AND coalesce(u.pe_ns, (extract(epoch FROM u.window_end) * 1e9)::bigint) > f.ps);
EXPLAIN ANALYZE UPDATE mfi f SET bad = true
FROM (SELECT DISTINCT f2.ord FROM mfi f2 JOIN mfi j ON j.sb = f2.sb AND j.gen = f2.gen
      WHERE j.ord < f2.ord AND j.first AND j.ws >= f2.ws
        AND coalesce(j.pe, j.we * 1000000000) > f2.ps) b
WHERE b.ord = f.ord;
ROLLBACK;

\echo '5. :n flush items from their text: as jsonb (0037), then as json (0044)'
\timing off
CREATE TEMP TABLE flush_text AS
SELECT json_agg(json_build_object('sb', 'sb_' || s, 'tenant', 'tn_' || (s / 10), 'node', 'n1',
        'gen', 1, 'ws', 1700000000 + 10 * w, 'we', 1700000010 + 10 * w,
        'ps', (1700000000 + 10 * w) * 1000000000::bigint,
        'pe', (1700000010 + 10 * w) * 1000000000::bigint, 'ucr', 1000 + s % 100, 'cpu', 1000,
        'mem_bs', 2684354560, 'rx', 0, 'tx', 0, 'state', 'running',
        't', (1700000010 + 10 * w) * 1000000000::bigint, 'cpu_at', 1000 * (w + 1), 'rx_at', 0,
        'tx_at', 0, 'rem', 7, 'gnode', '', 'id', kiln_new_id('tx_')))::text AS t
FROM generate_series(0, :n / 10 - 1) s, generate_series(0, 9) w;
\timing on
SELECT count(*) FROM flush_text, jsonb_array_elements(t::jsonb) e,
     jsonb_to_record(e) AS x(sb text, tenant text, node text, gen bigint, ws bigint, we bigint,
                             ps bigint, pe bigint, ucr bigint, cpu bigint, mem_bs bigint,
                             rx bigint, tx bigint, state text, t bigint, cpu_at bigint,
                             rx_at bigint, tx_at bigint, rem bigint, gnode text);
SELECT count(*) FROM flush_text,
     json_to_recordset(t::json) AS x(sb text, tenant text, node text, gen bigint, ws bigint,
                                     we bigint, ps bigint, pe bigint, ucr bigint, cpu bigint,
                                     mem_bs bigint, rx bigint, tx bigint, state text, t bigint,
                                     cpu_at bigint, rx_at bigint, tx_at bigint, rem bigint,
                                     gnode text, id text);
DROP TABLE flush_text;
