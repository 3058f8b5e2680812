-- 0014_state_log: every state change of a sandbox with its own time, and the meter's fence on
-- (sandbox, generation).
--
-- sandbox_state_log holds one row per change of a sandbox's state, generation, node or deletion,
-- written by a trigger on `sandboxes` in the transaction that makes the change (record/ is the
-- only writer of that table; the trigger makes the log impossible to bypass). kiln-meter bills
-- the time between a sandbox's billed-up-to point and now piece by piece over these rows: the
-- piece from one row to the next is billed in that row's state, under its generation, by the
-- meter of its node. A row may carry the generation's cumulative CPU counter at its instant
-- (`cpu_ns`: a pause logs the stop of its vCPUs with the counter then, record_vcpus_stopped() in
-- record/record.h, before the row changes), which bounds the CPU billed to the running time
-- before it. Rows a sandbox's billed-up-to point passed long ago are
-- trimmed (sandbox_state_log_trim()).
--
-- usage_windows gains the billed period of each window in ns (ps_ns, pe_ns), and meter_flush()
-- refuses a window of a generation that overlaps time already billed for that generation (by
-- any meter), returning the (sandbox, generation) pairs it refused: the meter that sent them
-- drops what it holds of them and bills on from the ledger's billed-up-to point, so two meters
-- billing one generation never bill a second twice nor lose one.

CREATE TABLE sandbox_state_log (
    seq         bigserial PRIMARY KEY,
    sandbox_id  text NOT NULL,
    generation  bigint NOT NULL,
    state       text NOT NULL,      -- creating, running, paused, stopped, error, or deleted
    at          timestamptz NOT NULL,
    node_id     text,               -- the node that holds it from `at` on
    cpu_ns      bigint              -- the generation's cgroup CPU counter at `at`, when known
);
CREATE INDEX sandbox_state_log_sandbox ON sandbox_state_log (sandbox_id, at, seq);
CREATE INDEX sandbox_state_log_node ON sandbox_state_log (node_id, at);

CREATE FUNCTION sandbox_state_log_apply() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    st text := CASE WHEN NEW.deleted_at IS NOT NULL THEN 'deleted' ELSE NEW.state END;
    at timestamptz;
    last record;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.state IS NOT DISTINCT FROM OLD.state
           AND NEW.generation IS NOT DISTINCT FROM OLD.generation
           AND NEW.node_id IS NOT DISTINCT FROM OLD.node_id
           AND (NEW.deleted_at IS NULL) = (OLD.deleted_at IS NULL)
           AND NEW.state_changed_at IS NOT DISTINCT FROM OLD.state_changed_at THEN
            RETURN NULL;
        END IF;
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
    INSERT INTO sandbox_state_log (sandbox_id, generation, state, at, node_id)
    VALUES (NEW.id, NEW.generation, st, at, NEW.node_id);
    RETURN NULL;
END $$;
CREATE TRIGGER sandboxes_state_log AFTER INSERT OR UPDATE ON sandboxes
    FOR EACH ROW EXECUTE FUNCTION sandbox_state_log_apply();

-- The sandboxes of before this migration: where each stands now.
INSERT INTO sandbox_state_log (sandbox_id, generation, state, at, node_id)
SELECT id, generation, CASE WHEN deleted_at IS NOT NULL THEN 'deleted' ELSE state END,
       coalesce(least(deleted_at, state_changed_at), state_changed_at), node_id
FROM sandboxes;

-- Drops the log rows no meter needs again: those of a generation older than its billed-up-to
-- point by more than `keep` (the newest row before the point stays: it says the state at the
-- point), and every row of a sandbox deleted more than `keep` ago whose point says it ended.
-- Returns the rows dropped.
CREATE FUNCTION sandbox_state_log_trim(keep interval) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
    k bigint;
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
    RETURN n + k;
END $$;

-- A billed-up-to point per (sandbox, generation): each node's meter goes on from its own
-- generation's point, whatever another node billed of a later one. gen_node is the node the
-- generation ran on (NULL before this migration: node_id, the meter that wrote it).
ALTER TABLE meter_sandboxes ADD COLUMN gen_node text;
ALTER TABLE meter_sandboxes DROP CONSTRAINT meter_sandboxes_pkey;
ALTER TABLE meter_sandboxes ADD PRIMARY KEY (sandbox_id, generation);

