-- 0053_meter_step_told: the gap start of the newest forward step of the wall clock that a meter of
-- each node told at its held tick (kiln-meter, metering/meter.c, held_to()), for the node's late
-- meters: by_ns the step's length, from_ns the label its gap begins at, both ns. A meter whose held
-- tick comes a second after its last tick writes it (one statement, on held ticks only, unless its
-- last tick could not reach Postgres) beside the Redis key kiln:meter:<node>:step; a late one
-- reads it when Redis told nothing (unless the same). With Redis
-- alone, a telling meter without Redis at the step told nothing, the late meter began its gap a
-- second after it, and each one's copy of that second was refused behind the other's (kiln-sim
-- seed 31233, -22 and -36 µcr: one paused second lost on two sandboxes). One row per node, the
-- last held tick's: a row from an earlier step is out of the late meter's range (its label, or
-- the step's length) and ignored, as a stale Redis key is, and so is one written more than 60 s
-- ago (the key's TTL). A running kiln-meter built before this migration neither writes nor reads
-- it and keeps the Redis-only behaviour; kiln-meter applies its migrations at start, so any
-- upgrade order works.
CREATE TABLE meter_step_told (
    node_id     text PRIMARY KEY,
    by_ns       bigint NOT NULL,
    from_ns     bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
