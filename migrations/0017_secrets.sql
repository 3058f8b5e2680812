-- 0017_secrets: secrets a sandbox may use without holding them (PUT /v1/sandboxes/{id}/secrets),
-- and each tenant's CA, whose certificates the injecting proxy shows the sandbox for those hosts
-- (node/inject.c, docs/network-policy.md "Secrets").
--
-- A secret's value is sealed with the master key (auth_seal), its associated data
-- "secret:<tenant>:<sandbox>:<host>:<header>" binding it to its row: a sealed value copied to
-- another tenant, sandbox, host or header does not open. Only kiln-node opens them, into memory.
-- The CA's private key is sealed the same way, bound to "tenant-ca:<tenant>".

CREATE TABLE sandbox_secrets (
    sandbox_id    text NOT NULL,
    tenant_id     text NOT NULL REFERENCES tenants(id),
    host          text NOT NULL,               -- an exact host rule of the sandbox, lowercase
    header        text NOT NULL,               -- as the tenant spelt it
    value_sealed  text NOT NULL,               -- k1.… (auth_seal)
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sandbox_id, host, header)
);
CREATE INDEX sandbox_secrets_tenant ON sandbox_secrets (tenant_id);

CREATE TABLE tenant_ca (
    tenant_id     text PRIMARY KEY REFERENCES tenants(id),
    cert_pem      text NOT NULL,               -- the CA's certificate (the guests get it)
    key_sealed    text NOT NULL,               -- k1.… its private key (PKCS#8 PEM), sealed
    created_at    timestamptz NOT NULL DEFAULT now()
);