ALTER TABLE usage_windows ADD COLUMN ps_ns bigint;
ALTER TABLE usage_windows ADD COLUMN pe_ns bigint;

-- meter_flush() of 0012 fenced on (sandbox, generation): a window whose billed period [ps, pe)
-- overlaps time already billed for its generation is refused whole, and so is every later window
-- of that generation in the same flush; the refused pairs are returned (the meter re-reads its
-- billed-up-to point). Billed time of a generation is a prefix of it (windows are flushed in
-- order and the point only moves forward), so a window overlaps when one of its generation at
-- or after its start ends after its period starts. An exact replay overlaps too and is refused.
DROP FUNCTION meter_flush(jsonb, text);
CREATE FUNCTION meter_flush(items jsonb, card text)
RETURNS TABLE (refused_sandbox text, refused_generation bigint) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    it jsonb;
    ws timestamptz;
    refused text[] := '{}';
    key text;
BEGIN
    PERFORM ledger_lock_tenants(ARRAY(SELECT DISTINCT e->>'tenant'
                                      FROM jsonb_array_elements(items) e
                                      WHERE (e->>'ucr')::bigint > 0));
    FOR it IN SELECT * FROM jsonb_array_elements(items) LOOP
        ws := to_timestamp((it->>'ws')::bigint);
        key := (it->>'sb') || ':' || (it->>'gen');
        IF key = ANY (refused) OR EXISTS (
            SELECT 1 FROM usage_windows u
            WHERE u.sandbox_id = it->>'sb' AND u.generation = (it->>'gen')::bigint
              AND u.window_start >= ws
              AND coalesce(u.pe_ns, (extract(epoch FROM u.window_end) * 1e9)::bigint)
                  > (it->>'ps')::bigint) THEN
            IF NOT key = ANY (refused) THEN
                refused := refused || key;
                refused_sandbox := it->>'sb';
                refused_generation := (it->>'gen')::bigint;
                RETURN NEXT;
            END IF;
            CONTINUE;
        END IF;
        INSERT INTO usage_windows AS u (sandbox_id, generation, window_start, window_end,
                                        tenant_id, cpu_ns, mem_byte_s, rx_bytes, tx_bytes, ucr,
                                        rate_card, ps_ns, pe_ns)
        VALUES (it->>'sb', (it->>'gen')::bigint, ws, to_timestamp((it->>'we')::bigint),
                it->>'tenant', (it->>'cpu')::bigint, (it->>'mem_bs')::bigint,
                (it->>'rx')::bigint, (it->>'tx')::bigint, (it->>'ucr')::bigint, card,
                (it->>'ps')::bigint, (it->>'pe')::bigint)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            -- The window is recorded with a period that does not reach this one's start (an
            -- end marker of no length): nothing to charge.
            CONTINUE;
        END IF;
        PERFORM ledger_draw(it->>'tenant', (it->>'ucr')::bigint,
                            'usage:' || (it->>'sb') || ':' || (it->>'gen') || ':' || (it->>'ws'),
                            it->>'sb', to_timestamp((it->>'ps')::numeric / 1e9),
                            to_timestamp((it->>'pe')::numeric / 1e9), card);
        INSERT INTO meter_sandboxes AS m (sandbox_id, tenant_id, node_id, generation, state,
                                          last_t_ns, cpu_ns, rx_bytes, tx_bytes, remainder_fine,
                                          gen_node)
        VALUES (it->>'sb', it->>'tenant', it->>'node', (it->>'gen')::bigint, it->>'state',
                (it->>'t')::bigint, (it->>'cpu_at')::bigint, (it->>'rx_at')::bigint,
                (it->>'tx_at')::bigint, (it->>'rem')::bigint,
                coalesce(nullif(it->>'gnode', ''), it->>'node'))
        ON CONFLICT (sandbox_id, generation) DO UPDATE SET
            tenant_id = EXCLUDED.tenant_id, node_id = EXCLUDED.node_id,
            state = EXCLUDED.state, last_t_ns = EXCLUDED.last_t_ns, cpu_ns = EXCLUDED.cpu_ns,
            rx_bytes = EXCLUDED.rx_bytes, tx_bytes = EXCLUDED.tx_bytes,
            remainder_fine = EXCLUDED.remainder_fine, gen_node = EXCLUDED.gen_node,
            updated_at = now()
        WHERE m.last_t_ns <= EXCLUDED.last_t_ns;
    END LOOP;
END $$;
