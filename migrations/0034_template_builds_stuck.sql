-- 0034_template_builds_stuck: a build whose node goes down, or that never ends, no longer stays
-- `building` for ever (docs/templates.md, "Builds": a build that loses its node).
--
-- template_build_fail() fails one building version with a reason naming the cause, written as the
-- last line of its log too, and releases what the build held: the tenant's concurrent-build slot
-- (template_max_builds counts the versions `building`), its builder sandbox (the deletion asked
-- for, carried out by its node when it restarts: node/recovery.c; a node still up that hung keeps
-- the builder running until its own bound, template_build_max_s + 600 s). Its cached layers need nothing: a layer's row and its snapshot are written in one
-- transaction when the layer is kept, so a build cut off leaves none half made (and the layers it
-- kept stay in the cache, as a failed build's do). A node that was down and comes back finds the
-- version failed: its build thread, if it still runs, ends without an image (every update of the
-- node's build is conditioned on `building`), and a node restart fails nothing more.

CREATE FUNCTION template_build_fail(tid text, ver integer, why text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    builder text;
BEGIN
    SELECT v.builder_id INTO builder FROM template_versions v
    WHERE v.template_id = tid AND v.version = ver AND v.status = 'building' FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE template_versions SET status = 'failed', reason = why, finished_at = now(),
                                 builder_id = NULL
    WHERE template_id = tid AND version = ver;
    INSERT INTO template_build_log (template_id, version, chunk) VALUES (tid, ver, why || E'\n');
    IF builder IS NOT NULL THEN
        UPDATE sandboxes SET delete_requested_at = coalesce(delete_requested_at, now())
        WHERE id = builder AND deleted_at IS NULL;
    END IF;
    RETURN true;
END $$;

-- A node marked down (its heartbeat lapsed: nodes_mark_down of 0019) fails the builds it ran, in
-- the statement that marks it.
CREATE FUNCTION template_builds_node_down() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM template_build_fail(v.template_id, v.version,
        format('the build node %s went down during the build (its heartbeat lapsed at %s)',
               NEW.id, to_char(NEW.heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')))
    FROM template_versions v WHERE v.node_id = NEW.id AND v.status = 'building';
    RETURN NULL;
END $$;
CREATE TRIGGER nodes_down_template_builds AFTER UPDATE OF down_at ON nodes
    FOR EACH ROW WHEN (OLD.down_at IS NULL AND NEW.down_at IS NOT NULL)
    EXECUTE FUNCTION template_builds_node_down();

-- A build still `building` `grace_s` seconds past template_build_max_s (`max_s`) is failed by the
-- gateways' periodic work (api/gateway.c): its node bounds every build by max_s and fails it
-- itself, so it hung or lost its database at the end (a node marked down failed its builds
-- already, above). Returns how many.
CREATE FUNCTION template_builds_fail_hung(max_s bigint, grace_s bigint) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v record;
    n integer := 0;
BEGIN
    FOR v IN SELECT template_id, version, node_id FROM template_versions
             WHERE status = 'building'
             AND started_at < now() - make_interval(secs => max_s + grace_s) LOOP
        IF template_build_fail(v.template_id, v.version,
               format('the build on node %s did not end within template_build_max_s (%s s) '
                      'and %s s more: taken as hung', v.node_id, max_s, grace_s)) THEN
            n := n + 1;
        END IF;
    END LOOP;
    RETURN n;
END $$;
