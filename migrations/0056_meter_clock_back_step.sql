-- 0056_meter_clock_back_step: with each node's label clock frame (meter_clocks, 0037, 0039, 0042,
-- 0048, 0050, 0052), the backward step of the wall clock that began it: its label (back_at_ns;
-- NULL: none, an offset no backward step gave), the offset (label - wall) in force before it
-- (back_off_ns), read only for the changes logged with a sequence above back_min (0: any), and a
-- sequence at or below which every change was logged before it (back_pre; 0: none known). A meter
-- that starts in that frame keeps the step as the meter that saved it did, so a change logged just
-- before the step reads in the frame before it, not at offset 0, the whole lead of the node's
-- label clock early (kiln-meter, metering/meter.c, meter_clock()). Read at offset 0, a running
-- sandbox's start logged a second before a -270 s step, read by the node's meter restarted a
-- second after it, stood 3,097 s early, inside the ledger's point, and was dropped: its running
-- time billed in no state (kiln-sim seed 77018, -45,367 µcr).
-- NULL, the default of the frames saved before this migration: offset 0, as before it. A
-- kiln-meter built before this migration does not set the columns, so a frame it saves keeps a
-- stale step: the meters upgrade with the migration.
ALTER TABLE meter_clocks
  ADD COLUMN back_at_ns bigint,
  ADD COLUMN back_off_ns bigint NOT NULL DEFAULT 0,
  ADD COLUMN back_min bigint NOT NULL DEFAULT 0,
  ADD COLUMN back_pre bigint NOT NULL DEFAULT 0;
