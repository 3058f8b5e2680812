-- 0050_meter_clock_tick_seq: with each node's label clock frame (meter_clocks, 0037, 0039, 0042,
-- 0048), the state log's sequence (sandbox_state_log.seq, the sequence's last value) read at the
-- tick before the flushing meter's tick, before that tick read the wall clock, while its offset
-- was off_ns: every change logged with a sequence no higher was logged by then, in that frame or
-- an older one. The bound relies on the log's sequence having cache 1 (bigserial's default), so
-- seq <= tick_seq means the seq was drawn before the read. A meter that starts in that frame and
-- finds the wall clock stepped back since (a step it never saw) reads such a change in the frame
-- before that step, never in the one after it, however it then stands against the tick
-- (kiln-meter, metering/meter.c, node_time_logged()). Read by the tick alone, a paused sandbox's
-- creation, boot and pause, logged 440 s before a -433 s step made while the meter was down and
-- the node's other meter was without Postgres, stood 433 s late, past the ledger's point, and its
-- 4.1 s of running time was billed again (kiln-sim seed 31150, +9,974 µcr).
-- 0, the default of the frames saved before this migration: no bound (as before it). A kiln-meter
-- built before this migration does not set the column, so a frame it saves keeps a stale one: the
-- meters upgrade with the migration.
ALTER TABLE meter_clocks
  ADD COLUMN tick_seq bigint NOT NULL DEFAULT 0;
