-- 0015_flush_set: kiln-meter's flush as a few set-based statements instead of a loop over items.
--
-- meter_flush_set(items, card) does what meter_flush() of 0004/0012 does, with the same result
-- to the transfer: every tenant's ledger lock first (ledger_lock_tenants(), one global order);
-- each window recorded in usage_windows once (a window already there is skipped whole, so a
-- replay charges nothing); each new window's charge drawn from the tenant's grants valid at the
-- window's start, earliest expiry first, one transfer per account keyed `usage:<sb>:<gen>:<ws>`,
-- `…:2`, `…:3`, the rest from its overdraft account; each sandbox's billed-up-to point moved to
-- its newest new window (generation, then time), never back. The items are taken in their order
-- in the array, as the loop took them.
--
-- The draws are one INSERT for all windows: each tenant's new windows, in order, cover the
-- stretches [c - ucr, c) of their running sum c, its grants (balance > 0, not expired, in draw
-- order) the stretches of theirs; a transfer is each overlap, and what passes the grants' total
-- goes to the overdraft. That needs every window of a tenant in the flush to see the same
-- grants: a tenant with a grant whose expiry falls between its windows' starts (rare: a flush
-- spans a window or a catch-up) is drawn window by window with ledger_draw() as before.
CREATE FUNCTION meter_flush_set(items jsonb, card text) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    n integer;
    it record;
BEGIN
    PERFORM ledger_lock_tenants(ARRAY(SELECT DISTINCT e->>'tenant'
                                      FROM jsonb_array_elements(items) e
                                      WHERE (e->>'ucr')::bigint > 0));
    CREATE TEMP TABLE meter_flush_items ON COMMIT DROP AS
    SELECT x.*, o.ord, false AS fresh
    FROM jsonb_array_elements(items) WITH ORDINALITY AS o(e, ord),
         jsonb_to_record(o.e) AS x(sb text, tenant text, node text, gen bigint, ws bigint,
                                   we bigint, ps bigint, pe bigint, ucr bigint, cpu bigint,
                                   mem_bs bigint, rx bigint, tx bigint, state text, t bigint,
                                   cpu_at bigint, rx_at bigint, tx_at bigint, rem bigint);

    WITH ins AS (
        INSERT INTO usage_windows (sandbox_id, generation, window_start, window_end, tenant_id,
                                   cpu_ns, mem_byte_s, rx_bytes, tx_bytes, ucr, rate_card)
        SELECT sb, gen, to_timestamp(ws), to_timestamp(we), tenant, cpu, mem_bs, rx, tx, ucr, card
        FROM meter_flush_items ORDER BY ord
        ON CONFLICT DO NOTHING
        RETURNING sandbox_id, generation, window_start)
    UPDATE meter_flush_items f SET fresh = true FROM ins
    WHERE f.sb = ins.sandbox_id AND f.gen = ins.generation AND to_timestamp(f.ws) = ins.window_start;
    GET DIAGNOSTICS n = ROW_COUNT;

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

    -- Each sandbox's billed-up-to point: its newest new window, if newer than the ledger's.
    INSERT INTO meter_sandboxes AS m (sandbox_id, tenant_id, node_id, generation, state,
                                      last_t_ns, cpu_ns, rx_bytes, tx_bytes, remainder_fine)
    SELECT DISTINCT ON (sb) sb, tenant, node, gen, state, t, cpu_at, rx_at, tx_at, rem
    FROM meter_flush_items WHERE fresh
    ORDER BY sb, gen DESC, t DESC, ord DESC
    ON CONFLICT (sandbox_id) DO UPDATE SET
        tenant_id = EXCLUDED.tenant_id, node_id = EXCLUDED.node_id,
        generation = EXCLUDED.generation, state = EXCLUDED.state,
        last_t_ns = EXCLUDED.last_t_ns, cpu_ns = EXCLUDED.cpu_ns,
        rx_bytes = EXCLUDED.rx_bytes, tx_bytes = EXCLUDED.tx_bytes,
        remainder_fine = EXCLUDED.remainder_fine, updated_at = now()
    WHERE m.generation < EXCLUDED.generation
       OR (m.generation = EXCLUDED.generation AND m.last_t_ns <= EXCLUDED.last_t_ns);

    DROP TABLE meter_flush_items, meter_flush_grants, meter_flush_slow;
    RETURN n;
END $$;
