-- 0022_connlog_names: what kiln-node's proxies add to a flow of the connection log
-- (docs/network-policy.md, "Connection log"). For a flow through the name-checking proxy,
-- dns_name (reserved since 0011) holds the name it checked (TLS SNI or HTTP Host) and
-- proxy_decision what it decided: allowed, cut (allowed, then cut by a rule change), or the
-- refusal's reason (no_rule, not_answered, denied_range, unsupported, no_name,
-- over_cap:<limit>), a refusal also turning the verdict to denied. For a flow through the
-- injecting proxy, requests holds its requests, oldest first: [{"method", "host", "path" (without
-- query), "status", "secret" (whether a secret header was added; never its value)}].

ALTER TABLE sandbox_connections
    ADD COLUMN proxy_decision text,
    ADD COLUMN requests jsonb;
