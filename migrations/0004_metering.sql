-- 0004_metering: what kiln-meter keeps beside the ledger of 0001: rate cards, plan limits, the
-- running balance of every tenant account, each sandbox's billed-up-to point (counters and the
-- sub-µcr remainder), usage per sandbox and billing window, and grant expiries. The ledger's
-- transfers stay append-only; everything here is derived from them or written in the same
-- transaction as them.

-- Usage beyond every grant is drawn from the tenant's overdraft account (balance below zero).
ALTER TABLE ledger_accounts DROP CONSTRAINT ledger_accounts_kind_check;
ALTER TABLE ledger_accounts ADD CONSTRAINT ledger_accounts_kind_check
    CHECK (kind IN ('system', 'grant', 'overdraft'));

CREATE INDEX ledger_transfers_debit ON ledger_transfers (debit_account);
CREATE INDEX ledger_transfers_credit ON ledger_transfers (credit_account);
-- Grants and expiries of a tenant without reading its every usage charge.
CREATE INDEX ledger_transfers_tenant_kind ON ledger_transfers (tenant_id, kind, seq);

-- The balance of each tenant-owned account (grant:…, overdraft:…), kept by a trigger on every
-- transfer, so drawing earliest-expiry first never sums a grant's history. System accounts are
-- left out: every usage charge would otherwise update the one row of system:revenue.
CREATE TABLE ledger_account_balances (
    account_id  text PRIMARY KEY REFERENCES ledger_accounts(id),
    tenant_id   text NOT NULL,
    balance_ucr bigint NOT NULL
);
CREATE INDEX ledger_account_balances_tenant ON ledger_account_balances (tenant_id);

CREATE FUNCTION ledger_account_balance_apply() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.credit_account NOT LIKE 'system:%' THEN
        INSERT INTO ledger_account_balances AS b (account_id, tenant_id, balance_ucr)
        SELECT a.id, a.tenant_id, NEW.amount_ucr FROM ledger_accounts a WHERE a.id = NEW.credit_account
        ON CONFLICT (account_id) DO UPDATE SET balance_ucr = b.balance_ucr + NEW.amount_ucr;
    END IF;
    IF NEW.debit_account NOT LIKE 'system:%' THEN
        INSERT INTO ledger_account_balances AS b (account_id, tenant_id, balance_ucr)
        SELECT a.id, a.tenant_id, -NEW.amount_ucr FROM ledger_accounts a WHERE a.id = NEW.debit_account
        ON CONFLICT (account_id) DO UPDATE SET balance_ucr = b.balance_ucr - NEW.amount_ucr;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER ledger_transfers_balances AFTER INSERT ON ledger_transfers
    FOR EACH ROW EXECUTE FUNCTION ledger_account_balance_apply();

-- Balances of the transfers made before this migration.
INSERT INTO ledger_account_balances (account_id, tenant_id, balance_ucr)
SELECT a.id, a.tenant_id,
       coalesce((SELECT sum(amount_ucr) FROM ledger_transfers WHERE credit_account = a.id), 0) -
       coalesce((SELECT sum(amount_ucr) FROM ledger_transfers WHERE debit_account = a.id), 0)
FROM ledger_accounts a WHERE a.kind <> 'system';

-- Prices, versioned: every usage transfer names the card it was priced with.
CREATE TABLE rate_cards (
    version                 text PRIMARY KEY,
    cpu_ucr_per_cpu_s       bigint NOT NULL,   -- per CPU-second of measured use
    mem_ucr_per_gib_s       bigint NOT NULL,   -- per GiB-second of allocated memory, running
    disk_ucr_per_gib_s      bigint NOT NULL,   -- per GiB-second of allocated disk, running
    snapshot_ucr_per_gib_s  bigint NOT NULL,   -- per GiB-second of a paused sandbox's snapshot
    created_at              timestamptz NOT NULL DEFAULT now()
);

-- Limits per plan (tenants.plan); the row 'default' serves plans without a row of their own and
-- is written by kiln-meter from its plan_* settings.
CREATE TABLE plan_limits (
    plan            text PRIMARY KEY,
    max_sandboxes   integer NOT NULL,   -- creating or running at once
    max_vcpu_milli  integer NOT NULL,   -- thousandths of a vCPU, creating or running
    max_memory_mib  integer NOT NULL,
    max_snapshot_bytes bigint NOT NULL
);
INSERT INTO plan_limits VALUES ('default', 10, 16000, 32768, 53687091200);

-- Each sandbox's billed-up-to point: everything before last_t is in the ledger. cpu_ns, rx and
-- tx are the cumulative counters of `generation` at last_t; remainder_fine is the part of a µcr
-- not charged yet, in units of 1/(1e9 * 1024) µcr (see metering/price.h), never rounded away.
CREATE TABLE meter_sandboxes (
    sandbox_id      text PRIMARY KEY,
    tenant_id       text NOT NULL,
    node_id         text NOT NULL,
    generation      bigint NOT NULL,
    state           text NOT NULL,               -- as billed at last_t: running or paused
    last_t_ns       bigint NOT NULL,             -- ns since the epoch
    cpu_ns          bigint NOT NULL,
    rx_bytes        bigint NOT NULL,
    tx_bytes        bigint NOT NULL,
    remainder_fine  bigint NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX meter_sandboxes_node ON meter_sandboxes (node_id);

-- Usage of one sandbox generation over one aligned billing window; its primary key is what
-- makes a replayed flush charge nothing. GET /v1/usage sums these by day.
CREATE TABLE usage_windows (
    sandbox_id      text NOT NULL,
    generation      bigint NOT NULL,
    window_start    timestamptz NOT NULL,
    window_end      timestamptz NOT NULL,
    tenant_id       text NOT NULL,
    cpu_ns          bigint NOT NULL,
    mem_byte_s      bigint NOT NULL,             -- memory allocated times seconds running
    rx_bytes        bigint NOT NULL,
    tx_bytes        bigint NOT NULL,
    ucr             bigint NOT NULL,
    rate_card       text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sandbox_id, generation, window_start)
);
CREATE INDEX usage_windows_tenant ON usage_windows (tenant_id, window_start);

