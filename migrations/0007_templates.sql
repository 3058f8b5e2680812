-- 0007_templates: pre-booted templates that new sandboxes are restored from. A template belongs
-- to its node, not to a tenant; sandboxes made from one list it in their lineage.
ALTER TABLE snapshots DROP CONSTRAINT snapshots_kind_check;
ALTER TABLE snapshots ADD CONSTRAINT snapshots_kind_check
    CHECK (kind IN ('pause', 'fork', 'named', 'template'));
ALTER TABLE snapshots ALTER COLUMN tenant_id DROP NOT NULL;
ALTER TABLE snapshots ADD CONSTRAINT snapshots_tenant_unless_template
    CHECK (kind = 'template' OR tenant_id IS NOT NULL);
ALTER TABLE snapshots ADD COLUMN image_hash text;
