-- 0033_storage_billing: every snapshot a tenant keeps is billed as storage, per second, at the
-- snapshot price, by the path that bills a paused sandbox's snapshot (docs/metering.md, "Kept
-- snapshots"). Kept means a named snapshot, or a snapshot of kind 'build' (a template version's
-- warm image or a cached layer) of a tenant, from the moment it is kept (inserted live, or its
-- deleted_at cleared: node/build.c records a build's snapshot deleted and clears it in the same
-- transaction when it keeps it) to its deletion. Pause snapshots are billed with their paused
-- sandbox already; fork snapshots (internal, deleted at once) are not kept.
--
-- kiln-meter reads such a snapshot as a sandbox that is paused from `kept_since` to `deleted_at`,
-- of no memory and no disk, whose pause snapshot is itself (meter_billables below), on the node
-- holding its files. Its two changes go to sandbox_state_log by a trigger, as a sandbox's do, so
-- a meter down (or its Postgres, or Redis) across the keeping and the deletion bills the stretch
-- exactly when it is back, fenced on (snapshot, generation 1) like any sandbox's windows:
-- nothing twice, nothing lost.

ALTER TABLE snapshots ADD COLUMN kept_since timestamptz;

-- The snapshots kept now start to be billed from now (nothing before this migration is charged).
UPDATE snapshots SET kept_since = now()
WHERE kind IN ('named', 'build') AND tenant_id IS NOT NULL AND deleted_at IS NULL;
INSERT INTO sandbox_state_log (sandbox_id, generation, state, at, node_id)
SELECT id, 1, 'paused', kept_since, node_id FROM snapshots WHERE kept_since IS NOT NULL;

CREATE FUNCTION snapshot_kept_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.kind IN ('named', 'build') AND NEW.tenant_id IS NOT NULL AND NEW.deleted_at IS NULL
       AND NEW.kept_since IS NULL
       AND (TG_OP = 'INSERT' OR OLD.deleted_at IS NOT NULL) THEN
        NEW.kept_since := CASE WHEN TG_OP = 'INSERT' THEN NEW.created_at ELSE now() END;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER snapshots_kept_mark BEFORE INSERT OR UPDATE OF deleted_at ON snapshots
    FOR EACH ROW EXECUTE FUNCTION snapshot_kept_mark();

-- A snapshot is kept once: cleared of its deletion again later, it is not billed again.
CREATE FUNCTION snapshot_kept_log() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.kept_since IS NULL THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'INSERT' OR OLD.kept_since IS NULL THEN
        INSERT INTO sandbox_state_log (sandbox_id, generation, state, at, node_id)
        VALUES (NEW.id, 1, 'paused', NEW.kept_since, NEW.node_id);
    END IF;
    IF NEW.deleted_at IS NOT NULL AND (TG_OP = 'INSERT' OR OLD.deleted_at IS NULL
                                       OR OLD.kept_since IS NULL) THEN
        INSERT INTO sandbox_state_log (sandbox_id, generation, state, at, node_id)
        VALUES (NEW.id, 1, 'deleted', greatest(NEW.deleted_at, NEW.kept_since), NEW.node_id);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER snapshots_kept_log AFTER INSERT OR UPDATE OF deleted_at ON snapshots
    FOR EACH ROW EXECUTE FUNCTION snapshot_kept_log();

-- What kiln-meter bills (metering/meter.c, rows_sql): the sandboxes, and the kept snapshots as
-- sandboxes paused from their keeping to their deletion (generation 1, no memory, no disk, their
-- own pause snapshot; a deletion cleared again leaves the row ended: kept once).
CREATE VIEW meter_billables AS
SELECT id, tenant_id, generation, state, memory_mib, disk_gib, state_changed_at, deleted_at,
       created_at, pause_snapshot, node_id
FROM sandboxes
UNION ALL
SELECT id, tenant_id, 1, 'paused', 0, 0, kept_since,
       CASE WHEN deleted_at IS NOT NULL AND deleted_at > kept_since THEN deleted_at
            WHEN deleted_at IS NOT NULL THEN kept_since END,
       kept_since, id, node_id
FROM snapshots WHERE kept_since IS NOT NULL;

CREATE INDEX snapshots_kept ON snapshots (node_id) WHERE kept_since IS NOT NULL;

-- The trim of 0014, and the log rows of a kept snapshot once it is billed to its deletion and that
-- is older than the bound (as an ended sandbox's).
CREATE OR REPLACE FUNCTION sandbox_state_log_trim(keep interval) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
    k bigint;
    j bigint;
BEGIN
    DELETE FROM sandbox_state_log l USING meter_sandboxes m
    WHERE m.sandbox_id = l.sandbox_id AND m.generation = l.generation
      AND l.at < to_timestamp(m.last_t_ns / 1e9) - keep
      AND EXISTS (SELECT 1 FROM sandbox_state_log l2 WHERE l2.sandbox_id = l.sandbox_id
                  AND l2.generation = l.generation
                  AND l2.at > l.at AND l2.at < to_timestamp(m.last_t_ns / 1e9) - keep);
    GET DIAGNOSTICS n = ROW_COUNT;
    DELETE FROM sandbox_state_log l USING sandboxes s, meter_sandboxes m
    WHERE s.id = l.sandbox_id AND m.sandbox_id = l.sandbox_id AND m.generation = s.generation
      AND m.state = 'none'
      AND s.deleted_at IS NOT NULL AND s.deleted_at < now() - keep
      AND m.last_t_ns >= (extract(epoch FROM s.deleted_at) * 1e9)::bigint;
    GET DIAGNOSTICS k = ROW_COUNT;
    DELETE FROM sandbox_state_log l USING snapshots sn, meter_sandboxes m
    WHERE sn.id = l.sandbox_id AND m.sandbox_id = l.sandbox_id AND m.generation = 1
      AND m.state = 'none' AND sn.kept_since IS NOT NULL
      AND sn.deleted_at IS NOT NULL AND sn.deleted_at < now() - keep
      AND m.last_t_ns >= (extract(epoch FROM greatest(sn.deleted_at, sn.kept_since)) * 1e9)::bigint;
    GET DIAGNOSTICS j = ROW_COUNT;
    RETURN n + k + j;
END $$;