-- Grants whose expiry was handled (an expiry transfer, or nothing left to expire).
CREATE TABLE grant_expiries (
    account_id  text PRIMARY KEY REFERENCES ledger_accounts(id),
    amount_ucr  bigint NOT NULL,
    done_at     timestamptz NOT NULL DEFAULT now()
);

-- An id as auth_new_id() makes them: prefix + 26 base32 characters of 128 random bits.
CREATE FUNCTION kiln_new_id(prefix text) RETURNS text LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    alpha constant text := 'abcdefghijklmnopqrstuvwxyz234567';
    b bytea := decode(replace(gen_random_uuid()::text, '-', ''), 'hex');
    out text := prefix;
    acc bigint := 0;
    bits int := 0;
BEGIN
    FOR i IN 0..15 LOOP
        acc := ((acc << 8) | get_byte(b, i)) & 65535;
        bits := bits + 8;
        WHILE bits >= 5 LOOP
            out := out || substr(alpha, ((acc >> (bits - 5)) & 31)::int + 1, 1);
            bits := bits - 5;
        END LOOP;
    END LOOP;
    IF bits > 0 THEN
        out := out || substr(alpha, ((acc << (5 - bits)) & 31)::int + 1, 1);
    END IF;
    RETURN out;
END $$;

-- Charges `amount` µcr of usage to `tenant`, drawn from its grants earliest expiry first (grants
-- still valid at `period_start`), the rest from its overdraft account: one transfer per account,
-- the first keyed `idem`, the next `idem:2`, `idem:3`... Returns the number of transfers.
CREATE FUNCTION ledger_draw(tenant text, amount bigint, idem text, sandbox text,
                            period_start timestamptz, period_end timestamptz, card text)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    left_ucr bigint := amount;
    part bigint;
    n integer := 0;
    g record;
    od text := 'overdraft:' || tenant;
BEGIN
    IF amount <= 0 THEN
        RETURN 0;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('ledger:' || tenant));
    FOR g IN
        SELECT a.id, b.balance_ucr FROM ledger_accounts a
        JOIN ledger_account_balances b ON b.account_id = a.id
        WHERE a.tenant_id = tenant AND a.kind = 'grant' AND b.balance_ucr > 0
          AND (a.expires_at IS NULL OR a.expires_at > period_start)
          AND NOT EXISTS (SELECT 1 FROM grant_expiries e WHERE e.account_id = a.id)
        ORDER BY a.expires_at ASC NULLS LAST, a.created_at, a.id
    LOOP
        EXIT WHEN left_ucr = 0;
        part := least(left_ucr, g.balance_ucr);
        n := n + 1;
        INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account,
                                      amount_ucr, tenant_id, sandbox_id, period_start, period_end,
                                      rate_card)
        VALUES (kiln_new_id('tx_'), CASE WHEN n = 1 THEN idem ELSE idem || ':' || n END, 'usage',
                g.id, 'system:revenue', part, tenant, sandbox, period_start, period_end, card);
        left_ucr := left_ucr - part;
    END LOOP;
    IF left_ucr > 0 THEN
        INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES (od, tenant, 'overdraft')
        ON CONFLICT (id) DO NOTHING;
        n := n + 1;
        INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account,
                                      amount_ucr, tenant_id, sandbox_id, period_start, period_end,
                                      rate_card)
        VALUES (kiln_new_id('tx_'), CASE WHEN n = 1 THEN idem ELSE idem || ':' || n END, 'usage',
                od, 'system:revenue', left_ucr, tenant, sandbox, period_start, period_end, card);
    END IF;
    RETURN n;
END $$;

-- One flush of kiln-meter: `items` is a JSON array with one object per sandbox window
-- (sb, tenant, node, gen, ws, we: window start/end in s; ps, pe: the billed period in ns; ucr,
-- cpu, mem_bs, rx, tx: the window's usage; state, t, cpu_at, rx_at, tx_at, rem: the billed-up-to
-- point after it). A window already recorded is skipped whole. Returns the windows charged.
CREATE FUNCTION meter_flush(items jsonb, card text) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    it jsonb;
    n integer := 0;
    ws timestamptz;
BEGIN
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

-- Expires the grants whose time came by `at`: what is left of each, but never more than the
-- tenant's positive balance (a tenant in overdraft keeps its debt), moves to system:expired.
-- Returns the tenants whose balance changed.
CREATE FUNCTION ledger_expire_grants(at timestamptz) RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    g record;
    bal bigint;
    amt bigint;
BEGIN
    FOR g IN
        SELECT a.id, a.tenant_id FROM ledger_accounts a
        WHERE a.kind = 'grant' AND a.expires_at IS NOT NULL AND a.expires_at <= at
          AND NOT EXISTS (SELECT 1 FROM grant_expiries e WHERE e.account_id = a.id)
        ORDER BY a.expires_at, a.id
    LOOP
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
