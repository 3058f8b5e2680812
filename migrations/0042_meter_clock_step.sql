-- 0042_meter_clock_step: with each node's label clock frame (meter_clocks, 0037, 0039), the newest
-- forward step of the wall clock the flushing meter followed in it (kiln-meter, metering/meter.c):
-- step_at_ns the label it left (NULL: none), step_by_ns how far the label clock moved on,
-- step_off_ns the offset (label - wall) before it, step_back when a backward step came after it.
-- A meter that starts in that frame keeps it as a step it followed: a billed-up-to point read from
-- the ledger from before it moves on by it, and the node's times logged before it keep their
-- offset. Without it, a meter restarted just after a 3,160 s forward step another meter of its
-- node followed started in the frame after it, read a paused sandbox's point from before it and
-- billed the step as paused time (kiln-sim `clock`, seed 150252085, +588,657 µcr).
ALTER TABLE meter_clocks
  ADD COLUMN step_at_ns bigint,
  ADD COLUMN step_by_ns bigint NOT NULL DEFAULT 0,
  ADD COLUMN step_off_ns bigint NOT NULL DEFAULT 0,
  ADD COLUMN step_back boolean NOT NULL DEFAULT false;
