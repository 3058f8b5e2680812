-- 0029_node_stopped: a cleanly stopped node leaves placement at once (docs/operations.md,
-- "Many hosts: nodes").
--
-- nodes.stopped_at: set by kiln-node's clean stop before it pauses its sandboxes; no create,
-- move or build is placed on the node while it is set (api/gateway.h GW_NODE_LIVE_SQL). The
-- node's first heartbeat after a start clears it. A node killed instead leaves it NULL and is
-- marked down when its heartbeat lapses, as before.
ALTER TABLE nodes ADD COLUMN stopped_at timestamptz;
