-- 0041_snapshot_generation: the generation of its sandbox a snapshot was taken in, written with
-- the snapshot (node/lifecycle.c, snap_record_public(); a pause's in the transaction of
-- record_paused(), fenced on that generation). kiln-meter finds an ended generation's pause
-- snapshot by it (metering/meter.c, GEN_SNAP_SQL), not by time: after a backward step of the wall
-- clock the next generation's first change can read earlier than the snapshot (kiln-sim `clock`,
-- seeds 627238415 and 497680908: paused time billed at the guest's memory, +553 and +1,091 µcr),
-- and a pause's own log row (the vCPUs' stop) is written before its snapshot's row.
ALTER TABLE snapshots ADD COLUMN generation bigint;
-- A paused sandbox's snapshot is its current generation's; the pause snapshots of generations that
-- ended before this migration keep NULL (the meter finds those by time, as before).
UPDATE snapshots sn SET generation = s.generation FROM sandboxes s
WHERE s.pause_snapshot = sn.id AND sn.kind = 'pause';
CREATE INDEX snapshots_pause_generation ON snapshots (sandbox_id, generation) WHERE kind = 'pause';
