-- 0048_meter_clock_log_seq: with each node's label clock frame (meter_clocks, 0037, 0039, 0042),
-- the state log's sequence (sandbox_state_log.seq, the sequence's last value) when the flushing
-- meter's offset took the value off_ns holds: read at the last tick before the backward step that
-- began the frame (at a restarted meter's first tick, that tick's), kept while the frame stays
-- (kiln-meter, metering/meter.c). A meter that starts in that frame and finds the wall clock
-- stepped back (or forward within the lead) while no meter of the node ran reads the node's times
-- logged before that step in the frame's offset only when logged above it: one logged before may
-- be from before the frame's own backward step, in an older frame. Read in the saved frame, a
-- pause logged before the frame's -100 s step stood 100 s late, between the ledger's point and
-- the restart, was not taken as in the point and was applied again (14,730 µcr for 13,765).
-- 0, the default of the frames saved before this migration: any change (as before it). A
-- kiln-meter built before this migration does not set the column, so a frame it saves keeps a
-- stale one: the meters upgrade with the migration.
ALTER TABLE meter_clocks
  ADD COLUMN log_seq bigint NOT NULL DEFAULT 0;
