-- 0038_template_registry: template versions whose image is pulled from a registry
-- (docs/templates.md, "Pulling from a registry"). The gateway checks the reference and the
-- registry's addresses, seals the credentials (bound to the tenant, template and version) and
-- moves the version to building with source_format 'registry'; the builder microVM pulls it with
-- skopeo. The sealed credentials live only while the version is building: any update that takes
-- the version out of `building` (ready, failed, put back to pending, failed by a sweep or by its
-- node going down) clears them in the same statement.

ALTER TABLE template_versions DROP CONSTRAINT template_versions_source_format_check;
ALTER TABLE template_versions
    ADD CONSTRAINT template_versions_source_format_check
        CHECK (source_format IN ('context', 'oci-archive', 'registry')),
    ADD COLUMN image_ref text,
    ADD COLUMN registry_auth text,
    ADD COLUMN registry_tls_verify boolean NOT NULL DEFAULT true;

CREATE FUNCTION template_registry_auth_clear() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status <> 'building' THEN
        NEW.registry_auth := NULL;
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER template_registry_auth_clear BEFORE UPDATE ON template_versions
    FOR EACH ROW WHEN (NEW.registry_auth IS NOT NULL)
    EXECUTE FUNCTION template_registry_auth_clear();

-- As template_image_start of 0023 (the same checks and answers), for a pull: a version it moved
-- to building gets source_format 'registry', the reference, the sealed credentials (or NULL) and
-- whether the registry's TLS certificate is verified.
CREATE FUNCTION template_pull_start(tenant text, tid text, ver integer, node text,
                                    max_builds integer, ref text, auth text, tls boolean,
                                    OUT state text, OUT quota text, OUT has_df boolean)
LANGUAGE plpgsql AS $$
BEGIN
    SELECT s.state, s.quota, s.has_df INTO state, quota, has_df
    FROM template_image_start(tenant, tid, ver, node, max_builds) s;
    IF state = 'pending' AND quota IS NULL AND NOT has_df THEN
        UPDATE template_versions SET source_format = 'registry', image_ref = ref,
                                     registry_auth = auth, registry_tls_verify = tls
        WHERE template_id = tid AND version = ver;
    END IF;
END $$;
