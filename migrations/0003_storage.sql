-- 0003_storage: each tenant's own snapshot bucket (PUT /v1/storage). The secret access key is
-- sealed with the master key (auth_seal), bound to the tenant id: it is never stored in clear.

CREATE TABLE tenant_storage (
    tenant_id       text PRIMARY KEY REFERENCES tenants(id),
    kind            text NOT NULL CHECK (kind IN ('s3')),
    endpoint        text NOT NULL,               -- http(s)://host[:port][/path], path-style
    bucket          text NOT NULL,
    region          text NOT NULL,
    prefix          text NOT NULL DEFAULT '',    -- prepended to every object key
    access_key_id   text NOT NULL,
    secret_sealed   text NOT NULL,               -- k1.… (auth_seal, associated data "storage:<tenant>")
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
