-- 0057_meter_cut_watch: the generations a node's meter took over from another node and then left
-- to that node's meter when it came back part-way (kiln-meter, metering/meter.c, sb_cut()), watched
-- until the ledger has a point of them the tails path bills on from, or their end
-- (take_cut_tails()). The watch was in the meter's memory: a restart of the meter that cut a
-- generation, before the generation's own meter died again without flushing any of it, ended the
-- watch, and the generation's time from its start was billed by nobody (the ledger had no point of
-- it for the tails path). Written by the watching meter's tick, deleted when its watch ends, read
-- by meter_start() on its node.
CREATE TABLE meter_cut_watch (
  node_id text NOT NULL,
  sandbox_id text NOT NULL,
  generation bigint NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (node_id, sandbox_id, generation)
);
