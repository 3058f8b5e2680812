-- 0054_meter_tick_indexes: what kiln-meter's tick looks up every second (metering/meter.c,
-- rows_sql), by index, so that its cost follows the node's live sandboxes and not the history
-- of the deployment: a node's deleted sandboxes changed or deleted since a time (greatest()
-- of the two), and the billed-up-to points not at their generation's end (state other than
-- 'none'). Before, the tick's query read every sandbox ever made, on any node, and joined each
-- to its points before it could drop it.
CREATE INDEX sandboxes_node_changed ON sandboxes (node_id, (greatest(state_changed_at, deleted_at)));
CREATE INDEX meter_sandboxes_open ON meter_sandboxes (sandbox_id) WHERE state <> 'none';
