-- 0009_tenant_suspension: an operator can suspend a tenant (POST /v1/tenants/{id}/suspend). While
-- suspended_at is set every API key and token of the tenant is refused (403 suspended); nothing
-- of the tenant is deleted. Also an index for the gateway's sweep of expired Idempotency-Key
-- records (api/authn.c), which deletes by age in bounded batches.
ALTER TABLE tenants ADD COLUMN suspended_at timestamptz;
CREATE INDEX idempotency_created ON idempotency (created_at);
