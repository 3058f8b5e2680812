-- 0032_snapshot_image_index: the guest images a node pins (node/images.c, images_pin(), every
-- 10 s on every node) are found by the snapshots not yet purged that name them; without an index
-- that read scans every snapshot ever taken.
CREATE INDEX snapshots_image_hash ON snapshots (image_hash) WHERE purged_at IS NULL;
