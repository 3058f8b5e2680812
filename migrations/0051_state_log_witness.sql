-- 0051_state_log_witness: each state change logged with its own witness of when it happened on
-- its node: the host's boot id (the epoch of CLOCK_MONOTONIC) and its CLOCK_MONOTONIC time at the
-- change (ns), next to the wall-clock time `at`.
--
-- The wall clock's times alone cannot place a change logged while no meter of its node ran
-- between two steps of the wall clock: the restarted meter sees only the net step, and reads
-- such a change in a frame it never saw, early or late by a step's size (kiln-sim seeds 31117,
-- 31167, 31169). A meter on the same boot places a witnessed change on its label clock exactly
-- (kiln-meter, metering/meter.c, witness_time()); the frames serve only the rows without a
-- witness or of another boot (another host, rows from before this migration).
--
-- The writer supplies the witness on the sandbox's row (sandboxes.log_boot_id, log_mono_ns), in
-- the statement that makes the change (record/record.c, when its process set a clock: kiln-node
-- and kiln-sim). The trigger takes it only when that statement set it (the pair differs from the
-- row's before), else logs NULL: a change by a writer that supplies none (kiln-gateway's delete,
-- nodes_mark_down() of 0019, any statement outside record/) never carries the witness an
-- earlier change left on the row. NULL, too, when a writer supplies the same pair twice (two
-- changes at one monotonic instant, which only a simulated clock makes): read by the frames.
-- The log rows record/ inserts itself (a pause's vCPU stop, a deletion with its CPU counter)
-- carry the witness in their own columns.

ALTER TABLE sandbox_state_log ADD COLUMN boot_id text;
ALTER TABLE sandbox_state_log ADD COLUMN mono_ns bigint;
ALTER TABLE sandboxes ADD COLUMN log_boot_id text;
ALTER TABLE sandboxes ADD COLUMN log_mono_ns bigint;

-- 0014's trigger, the witness added.
CREATE OR REPLACE FUNCTION sandbox_state_log_apply() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    st text := CASE WHEN NEW.deleted_at IS NOT NULL THEN 'deleted' ELSE NEW.state END;
    at timestamptz;
    last record;
    witnessed boolean := TG_OP = 'INSERT';
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.state IS NOT DISTINCT FROM OLD.state
           AND NEW.generation IS NOT DISTINCT FROM OLD.generation
           AND NEW.node_id IS NOT DISTINCT FROM OLD.node_id
           AND (NEW.deleted_at IS NULL) = (OLD.deleted_at IS NULL)
           AND NEW.state_changed_at IS NOT DISTINCT FROM OLD.state_changed_at THEN
            RETURN NULL;
        END IF;
        -- The witness of this statement's writer only, never one an earlier change left.
        witnessed := NEW.log_boot_id IS DISTINCT FROM OLD.log_boot_id
                     OR NEW.log_mono_ns IS DISTINCT FROM OLD.log_mono_ns;
        IF NEW.deleted_at IS NOT NULL AND OLD.deleted_at IS NULL THEN
            -- Deleted: it ends at the deletion, or at its last change if that came first.
            at := CASE WHEN NEW.state_changed_at IS DISTINCT FROM OLD.state_changed_at
                       THEN least(NEW.deleted_at, NEW.state_changed_at) ELSE NEW.deleted_at END;
        ELSIF NEW.state_changed_at IS DISTINCT FROM OLD.state_changed_at THEN
            at := NEW.state_changed_at;
        ELSE
            -- A new generation or node without a new state time (a restore): from now on.
            at := now();
        END IF;
    ELSE
        at := NEW.state_changed_at;
    END IF;
    -- A change that repeats the last row of its generation (a pause whose stop was logged
    -- first, with the same state and time) is not logged twice.
    SELECT l.generation, l.state, l.at, l.node_id INTO last FROM sandbox_state_log l
    WHERE l.sandbox_id = NEW.id ORDER BY l.at DESC, l.seq DESC LIMIT 1;
    IF FOUND AND last.generation = NEW.generation AND last.state = st AND last.at = at
       AND last.node_id IS NOT DISTINCT FROM NEW.node_id THEN
        RETURN NULL;
    END IF;
    INSERT INTO sandbox_state_log (sandbox_id, generation, state, at, node_id, boot_id, mono_ns)
    VALUES (NEW.id, NEW.generation, st, at, NEW.node_id,
            CASE WHEN witnessed AND NEW.log_mono_ns IS NOT NULL THEN NEW.log_boot_id END,
            CASE WHEN witnessed AND NEW.log_boot_id IS NOT NULL THEN NEW.log_mono_ns END);
    RETURN NULL;
END $$;

-- kiln-meter reads the changes witnessed on its boot by their monotonic time too, OR'd with the
-- wall-clock bound (log_sql): without an index of its own that arm scans the whole log each
-- tick (256 sandboxes of 1,440 changes each: a parallel sequential scan, 112 ms for the 768
-- rows read; 1.8 ms by the wall-clock bound alone). With it, both arms are index scans
-- (BitmapOr): 2.9 ms, 17 ms cold.
CREATE INDEX sandbox_state_log_witness ON sandbox_state_log (sandbox_id, boot_id, mono_ns);
