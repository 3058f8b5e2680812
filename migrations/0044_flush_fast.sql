-- 0044_flush_fast (issue 14): meter_flush_set() (0037) with the same result, faster
-- (bench/metering/meter.sh, bench/metering/flush_profile.sh; docs/benchmarks.md has the figures).
--
-- 1. The items come as json, not jsonb: meter_flush_set(items json, card) is the flush, read
--    with one json_to_recordset(). Parsing a flush's text as jsonb (a tree, keys sorted) took
--    about four times as long as reading it as json once, and was the largest single part of a
--    flush of 10,000 windows. meter_flush_set(items jsonb, card) stays, calling it, for a meter
--    of an older build (a rolling upgrade) and for tests.
-- 2. The id of a window's first transfer comes with the window (`id`, made by kiln-meter with
--    auth_new_id("tx_"): the form of kiln_new_id('tx_')), not from a call of kiln_new_id() per
--    row. A window's further transfers (a second grant, the overdraft), and a window sent
--    without an id, still take kiln_new_id('tx_'). An id not of that form fails the flush with
--    an error (meter_flush_bad_id()), so nothing of it is written.
-- 3. JIT off for the flush's statements (SET jit = off): once a flush holds a few thousand
--    windows they are costed above jit_above_cost, and compiling them took longer than running
--    them.
-- Everything else (the fence, the draws, the billed-up-to points) is 0037's, statement for
-- statement (tests/unit/metering/test_flush_set.c holds it to 0014's loop).

-- Raises the error of a transfer id that is not tx_ and 26 characters of base32; never returns.
CREATE FUNCTION meter_flush_bad_id(id text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'meter_flush_set: bad transfer id "%" (want tx_ and 26 of a-z, 2-7)',
        left(id, 64) USING ERRCODE = 'invalid_parameter_value';
END $$;

CREATE FUNCTION meter_flush_set(items json, card text)
RETURNS TABLE (refused_sandbox text, refused_generation bigint) LANGUAGE plpgsql
SET jit = off AS $$
#variable_conflict use_column
DECLARE
    it record;
BEGIN
    CREATE TEMP TABLE meter_flush_in ON COMMIT DROP AS
    SELECT x.*
    FROM ROWS FROM (json_to_recordset(items)
                    AS (sb text, tenant text, node text, gen bigint, ws bigint, we bigint,
                        ps bigint, pe bigint, ucr bigint, cpu bigint, mem_bs bigint, rx bigint,
                        tx bigint, state text, t bigint, cpu_at bigint, rx_at bigint,
                        tx_at bigint, rem bigint, gnode text, id text))
         WITH ORDINALITY AS x(sb, tenant, node, gen, ws, we, ps, pe, ucr, cpu, mem_bs, rx, tx,
                              state, t, cpu_at, rx_at, tx_at, rem, gnode, id, ord);
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
        SELECT w.ord, w.sb, w.gen, w.ws, w.ps, w.pe, w.tenant, w.id AS tx, g.id AS account,
               least(w.c_end, g.c_end) - greatest(w.c_end - w.ucr, g.c_end - g.balance_ucr) AS amount,
               0 AS od, g.expires_at, g.created_at, g.id AS gid
        FROM w JOIN g ON g.tenant_id = w.tenant
        WHERE least(w.c_end, g.c_end) > greatest(w.c_end - w.ucr, g.c_end - g.balance_ucr)
        UNION ALL
        SELECT w.ord, w.sb, w.gen, w.ws, w.ps, w.pe, w.tenant, w.id, 'overdraft:' || w.tenant,
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
    SELECT CASE WHEN k > 1 OR tx IS NULL THEN kiln_new_id('tx_')
                WHEN tx ~ '^tx_[a-z2-7]{26}$' THEN tx
                ELSE meter_flush_bad_id(tx) END,
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

-- The flush of 0037's signature: the same, its items read as json.
CREATE OR REPLACE FUNCTION meter_flush_set(items jsonb, card text)
RETURNS TABLE (refused_sandbox text, refused_generation bigint) LANGUAGE sql AS $$
    SELECT * FROM meter_flush_set(items::json, card)
$$;
