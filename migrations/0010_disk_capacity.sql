-- 0010_disk_capacity: the disk each node promises its sandboxes, and the snapshot bytes that
-- pauses in progress have reserved against their tenant's plan.

-- GiB of guest disk (each sandbox's disk_gib) the node may promise at once: its disk for
-- sandboxes times its overcommit ratio, written by its heartbeat. NULL: a node that does not
-- report it (none since this migration), placed without a disk check.
ALTER TABLE nodes ADD COLUMN disk_gib bigint;

-- The expected size of a pause snapshot being written (its memory and its disk layer), held from
-- the plan check until the snapshot is recorded (or the pause fails): concurrent pauses of one
-- tenant each see the others' reservations (metering/plan.h). A reservation older than an hour
-- (its node died mid-pause) no longer counts.
CREATE TABLE snapshot_reservations (
    snapshot_id text PRIMARY KEY,
    tenant_id   text NOT NULL REFERENCES tenants(id),
    bytes       bigint NOT NULL CHECK (bytes >= 0),
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX snapshot_reservations_tenant ON snapshot_reservations (tenant_id);
