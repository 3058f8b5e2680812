-- 0025_flush_fast: the ledger flush of 0015 made fast with the same result to the transfer
-- (bench/metering/flush_profile.sh found where its time went; docs/benchmarks.md has the figures).
--
-- 1. meter_flush_set(): whether a window overlaps one written earlier in the same flush was a
--    correlated EXISTS over the flush's own items, a scan of them all for every window; it is now
--    a join of the items with themselves, in a statement of its own. Which windows are bad is the
--    same set.
-- 2. ledger_account_balances (0004) kept by a statement-level trigger: each account a statement's
--    transfers touch is upserted once with their sum, in account order, instead of once per
--    transfer (a flush of many windows from one grant updated its row once per window). It fires
--    before billing_debts_apply() (0013) as the row trigger did: AFTER triggers of one level fire
--    by name, ledger_transfers_balances before ledger_transfers_debts.
-- 3. kiln_new_id() (0004) with the same ids from the same random bits: the 16 bytes of a random
--    UUID as 26 base32 characters, most significant bits first, the last 3 bits padded with two
--    zero bits; one expression over the UUID as a bit string instead of a loop over its bytes.

CREATE OR REPLACE FUNCTION meter_flush_set(items jsonb, card text)
RETURNS TABLE (refused_sandbox text, refused_generation bigint) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    it record;
BEGIN
    PERFORM ledger_lock_tenants(ARRAY(SELECT DISTINCT e->>'tenant'
                                      FROM jsonb_array_elements(items) e
                                      WHERE (e->>'ucr')::bigint > 0));
    CREATE TEMP TABLE meter_flush_items ON COMMIT DROP AS
    SELECT x.*, o.ord, false AS fresh, false AS first, false AS bad, false AS refused
    FROM jsonb_array_elements(items) WITH ORDINALITY AS o(e, ord),
         jsonb_to_record(o.e) AS x(sb text, tenant text, node text, gen bigint, ws bigint,
                                   we bigint, ps bigint, pe bigint, ucr bigint, cpu bigint,
                                   mem_bs bigint, rx bigint, tx bigint, state text, t bigint,
                                   cpu_at bigint, rx_at bigint, tx_at bigint, rem bigint,
                                   gnode text);

    -- first: the window would be written unless refused (the first of its start in the flush,
    -- and that start not in the ledger).
    UPDATE meter_flush_items f SET first = true
    FROM (SELECT ord, row_number() OVER (PARTITION BY sb, gen, ws ORDER BY ord) AS r
          FROM meter_flush_items) k
    WHERE k.ord = f.ord AND k.r = 1
      AND NOT EXISTS (SELECT 1 FROM usage_windows u
                      WHERE u.sandbox_id = f.sb AND u.generation = f.gen
                        AND u.window_start = to_timestamp(f.ws));
    -- bad: it overlaps billed time of its generation, in the ledger or written before it here.
    -- Two statements: the ledger by its primary key, then the flush's own windows as a join of
    -- the table with itself (hashed on the pair; a correlated EXISTS over it scanned it whole
    -- once per window).
    UPDATE meter_flush_items f SET bad = true
    WHERE EXISTS (SELECT 1 FROM usage_windows u
                  WHERE u.sandbox_id = f.sb AND u.generation = f.gen
                    AND u.window_start >= to_timestamp(f.ws)
                    AND coalesce(u.pe_ns, (extract(epoch FROM u.window_end) * 1e9)::bigint) > f.ps);
    UPDATE meter_flush_items f SET bad = true
    FROM (SELECT DISTINCT f2.ord
          FROM meter_flush_items f2 JOIN meter_flush_items j ON j.sb = f2.sb AND j.gen = f2.gen
          WHERE j.ord < f2.ord AND j.first AND j.ws >= f2.ws
            AND coalesce(j.pe, j.we * 1000000000) > f2.ps) b
    WHERE b.ord = f.ord AND NOT f.bad;
    -- refused: the pair's first bad window and every later one of the pair.
    UPDATE meter_flush_items f SET refused = true
    FROM (SELECT sb, gen, min(ord) AS o FROM meter_flush_items WHERE bad GROUP BY sb, gen) b
    WHERE f.sb = b.sb AND f.gen = b.gen AND f.ord >= b.o;

    WITH ins AS (
        INSERT INTO usage_windows (sandbox_id, generation, window_start, window_end, tenant_id,
                                   cpu_ns, mem_byte_s, rx_bytes, tx_bytes, ucr, rate_card,
                                   ps_ns, pe_ns)
        SELECT sb, gen, to_timestamp(ws), to_timestamp(we), tenant, cpu, mem_bs, rx, tx, ucr, card,
               ps, pe
        FROM meter_flush_items WHERE first AND NOT refused ORDER BY ord
        ON CONFLICT DO NOTHING
        RETURNING sandbox_id, generation, window_start)
    UPDATE meter_flush_items f SET fresh = true FROM ins
    WHERE f.first AND f.sb = ins.sandbox_id AND f.gen = ins.generation
      AND to_timestamp(f.ws) = ins.window_start;

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
    DROP TABLE meter_flush_items, meter_flush_grants, meter_flush_slow;
END $$;

CREATE OR REPLACE FUNCTION ledger_account_balance_apply() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ledger_account_balances AS b (account_id, tenant_id, balance_ucr)
    SELECT a.id, a.tenant_id, d.delta
    FROM (SELECT account, sum(amount)::bigint AS delta
          FROM (SELECT credit_account AS account, amount_ucr AS amount FROM new_rows
                WHERE credit_account NOT LIKE 'system:%'
                UNION ALL
                SELECT debit_account, -amount_ucr FROM new_rows
                WHERE debit_account NOT LIKE 'system:%') m
          GROUP BY account) d
    JOIN ledger_accounts a ON a.id = d.account
    ORDER BY a.id
    ON CONFLICT (account_id) DO UPDATE SET balance_ucr = b.balance_ucr + EXCLUDED.balance_ucr;
    RETURN NULL;
END $$;
DROP TRIGGER ledger_transfers_balances ON ledger_transfers;
CREATE TRIGGER ledger_transfers_balances AFTER INSERT ON ledger_transfers
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_account_balance_apply();

CREATE OR REPLACE FUNCTION kiln_new_id(prefix text) RETURNS text LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    a constant text := 'abcdefghijklmnopqrstuvwxyz234567';
    v constant bit(128) := ('x' || replace(gen_random_uuid()::text, '-', ''))::bit(128);
BEGIN
    RETURN prefix ||
        substr(a, substring(v FROM 1 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 6 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 11 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 16 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 21 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 26 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 31 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 36 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 41 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 46 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 51 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 56 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 61 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 66 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 71 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 76 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 81 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 86 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 91 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 96 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 101 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 106 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 111 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 116 FOR 5)::int + 1, 1) ||
        substr(a, substring(v FROM 121 FOR 5)::int + 1, 1) ||
        substr(a, (substring(v FROM 126 FOR 3) || B'00')::bit(5)::int + 1, 1);
END $$;
