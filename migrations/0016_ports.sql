-- Ports a tenant made public (docs/ports.md): a public port of a sandbox answers on its port URL
-- without a credential. Opt-in per port; a port without a row (or with public false) is private.
-- The rows go with their sandbox.
CREATE TABLE sandbox_ports (
    sandbox_id  text NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    port        integer NOT NULL CHECK (port BETWEEN 1 AND 65535),
    public      boolean NOT NULL DEFAULT false,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sandbox_id, port)
);

-- A sandbox's settings of the gateway's own (docs/ports.md): auto_resume, whether a request to
-- one of its port URLs resumes it while it is paused. Set by the create request or PATCH
-- /v1/sandboxes/{id}; no row is the default (false). Keyed by the sandbox's id without a
-- foreign key: the gateway writes it before the node makes the sandbox's row.
CREATE TABLE sandbox_settings (
    sandbox_id   text PRIMARY KEY,
    auto_resume  boolean NOT NULL DEFAULT false,
    updated_at   timestamptz NOT NULL DEFAULT now()
);
