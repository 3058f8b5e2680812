-- 0045_audit_row_id: the id the gateway's commit queue gives an audit row before its group's first
-- attempt (api/commitq.c). A group is written again when its connection is lost, and the lost
-- attempt may have committed: the insert skips a row whose id is already there (ON CONFLICT DO
-- NOTHING), so a row is never recorded twice. Rows written otherwise (alone after their group
-- refused them, by the debt sweep, or before this migration) have none and are not in the index,
-- which is partial: its build reads the table once but writes nothing for the rows already there.
-- The ids start with the time in ms (api/commitq.c), so new entries go to the index's right edge.
ALTER TABLE audit_log ADD COLUMN row_id uuid;
CREATE UNIQUE INDEX audit_log_row_id ON audit_log (row_id) WHERE row_id IS NOT NULL;
