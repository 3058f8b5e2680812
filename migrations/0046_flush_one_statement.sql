-- 0046_flush_one_statement (issue 14): meter_flush_set(items json, card) of 0044 with the same
-- result, its fixed cost and its per-row cost cut (bench/metering/meter.sh; docs/benchmarks.md
-- "The flush with migration 0046" has the figures).
--
-- 1. No temporary tables. 0044 made and dropped five per flush (catalog rows written and
--    removed each time, the session's temporary schema set up at its first flush) and planned
--    every statement on them again at each call. The items are read once, with one
--    json_populate_recordset(), into an array of meter_flush_item held by the function; the
--    flags, the usage windows, the transfers and the billed-up-to points are one statement of
--    data-modifying CTEs over it (its triggers and foreign-key checks fire at its end, when
--    every row of it is in place). The function's other statements are static, so plpgsql keeps
--    their plans for the session. The one statement is planned at each flush (EXECUTE), with
--    the array's length known: a plan kept for the session is a generic one, which costs
--    unnest() of an array parameter at 10 rows and joined 10,000 items by nested loops (13.9 s
--    under EXPLAIN ANALYZE, against 1.6 s planned for them). plan_cache_mode =
--    force_custom_plan on the function would plan it so too, but reaches the foreign-key
--    checks' own queries as well, planned again for each of 30,000 rows (905 ms against 419).
-- 2. The transfers' window functions and sorts run over the columns they need, not the
--    full-width items, and their order is the one the numbering sorted them in (no second
--    sort).
-- 3. The windows of tenants that draw one by one (an expiry between their windows) are drawn
--    with ledger_draw() after the statement, not before it: those tenants and the others are
--    disjoint, and each tenant's ledger lock is held from the start, so what each tenant is
--    given is the same. Their transfers now come after the others' of the same flush in
--    ledger_transfers.seq (before them with 0044); nothing compares seq across tenants.
-- Everything else (the ledger locks first, the fence, the lost windows of a concurrent insert,
-- the draws, the billed-up-to points, the refused pairs and their order) is 0044's, rule for
-- rule (tests/unit/metering/test_flush_set.c holds it to 0014's loop).

-- One window of a flush, as kiln-meter sends it (metering/meter.c, json_item()).
CREATE TYPE meter_flush_item AS (
    sb text, tenant text, node text, gen bigint, ws bigint, we bigint, ps bigint, pe bigint,
    ucr bigint, cpu bigint, mem_bs bigint, rx bigint, tx bigint, state text, t bigint,
    cpu_at bigint, rx_at bigint, tx_at bigint, rem bigint, gnode text, id text);

CREATE OR REPLACE FUNCTION meter_flush_set(items json, card text)
RETURNS TABLE (refused_sandbox text, refused_generation bigint) LANGUAGE plpgsql
SET jit = off AS $$
#variable_conflict use_column
DECLARE
    its meter_flush_item[];
    rsb text[];
    rgen bigint[];
    slow_ords bigint[];
    it record;
BEGIN
    its := ARRAY(SELECT x FROM json_populate_recordset(NULL::meter_flush_item, items) x);
    -- The ledger locks of its tenants before anything of the ledger is read (the statement
    -- below reads the ledger as of its start, after them).
    PERFORM ledger_lock_tenants(ARRAY(SELECT DISTINCT x.tenant FROM unnest(its) x
                                      WHERE x.ucr > 0));

    -- first: the window would be written unless refused (the first of its start in the flush,
    --   and that start not in the ledger);
    -- bad: it overlaps billed time of its generation, in the ledger or written before it here;
    -- refused: the pair's first bad window and every later one of the pair;
    -- fresh: to be written (first and not refused); written: fresh and inserted (not taken by a
    --   concurrent flush between this statement's start and its insert).
    EXECUTE $q$
    WITH i AS MATERIALIZED (
        SELECT * FROM unnest($1) WITH ORDINALITY
            AS x(sb, tenant, node, gen, ws, we, ps, pe, ucr, cpu, mem_bs, rx, tx, state, t,
                 cpu_at, rx_at, tx_at, rem, gnode, id, ord)),
    k AS (
        SELECT ord, sb, gen, ws, row_number() OVER (PARTITION BY sb, gen, ws ORDER BY ord) AS r
        FROM i),
    firsts AS (
        SELECT k.ord FROM k
        WHERE k.r = 1
          AND NOT EXISTS (SELECT 1 FROM usage_windows u
                          WHERE u.sandbox_id = k.sb AND u.generation = k.gen
                            AND u.window_start = to_timestamp(k.ws))),
    f AS MATERIALIZED (
        SELECT i.ord, i.sb, i.gen, i.ws, i.we, i.ps, i.pe, fi.ord IS NOT NULL AS first
        FROM i LEFT JOIN firsts fi ON fi.ord = i.ord),
    bad AS (
        -- one probe of usage_windows' key per item (LIMIT 1: never a scan of the whole ledger)
        SELECT i.ord FROM i
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
    fl AS MATERIALIZED (
        SELECT b.ord, b.first,
               coalesce(b.ord >= min(b.ord) FILTER (WHERE b.bad)
                                   OVER (PARTITION BY b.sb, b.gen), false) AS refused
        FROM (SELECT f.ord, f.sb, f.gen, f.first, bd.ord IS NOT NULL AS bad
              FROM f LEFT JOIN bad bd ON bd.ord = f.ord) b),
    fresh AS MATERIALIZED (
        SELECT i.* FROM i JOIN fl ON fl.ord = i.ord WHERE fl.first AND NOT fl.refused),
    ins AS (
        INSERT INTO usage_windows (sandbox_id, generation, window_start, window_end, tenant_id,
                                   cpu_ns, mem_byte_s, rx_bytes, tx_bytes, ucr, rate_card,
                                   ps_ns, pe_ns)
        SELECT sb, gen, to_timestamp(ws), to_timestamp(we), tenant, cpu, mem_bs, rx, tx, ucr, $2,
               ps, pe
        FROM fresh ORDER BY ord
        ON CONFLICT DO NOTHING
        RETURNING sandbox_id, generation, window_start),
    wr AS MATERIALIZED (
        SELECT fr.* FROM fresh fr
        JOIN ins ON ins.sandbox_id = fr.sb AND ins.generation = fr.gen
                AND ins.window_start = to_timestamp(fr.ws)),
    -- Grants that can pay for these windows, per tenant, and whether a tenant's windows would
    -- see different ones (an expiry between their starts): those tenants draw one by one.
    gr AS MATERIALIZED (
        SELECT a.tenant_id, a.id, b.balance_ucr, a.expires_at, a.created_at
        FROM ledger_accounts a JOIN ledger_account_balances b ON b.account_id = a.id
        WHERE a.kind = 'grant' AND b.balance_ucr > 0
          AND a.tenant_id IN (SELECT tenant FROM wr WHERE ucr > 0)
          AND NOT EXISTS (SELECT 1 FROM grant_expiries e WHERE e.account_id = a.id)),
    slow AS MATERIALIZED (
        SELECT DISTINCT g.tenant_id FROM gr g
        JOIN (SELECT tenant, min(ps) AS lo, max(ps) AS hi FROM wr
              WHERE ucr > 0 GROUP BY tenant) r ON r.tenant = g.tenant_id
        WHERE g.expires_at > to_timestamp(r.lo::numeric / 1e9)
          AND g.expires_at <= to_timestamp(r.hi::numeric / 1e9)),
    -- The rest at once. Stretches of each tenant's windows and of its grants valid for them all.
    w AS MATERIALIZED (
        SELECT wr.ord, wr.sb, wr.gen, wr.ws, wr.ps, wr.pe, wr.tenant, wr.id, wr.ucr,
               sum(wr.ucr) OVER (PARTITION BY wr.tenant ORDER BY wr.ord) AS c_end
        FROM wr
        WHERE wr.ucr > 0 AND wr.tenant NOT IN (SELECT tenant_id FROM slow)),
    od AS (
        INSERT INTO ledger_accounts (id, tenant_id, kind)
        SELECT DISTINCT 'overdraft:' || tenant, tenant, 'overdraft' FROM w
        ON CONFLICT (id) DO NOTHING),
    lo AS (
        SELECT tenant, min(ps) AS ps FROM w GROUP BY tenant),
    g AS MATERIALIZED (
        SELECT g.tenant_id, g.id, g.expires_at, g.created_at,
               sum(g.balance_ucr) OVER (PARTITION BY g.tenant_id
                                        ORDER BY g.expires_at ASC NULLS LAST, g.created_at, g.id)
                   AS c_end,
               g.balance_ucr
        FROM gr g JOIN lo ON lo.tenant = g.tenant_id
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
        SELECT p.*,
               row_number() OVER (PARTITION BY p.ord
                                  ORDER BY p.od, p.expires_at ASC NULLS LAST, p.created_at, p.gid)
                   AS k
        FROM parts p),
    tr AS (
        INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account,
                                      amount_ucr, tenant_id, sandbox_id, period_start, period_end,
                                      rate_card)
        SELECT CASE WHEN k > 1 OR tx IS NULL THEN kiln_new_id('tx_')
                    WHEN tx ~ '^tx_[a-z2-7]{26}$' THEN tx
                    ELSE meter_flush_bad_id(tx) END,
               'usage:' || sb || ':' || gen || ':' || ws || CASE WHEN k = 1 THEN '' ELSE ':' || k END,
               'usage', account, 'system:revenue', amount, tenant, sb,
               to_timestamp(ps::numeric / 1e9), to_timestamp(pe::numeric / 1e9), $2
        FROM numbered
        -- (ord, k): the order the numbering sorted them in, so no second sort
        ORDER BY ord, od, expires_at ASC NULLS LAST, created_at, gid),
    -- Each (sandbox, generation)'s billed-up-to point: its newest written window (the last of
    -- the newest time, as the loop's row-by-row upserts leave it), if not older than the
    -- ledger's.
    pt AS (
        INSERT INTO meter_sandboxes AS m (sandbox_id, tenant_id, node_id, generation, state,
                                          last_t_ns, cpu_ns, rx_bytes, tx_bytes, remainder_fine,
                                          gen_node)
        SELECT DISTINCT ON (sb, gen) sb, tenant, node, gen, state, t, cpu_at, rx_at, tx_at, rem,
               coalesce(nullif(gnode, ''), node)
        FROM wr
        ORDER BY sb, gen, t DESC, ord DESC
        ON CONFLICT (sandbox_id, generation) DO UPDATE SET
            tenant_id = EXCLUDED.tenant_id, node_id = EXCLUDED.node_id,
            state = EXCLUDED.state, last_t_ns = EXCLUDED.last_t_ns, cpu_ns = EXCLUDED.cpu_ns,
            rx_bytes = EXCLUDED.rx_bytes, tx_bytes = EXCLUDED.tx_bytes,
            remainder_fine = EXCLUDED.remainder_fine, gen_node = EXCLUDED.gen_node,
            updated_at = now()
        WHERE m.last_t_ns <= EXCLUDED.last_t_ns),
    rf AS (
        SELECT f.sb, f.gen, min(f.ord) AS o FROM f JOIN fl ON fl.ord = f.ord
        WHERE fl.refused GROUP BY f.sb, f.gen)
    SELECT ARRAY(SELECT rf.sb FROM rf ORDER BY rf.o), ARRAY(SELECT rf.gen FROM rf ORDER BY rf.o),
           ARRAY(SELECT wr.ord FROM wr
                 WHERE wr.ucr > 0 AND wr.tenant IN (SELECT tenant_id FROM slow) ORDER BY wr.ord)
    $q$ INTO rsb, rgen, slow_ords USING its, card;

    -- The tenants with an expiry between their windows, window by window.
    FOR it IN SELECT x.* FROM unnest(its) WITH ORDINALITY
                  AS x(sb, tenant, node, gen, ws, we, ps, pe, ucr, cpu, mem_bs, rx, tx, state, t,
                       cpu_at, rx_at, tx_at, rem, gnode, id, ord)
              WHERE x.ord = ANY (slow_ords) ORDER BY x.ord LOOP
        PERFORM ledger_draw(it.tenant, it.ucr,
                            'usage:' || it.sb || ':' || it.gen || ':' || it.ws, it.sb,
                            to_timestamp(it.ps::numeric / 1e9), to_timestamp(it.pe::numeric / 1e9),
                            card);
    END LOOP;

    RETURN QUERY SELECT * FROM unnest(rsb, rgen);
END $$;
