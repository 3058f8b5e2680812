-- 0013_debt: a tenant's balance may go below zero (debt), and grant expiry never forgives it.
--
-- kiln-meter charges every second at its price whatever the balance: what no grant covers is
-- drawn from the tenant's overdraft account (ledger_draw() of 0004), so balance = credits -
-- charges, negative while the tenant owes. A grant to a tenant in debt pays the debt first: its
-- account is credited whole, the overdraft stays, and the sum of the two is the balance.
--
-- billing_debts holds, for each tenant whose ledger balance is at or below zero, since when it
-- has been so without a break (kept by a trigger on every transfer: the first transfer that takes
-- the balance to zero or below starts the period, any transfer that takes it above zero ends it).
-- The gateway shows it (GET /v1/billing/balance: debt_since) and, when the operator set
-- snapshot_delete_after_zero_days, writes an audit event when the period starts (noticed_at)
-- and deletes the tenant's paused sandboxes once the period has lasted that long (api/debt.c,
-- docs/metering.md). A period that ends (a grant) deletes its row: nothing is deleted for it.

CREATE TABLE billing_debts (
    tenant_id   text PRIMARY KEY,
    since       timestamptz NOT NULL,
    seq         bigint NOT NULL,             -- the transfer that started the period
    noticed_at  timestamptz                  -- the gateway wrote the period's audit event
);

-- After the transfers of a statement (the balances of 0004's row trigger are up to date): starts
-- or ends the period at/below zero of each tenant they touched.
CREATE FUNCTION billing_debts_apply() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- One statement: each touched tenant's balance summed once (its few accounts, by index).
    WITH t AS (
        SELECT tenant_id, max(seq) AS seq FROM new_rows
        WHERE tenant_id IS NOT NULL GROUP BY tenant_id
    ), b AS (
        SELECT t.tenant_id, t.seq,
               (SELECT coalesce(sum(x.balance_ucr), 0) FROM ledger_account_balances x
                WHERE x.tenant_id = t.tenant_id) AS bal
        FROM t
    ), started AS (
        INSERT INTO billing_debts (tenant_id, since, seq)
        SELECT tenant_id, now(), seq FROM b WHERE bal <= 0
        ON CONFLICT (tenant_id) DO NOTHING
    )
    DELETE FROM billing_debts d USING b WHERE d.tenant_id = b.tenant_id AND b.bal > 0;
    RETURN NULL;
END $$;
CREATE TRIGGER ledger_transfers_debts AFTER INSERT ON ledger_transfers
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION billing_debts_apply();

-- The tenants at or below zero now: their period starts now (when it began before this migration is
-- not known).
INSERT INTO billing_debts (tenant_id, since, seq)
SELECT b.tenant_id, now(), (SELECT max(seq) FROM ledger_transfers t WHERE t.tenant_id = b.tenant_id)
FROM ledger_account_balances b GROUP BY b.tenant_id HAVING sum(b.balance_ucr) <= 0;

-- ledger_expire_grants() of 0012, with what an expiry takes computed as of the grant's expiry
-- time. Before, it was the grant's balance but never more than the tenant's positive balance when
-- the expiry ran: windows after the expiry flushed before it (a meter or Postgres down, a late
-- expiry run) were drawn from the overdraft, which the expiry then left standing out of the
-- expired grant's credits. Now the tenant's balance as of the expiry counts only the usage of
-- windows that started before it (ledger_draw() no longer draws a grant for a window starting at
-- or after its expiry) and the grants made before it: an expired grant takes away its own
-- unspent credits (what is left after paying any debt it came to), never pays for later windows.
-- Both kinds of later transfers come after the grant's own (it was made before its expiry, under
-- the tenant's lock), so only the tenant's transfers since the grant are read.
CREATE OR REPLACE FUNCTION ledger_expire_grants(at timestamptz) RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    g record;
    bal bigint;
    later bigint;
    amt bigint;
BEGIN
    PERFORM ledger_lock_tenants(ARRAY(
        SELECT DISTINCT a.tenant_id FROM ledger_accounts a
        WHERE a.kind = 'grant' AND a.expires_at IS NOT NULL AND a.expires_at <= at
          AND NOT EXISTS (SELECT 1 FROM grant_expiries e WHERE e.account_id = a.id)));
    FOR g IN
        SELECT a.id, a.tenant_id, a.expires_at,
               coalesce((SELECT min(t.seq) FROM ledger_transfers t WHERE t.credit_account = a.id), 0)
                   AS gseq
        FROM ledger_accounts a
        WHERE a.kind = 'grant' AND a.expires_at IS NOT NULL AND a.expires_at <= at
          AND NOT EXISTS (SELECT 1 FROM grant_expiries e WHERE e.account_id = a.id)
        ORDER BY a.expires_at, a.id
    LOOP
        PERFORM pg_advisory_xact_lock(hashtext('ledger:' || g.tenant_id));
        CONTINUE WHEN EXISTS (SELECT 1 FROM grant_expiries e WHERE e.account_id = g.id);
        SELECT coalesce(sum(balance_ucr), 0) INTO bal FROM ledger_account_balances
        WHERE tenant_id = g.tenant_id;
        -- Usage of windows from the expiry on (charged since: add back) and grants made after
        -- the expiry (credited since: take off).
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
        IF amt > 0 THEN
            INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account,
                                          amount_ucr, tenant_id, reason)
            VALUES (kiln_new_id('tx_'), 'expiry:' || g.id, 'expiry', g.id, 'system:expired', amt,
                    g.tenant_id, 'grant expired');
            RETURN NEXT g.tenant_id;
        END IF;
    END LOOP;
END $$;
