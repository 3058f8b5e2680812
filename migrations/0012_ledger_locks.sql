-- 0012_ledger_locks: one order for the per-tenant ledger locks, and grants that remember their
-- request for as long as they exist.
--
-- Every writer of a tenant's ledger (usage draws, grant expiries, grants: metering/ledger.c)
-- holds the transaction lock pg_advisory_xact_lock(hashtext('ledger:' || tenant)) while it posts,
-- so the transfers of one tenant commit in the order of their seq, and a read that sees seq N
-- sees every earlier transfer of that tenant (what the `lseq` compare of the Redis balance
-- relies on, metering/billing.c). A transaction that needs several tenants' locks takes them all
-- first, in ascending order of the lock key, so two flushes (or a flush and an expiry) never wait
-- on each other in a cycle.
--
-- A grant's transfer keeps the SHA-256 of the request body that made it (as the gateway's
-- Idempotency-Key records hash it): its Idempotency-Key (idem_key
-- `grant:<caller tenant>:<key>`) answers the same grant for as long as the grant exists, long
-- after the gateway's idempotency record is swept.

ALTER TABLE ledger_transfers ADD COLUMN request_sha256 text;

-- Takes the ledger lock of every tenant in `tenants`, in one global order (the lock key, then
-- the id, so two ids with one key are taken once). Call it before posting for several tenants.
CREATE FUNCTION ledger_lock_tenants(tenants text[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    k integer;
BEGIN
    FOR k IN
        SELECT DISTINCT hashtext('ledger:' || t) AS k FROM unnest(tenants) AS u(t)
        WHERE t IS NOT NULL ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(k);
    END LOOP;
END $$;

-- meter_flush() of 0004, taking every tenant's ledger lock first, in the global order, instead
-- of one by one in the order of the items (sandbox order: two meters could deadlock).
CREATE OR REPLACE FUNCTION meter_flush(items jsonb, card text) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    it jsonb;
    n integer := 0;
    ws timestamptz;
BEGIN
    PERFORM ledger_lock_tenants(ARRAY(SELECT DISTINCT e->>'tenant'
                                      FROM jsonb_array_elements(items) e
                                      WHERE (e->>'ucr')::bigint > 0));
    FOR it IN SELECT * FROM jsonb_array_elements(items) LOOP
        ws := to_timestamp((it->>'ws')::bigint);
        INSERT INTO usage_windows (sandbox_id, generation, window_start, window_end, tenant_id,
                                   cpu_ns, mem_byte_s, rx_bytes, tx_bytes, ucr, rate_card)
        VALUES (it->>'sb', (it->>'gen')::bigint, ws, to_timestamp((it->>'we')::bigint),
                it->>'tenant', (it->>'cpu')::bigint, (it->>'mem_bs')::bigint,
                (it->>'rx')::bigint, (it->>'tx')::bigint, (it->>'ucr')::bigint, card)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        n := n + 1;
        PERFORM ledger_draw(it->>'tenant', (it->>'ucr')::bigint,
                            'usage:' || (it->>'sb') || ':' || (it->>'gen') || ':' || (it->>'ws'),
                            it->>'sb', to_timestamp((it->>'ps')::numeric / 1e9),
                            to_timestamp((it->>'pe')::numeric / 1e9), card);
        INSERT INTO meter_sandboxes AS m (sandbox_id, tenant_id, node_id, generation, state,
                                          last_t_ns, cpu_ns, rx_bytes, tx_bytes, remainder_fine)
        VALUES (it->>'sb', it->>'tenant', it->>'node', (it->>'gen')::bigint, it->>'state',
                (it->>'t')::bigint, (it->>'cpu_at')::bigint, (it->>'rx_at')::bigint,
                (it->>'tx_at')::bigint, (it->>'rem')::bigint)
        ON CONFLICT (sandbox_id) DO UPDATE SET
            tenant_id = EXCLUDED.tenant_id, node_id = EXCLUDED.node_id,
            generation = EXCLUDED.generation, state = EXCLUDED.state,
            last_t_ns = EXCLUDED.last_t_ns, cpu_ns = EXCLUDED.cpu_ns,
            rx_bytes = EXCLUDED.rx_bytes, tx_bytes = EXCLUDED.tx_bytes,
            remainder_fine = EXCLUDED.remainder_fine, updated_at = now()
        WHERE m.generation < EXCLUDED.generation
           OR (m.generation = EXCLUDED.generation AND m.last_t_ns <= EXCLUDED.last_t_ns);
    END LOOP;
    RETURN n;
END $$;

-- ledger_expire_grants() of 0004, taking the ledger locks of every tenant with a grant due first,
-- in the global order, instead of one by one in expiry order.
CREATE OR REPLACE FUNCTION ledger_expire_grants(at timestamptz) RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    g record;
    bal bigint;
    amt bigint;
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
        -- Taken above (a grant made since with an expiry already due cannot be: grants must
        -- expire in the future), so this only waits if it was not.
        PERFORM pg_advisory_xact_lock(hashtext('ledger:' || g.tenant_id));
        CONTINUE WHEN EXISTS (SELECT 1 FROM grant_expiries e WHERE e.account_id = g.id);
        SELECT coalesce(sum(balance_ucr), 0) INTO bal FROM ledger_account_balances
        WHERE tenant_id = g.tenant_id;
        SELECT least(balance_ucr, greatest(bal, 0)) INTO amt FROM ledger_account_balances
        WHERE account_id = g.id;
        amt := greatest(coalesce(amt, 0), 0);
        INSERT INTO grant_expiries (account_id, amount_ucr) VALUES (g.id, amt);
        IF amt > 0 THEN
            INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account,
                                          amount_ucr, tenant_id, reason)
            VALUES (kiln_new_id('tx_'), 'expiry:' || g.id, 'expiry', g.id, 'system:expired', amt,
                    g.tenant_id, 'grant expired');
            RETURN NEXT g.tenant_id;
        END IF;
    END LOOP;
END $$;
