-- 0055_ended_generation_fence (issue 14): the flush refuses a window of a (sandbox, generation)
-- whose billed-up-to point is marked as the generation's end (migrations/0049), with every later
-- window of the pair, as it refuses one overlapping billed time.
--
-- The overlap test compares labels, and two meters can label the same real time differently: a
-- node's meter down across a forward step of the wall clock keeps the step at its first tick
-- after it, while the other nodes' meters followed it live, so the same stretch of a generation
-- reads a step apart on the two. A generation taken over by another node's meter (its own meter
-- gone) whose end was not yet readable there waits in the taker's memory; its own meter, back
-- after the step without Redis (it cannot see the take-over), bills it from its start by its
-- witness under the earlier labels and flushes first: both copies overlapped nowhere on the
-- labels and the ledger took both (metering/meter.c; test_meter's
-- test_a_taken_over_generation_its_own_meter_bills_first_is_billed_once: 3,598 µcr for 1,799).
-- A meter marks a generation's end only when it billed it whole from the ledger's point (or its
-- start) to that end, so once the mark is in, every second of the generation is; a copy that
-- comes after it is time billed already, whatever its labels. kiln-meter no longer marks the end
-- of a taken-over generation whose pieces stopped being its own part-way (its node's meter alive
-- again): that meter bills the rest and marks the end.
--
-- The expiry probe at the top counts such a window as not written (it draws nothing).

-- 0049's meter_flush_set(), a window of a generation whose point is marked ended refused with its
-- pair's later ones. Everything else is 0049's, rule for rule.
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
    cand text[];
    reopened text[];
    runs bigint[];
    debts billing_debts[];
