-- Each node's label clock frame (meter_clocks, 0037) with its offset: off_ns, the label clock less
-- the wall clock at that flush (kiln-meter, metering/meter.c). When the node's next meter on the
-- same host finds the wall clock ahead of that frame (a forward step made while no meter of the
-- node ran), it places the changes logged before the step with that offset and moves them on by
-- the step, as it moves the ledger's points (kiln-sim `clock`, seed 9119: a meter restarted 63 s
-- ahead of the wall clock, after a backward step, across a 2,918 s forward step made while it
-- was down, billed a sandbox created before the step from its creation read in the new frame,
-- +2,194,336 µcr).
ALTER TABLE meter_clocks ADD COLUMN off_ns bigint NOT NULL DEFAULT 0;
