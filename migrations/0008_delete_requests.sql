-- 0008_delete_requests: a delete the gateway could not hand to the sandbox's node because the
-- node was down (its heartbeat stale). The gateway records the request here and never writes the
-- sandbox's state; the node carries the delete out when it comes back (node/recovery.c). Until
-- then the sandbox is shown as being deleted ("deleting": true).
ALTER TABLE sandboxes ADD COLUMN delete_requested_at timestamptz;
CREATE INDEX sandboxes_delete_requested ON sandboxes (node_id)
    WHERE delete_requested_at IS NOT NULL AND deleted_at IS NULL;

CREATE OR REPLACE FUNCTION sandbox_json(s sandboxes) RETURNS jsonb LANGUAGE sql STABLE AS $$
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
        'parent_id', s.parent_id,
        'deleting', s.delete_requested_at IS NOT NULL)
$$;
