-- 0037_meter_flush (issue 14): the ledger flush in fewer passes, and each node's clock frame.
--
-- 1. meter_flush_set() (0025) with the same result (tests/unit/metering/test_flush_set.c) in
--    fewer passes over its items (bench/metering/meter.sh; docs/benchmarks.md has the figures).
--    0025 parsed the flush's JSON twice (the tenants to lock, then the items) and wrote its
--    temporary table of items five times over: made, then each flag (first, bad twice,
--    refused) and `fresh` set by an UPDATE, each rewriting every row of a wide table. Now the
--    items are parsed once, the tenants locked from them, and every flag is computed in the
--    statement that makes the table (the same sets: first, bad in the ledger or against a
--    window written earlier in the flush, refused from a pair's first bad window on); `fresh`
--    is first and not refused, and only the windows the usage_windows INSERT did not write (a
--    concurrent flush committed them first: ON CONFLICT DO NOTHING) are turned off afterwards,
--    which a flush normally has none of. The ledger half of the overlap check probes
--    usage_windows' key once per item (LIMIT 1) instead of leaving the planner free to hash the
--    whole table, which grows with every window ever billed. What follows (the draws, the
--    transfers, the billed-up-to points) is 0025's.
-- 2. meter_clocks, below.

CREATE OR REPLACE FUNCTION meter_flush_set(items jsonb, card text)
RETURNS TABLE (refused_sandbox text, refused_generation bigint) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    it record;
BEGIN
    CREATE TEMP TABLE meter_flush_in ON COMMIT DROP AS
    SELECT x.*, o.ord
    FROM jsonb_array_elements(items) WITH ORDINALITY AS o(e, ord),
         jsonb_to_record(o.e) AS x(sb text, tenant text, node text, gen bigint, ws bigint,
                                   we bigint, ps bigint, pe bigint, ucr bigint, cpu bigint,
                                   mem_bs bigint, rx bigint, tx bigint, state text, t bigint,
                                   cpu_at bigint, rx_at bigint, tx_at bigint, rem bigint,
                                   gnode text);
    -- The ledger locks of its tenants before anything of the ledger is read.
    PERFORM ledger_lock_tenants(ARRAY(SELECT DISTINCT tenant FROM meter_flush_in WHERE ucr > 0));

    -- first: the window would be written unless refused (the first of its start in the flush,
    --   and that start not in the ledger);
    -- bad: it overlaps billed time of its generation, in the ledger or written before it here;
    -- refused: the pair's first bad window and every later one of the pair;
    -- fresh: written (first and not refused; the INSERT below turns off what it did not write).
    CREATE TEMP TABLE meter_flush_items ON COMMIT DROP AS
    WITH k AS (
        SELECT ord, sb, gen, ws, row_number() OVER (PARTITION BY sb, gen, ws ORDER BY ord) AS r
        FROM meter_flush_in),
    firsts AS (
        SELECT k.ord FROM k
        WHERE k.r = 1
          AND NOT EXISTS (SELECT 1 FROM usage_windows u
                          WHERE u.sandbox_id = k.sb AND u.generation = k.gen
                            AND u.window_start = to_timestamp(k.ws))),
    f AS (
        SELECT i.*, fi.ord IS NOT NULL AS first
        FROM meter_flush_in i LEFT JOIN firsts fi ON fi.ord = i.ord),
    bad AS (
        -- one probe of usage_windows' key per item (LIMIT 1: never a scan of the whole ledger)
        SELECT i.ord FROM meter_flush_in i
        CROSS JOIN LATERAL (SELECT 1 FROM usage_windows u
                            WHERE u.sandbox_id = i.sb AND u.generation = i.gen
                              AND u.window_start >= to_timestamp(i.ws)
                              AND coalesce(u.pe_ns,
                                           (extract(epoch FROM u.window_end) * 1e9)::bigint)
                                  > i.ps
                            LIMIT 1) o
        UNION
        SELECT f2.ord
        FROM f f2 JOIN f j ON j.sb = f2.sb AND j.gen = f2.gen
        WHERE j.ord < f2.ord AND j.first AND j.ws >= f2.ws
          AND coalesce(j.pe, j.we * 1000000000) > f2.ps),
    b AS (
        SELECT f.*, bd.ord IS NOT NULL AS bad FROM f LEFT JOIN bad bd ON bd.ord = f.ord),
    r AS (
        SELECT b.*, coalesce(b.ord >= min(b.ord) FILTER (WHERE b.bad)
                                      OVER (PARTITION BY b.sb, b.gen), false) AS refused
        FROM b)
    SELECT r.*, r.first AND NOT r.refused AS fresh FROM r;
    DROP TABLE meter_flush_in;

    CREATE TEMP TABLE meter_flush_lost (ord bigint) ON COMMIT DROP;
    WITH ins AS (
        INSERT INTO usage_windows (sandbox_id, generation, window_start, window_end, tenant_id,
                                   cpu_ns, mem_byte_s, rx_bytes, tx_bytes, ucr, rate_card,
                                   ps_ns, pe_ns)
        SELECT sb, gen, to_timestamp(ws), to_timestamp(we), tenant, cpu, mem_bs, rx, tx, ucr, card,
               ps, pe
        FROM meter_flush_items WHERE fresh ORDER BY ord
        ON CONFLICT DO NOTHING
        RETURNING sandbox_id, generation, window_start)
    INSERT INTO meter_flush_lost
    SELECT f.ord FROM meter_flush_items f
    WHERE f.fresh
      AND NOT EXISTS (SELECT 1 FROM ins
                      WHERE ins.sandbox_id = f.sb AND ins.generation = f.gen
                        AND ins.window_start = to_timestamp(f.ws));
    IF FOUND THEN
        UPDATE meter_flush_items f SET fresh = false FROM meter_flush_lost l WHERE l.ord = f.ord;
    END IF;

    -- Grants that can pay for these windows, per tenant, and whether a tenant's windows would
    -- see different ones (an expiry between their starts): those tenants draw one by one.
    CREATE TEMP TABLE meter_flush_grants ON COMMIT DROP AS
    SELECT a.tenant_id, a.id, b.balance_ucr, a.expires_at, a.created_at
    FROM ledger_accounts a JOIN ledger_account_balances b ON b.account_id = a.id
    WHERE a.kind = 'grant' AND b.balance_ucr > 0
      AND a.tenant_id IN (SELECT DISTINCT tenant FROM meter_flush_items WHERE fresh AND ucr > 0)
      AND NOT EXISTS (SELECT 1 FROM grant_expiries e WHERE e.account_id = a.id);
    CREATE TEMP TABLE meter_flush_slow ON COMMIT DROP AS
    SELECT DISTINCT g.tenant_id FROM meter_flush_grants g
    JOIN (SELECT tenant, min(ps) AS lo, max(ps) AS hi FROM meter_flush_items
          WHERE fresh AND ucr > 0 GROUP BY tenant) r ON r.tenant = g.tenant_id
    WHERE g.expires_at > to_timestamp(r.lo::numeric / 1e9)
      AND g.expires_at <= to_timestamp(r.hi::numeric / 1e9);

    FOR it IN SELECT * FROM meter_flush_items
              WHERE fresh AND ucr > 0 AND tenant IN (SELECT tenant_id FROM meter_flush_slow)
              ORDER BY ord LOOP
        PERFORM ledger_draw(it.tenant, it.ucr,
                            'usage:' || it.sb || ':' || it.gen || ':' || it.ws, it.sb,
                            to_timestamp(it.ps::numeric / 1e9), to_timestamp(it.pe::numeric / 1e9),
                            card);
    END LOOP;

    -- The rest at once. Stretches of each tenant's windows and of its grants valid for them all.
    INSERT INTO ledger_accounts (id, tenant_id, kind)
    SELECT DISTINCT 'overdraft:' || tenant, tenant, 'overdraft' FROM meter_flush_items
    WHERE fresh AND ucr > 0 AND tenant NOT IN (SELECT tenant_id FROM meter_flush_slow)
    ON CONFLICT (id) DO NOTHING;
    WITH w AS (
        SELECT f.*, sum(ucr) OVER (PARTITION BY tenant ORDER BY ord) AS c_end
        FROM meter_flush_items f
        WHERE fresh AND ucr > 0 AND tenant NOT IN (SELECT tenant_id FROM meter_flush_slow)),
    lo AS (
        SELECT tenant, min(ps) AS ps FROM w GROUP BY tenant),
    g AS (
        SELECT g.tenant_id, g.id, g.expires_at, g.created_at,
               sum(g.balance_ucr) OVER (PARTITION BY g.tenant_id
                                        ORDER BY g.expires_at ASC NULLS LAST, g.created_at, g.id)
                   AS c_end,
               g.balance_ucr
        FROM meter_flush_grants g JOIN lo ON lo.tenant = g.tenant_id
        WHERE g.expires_at IS NULL OR g.expires_at > to_timestamp(lo.ps::numeric / 1e9)),
    tot AS (
        SELECT tenant_id, max(c_end) AS total FROM g GROUP BY tenant_id),
    parts AS (
        SELECT w.ord, w.sb, w.gen, w.ws, w.ps, w.pe, w.tenant, g.id AS account,
               least(w.c_end, g.c_end) - greatest(w.c_end - w.ucr, g.c_end - g.balance_ucr) AS amount,
               0 AS od, g.expires_at, g.created_at, g.id AS gid
        FROM w JOIN g ON g.tenant_id = w.tenant
        WHERE least(w.c_end, g.c_end) > greatest(w.c_end - w.ucr, g.c_end - g.balance_ucr)
        UNION ALL
        SELECT w.ord, w.sb, w.gen, w.ws, w.ps, w.pe, w.tenant, 'overdraft:' || w.tenant,
               w.c_end - greatest(w.c_end - w.ucr, coalesce(tot.total, 0)), 1, NULL, NULL, NULL
        FROM w LEFT JOIN tot ON tot.tenant_id = w.tenant
        WHERE w.c_end > coalesce(tot.total, 0)),
    numbered AS (
        SELECT p.*, row_number() OVER (PARTITION BY ord
                                       ORDER BY od, expires_at ASC NULLS LAST, created_at, gid)
                   AS k
        FROM parts p)
    INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, amount_ucr,
                                  tenant_id, sandbox_id, period_start, period_end, rate_card)
    SELECT kiln_new_id('tx_'),
           'usage:' || sb || ':' || gen || ':' || ws || CASE WHEN k = 1 THEN '' ELSE ':' || k END,
           'usage', account, 'system:revenue', amount, tenant, sb,
           to_timestamp(ps::numeric / 1e9), to_timestamp(pe::numeric / 1e9), card
    FROM numbered ORDER BY ord, k;

    -- Each (sandbox, generation)'s billed-up-to point: its newest new window (the last of the
    -- newest time, as the loop's row-by-row upserts leave it), if not older than the ledger's.
    INSERT INTO meter_sandboxes AS m (sandbox_id, tenant_id, node_id, generation, state,
                                      last_t_ns, cpu_ns, rx_bytes, tx_bytes, remainder_fine,
                                      gen_node)
    SELECT DISTINCT ON (sb, gen) sb, tenant, node, gen, state, t, cpu_at, rx_at, tx_at, rem,
           coalesce(nullif(gnode, ''), node)
    FROM meter_flush_items WHERE fresh
    ORDER BY sb, gen, t DESC, ord DESC
    ON CONFLICT (sandbox_id, generation) DO UPDATE SET
        tenant_id = EXCLUDED.tenant_id, node_id = EXCLUDED.node_id,
        state = EXCLUDED.state, last_t_ns = EXCLUDED.last_t_ns, cpu_ns = EXCLUDED.cpu_ns,
        rx_bytes = EXCLUDED.rx_bytes, tx_bytes = EXCLUDED.tx_bytes,
        remainder_fine = EXCLUDED.remainder_fine, gen_node = EXCLUDED.gen_node,
        updated_at = now()
    WHERE m.last_t_ns <= EXCLUDED.last_t_ns;

    RETURN QUERY SELECT f.sb, f.gen FROM meter_flush_items f WHERE f.refused
                 GROUP BY f.sb, f.gen ORDER BY min(f.ord);
    DROP TABLE meter_flush_items, meter_flush_lost, meter_flush_grants, meter_flush_slow;
END $$;

-- 2. Each node's label clock as its last flush left it (kiln-meter, metering/meter.c): label_ns at
-- mono_ns on the monotonic clock of the boot boot_id. The node's next meter on the same host
-- goes on in that frame, so a wall-clock step made before it started shifts none of the node's
-- timestamps (kiln-sim `clock`, seed 9102: a meter restarted after a backward step began at the
-- ledger's newest point, 7 s behind, and read every later change 7 s early).
CREATE TABLE meter_clocks (
    node_id     text PRIMARY KEY,
    boot_id     text NOT NULL,
    label_ns    bigint NOT NULL,
    mono_ns     bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