BEGIN
    its := ARRAY(SELECT x FROM json_populate_recordset(NULL::meter_flush_item, items) x);
    -- The ledger locks of its tenants before anything of the ledger is read (the statement
    -- below reads the ledger as of its start, after them).
    PERFORM ledger_lock_tenants(ARRAY(SELECT DISTINCT x.tenant FROM unnest(its) x
                                      WHERE x.ucr > 0));
    -- The expiries its windows reopen: each tenant's expired grants expiring after the earliest
    -- start of its charged windows that will be written. First the tenants with an expired grant
    -- expiring after any of their windows (one join, by index: most flushes stop here), then for
    -- those the windows not in the ledger already nor overlapping billed time (the statement's
    -- `bad` probe: a replayed or refused window draws nothing and reopens nothing).
    cand := ARRAY(
        SELECT DISTINCT s.tenant
        FROM (SELECT x.tenant, to_timestamp(min(x.ps)::numeric / 1e9) AS ps
              FROM unnest(its) x WHERE x.ucr > 0 GROUP BY x.tenant) s
        JOIN ledger_accounts a ON a.tenant_id = s.tenant AND a.kind = 'grant'
                              AND a.expires_at > s.ps
        JOIN grant_expiries e ON e.account_id = a.id);
    IF cardinality(cand) > 0 THEN
        -- Their periods at or below zero, kept across the reopening (below).
        debts := ARRAY(SELECT d FROM billing_debts d WHERE d.tenant_id = ANY (cand));
        SELECT array_agg(r.id), array_agg(r.run_seq) INTO reopened, runs
        FROM (SELECT x.tenant, to_timestamp(min(x.ps)::numeric / 1e9) AS ps
              FROM unnest(its) x
              WHERE x.ucr > 0 AND x.tenant = ANY (cand)
                AND NOT EXISTS (SELECT 1 FROM meter_sandboxes m
                                WHERE m.sandbox_id = x.sb AND m.generation = x.gen AND m.ended)
                AND NOT EXISTS (SELECT 1 FROM usage_windows u
                                WHERE u.sandbox_id = x.sb AND u.generation = x.gen
                                  AND u.window_start >= to_timestamp(x.ws)
                                  AND coalesce(u.pe_ns,
                                               (extract(epoch FROM u.window_end) * 1e9)::bigint)
                                      > x.ps)
              GROUP BY x.tenant) s
        CROSS JOIN LATERAL ledger_reopen_expiries(s.tenant, s.ps) AS r;
    END IF;

    -- first: the window would be written unless refused (the first of its start in the flush,
    --   and that start not in the ledger);
    -- bad: it overlaps billed time of its generation, in the ledger or written before it here,
    --   or its generation's end is in the ledger (another copy of time billed to that end);
    -- refused: the pair's first bad window and every later one of the pair;
    -- fresh: to be written (first and not refused); written: fresh and inserted (not taken by a
    --   concurrent flush between this statement's start and its insert).
    EXECUTE $q$
    WITH i AS MATERIALIZED (
        SELECT * FROM unnest($1) WITH ORDINALITY
            AS x(sb, tenant, node, gen, ws, we, ps, pe, ucr, cpu, mem_bs, rx, tx, state, t,
                 cpu_at, rx_at, tx_at, rem, gnode, id, ended, ord)),
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
        -- one probe of meter_sandboxes' key per item, as above
        SELECT i.ord FROM i
        CROSS JOIN LATERAL (SELECT 1 FROM meter_sandboxes m
                            WHERE m.sandbox_id = i.sb AND m.generation = i.gen AND m.ended
                            LIMIT 1) e
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
    -- ledger's; ended when a written window of the pair marks the end, and kept ended.
    pt AS (
        INSERT INTO meter_sandboxes AS m (sandbox_id, tenant_id, node_id, generation, state,
                                          last_t_ns, cpu_ns, rx_bytes, tx_bytes, remainder_fine,
                                          gen_node, ended)
        SELECT DISTINCT ON (sb, gen) sb, tenant, node, gen, state, t, cpu_at, rx_at, tx_at, rem,
               coalesce(nullif(gnode, ''), node),
               bool_or(coalesce(ended, false)) OVER (PARTITION BY sb, gen)
        FROM wr
        ORDER BY sb, gen, t DESC, ord DESC
        ON CONFLICT (sandbox_id, generation) DO UPDATE SET
            tenant_id = EXCLUDED.tenant_id, node_id = EXCLUDED.node_id,
            state = EXCLUDED.state, last_t_ns = EXCLUDED.last_t_ns, cpu_ns = EXCLUDED.cpu_ns,
            rx_bytes = EXCLUDED.rx_bytes, tx_bytes = EXCLUDED.tx_bytes,
            remainder_fine = EXCLUDED.remainder_fine, gen_node = EXCLUDED.gen_node,
            ended = m.ended OR EXCLUDED.ended, updated_at = now()
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
                       cpu_at, rx_at, tx_at, rem, gnode, id, ended, ord)
              WHERE x.ord = ANY (slow_ords) ORDER BY x.ord LOOP
        PERFORM ledger_draw(it.tenant, it.ucr,
                            'usage:' || it.sb || ':' || it.gen || ':' || it.ws, it.sb,
                            to_timestamp(it.ps::numeric / 1e9), to_timestamp(it.pe::numeric / 1e9),
                            card);
    END LOOP;

    -- Each reopened grant expires again, its windows drawn, in the order expiries run, counting
    -- the grants made since its first run as made after it.
    FOR it IN SELECT r.id, r.run_seq FROM unnest(reopened, runs) AS r(id, run_seq)
              JOIN ledger_accounts a ON a.id = r.id ORDER BY a.expires_at, a.id LOOP
        PERFORM ledger_expire_grant(it.id, it.run_seq);
    END LOOP;
    -- A period at or below zero that went on through the reopening is the one it was: the
    -- reversal ended it for a moment and the draws or the expiry began it again, since now.
    UPDATE billing_debts d SET since = o.since, seq = o.seq, noticed_at = o.noticed_at
    FROM unnest(debts) AS o
    WHERE d.tenant_id = o.tenant_id AND cardinality(reopened) > 0;

    RETURN QUERY SELECT * FROM unnest(rsb, rgen);
END $$;

-- 0049's loop form of the flush, refusing a window of an ended generation the same way
-- (test_flush_set.c holds the set form to it). Everything else is 0049's.
CREATE OR REPLACE FUNCTION meter_flush(items jsonb, card text)
RETURNS TABLE (refused_sandbox text, refused_generation bigint) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    it jsonb;
    ws timestamptz;
    refused text[] := '{}';
    ended text[];
    key text;
BEGIN
    PERFORM ledger_lock_tenants(ARRAY(SELECT DISTINCT e->>'tenant'
                                      FROM jsonb_array_elements(items) e
                                      WHERE (e->>'ucr')::bigint > 0));
    -- The pairs whose end the ledger held when the flush began (the set form reads the ledger
    -- as of its statement's start: a mark written by this flush refuses nothing in it).
    ended := ARRAY(SELECT m.sandbox_id || ':' || m.generation FROM meter_sandboxes m
                   JOIN (SELECT DISTINCT e->>'sb' AS sb, (e->>'gen')::bigint AS gen
                         FROM jsonb_array_elements(items) e) x
                     ON m.sandbox_id = x.sb AND m.generation = x.gen
                   WHERE m.ended);
    FOR it IN SELECT * FROM jsonb_array_elements(items) LOOP
        ws := to_timestamp((it->>'ws')::bigint);
        key := (it->>'sb') || ':' || (it->>'gen');
        IF key = ANY (refused) OR key = ANY (ended) OR EXISTS (
            SELECT 1 FROM usage_windows u
            WHERE u.sandbox_id = it->>'sb' AND u.generation = (it->>'gen')::bigint
              AND u.window_start >= ws
              AND coalesce(u.pe_ns, (extract(epoch FROM u.window_end) * 1e9)::bigint)
                  > (it->>'ps')::bigint) THEN
            IF NOT key = ANY (refused) THEN
                refused := refused || key;
                refused_sandbox := it->>'sb';
                refused_generation := (it->>'gen')::bigint;
                RETURN NEXT;
            END IF;
            CONTINUE;
        END IF;
        INSERT INTO usage_windows AS u (sandbox_id, generation, window_start, window_end,
                                        tenant_id, cpu_ns, mem_byte_s, rx_bytes, tx_bytes, ucr,
                                        rate_card, ps_ns, pe_ns)
        VALUES (it->>'sb', (it->>'gen')::bigint, ws, to_timestamp((it->>'we')::bigint),
                it->>'tenant', (it->>'cpu')::bigint, (it->>'mem_bs')::bigint,
                (it->>'rx')::bigint, (it->>'tx')::bigint, (it->>'ucr')::bigint, card,
                (it->>'ps')::bigint, (it->>'pe')::bigint)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            -- The window is recorded with a period that does not reach this one's start (an
            -- end marker of no length): nothing to charge.
            CONTINUE;
        END IF;
        PERFORM ledger_draw(it->>'tenant', (it->>'ucr')::bigint,
                            'usage:' || (it->>'sb') || ':' || (it->>'gen') || ':' || (it->>'ws'),
                            it->>'sb', to_timestamp((it->>'ps')::numeric / 1e9),
                            to_timestamp((it->>'pe')::numeric / 1e9), card);
        INSERT INTO meter_sandboxes AS m (sandbox_id, tenant_id, node_id, generation, state,
                                          last_t_ns, cpu_ns, rx_bytes, tx_bytes, remainder_fine,
                                          gen_node, ended)
        VALUES (it->>'sb', it->>'tenant', it->>'node', (it->>'gen')::bigint, it->>'state',
                (it->>'t')::bigint, (it->>'cpu_at')::bigint, (it->>'rx_at')::bigint,
                (it->>'tx_at')::bigint, (it->>'rem')::bigint,
                coalesce(nullif(it->>'gnode', ''), it->>'node'),
                coalesce((it->>'ended')::boolean, false))
        ON CONFLICT (sandbox_id, generation) DO UPDATE SET
            tenant_id = EXCLUDED.tenant_id, node_id = EXCLUDED.node_id,
            state = EXCLUDED.state, last_t_ns = EXCLUDED.last_t_ns, cpu_ns = EXCLUDED.cpu_ns,
            rx_bytes = EXCLUDED.rx_bytes, tx_bytes = EXCLUDED.tx_bytes,
            remainder_fine = EXCLUDED.remainder_fine, gen_node = EXCLUDED.gen_node,
            ended = m.ended OR EXCLUDED.ended, updated_at = now()
        WHERE m.last_t_ns <= EXCLUDED.last_t_ns;
    END LOOP;
END $$;
