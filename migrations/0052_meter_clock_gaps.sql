-- 0052_meter_clock_gaps: with each node's label clock frame (meter_clocks, 0037, 0039, 0042, 0048,
-- 0050), the gaps of the flushing meter's label clock, oldest first, as pairs of a label and a
-- length (ns): {at_1, by_1, at_2, by_2, ...}. A forward step of the wall clock past the label clock
-- leaves the labels [at, at + by) that no real time passed under (kiln-meter, metering/meter.c,
-- meter_clock()): the points before it stay where they are, and billing across it bills either
-- side of it only. A meter that starts in that frame keeps the gaps as its own, so it labels and
-- bills the node's time as the meter that saved them did. A gap begins where the tick that held
-- its step billed to, up to two seconds before the step's own label (step_at_ns, 0042): kept at
-- step_at_ns, a restarted meter billed a point between the two from past the gap and lost that
-- time (2 s of 40). Several steps are kept, the newest sixteen, not only the newest (0042).
-- '{}', the default of the frames saved before this migration: the saved step's gap from its
-- label (step_at_ns). A kiln-meter built before this migration does not set the column, so a frame
-- it saves keeps stale gaps: the meters upgrade with the migration.
ALTER TABLE meter_clocks
  ADD COLUMN gaps_ns bigint[] NOT NULL DEFAULT '{}';
