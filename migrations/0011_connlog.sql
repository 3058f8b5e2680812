-- 0011_connlog: each sandbox's outbound connections (flows the guest opened and attempts the
-- policy refused), as its node's collector reads them from the eBPF maps (node/connlog.c), kept
-- connlog_retention_days, for answering abuse reports. Read by the operator only
-- (GET /v1/admin/sandboxes/{id}/connections).

CREATE TABLE sandbox_connections (
    id            bigserial PRIMARY KEY,
    sandbox_id    text NOT NULL,               -- no foreign key: the log outlives the sandbox
    tenant_id     text,
    node_id       text NOT NULL,
    flow_key      text NOT NULL,               -- family, proto, ports, address, opening (hex)
    opened_at     timestamptz NOT NULL,        -- the first packet (a refused attempt: its time)
    last_seen_at  timestamptz NOT NULL,        -- the last packet, to the second
    verdict       text NOT NULL CHECK (verdict IN ('allowed', 'denied')),
    family        smallint NOT NULL CHECK (family IN (4, 6)),
    proto         text NOT NULL,               -- tcp, udp, icmp, icmpv6
    dst           inet NOT NULL,
    dst_port      integer NOT NULL,            -- ICMP: the echo id
    src_port      integer NOT NULL,            -- the guest's port
    dns_name      text,                        -- reserved: the name the DNS proxy learnt it from
    bytes_out     bigint NOT NULL DEFAULT 0,   -- guest to remote, frames let through
    bytes_in      bigint NOT NULL DEFAULT 0,
    packets_out   bigint NOT NULL DEFAULT 0,
    packets_in    bigint NOT NULL DEFAULT 0,
    UNIQUE (sandbox_id, flow_key)
);
CREATE INDEX sandbox_connections_time ON sandbox_connections (sandbox_id, opened_at, id);
CREATE INDEX sandbox_connections_age ON sandbox_connections (opened_at);

-- What the log could not hold, per sandbox and node: events lost because the kernel's ring was
-- full (read from the programs' counter), and rows over connlog_max_per_minute.
CREATE TABLE sandbox_connlog_lost (
    sandbox_id    text NOT NULL,
    node_id       text NOT NULL,
    ring_full     bigint NOT NULL DEFAULT 0,
    over_cap      bigint NOT NULL DEFAULT 0,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sandbox_id, node_id)
);
