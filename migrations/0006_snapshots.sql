-- 0006_snapshots: memory + disk snapshots (pause, fork, named) and what each sandbox's disk and
-- memory still depend on.

CREATE TABLE snapshots (
    id              text PRIMARY KEY,             -- snap_…
    tenant_id       text NOT NULL REFERENCES tenants(id),
    sandbox_id      text NOT NULL,                -- the sandbox it was taken of
    node_id         text REFERENCES nodes(id),    -- where its files are
    kind            text NOT NULL CHECK (kind IN ('pause', 'fork', 'named')),
    name            text,
    size_bytes      bigint NOT NULL DEFAULT 0,
    storage         text NOT NULL DEFAULT 'local',
    status          text NOT NULL DEFAULT 'local' CHECK (status IN ('local', 'uploading', 'stored', 'failed')),
    reason          text,
    vcpu_milli      integer NOT NULL,
    memory_mib      integer NOT NULL,
    disk_gib        integer NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    deleted_at      timestamptz                   -- gone for the API; files go when nothing uses them
);
CREATE INDEX snapshots_tenant ON snapshots (tenant_id, created_at DESC, id) WHERE deleted_at IS NULL;

-- The snapshots whose frozen files (disk layers, a privately mapped memory image) a sandbox's VM
-- stands on; a snapshot's files are removed only when no live sandbox lists it.
ALTER TABLE sandboxes ADD COLUMN lineage text[] NOT NULL DEFAULT '{}';
-- The snapshot a paused sandbox resumes from.
ALTER TABLE sandboxes ADD COLUMN pause_snapshot text;

CREATE FUNCTION snapshot_json(s snapshots) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', s.id,
        'sandbox_id', s.sandbox_id,
        'name', s.name,
        'size_bytes', s.size_bytes,
        'storage', s.storage,
        'status', s.status,
        'reason', s.reason,
        'created_at', rfc3339(s.created_at))
$$;

-- What a snapshot's own files stand on (a named snapshot's disk layer has its sandbox's chain
-- below it), and when its files were removed.
ALTER TABLE snapshots ADD COLUMN lineage text[] NOT NULL DEFAULT '{}';
ALTER TABLE snapshots ADD COLUMN purged_at timestamptz;
