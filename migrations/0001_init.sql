-- 0001_init: tenants, API keys, signing keys, the ledger, the audit trail, idempotency records.

CREATE TABLE tenants (
    id          text PRIMARY KEY,                 -- tn_…
    name        text NOT NULL,
    plan        text NOT NULL DEFAULT 'free',
    operator    boolean NOT NULL DEFAULT false,   -- the operator's own tenant (admin keys)
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_keys (
    id           text PRIMARY KEY,                -- key_…
    tenant_id    text NOT NULL REFERENCES tenants(id),
    name         text NOT NULL,
    prefix       text NOT NULL,                   -- shown in listings, never the secret
    secret_hash  text NOT NULL,                   -- hex digest of the secret
    scopes       text NOT NULL,                   -- space-separated
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz,
    last_used_at timestamptz,
    revoked_at   timestamptz
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id, created_at);

-- JWT signing keys shared by every gateway; the private key is sealed with the master key.
CREATE TABLE signing_keys (
    kid             text PRIMARY KEY,
    private_sealed  text NOT NULL,
    public_pem      text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    retired_at      timestamptz                  -- no longer signs; verifies until tokens expire
);

-- The ledger: append-only transfers between accounts. A tenant's credits sit in grant accounts
-- (one per grant, with its expiry); system accounts are the other side of every transfer.
CREATE TABLE ledger_accounts (
    id          text PRIMARY KEY,                 -- system:<name> or grant:<tx id>
    tenant_id   text REFERENCES tenants(id),
    kind        text NOT NULL CHECK (kind IN ('system', 'grant')),
    expires_at  timestamptz,
    created_at  timestamptz NOT NULL DEFAULT now()
);
INSERT INTO ledger_accounts (id, kind) VALUES
    ('system:issuance', 'system'), ('system:revenue', 'system'), ('system:expired', 'system');

CREATE TABLE ledger_transfers (
    seq             bigserial PRIMARY KEY,
    id              text NOT NULL UNIQUE,         -- tx_…
    idem_key        text NOT NULL UNIQUE,         -- what it bills: a replay never charges twice
    kind            text NOT NULL,                -- grant, usage, expiry
    debit_account   text NOT NULL REFERENCES ledger_accounts(id),
    credit_account  text NOT NULL REFERENCES ledger_accounts(id),
    amount_ucr      bigint NOT NULL CHECK (amount_ucr > 0),
    tenant_id       text REFERENCES tenants(id),
    sandbox_id      text,
    period_start    timestamptz,
    period_end      timestamptz,
    rate_card       text,
    reason          text,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ledger_transfers_tenant ON ledger_transfers (tenant_id, seq);

CREATE FUNCTION ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'ledger_transfers is append-only';
END $$;
CREATE TRIGGER ledger_transfers_append_only BEFORE UPDATE OR DELETE ON ledger_transfers
    FOR EACH ROW EXECUTE FUNCTION ledger_append_only();

CREATE TABLE audit_log (
    seq         bigserial PRIMARY KEY,
    tenant_id   text NOT NULL,
    key_id      text,
    method      text NOT NULL,
    route       text NOT NULL,
    object_id   text,
    status      integer NOT NULL,
    request_id  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX audit_log_tenant ON audit_log (tenant_id, seq DESC);

CREATE TABLE idempotency (
    tenant_id   text NOT NULL,
    key         text NOT NULL,
    method      text NOT NULL,
    path        text NOT NULL,
    body_sha256 text NOT NULL,
    status      integer,                          -- NULL while the first request runs
    response    text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, key)
);

-- RFC 3339 UTC text of a time, as the API shows it; NULL stays NULL.
CREATE FUNCTION rfc3339(t timestamptz) RETURNS text LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
$$;
