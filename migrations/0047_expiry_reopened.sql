-- 0047_expiry_reopened (issue 14): a window flushed after the expiry of a grant it could have
-- drawn from reopens that expiry, so an expiry is exact however late the windows before it come.
--
-- A grant's expiry takes what is left of it, never more than its tenant's balance as of the
-- expiry (0013). It runs two windows after its time (kiln-meter's meter_expire()), when every
-- meter has flushed the windows that started before it: but a meter whose Postgres is down, a
-- crashed meter whose windows the next one bills again from the ledger, or one that followed a
-- forward step of the wall clock later than the others flushes such a window after the expiry
-- ran. The draws never offer an expired grant, so that window was drawn from another grant
-- or the overdraft, while the expiry had taken the credits that should have paid it: debt made by
-- an expiry (kiln-sim seed 31035, one hour of make test's kinds: a 262 µcr window of 22:55:30
-- flushed 53 s after the expiry of a grant expiring at 23:00:35 ran, drawn from another grant;
-- the tenant's balance as of the expiry -262 µcr after it).
--
-- Now meter_flush_set() first reopens, for each tenant of the flush, the expired grants that one
-- of its windows could have drawn from (expiring after the earliest start among them, with
-- credits the expiry took or kept): what the expiry took comes back to the grant (a transfer of
-- kind expiry_reversal, system:expired to the grant) and its grant_expiries row goes. The windows
-- are then drawn as they would have been before the expiry (earliest expiry first), and each
-- reopened grant expires again at once, with the same rule as of its expiry time (its transfer's
-- idempotency key numbered after the first: expiry:<account>:<n>). A grant's net expiry is its
-- expiry transfers less its reversals; ledger_balance() and billing_balance() count it so.
-- Only windows the flush will write reopen (not one already in the ledger: a replayed flush, nor
-- one overlapping billed time, which is refused). The expiry run again counts as made after it
-- the grants made after its first run (grant_expiries.run_seq, the tenant's newest transfer
-- then), whatever their time reads, as the first run did by not seeing them. A tenant's period at
-- or below zero (billing_debts) is kept across the reopening: the reversal, a statement of its
-- own, lifts the balance for a moment and ended the period, and the re-expiry started another.

CREATE INDEX ledger_accounts_tenant ON ledger_accounts (tenant_id);
ALTER TABLE grant_expiries ADD COLUMN run_seq bigint;

-- One grant's expiry (the body of 0013's loop): the grant's credits left, but never more than
-- its tenant's balance as of its expiry (usage of windows from the expiry on added back, grants
-- made after it taken off: those stamped after it, and when `first_seq` is given, the expiry run
-- again, those made after its first run, the tenant's newest transfer then). The caller holds the
-- tenant's ledger lock. True when it took any.
CREATE FUNCTION ledger_expire_grant(gid text, first_seq bigint DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    g record;
    bal bigint;
    later bigint;
    amt bigint;
    n integer;
    run bigint;
BEGIN
    SELECT a.id, a.tenant_id, a.expires_at,
           coalesce((SELECT min(t.seq) FROM ledger_transfers t WHERE t.credit_account = a.id), 0)
               AS gseq
    INTO g FROM ledger_accounts a WHERE a.id = gid;
    IF g.id IS NULL OR EXISTS (SELECT 1 FROM grant_expiries e WHERE e.account_id = gid) THEN
        RETURN false;
    END IF;
    SELECT coalesce(sum(balance_ucr), 0) INTO bal FROM ledger_account_balances
    WHERE tenant_id = g.tenant_id;
    SELECT coalesce(sum(CASE WHEN t.kind = 'usage' THEN t.amount_ucr ELSE -t.amount_ucr END), 0)
    INTO later FROM ledger_transfers t
    WHERE t.tenant_id = g.tenant_id AND t.seq > g.gseq
      AND ((t.kind = 'usage' AND t.period_start >= g.expires_at)
           OR (t.kind = 'grant' AND (t.created_at > g.expires_at OR t.seq > first_seq)));
    bal := bal + later;
    SELECT least(balance_ucr, greatest(bal, 0)) INTO amt FROM ledger_account_balances
    WHERE account_id = g.id;
    amt := greatest(coalesce(amt, 0), 0);
    IF first_seq IS NULL THEN
        SELECT coalesce(max(t.seq), 0) INTO run FROM ledger_transfers t
        WHERE t.tenant_id = g.tenant_id;
    ELSE
        run := first_seq;
    END IF;
    INSERT INTO grant_expiries (account_id, amount_ucr, run_seq) VALUES (g.id, amt, run);
    IF amt = 0 THEN
        RETURN false;
    END IF;
    SELECT count(*) INTO n FROM ledger_transfers
    WHERE credit_account = g.id AND kind = 'expiry_reversal';
    INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, amount_ucr,
                                  tenant_id, reason)
    VALUES (kiln_new_id('tx_'),
            'expiry:' || g.id || CASE WHEN n = 0 THEN '' ELSE ':' || (n + 1) END,
            'expiry', g.id, 'system:expired', amt, g.tenant_id, 'grant expired');
    RETURN true;
END $$;

-- 0013's, one grant at a time through ledger_expire_grant().
CREATE OR REPLACE FUNCTION ledger_expire_grants(at timestamptz) RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    g record;
BEGIN
    PERFORM ledger_lock_tenants(ARRAY(
        SELECT DISTINCT a.tenant_id FROM ledger_accounts a
        WHERE a.kind = 'grant' AND a.expires_at IS NOT NULL AND a.expires_at <= at
          AND NOT EXISTS (SELECT 1 FROM grant_expiries e WHERE e.account_id = a.id)));
    FOR g IN
        SELECT a.id, a.tenant_id FROM ledger_accounts a
        WHERE a.kind = 'grant' AND a.expires_at IS NOT NULL AND a.expires_at <= at
          AND NOT EXISTS (SELECT 1 FROM grant_expiries e WHERE e.account_id = a.id)
        ORDER BY a.expires_at, a.id
    LOOP
        PERFORM pg_advisory_xact_lock(hashtext('ledger:' || g.tenant_id));
        IF ledger_expire_grant(g.id) THEN
            RETURN NEXT g.tenant_id;
        END IF;
    END LOOP;
END $$;

-- Reopens the expired grants of `tenant` that a window starting at `ps` could have drawn from
-- (expiring after it) and that hold credits or gave some to their expiry: the expiry's credits
-- back to the grant, its row gone. The caller holds the tenant's ledger lock and expires each
-- again (ledger_expire_grant()) once the windows are drawn. Returns the grants reopened, each
-- with where its expiry first ran (run_seq; NULL for an expiry from before this migration).
CREATE FUNCTION ledger_reopen_expiries(tenant text, ps timestamptz)
RETURNS TABLE (id text, run_seq bigint) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    g record;
    n integer;
BEGIN
    FOR g IN
        SELECT a.id, e.amount_ucr, e.run_seq FROM ledger_accounts a
        JOIN grant_expiries e ON e.account_id = a.id
        JOIN ledger_account_balances b ON b.account_id = a.id
        WHERE a.tenant_id = tenant AND a.kind = 'grant' AND a.expires_at > ps
          AND (e.amount_ucr > 0 OR b.balance_ucr > 0)
        ORDER BY a.expires_at, a.id
    LOOP
        IF g.amount_ucr > 0 THEN
            SELECT count(*) INTO n FROM ledger_transfers
            WHERE credit_account = g.id AND kind = 'expiry_reversal';
            INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account,
                                          amount_ucr, tenant_id, reason)
            VALUES (kiln_new_id('tx_'), 'expiry_reversal:' || g.id || ':' || (n + 1),
                    'expiry_reversal', 'system:expired', g.id, g.amount_ucr, tenant,
                    'grant expiry reopened by a window that started before it');
        END IF;
        DELETE FROM grant_expiries WHERE account_id = g.id;
        id := g.id;
        run_seq := g.run_seq;
        RETURN NEXT;
    END LOOP;
END $$;

-- 0046's meter_flush_set(), the expiries its windows reopen first (after the tenants' ledger
-- locks, before the statement that reads the ledger), each reopened grant expired again last.
-- Everything else is 0046's, rule for rule.
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
