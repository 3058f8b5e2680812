-- 0002_sandboxes: the nodes that run VMs and the sandboxes they run.

CREATE TABLE nodes (
    id              text PRIMARY KEY,
    address         text NOT NULL,               -- how gateways reach it: unix:/path or http://host:port
    vcpu_milli      integer NOT NULL,            -- capacity
    memory_mib      integer NOT NULL,
    max_sandboxes   integer NOT NULL,
    hypervisor      text NOT NULL,
    accelerator     text NOT NULL,
    image_hash      text NOT NULL,
    started_at      timestamptz NOT NULL DEFAULT now(),
    heartbeat_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE sandboxes (
    id              text PRIMARY KEY,            -- sb_…
    tenant_id       text NOT NULL REFERENCES tenants(id),
    node_id         text REFERENCES nodes(id),
    state           text NOT NULL CHECK (state IN ('creating', 'running', 'paused', 'stopped', 'error')),
    template        text NOT NULL,
    vcpu_milli      integer NOT NULL,
    memory_mib      integer NOT NULL,
    disk_gib        integer NOT NULL,
    timeout_s       integer NOT NULL,
    metadata        jsonb NOT NULL DEFAULT '{}',
    parent_id       text,
    generation      bigint NOT NULL DEFAULT 1,   -- bumped on every restore or move (fencing)
    net_index       integer,                     -- the node's network slot while it has one
    error           text,                        -- why it is in state error
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    state_changed_at timestamptz NOT NULL DEFAULT now(),
    deleted_at      timestamptz                  -- set by DELETE: the sandbox is gone for the API
);
CREATE INDEX sandboxes_tenant ON sandboxes (tenant_id, created_at DESC, id) WHERE deleted_at IS NULL;
CREATE INDEX sandboxes_node ON sandboxes (node_id) WHERE deleted_at IS NULL;
CREATE UNIQUE INDEX sandboxes_net_slot ON sandboxes (node_id, net_index)
    WHERE net_index IS NOT NULL AND deleted_at IS NULL;

-- A sandbox as the public API shows it; the gateway and the node both render it from here.
CREATE FUNCTION sandbox_json(s sandboxes) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', s.id,
        'state', s.state,
        'template', s.template,
        'vcpus', (s.vcpu_milli::float8 / 1000),
        'memory_mib', s.memory_mib,
        'disk_gib', s.disk_gib,
        'node', s.node_id,
        'created_at', rfc3339(s.created_at),
        'expires_at', rfc3339(s.expires_at),
        'timeout_s', s.timeout_s,
        'metadata', s.metadata,
        'parent_id', s.parent_id)
$$;
