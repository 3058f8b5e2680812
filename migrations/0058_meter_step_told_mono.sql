-- 0058_meter_step_told_mono: with each node's told forward step (meter_step_told, 0053), the
-- telling meter's host boot (boot_id; NULL: none known) and its monotonic clock when it told
-- (mono_ns). A late meter of the node on the same boot takes the row when it was told no more
-- than 60 s ago on that clock, whatever the database's own clock did since; on another boot, or
-- with no boot, by updated_at on the database's clock as before. By the database's clock alone, a
-- database whose clock stood still or stepped between the telling tick and the late meter's read
-- made a row told a second before read as older than 60 s: refused, the late meter began its gap a
-- second after the telling one's, and that real second was billed under two labels (kiln-sim seed
-- 77044: +87 and +34 µcr on two paused sandboxes). A row told on the late meter's boot with a
-- monotonic time past its own (another clock under the same boot id) is aged by updated_at. NULL,
-- the default of the rows written before this migration: read by updated_at, as before it. A
-- kiln-meter built before this migration does not set the columns, so a row it updates keeps
-- stale ones: the meters upgrade with the migration.
ALTER TABLE meter_step_told
  ADD COLUMN boot_id text,
  ADD COLUMN mono_ns bigint;
