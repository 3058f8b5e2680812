-- 0023: template versions built from an imported OCI image archive (docs/templates.md, "Importing
-- an image"). Such a version has no Dockerfile: its source is the archive, unpacked inside the
-- builder microVM by umoci into the root file system.

ALTER TABLE template_versions
    ADD COLUMN source_format text NOT NULL DEFAULT 'context'
        CHECK (source_format IN ('context', 'oci-archive'));

-- As template_build_start of 0021, for an image import: the version must be pending WITHOUT a
-- Dockerfile; it is moved to building with source_format 'oci-archive'. `state` is the status
-- before (NULL: no such version), `quota` names template_max_builds when the tenant is at it, and
-- `has_df` says a Dockerfile is there (then nothing changes).
CREATE FUNCTION template_image_start(tenant text, tid text, ver integer, node text,
                                     max_builds integer, OUT state text, OUT quota text,
                                     OUT has_df boolean)
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('templates:' || tenant));
    SELECT v.status, v.dockerfile IS NOT NULL INTO state, has_df
    FROM template_versions v JOIN templates t ON t.id = v.template_id
    WHERE t.tenant_id = tenant AND t.id = tid AND v.version = ver AND t.deleted_at IS NULL;
    IF state IS NULL OR state <> 'pending' OR has_df THEN
        RETURN;
    END IF;
    SELECT count(*) INTO n FROM template_versions v JOIN templates t ON t.id = v.template_id
    WHERE t.tenant_id = tenant AND v.status = 'building';
    IF n >= max_builds THEN
        quota := format('the tenant has %s template builds running, the limit (template_max_builds)', n);
        RETURN;
    END IF;
    UPDATE template_versions SET status = 'building', node_id = node, started_at = now(),
                                 reason = NULL, source_format = 'oci-archive'
    WHERE template_id = tid AND version = ver;
END $$;
