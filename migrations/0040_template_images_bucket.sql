-- 0040_template_images_bucket: a template version's warm image in the tenant's bucket
-- (docs/templates.md, "The image in the tenant's bucket"). The image is a snapshot of kind
-- 'build'; when the tenant has a bucket it is uploaded like any snapshot (its row's storage,
-- status and reason say how that went), and a node that creates or builds from it without
-- having it fetches it once and keeps a copy, recorded here.

-- The nodes holding a fetched copy of another node's snapshot (today: template images). The
-- copy's files go with the snapshot (snap_gc on that node), and the row with them.
CREATE TABLE snapshot_copies (
    snapshot_id  text NOT NULL REFERENCES snapshots(id),
    node_id      text NOT NULL,
    fetched_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (snapshot_id, node_id)
);
CREATE INDEX snapshot_copies_node ON snapshot_copies (node_id);

-- Whether `node` holds the files of snapshot `snap`: the node that took it (until purged) or one
-- with a copy.
CREATE FUNCTION snapshot_held(snap text, node text) RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM snapshots s WHERE s.id = snap AND s.node_id = node
                   AND s.purged_at IS NULL)
        OR EXISTS (SELECT 1 FROM snapshot_copies c WHERE c.snapshot_id = snap AND c.node_id = node)
$$;

-- A version shows where its image is kept: image_status local (on its node only: the tenant has
-- no bucket), uploading, stored (in the bucket: any node creates from it) or failed (on its node
-- only, image_reason says why); NULL until the version is ready.
CREATE OR REPLACE FUNCTION template_version_json(v template_versions) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'version', v.version,
        'vcpus', (v.vcpu_milli::float8 / 1000),
        'memory_mib', v.memory_mib,
        'disk_gib', v.disk_gib,
        'start_cmd', v.start_cmd,
        'ready_cmd', v.ready_cmd,
        'egress', v.egress,
        'status', v.status,
        'reason', v.reason,
        'env', v.env,
        'workdir', v.workdir,
        'user', v.run_user,
        'image_status', (SELECT s.status FROM snapshots s WHERE s.id = v.snapshot_id
                         AND v.status = 'ready'),
        'image_reason', (SELECT s.reason FROM snapshots s WHERE s.id = v.snapshot_id
                         AND v.status = 'ready'),
        'created_at', rfc3339(v.created_at),
        'started_at', rfc3339(v.started_at),
        'finished_at', rfc3339(v.finished_at))
$$;
