-- 0043_sandbox_node_generation: a sandbox creating or running (before or after the change) never
-- changes node without a new generation in the same UPDATE. Each generation is billed by the
-- meter of its node only (kiln-meter, metering/meter.c; the ledger is fenced on (sandbox,
-- generation)): a move under the same generation would have two nodes' meters bill one
-- generation, each from its own clock and counters, and the fence, which compares the time each
-- billed, would take both where they do not overlap. Every move kiln writes is a new generation
-- already (record_resumed(), record/record.c, the only statement that sets node_id; a node marked
-- down keeps its sandboxes' node: 0019); this holds any other writer to it. Paused time is billed
-- by the node's meter too, so a paused sandbox is held to it as well; an ended one may change node.
CREATE FUNCTION sandboxes_node_generation_check() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.node_id IS DISTINCT FROM OLD.node_id
       AND NOT coalesce(NEW.generation > OLD.generation, false)
       AND (OLD.state IN ('creating', 'running', 'paused')
            OR NEW.state IN ('creating', 'running', 'paused')) THEN
        RAISE EXCEPTION 'sandbox % moved from node % to node % in state % without a new generation',
            NEW.id, coalesce(OLD.node_id, 'none'), coalesce(NEW.node_id, 'none'), NEW.state
            USING ERRCODE = 'check_violation',
                  HINT = 'a move is a new generation: set generation = generation + 1 in the same UPDATE';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER sandboxes_node_generation BEFORE UPDATE OF node_id ON sandboxes
    FOR EACH ROW EXECUTE FUNCTION sandboxes_node_generation_check();
