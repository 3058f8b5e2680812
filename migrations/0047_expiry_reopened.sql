-- 0047_expiry_reopened (issue 14): a window flushed after the expiry of a grant it could have
-- drawn from reopens that expiry, so an expiry is exact however late the windows before it come.
--
-- A grant's expiry takes what is left of it, never more than its tenant's balance as of the
-- expiry (0013). It runs two windows after its time (kiln-meter's meter_expire()), when every
-- meter has flushed the windows that started before it: but a meter whose Postgres is down, a
-- crashed meter whose windows the next one bills again from the ledger, or one that followed a
-- forward step of the wall clock later than the others flushes such a window after the expiry
-- ran. ledger_draw() no longer offers the expired grant to it, so it was drawn from another grant
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

-- One grant's expiry (the body of 0013's loop): the grant's credits left, but never more than
-- its tenant's balance as of its expiry (usage of windows from the expiry on added back, grants
-- made after it taken off). The caller holds the tenant's ledger lock. True when it took any.
CREATE FUNCTION ledger_expire_grant(gid text) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    g record;
    bal bigint;
    later bigint;
    amt bigint;
    n integer;
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
           OR (t.kind = 'grant' AND t.created_at > g.expires_at));
    bal := bal + later;
    SELECT least(balance_ucr, greatest(bal, 0)) INTO amt FROM ledger_account_balances
    WHERE account_id = g.id;
    amt := greatest(coalesce(amt, 0), 0);
    INSERT INTO grant_expiries (account_id, amount_ucr) VALUES (g.id, amt);
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
-- again (ledger_expire_grant()) once the windows are drawn. Returns the grants reopened.
CREATE FUNCTION ledger_reopen_expiries(tenant text, ps timestamptz) RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    g record;
    n integer;
BEGIN
    FOR g IN
        SELECT a.id, e.amount_ucr FROM ledger_accounts a
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
        RETURN NEXT g.id;
    END LOOP;
END $$;

-- 0046's meter_flush_set(), unchanged, called by the one below between the reopening and the
-- expiries again.
ALTER FUNCTION meter_flush_set(json, text) RENAME TO meter_flush_draw;

CREATE FUNCTION meter_flush_set(items json, card text)
RETURNS TABLE (refused_sandbox text, refused_generation bigint) LANGUAGE plpgsql
SET jit = off AS $$
DECLARE
    ts text[];
    pss bigint[];
    reopened text[];
    g record;
BEGIN
    -- The earliest start of each tenant's charged windows (read from the items apart from
    -- meter_flush_draw(): no temporary table, 0046), and the tenants' ledger locks, first and in
    -- the global order, as meter_flush_draw() takes them.
    SELECT array_agg(s.tenant), array_agg(s.ps) INTO ts, pss
    FROM (SELECT x.tenant, min(x.ps) AS ps
          FROM json_to_recordset(items) AS x(tenant text, ps bigint, ucr bigint)
          WHERE x.ucr > 0 GROUP BY x.tenant) s;
    PERFORM ledger_lock_tenants(ts);
    -- The expiries those windows reopen: tenants with an expired grant expiring after their
    -- earliest start (one join over all of them), then each of those tenants' grants.
    reopened := ARRAY(
        SELECT r.id
        FROM (SELECT DISTINCT s.tenant, s.ps FROM unnest(ts, pss) AS s(tenant, ps)
              JOIN ledger_accounts a ON a.tenant_id = s.tenant AND a.kind = 'grant'
                                    AND a.expires_at > to_timestamp(s.ps::numeric / 1e9)
              JOIN grant_expiries e ON e.account_id = a.id) s
        CROSS JOIN LATERAL ledger_reopen_expiries(s.tenant, to_timestamp(s.ps::numeric / 1e9))
            AS r(id));
    RETURN QUERY SELECT * FROM meter_flush_draw(items, card);
    -- Each reopened grant expires again, its windows drawn, in the order the expiries run.
    FOR g IN SELECT a.id FROM ledger_accounts a WHERE a.id = ANY (reopened)
             ORDER BY a.expires_at, a.id LOOP
        PERFORM ledger_expire_grant(g.id);
    END LOOP;
END $$;
