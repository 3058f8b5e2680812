-- 0019_node_down: nodes marked down when their heartbeat lapses, the sandboxes they ran reported
-- lost, and nodes drained of their sandboxes (docs/operations.md, Many hosts).
--
-- nodes.down_at is set once, by whoever sees the lapse first (a gateway, another node), in one
-- statement with row locks (nodes_mark_down): two that see it at once mark it once. The node
-- clears it with its next heartbeat, after it fenced off (stopped and discarded) the VMs of every
-- sandbox that is no longer its own at the generation it holds (node/main.c).
-- nodes.drain_at: no new placement on the node (POST /v1/admin/nodes/{id}/drain).
ALTER TABLE nodes ADD COLUMN down_at timestamptz;
ALTER TABLE nodes ADD COLUMN drain_at timestamptz;

-- `lost`: the sandbox ran on a node that went down; its VM and memory are gone with that node
-- (`error` holds the reason, node_down). It is never resumed, only deleted.
ALTER TABLE sandboxes DROP CONSTRAINT sandboxes_state_check;
ALTER TABLE sandboxes ADD CONSTRAINT sandboxes_state_check
    CHECK (state IN ('creating', 'running', 'paused', 'stopped', 'error', 'lost'));

-- Marks every node whose heartbeat is older than `after_s` seconds down, and its sandboxes that
-- were running (or being created) lost with the reason node_down, their network slot given back.
-- The time of the change (state_changed_at, hence sandbox_state_log's row, hence billing's end) is
-- the node's last heartbeat, or the point its meter already billed the generation to when that
-- is later (a meter that outlived its node's heartbeat): nothing is billed past it and nothing
-- billed is undone. Returns the nodes it marked. Idempotent: a node already down is skipped, and
-- a second caller waits on the first one's row locks, then finds the node down.
CREATE FUNCTION nodes_mark_down(after_s integer) RETURNS SETOF text LANGUAGE sql AS $$
    WITH d AS (
        UPDATE nodes SET down_at = now()
        WHERE down_at IS NULL AND heartbeat_at < now() - make_interval(secs => after_s)
        RETURNING id, heartbeat_at
    ), l AS (
        UPDATE sandboxes s SET state = 'lost', error = 'node_down', net_index = NULL,
            state_changed_at = greatest(d.heartbeat_at, s.state_changed_at,
                (SELECT to_timestamp(max(m.last_t_ns) / 1e9) FROM meter_sandboxes m
                 WHERE m.sandbox_id = s.id AND m.generation = s.generation))
        FROM d
        WHERE s.node_id = d.id AND s.deleted_at IS NULL AND s.state IN ('creating', 'running')
        RETURNING s.id
    )
    SELECT id FROM d
$$;

-- The lost reason in the API's sandbox (sandbox_json of 0008, plus lost_reason when lost).
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
        || CASE WHEN s.state = 'lost' THEN jsonb_build_object('lost_reason', s.error)
           ELSE '{}'::jsonb END
$$;
