-- 0018_user_templates: tenants' own templates (docs/templates.md). A template is a name of one
-- tenant; each POST /v1/templates of that name adds a version with its own shape, start and ready
-- commands and egress rules, built from the source uploaded for it. Sandboxes are created from the
-- latest ready version; a deleted template is gone for the API at once.

CREATE TABLE templates (
    id          text PRIMARY KEY,                 -- tmpl_…
    tenant_id   text NOT NULL REFERENCES tenants(id),
    name        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    deleted_at  timestamptz
);
-- One live template of a name per tenant; a deleted name may be taken again.
CREATE UNIQUE INDEX templates_live_name ON templates (tenant_id, name) WHERE deleted_at IS NULL;
CREATE INDEX templates_tenant ON templates (tenant_id, created_at DESC, id) WHERE deleted_at IS NULL;

CREATE TABLE template_versions (
    template_id  text NOT NULL REFERENCES templates(id),
    version      integer NOT NULL CHECK (version >= 1),
    vcpu_milli   integer NOT NULL,
    memory_mib   integer NOT NULL,
    disk_gib     integer NOT NULL,
    start_cmd    text,
    ready_cmd    text,
    egress       jsonb,                           -- NULL: open
    -- pending: waiting for its source; building; ready (snapshot_id is its warm image); failed.
    status       text NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'building', 'ready', 'failed')),
    reason       text,
    snapshot_id  text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz,
    PRIMARY KEY (template_id, version)
);

-- Adds a version of the tenant's template `tname` (making the template when the tenant has no
-- live one of that name) and returns the template's id and the new version. Serialised per
-- tenant, so neither limit can be passed by racing requests: at most `max_templates` live
-- templates per tenant and `max_versions` versions per template. When one is reached, returns
-- NULLs and `quota`, a message naming the limit, and changes nothing.
CREATE FUNCTION template_version_add(tenant text, tname text, vcpu integer, mem integer,
                                     disk integer, start text, ready text, egr jsonb,
                                     max_templates integer, max_versions integer,
                                     OUT template_id text, OUT version integer,
                                     OUT quota text)
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('templates:' || tenant));
    SELECT t.id INTO template_id FROM templates t
    WHERE t.tenant_id = tenant AND t.name = tname AND t.deleted_at IS NULL;
    IF template_id IS NULL THEN
        SELECT count(*) INTO n FROM templates t WHERE t.tenant_id = tenant AND t.deleted_at IS NULL;
        IF n >= max_templates THEN
            quota := format('the tenant has %s templates, the limit (template_max_per_tenant)', n);
            RETURN;
        END IF;
        template_id := kiln_new_id('tmpl_');
        INSERT INTO templates (id, tenant_id, name) VALUES (template_id, tenant, tname);
    END IF;
    SELECT count(*), coalesce(max(v.version), 0) + 1 INTO n, version FROM template_versions v
    WHERE v.template_id = template_version_add.template_id;
    IF n >= max_versions THEN
        template_id := NULL;
        version := NULL;
        quota := format('template "%s" has %s versions, the limit (template_max_versions)', tname, n);
        RETURN;
    END IF;
    INSERT INTO template_versions (template_id, version, vcpu_milli, memory_mib, disk_gib,
                                   start_cmd, ready_cmd, egress)
    VALUES (template_version_add.template_id, version, vcpu, mem, disk, start, ready, egr);
END $$;

-- A version as the API shows it.
CREATE FUNCTION template_version_json(v template_versions) RETURNS jsonb LANGUAGE sql STABLE AS $$
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
        'created_at', rfc3339(v.created_at),
        'finished_at', rfc3339(v.finished_at))
$$;

-- A template as listed: its newest version only (a listing stays small however many versions
-- the templates have), and the latest ready one.
CREATE FUNCTION template_summary_json(t templates) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', t.id,
        'name', t.name,
        'created_at', rfc3339(t.created_at),
        'latest_ready_version', (SELECT max(v.version) FROM template_versions v
                                 WHERE v.template_id = t.id AND v.status = 'ready'),
        'latest_version', (SELECT template_version_json(v) FROM template_versions v
                           WHERE v.template_id = t.id ORDER BY v.version DESC LIMIT 1))
$$;

-- A template as GET shows it: its versions newest first, and the latest ready one.
CREATE FUNCTION template_json(t templates) RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', t.id,
        'name', t.name,
        'created_at', rfc3339(t.created_at),
        'latest_ready_version', (SELECT max(v.version) FROM template_versions v
                                 WHERE v.template_id = t.id AND v.status = 'ready'),
        'versions', coalesce((SELECT jsonb_agg(template_version_json(v) ORDER BY v.version DESC)
                              FROM template_versions v WHERE v.template_id = t.id), '[]'::jsonb))
$$;
