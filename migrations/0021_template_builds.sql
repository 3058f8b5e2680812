-- 0021_template_builds: builds of template versions (docs/templates.md). A version's Dockerfile is
-- uploaded first (parsed by the gateway), then its build context; the build runs on one node in a
-- builder sandbox of the tenant, its log kept in template_build_log, and ends with the version's
-- warm image, a snapshot of kind 'build' (restored copy-on-write for every create from it).

ALTER TABLE template_versions
    ADD COLUMN dockerfile  text,                  -- as uploaded; NULL until then
    ADD COLUMN node_id     text,                  -- the node that builds it (and holds its image)
    ADD COLUMN builder_id  text,                  -- the builder sandbox while it builds
    ADD COLUMN env         jsonb,                 -- ENV of the built image: {"K": "v"}
    ADD COLUMN workdir     text,
    ADD COLUMN run_user    text,
    ADD COLUMN started_at  timestamptz;

-- A version's warm image: a snapshot of the tenant (never listed as a named one).
ALTER TABLE snapshots DROP CONSTRAINT snapshots_kind_check;
ALTER TABLE snapshots ADD CONSTRAINT snapshots_kind_check
    CHECK (kind IN ('pause', 'fork', 'named', 'template', 'build'));

-- The build log, in the order written (capped by the node at template_build_log_max_bytes).
CREATE TABLE template_build_log (
    seq          bigserial PRIMARY KEY,
    template_id  text NOT NULL,
    version      integer NOT NULL,
    at           timestamptz NOT NULL DEFAULT now(),
    chunk        text NOT NULL,
    FOREIGN KEY (template_id, version) REFERENCES template_versions (template_id, version)
);
CREATE INDEX template_build_log_version ON template_build_log (template_id, version, seq);

-- Moves a pending version with a Dockerfile to building on `node`, unless the tenant already has
-- `max_builds` builds running: then returns `quota`, a message naming the limit, and changes
-- nothing. `state` is the version's status before (NULL: no such version of the tenant).
CREATE FUNCTION template_build_start(tenant text, tid text, ver integer, node text,
                                     max_builds integer, OUT state text, OUT quota text)
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
    has_df boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('templates:' || tenant));
    SELECT v.status, v.dockerfile IS NOT NULL INTO state, has_df
    FROM template_versions v JOIN templates t ON t.id = v.template_id
    WHERE t.tenant_id = tenant AND t.id = tid AND v.version = ver AND t.deleted_at IS NULL;
    IF state IS NULL OR state <> 'pending' OR NOT has_df THEN
        RETURN;
    END IF;
    SELECT count(*) INTO n FROM template_versions v JOIN templates t ON t.id = v.template_id
    WHERE t.tenant_id = tenant AND v.status = 'building';
    IF n >= max_builds THEN
        quota := format('the tenant has %s template builds running, the limit (template_max_builds)', n);
        RETURN;
    END IF;
    UPDATE template_versions SET status = 'building', node_id = node, started_at = now(),
                                 reason = NULL
    WHERE template_id = tid AND version = ver;
END $$;

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
        'created_at', rfc3339(v.created_at),
        'started_at', rfc3339(v.started_at),
        'finished_at', rfc3339(v.finished_at))
$$;
