-- 0027_template_layers: the layer cache of template builds (docs/templates.md, "Layer cache").
-- Each Dockerfile step that changes the builder's disk (RUN, COPY, ADD, WORKDIR) leaves the
-- builder's memory and disk as a snapshot of kind 'build' (its disk a qcow2 layer on the step
-- before's); `key` is the SHA-256 of the parent's key, the instruction with the ENV, ARG, USER and
-- WORKDIR in effect, and the hash of the context files it reads. A rebuild restores the deepest
-- step whose key it finds, of the same tenant on the same node. The snapshot is kept (deleted_at
-- NULL): it counts against the tenant's max_snapshot_bytes. Deleting the template that made a
-- layer deletes the layer (its files go once nothing stands on them).
CREATE TABLE template_layers (
    tenant_id    text NOT NULL,
    node_id      text NOT NULL,
    key          text NOT NULL CHECK (key ~ '^[0-9a-f]{64}$'),
    snapshot_id  text NOT NULL,
    template_id  text NOT NULL,        -- the template whose build made it
    created_at   timestamptz NOT NULL DEFAULT now(),
    used_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, node_id, key)
);
CREATE INDEX template_layers_template ON template_layers (template_id);
CREATE INDEX template_layers_lru ON template_layers (tenant_id, used_at);
