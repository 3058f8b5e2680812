-- 0059_grant_expiry_redis: whether Redis has been given each expiry's new balance. The meter that
-- runs an expiry (ledger_expire_grants) sets the tenants' ledger halves in Redis right after its
-- commit (billing_sync); when that meter's Redis is unreachable then, or the meter dies first,
-- Redis kept the balance from before the expiry for good: no flush touches a tenant with nothing
-- running, and a balance too high is not read again (billing_admit re-reads one at or below
-- zero), so the tenant went on creating on credits it no longer had (kiln-sim seed 77274: 201,000
-- µcr left in Redis). A row is written unsynced; a meter syncs the tenants of the unsynced rows
-- once a window, and every tick while its own last try failed, and marks the rows it read synced
-- (by account and xmin: a reopened expiry is a new row) once Redis took the balances read after
-- them. The rows from before this migration start unsynced too: each tenant's balance is given to
-- Redis once after it, which mends one left behind so before.
ALTER TABLE grant_expiries ADD COLUMN redis_synced boolean NOT NULL DEFAULT false;
CREATE INDEX grant_expiries_unsynced ON grant_expiries (account_id) WHERE NOT redis_synced;
