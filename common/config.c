/*
 * config.c - the configuration table and its loader (see config.h).
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define F(field) offsetof(struct kiln_config, field)

static const char *const log_levels[] = { "debug", "info", "warn", "error", NULL };
static const char *const hypervisors[] = { "qemu", "firecracker", "hostagent", NULL };

const struct cfg_def config_table[] = {
	{ "log_level", CFG_STRING, F(log_level), "info", 0, 0, log_levels, true,
	  "least severe level logged" },
	{ "log_json", CFG_BOOL, F(log_json), "false", 0, 1, NULL, false,
	  "write JSON lines instead of text" },
	{ "database_url", CFG_STRING, F(database_url), "host=127.0.0.1 port=5432 dbname=kiln", 0, 0,
	  NULL, false, "libpq connection string of the Postgres database" },
	{ "redis_url", CFG_STRING, F(redis_url), "127.0.0.1:6379", 0, 0, NULL, false,
	  "Redis address: host:port or unix:/path/to/socket (unused when redis_sentinels is set)" },
	{ "redis_sentinels", CFG_STRING, F(redis_sentinels), "", 0, 0, NULL, false,
	  "Redis Sentinel addresses, host:port comma-separated (at most 8): Redis is the primary "
	  "they name redis_master_name; empty: redis_url" },
	{ "redis_master_name", CFG_STRING, F(redis_master_name), "kiln", 0, 0, NULL, false,
	  "the name Redis Sentinel monitors Kiln's Redis primary under (redis_sentinels)" },
	{ "data_dir", CFG_STRING, F(data_dir), "var", 0, 0, NULL, false,
	  "directory of persistent state" },
	{ "run_dir", CFG_STRING, F(run_dir), "/run/kiln", 0, 0, NULL, false,
	  "directory of sockets and pid files (keep it short: socket paths are at most 107 bytes)" },
	{ "master_key_file", CFG_STRING, F(master_key_file), NULL, 0, 0, NULL, false,
	  "file holding the 64-hex-digit master key (mode 0600)" },
	{ "master_key", CFG_STRING, F(master_key), NULL, 0, 0, NULL, false,
	  "the master key itself, 64 hex digits; overrides master_key_file" },
	{ "node_id", CFG_STRING, F(node_id), "node1", 0, 0, NULL, false,
	  "this host's node id: [a-z0-9-], at most 32 characters" },
	{ "storage_allow", CFG_STRING, F(storage_allow), "", 0, 0, NULL, false,
	  "hosts, addresses and networks (CIDR) tenants' bucket endpoints may reach although they are "
	  "private, loopback, link-local or this host's, comma-separated (e.g. minio.lan,10.0.5.0/24); "
	  "empty: none" },
	{ "listen", CFG_STRING, F(listen), "127.0.0.1:8080", 0, 0, NULL, false,
	  "address the gateway listens on, host:port" },
	{ "e2b_listen", CFG_STRING, F(e2b_listen), "127.0.0.1:8081", 0, 0, NULL, false,
	  "address of the gateway's E2B-compatible API (docs/e2b.md), host:port; empty: off" },
	{ "e2b_sandbox_listen", CFG_STRING, F(e2b_sandbox_listen), "127.0.0.1:8083", 0, 0, NULL,
	  false, "address of the gateway's E2B sandbox data plane, E2B_SANDBOX_URL (docs/e2b.md), "
	  "host:port; empty: off" },
	{ "db_pool_size", CFG_INT, F(db_pool_size), "8", 1, 64, NULL, false,
	  "Postgres connections each process keeps (the gateway 4 more for its audit trail)" },
	{ "http_max_connections", CFG_INT, F(http_max_connections), "1024", 1, 65536, NULL, false,
	  "concurrent HTTP connections accepted (one thread each)" },
	{ "http_body_max", CFG_INT, F(http_body_max), "1048576", 1024, 16777216, NULL, false,
	  "largest JSON request body, bytes" },
	{ "http_timeout_s", CFG_INT, F(http_timeout_s), "60", 1, 3600, NULL, false,
	  "seconds an idle connection stays open" },
	{ "http_max_connections_per_addr", CFG_INT, F(http_max_connections_per_addr), "32", 0,
	  65536, NULL, false,
	  "concurrent HTTP connections one client address (IPv6: its /64) may hold (0: no cap); "
	  "over it a new connection is answered 429 and closed" },
	{ "http_header_timeout_s", CFG_INT, F(http_header_timeout_s), "10", 0, 3600, NULL, false,
	  "seconds a request's headers may take to arrive, from the connection's start or the "
	  "previous reply (0: only the idle timeout)" },
	{ "http_body_min_rate", CFG_INT, F(http_body_min_rate), "1024", 0, 1073741824, NULL, false,
	  "bytes per second a request body must average: it may take http_header_timeout_s plus "
	  "1 s per this many bytes, else 408 and the connection closes (0: no check)" },
	{ "http_trusted_proxies", CFG_STRING, F(http_trusted_proxies), NULL, 0, 0, NULL, false,
	  "comma-separated addresses or CIDRs of proxies whose PROXY protocol header (v1 or v2) or "
	  "X-Forwarded-For names the client; from anyone else both are ignored" },
	{ "rate_limit_rps", CFG_INT, F(rate_limit_rps), "50", 1, 1000000, NULL, true,
	  "requests per second allowed per API key" },
	{ "rate_limit_burst", CFG_INT, F(rate_limit_burst), "100", 1, 1000000, NULL, true,
	  "requests an API key may send at once above its rate" },
	{ "create_limit_rpm", CFG_INT, F(create_limit_rpm), "60", 1, 1000000, NULL, true,
	  "sandbox creations per minute allowed per API key" },
	{ "tenant_rate_limit_rps", CFG_INT, F(tenant_rate_limit_rps), "100", 1, 1000000, NULL, true,
	  "requests per second allowed per tenant, all its API keys and tokens together" },
	{ "tenant_rate_limit_burst", CFG_INT, F(tenant_rate_limit_burst), "200", 1, 1000000, NULL,
	  true, "requests a tenant may send at once above its rate" },
	{ "tenant_create_limit_rpm", CFG_INT, F(tenant_create_limit_rpm), "120", 1, 1000000, NULL,
	  true, "sandbox creations per minute allowed per tenant, all its keys and tokens together" },
	{ "tenant_max_in_flight", CFG_INT, F(tenant_max_in_flight), "16", 1, 100000, NULL, true,
	  "requests of one tenant, all its keys and tokens together, in progress at once on one "
	  "gateway; past it the next is answered 429 at once" },
	{ "idempotency_ttl_s", CFG_INT, F(idempotency_ttl_s), "86400", 60, 2592000, NULL, false,
	  "seconds an Idempotency-Key's record is kept; a key reused after that is a new request" },
	{ "idempotency_sweep_s", CFG_INT, F(idempotency_sweep_s), "60", 1, 86400, NULL, false,
	  "seconds between the gateway's sweeps of expired Idempotency-Key records" },
	{ "idempotency_finish_s", CFG_INT, F(idempotency_finish_s), "30", 0, 3600, NULL, false,
	  "seconds a gateway keeps trying to record a request's outcome under its Idempotency-Key "
	  "while Postgres is down or switching primaries (after the reply, when its group could not "
	  "be written within 2 s; 0: one try)" },
	{ "snapshot_delete_after_zero_days", CFG_INT, F(snapshot_delete_after_zero_days), "0", 0,
	  3650, NULL, false,
	  "days a tenant's ledger balance may stay at or below zero before the gateway deletes its "
	  "paused sandboxes and their snapshots (0: never)" },
	{ "key_cache_s", CFG_INT, F(key_cache_s), "5", 0, 5, NULL, false,
	  "seconds a verified API key is trusted from memory (revocation reaches other gateways "
	  "within this bound)" },
	{ "admin_key_file", CFG_STRING, F(admin_key_file), NULL, 0, 0, NULL, false,
	  "file the operator's first admin API key is written to when the database has none" },
	{ "template_max_per_tenant", CFG_INT, F(template_max_per_tenant), "50", 1, 100000, NULL,
	  false, "templates (docs/templates.md) one tenant may have; past it POST /v1/templates of a "
	  "new name is 403 quota_exceeded" },
	{ "template_max_versions", CFG_INT, F(template_max_versions), "100", 1, 100000, NULL, false,
	  "versions one template may have; past it POST /v1/templates of its name is 403 "
	  "quota_exceeded" },
	{ "template_source_max_bytes", CFG_INT, F(template_source_max_bytes), "2147483648", 1,
	  1LL << 40, NULL, false,
	  "bytes of a template version's build context (PUT .../source); past it 413 naming the "
	  "setting" },
	{ "template_max_builds", CFG_INT, F(template_max_builds), "2", 1, 1000, NULL, false,
	  "template builds one tenant may run at once; past it PUT .../source is 429 naming the "
	  "setting" },
	{ "template_build_max_s", CFG_INT, F(template_build_max_s), "1800", 10, 86400, NULL, false,
	  "seconds one template build may take, its steps, start command and ready check included; "
	  "past it the build fails naming the setting" },
	{ "template_image_max_bytes", CFG_INT, F(template_image_max_bytes), "8589934592", 1 << 20,
	  1LL << 42, NULL, false,
	  "bytes a built template's image (memory and disk, as the host measures it) may take; past "
	  "it the build fails naming the setting" },
	{ "template_build_log_max_bytes", CFG_INT, F(template_build_log_max_bytes), "1048576", 4096,
	  1LL << 30, NULL, false,
	  "bytes of one template build's log that are kept (the rest is cut, saying so)" },
	{ "node_listen", CFG_STRING, F(node_listen), NULL, 0, 0, NULL, false,
	  "kiln-node's API: unix:/path or host:port (default unix:<run_dir>/node.sock)" },
	{ "node_address", CFG_STRING, F(node_address), NULL, 0, 0, NULL, false,
	  "how gateways reach this node (default: node_listen)" },
	{ "gateway_url", CFG_STRING, F(gateway_url), "http://127.0.0.1:8080", 0, 0, NULL, false,
	  "a gateway's base URL, where the node fetches the JWKS that verifies requests" },
	{ "node_max_sandboxes", CFG_INT, F(node_max_sandboxes), "32", 1, 16384, NULL, false,
	  "sandboxes this node runs at once" },
	{ "node_vcpu_milli", CFG_INT, F(node_vcpu_milli), "16000", 250, 4096000, NULL, false,
	  "thousandths of a vCPU this node hands out (may exceed its cores)" },
	{ "node_memory_mib", CFG_INT, F(node_memory_mib), "16384", 256, 16777216, NULL, false,
	  "guest memory this node hands out, MiB" },
	{ "node_disk_gib", CFG_INT, F(node_disk_gib), "0", 0, 1073741824, NULL, false,
	  "disk for sandboxes' layers, GiB (0: the size of data_dir's file system)" },
	{ "node_disk_overcommit_pct", CFG_INT, F(node_disk_overcommit_pct), "100", 10, 1000, NULL,
	  false, "disk promised to sandboxes, percent of node_disk_gib (over 100 risks ENOSPC in guests)" },
	{ "hypervisor", CFG_STRING, F(hypervisor), "qemu", 0, 0, hypervisors, false,
	  "the VMM driver (hostagent: a bench and test hook running the guest agent on the host, "
	  "never for tenants; docs/vmm.md)" },
	{ "hypervisor_binary", CFG_STRING, F(hypervisor_binary), "", 0, 0, NULL, false,
	  "the VMM driver's program; empty: its default (hostagent: the kiln-agent binary, required)" },
	{ "tcg_tb_size_mib", CFG_INT, F(tcg_tb_size_mib), "32", 8, 1024, NULL, false,
	  "TCG translation cache per VM, MiB (software emulation only)" },
	{ "free_page_reporting", CFG_BOOL, F(free_page_reporting), "true", 0, 1, NULL, false,
	  "a booted sandbox's guest hands the memory it frees back to the host (virtio-balloon free "
	  "page reporting; a shared memory image stays whole: docs/vmm.md)" },
	{ "guest_kernel", CFG_STRING, F(guest_kernel), NULL, 0, 0, NULL, false,
	  "guest kernel (vmm/guest/build-image.sh --print-env)" },
	{ "guest_initrd", CFG_STRING, F(guest_initrd), NULL, 0, 0, NULL, false,
	  "guest initramfs" },
	{ "guest_rootfs", CFG_STRING, F(guest_rootfs), NULL, 0, 0, NULL, false,
	  "guest root file system image" },
	{ "guest_codeint_rootfs", CFG_STRING, F(guest_codeint_rootfs), "", 0, 0, NULL, false,
	  "root file system of the code interpreter's image (template code-interpreter-v1; "
	  "build-image.sh --print-env); empty: that template is refused" },
	{ "guest_cmdline", CFG_STRING, F(guest_cmdline), NULL, 0, 0, NULL, false,
	  "guest kernel command line" },
	{ "guest_image_hash", CFG_STRING, F(guest_image_hash), "", 0, 0, NULL, false,
	  "hash of the guest image's recipe (recorded with the node and in snapshots)" },
	{ "guest_apt_mirror", CFG_STRING, F(guest_apt_mirror), "http://deb.debian.org/debian", 0, 0,
	  NULL, false,
	  "Debian mirror the guest image is built from and its /etc/apt/sources.list names "
	  "(security updates: the same URL with \"-security\" appended); read by "
	  "vmm/guest/build-image.sh as KILN_GUEST_APT_MIRROR and part of the image's recipe hash" },
	{ "boot_timeout_s", CFG_INT, F(boot_timeout_s), "120", 5, 3600, NULL, false,
	  "seconds a cold boot may take until the guest agent answers" },
	{ "exec_output_max", CFG_INT, F(exec_output_max), "10485760", 1024, 104857600, NULL, false,
	  "bytes of stdout (and of stderr) a non-streamed exec returns, measured JSON-encoded; the "
	  "rest is cut" },
	{ "node_exec_memory_max", CFG_INT, F(node_exec_memory_max), "1073741824", 16777216,
	  1099511627776LL, NULL, false,
	  "bytes of node memory all execs' output may hold at once (non-streamed: twice their "
	  "buffers, for the reply's copy; streamed: a fixed window); when used up a new exec gets "
	  "429 naming the limit, and a running one's output is cut as at exec_output_max" },
	{ "exec_max_per_sandbox", CFG_INT, F(exec_max_per_sandbox), "8", 1, 1024, NULL, false,
	  "execs one sandbox runs at once on its node (more: 429 naming the limit)" },
	{ "exec_max_per_tenant", CFG_INT, F(exec_max_per_tenant), "16", 1, 65536, NULL, false,
	  "execs one tenant's sandboxes run at once on one node (more: 429 naming the limit)" },
	{ "port_connect_timeout_ms", CFG_INT, F(port_connect_timeout_ms), "10000", 100, 600000, NULL,
	  false, "milliseconds a sandbox's port may take to accept a stream's connection (more: 504 "
	  "port_timeout)" },
	{ "port_streams_max_per_sandbox", CFG_INT, F(port_streams_max_per_sandbox), "64", 1, 64,
	  NULL, false, "port streams one sandbox carries at once on its node (more: 429 naming the "
	  "limit; the guest's agent carries 64 at most)" },
	{ "port_streams_max_per_tenant", CFG_INT, F(port_streams_max_per_tenant), "64", 1, 65536,
	  NULL, false, "port streams (and probes) one tenant holds open at once, counted across gateways "
	  "in Redis (each gateway's own count while Redis is down; more: 429 naming the limit)" },
	{ "ports_listen", CFG_STRING, F(ports_listen), "127.0.0.1:8082", 0, 0, NULL, false,
	  "address of the gateway's port URL listener, host:port: servers in sandboxes at "
	  "{port}-{id}.{ports_domain}, never the API (docs/ports.md)" },
	{ "ports_domain", CFG_STRING, F(ports_domain), "localhost", 0, 0, NULL, false,
	  "the domain of port URLs {port}-{id}.{ports_domain}; its names must resolve to the ports "
	  "listener (localhost's do in browsers)" },
	{ "ports_max_connections", CFG_INT, F(ports_max_connections), "1024", 1, 65536, NULL, false,
	  "connections the port URL listener holds at once (one thread each; more: 503 and closed)" },
	{ "port_url_ttl_max_s", CFG_INT, F(port_url_ttl_max_s), "86400", 60, 31536000, NULL, false,
	  "longest life in seconds a signed port URL may ask for (expires_in_s; more: 422)" },
	{ "port_public_max_per_sandbox", CFG_INT, F(port_public_max_per_sandbox), "16", 1, 65535,
	  NULL, false, "ports one sandbox may make public at once (more: 403 quota_exceeded naming "
	  "the limit)" },
	{ "port_public_wakes_per_hour", CFG_INT, F(port_public_wakes_per_hour), "60", 1, 3600, NULL,
	  false, "times per hour (a burst of as many) requests without a credential to a public port "
	  "may resume one paused sandbox with auto_resume (more: 429 naming the limit)" },
	{ "console_max_bytes", CFG_INT, F(console_max_bytes), "1048576", 65536, 1073741824, NULL,
	  false, "bytes of a sandbox's guest console kept on the node's disk (the newest half at "
	  "least; older output is dropped)" },
	{ "disk_iops_per_vcpu", CFG_INT, F(disk_iops_per_vcpu), "2000", 0, 10000000, NULL, false,
	  "disk I/O operations per second a sandbox may do, per whole vCPU (0: unlimited)" },
	{ "disk_mibps_per_vcpu", CFG_INT, F(disk_mibps_per_vcpu), "64", 0, 1000000, NULL, false,
	  "disk MiB per second a sandbox may read and write, per whole vCPU (0: unlimited)" },
	{ "node_network_setup", CFG_BOOL, F(node_network_setup), "true", 0, 1, NULL, false,
	  "kiln-node sets the host's network up at start: its nftables table inet kiln_<node id> "
	  "(masquerade of the sandbox ranges, forwarding from them, their traffic to the host's own "
	  "input dropped), IPv4 and IPv6 forwarding on (never off); the table goes at a clean stop. "
	  "false: a host whose network is set up otherwise" },
	{ "conntrack_max_per_sandbox", CFG_INT, F(conntrack_max_per_sandbox), "4096", 16, 1048576,
	  NULL, false, "connections one sandbox may have open at once through the host's masquerade "
	  "(tracked by the host, node_network_setup); past it a new one is refused (TCP: a reset)" },
	{ "dns_upstream", CFG_STRING, F(dns_upstream), NULL, 0, 0, NULL, false,
	  "resolver the sandboxes' DNS proxy forwards to: addr or addr:port (default: the first "
	  "nameserver of /etc/resolv.conf)" },
	{ "conn_rate", CFG_INT, F(conn_rate), "100", 1, 1000000, NULL, false,
	  "new connections per second a sandbox may open, even while egress is open" },
	{ "conn_burst", CFG_INT, F(conn_burst), "200", 1, 1000000, NULL, false,
	  "new connections a sandbox may open at once above that rate" },
	{ "egress_deny", CFG_STRING, F(egress_deny),
	  "host,127.0.0.0/8,169.254.0.0/16,0.0.0.0/8,10.0.0.0/8,100.64.0.0/10,172.16.0.0/12,"
	  "192.168.0.0/16,224.0.0.0/4,240.0.0.0/4,::1/128,fe80::/10,::/128,::ffff:0:0/96,"
	  "64:ff9b::/96,64:ff9b:1::/48,100::/64,fc00::/7,fec0::/10,ff00::/8", 0, 0, NULL, false,
	  "CIDRs sandboxes never reach, whatever their egress rules (a rule inside one is refused "
	  "with 422); \"host\" is the host's own addresses. Loopback, link-local, the host and the "
	  "sandboxes' ranges are denied even when left out" },
	{ "dns_pending_per_sandbox", CFG_INT, F(dns_pending_per_sandbox), "64", 1, 4096, NULL, false,
	  "DNS queries one sandbox may have waiting on the upstream resolver (more are REFUSED)" },
	{ "sniproxy_conns_per_sandbox", CFG_INT, F(sniproxy_conns_per_sandbox), "256", 1, 65536,
	  NULL, false, "connections one sandbox may have open through the name-checking proxy at once "
	  "(more are reset)" },
	{ "sniproxy_conns", CFG_INT, F(sniproxy_conns), "4096", 1, 1000000, NULL, false,
	  "connections all sandboxes of the node may have open through the name-checking proxy" },
	{ "sniproxy_handshakes_per_sandbox", CFG_INT, F(sniproxy_handshakes_per_sandbox), "50", 1,
	  100000, NULL, false, "new connections a second one sandbox may open through the "
	  "name-checking proxy (more are reset)" },
	{ "sniproxy_handshakes", CFG_INT, F(sniproxy_handshakes), "1000", 1, 1000000, NULL, false,
	  "new connections a second all sandboxes may open through the name-checking proxy" },
	{ "connlog_max_per_minute", CFG_INT, F(connlog_max_per_minute), "600", 1, 1000000, NULL,
	  false, "connections (and refused attempts) a sandbox's connection log records per minute; "
	  "more are counted as lost" },
	{ "connlog_retention_days", CFG_INT, F(connlog_retention_days), "30", 1, 3650, NULL, false,
	  "days the connection log keeps a row" },
	{ "secrets_max", CFG_INT, F(secrets_max), "16", 0, 256, NULL, false,
	  "secrets (host, header, value) one sandbox may hold (PUT /v1/sandboxes/{id}/secrets)" },
	{ "secret_value_max", CFG_INT, F(secret_value_max), "8192", 1, 65536, NULL, false,
	  "bytes of one secret's value" },
	{ "inject_ca_file", CFG_STRING, F(inject_ca_file), NULL, 0, 0, NULL, false,
	  "PEM file of the CAs the injecting proxy trusts for secrets' upstreams (default: the "
	  "system's trust store)" },
	{ "inject_connections_max", CFG_INT, F(inject_connections_max), "256", 1, 65536, NULL, false,
	  "connections the injecting proxy of a node relays at once (for hosts with secrets)" },
	{ "inject_connections_per_sandbox", CFG_INT, F(inject_connections_per_sandbox), "32", 1,
	  65536, NULL, false,
	  "of those, connections one sandbox may have relayed at once" },
	{ "connlog_interval_s", CFG_INT, F(connlog_interval_s), "5", 1, 300, NULL, false,
	  "seconds between the node's reads of its sandboxes' connection logs" },
	{ "connlog_requests_per_conn", CFG_INT, F(connlog_requests_per_conn), "100", 1, 10000, NULL,
	  false, "requests of one connection through the injecting proxy the connection log records "
	  "(more are relayed, not logged)" },
	{ "templates", CFG_BOOL, F(templates), "true", 0, 1, NULL, false,
	  "create sandboxes by restoring a pre-booted template of their shape (cold boot until "
	  "one is ready)" },
	{ "template_default", CFG_BOOL, F(template_default), "true", 0, 1, NULL, false,
	  "build the template of the default shape (1 vCPU, 512 MiB, 10 GiB) when the node starts" },
	{ "template_warm_vms", CFG_INT, F(template_warm_vms), "1", 0, 4, NULL, false,
	  "VMMs started ahead per ready template, each waiting for a create of its shape to load "
	  "the template's state (0: none; a create then starts its own)" },
	{ "template_warm_refill_ms", CFG_INT, F(template_warm_refill_ms), "400", 0, 60000, NULL,
	  false, "milliseconds after a create took a VMM started ahead that the next is begun (past "
	  "most of that create, not to share the CPU with it); creates coming meanwhile do not put "
	  "it off" },
	{ "paused_warm_vms", CFG_INT, F(paused_warm_vms), "2", 0, 16, NULL, false,
	  "paused sandboxes, the latest paused on this node, each with a VMM started ahead on its "
	  "snapshot that a resume takes (0: none; a resume then starts its own)" },
	{ "node_down_after_s", CFG_INT, F(node_down_after_s), "10", 3, 3600, NULL, false,
	  "seconds after a node's last heartbeat that it is marked down: no work for it, its running "
	  "sandboxes lost (node_down), its paused ones resumable elsewhere from their bucket" },
	{ "node_drain_wait_s", CFG_INT, F(node_drain_wait_s), "300", 10, 3600, NULL, false,
	  "seconds a drain (POST /v1/admin/nodes/{id}/drain) waits for each sandbox's pause, its "
	  "snapshot's upload to its bucket and its resume elsewhere" },
	{ "template_idle_s", CFG_INT, F(template_idle_s), "1800", 60, 604800, NULL, false,
	  "seconds an unused template is kept before it is retired" },
	{ "meter_window_s", CFG_INT, F(meter_window_s), "10", 1, 3600, NULL, false,
	  "kiln-meter: seconds of each billing window written to the ledger (aligned to the epoch)" },
	{ "meter_series_s", CFG_INT, F(meter_series_s), "900", 60, 86400, NULL, false,
	  "kiln-meter: seconds of per-second usage series kept in Redis" },
	{ "meter_live_ttl_s", CFG_INT, F(meter_live_ttl_s), "30", 3, 3600, NULL, false,
	  "kiln-meter: seconds after a meter's last tick that its unflushed charges (its live "
	  "balance field in Redis) are dropped by other meters and readers" },
	{ "meter_log_keep_s", CFG_INT, F(meter_log_keep_s), "86400", 600, 31536000, NULL, false,
	  "kiln-meter: seconds a sandbox generation's state changes are kept once billed" },
	{ "meter_commit_wait_ms", CFG_INT, F(meter_commit_wait_ms), "10000", 0, 60000, NULL, false,
	  "kiln-meter: ms billing may stay behind the clock for a database transaction still open "
	  "(a sandbox's end it commits late is billed to its own time; 0: never waits)" },
	{ "meter_cgroup_root", CFG_STRING, F(meter_cgroup_root), NULL, 0, 0, NULL, false,
	  "kiln-meter: where the cgroup hierarchies are mounted (default /sys/fs/cgroup)" },
	{ "meter_pin_root", CFG_STRING, F(meter_pin_root), NULL, 0, 0, NULL, false,
	  "kiln-meter: where the eBPF counters are pinned (default /sys/fs/bpf/kiln)" },
	{ "price_cpu_ucr_per_cpu_s", CFG_INT, F(price_cpu_ucr_per_cpu_s), "100", 0, 1000000000,
	  NULL, false, "µcr per CPU-second a sandbox uses (measured)" },
	{ "price_mem_ucr_per_gib_s", CFG_INT, F(price_mem_ucr_per_gib_s), "50", 0, 1000000000, NULL,
	  false, "µcr per GiB-second of memory allocated to a running sandbox" },
	{ "price_disk_ucr_per_gib_s", CFG_INT, F(price_disk_ucr_per_gib_s), "2", 0, 1000000000, NULL,
	  false, "µcr per GiB-second of disk allocated to a running sandbox" },
	{ "price_snapshot_ucr_per_gib_s", CFG_INT, F(price_snapshot_ucr_per_gib_s), "1", 0,
	  1000000000, NULL, false, "µcr per GiB-second of a paused sandbox's snapshot" },
	{ "plan_max_sandboxes", CFG_INT, F(plan_max_sandboxes), "10", 1, 1000000, NULL, false,
	  "plans without limits of their own: sandboxes creating or running at once" },
	{ "plan_max_vcpu_milli", CFG_INT, F(plan_max_vcpu_milli), "16000", 250, 1000000000, NULL,
	  false, "plans without limits of their own: thousandths of vCPUs creating or running" },
	{ "plan_max_memory_mib", CFG_INT, F(plan_max_memory_mib), "32768", 256, 1000000000, NULL,
	  false, "plans without limits of their own: MiB of memory creating or running" },
	{ "plan_max_snapshot_gib", CFG_INT, F(plan_max_snapshot_gib), "50", 0, 1000000, NULL, false,
	  "plans without limits of their own: GiB of snapshots kept" },
};
const size_t config_table_len = sizeof(config_table) / sizeof(config_table[0]);

static const struct cfg_def *config_find(const char *name)
{
	for (size_t i = 0; i < config_table_len; i++)
		if (strcmp(config_table[i].name, name) == 0)
			return &config_table[i];
	return NULL;
}

static int parse_bool(const char *s, bool *out)
{
	if (!strcmp(s, "true") || !strcmp(s, "yes") || !strcmp(s, "on") || !strcmp(s, "1"))
		*out = true;
	else if (!strcmp(s, "false") || !strcmp(s, "no") || !strcmp(s, "off") || !strcmp(s, "0"))
		*out = false;
	else
		return -EINVAL;
	return 0;
}

static int parse_int(const char *s, long long *out)
{
	char *end;

	if (!*s || isspace((unsigned char)*s))
		return -EINVAL;
	errno = 0;
	*out = strtoll(s, &end, 10);
	if (errno || *end)
		return -EINVAL;
	return 0;
}

enum kiln_err config_set(struct kiln_config *cfg, const char *name, const char *value,
			 const char *origin, struct kiln_error *err)
{
	const struct cfg_def *d = config_find(name);
	char *base = (char *)cfg;

	if (!d)
		return kiln_error_set(err, KILN_E_INVALID, "%s: unknown setting \"%s\"", origin, name);
	switch (d->type) {
	case CFG_BOOL: {
		bool b;
		if (parse_bool(value, &b))
			return kiln_error_set(err, KILN_E_INVALID,
					      "%s: setting \"%s\" must be true or false, not \"%s\"",
					      origin, name, value);
		*(bool *)(base + d->offset) = b;
		break;
	}
	case CFG_INT: {
		long long v;
		if (parse_int(value, &v))
			return kiln_error_set(err, KILN_E_INVALID,
					      "%s: setting \"%s\" must be a whole number, not \"%s\"",
					      origin, name, value);
		if (v < d->min || v > d->max)
			return kiln_error_set(err, KILN_E_INVALID,
					      "%s: setting \"%s\" is %lld, outside %lld..%lld", origin,
					      name, v, d->min, d->max);
		*(long long *)(base + d->offset) = v;
		break;
	}
	case CFG_STRING: {
		char **slot = (char **)(base + d->offset);
		char *copy;
		if (d->choices) {
			bool ok = false;
			for (const char *const *c = d->choices; *c; c++)
				ok = ok || strcmp(*c, value) == 0;
			if (!ok)
				return kiln_error_set(err, KILN_E_INVALID,
						      "%s: setting \"%s\" has no choice \"%s\"",
						      origin, name, value);
		}
		if (strlen(value) > 4096)
			return kiln_error_set(err, KILN_E_INVALID,
					      "%s: setting \"%s\" is longer than 4096 bytes", origin,
					      name);
		copy = strdup(value);
		if (!copy)
			return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		free(*slot);
		*slot = copy;
		break;
	}
	}
	return KILN_OK;
}

static char *trim(char *s)
{
	char *e;

	while (isspace((unsigned char)*s))
		s++;
	e = s + strlen(s);
	while (e > s && isspace((unsigned char)e[-1]))
		*--e = '\0';
	return s;
}

static enum kiln_err config_load_file(struct kiln_config *cfg, const char *path, bool must_exist,
				      struct kiln_error *err)
{
	char line[8192], origin[4200];
	enum kiln_err rc = KILN_OK;
	unsigned lineno = 0;
	FILE *f = fopen(path, "r");

	if (!f) {
		if (errno == ENOENT && !must_exist)
			return KILN_OK;
		return kiln_error_set(err, KILN_E_INVALID, "cannot read config file \"%s\": %s", path,
				      strerror(errno));
	}
	while (rc == KILN_OK && fgets(line, sizeof(line), f)) {
		char *s, *eq, *name, *value;

		lineno++;
		snprintf(origin, sizeof(origin), "%s:%u", path, lineno);
		if (!strchr(line, '\n') && !feof(f)) {
			rc = kiln_error_set(err, KILN_E_INVALID, "%s: line too long", origin);
			break;
		}
		s = trim(line);
		if (!*s || *s == '#')
			continue;
		eq = strchr(s, '=');
		if (!eq) {
			rc = kiln_error_set(err, KILN_E_INVALID, "%s: expected \"name = value\"",
					    origin);
			break;
		}
		*eq = '\0';
		name = trim(s);
		value = trim(eq + 1);
		rc = config_set(cfg, name, value, origin, err);
	}
	fclose(f);
	return rc;
}

enum kiln_err config_load(struct kiln_config *cfg, const char *path, bool must_exist,
			  struct kiln_error *err)
{
	enum kiln_err rc = KILN_OK;

	memset(cfg, 0, sizeof(*cfg));
	for (size_t i = 0; rc == KILN_OK && i < config_table_len; i++)
		if (config_table[i].def)
			rc = config_set(cfg, config_table[i].name, config_table[i].def, "default",
					err);
	if (rc == KILN_OK && path)
		rc = config_load_file(cfg, path, must_exist, err);
	for (size_t i = 0; rc == KILN_OK && i < config_table_len; i++) {
		char env[96], origin[120];
		const char *v;
		size_t j;

		memcpy(env, "KILN_", 5);
		for (j = 0; config_table[i].name[j] && j < sizeof(env) - 6; j++)
			env[5 + j] = (char)toupper((unsigned char)config_table[i].name[j]);
		env[5 + j] = '\0';
		v = getenv(env);
		if (!v)
			continue;
		snprintf(origin, sizeof(origin), "environment %s", env);
		rc = config_set(cfg, config_table[i].name, v, origin, err);
	}
	if (rc != KILN_OK)
		config_release(cfg);
	return rc;
}

void config_release(struct kiln_config *cfg)
{
	if (!cfg)
		return;
	for (size_t i = 0; i < config_table_len; i++) {
		if (config_table[i].type == CFG_STRING) {
			char **slot = (char **)((char *)cfg + config_table[i].offset);
			free(*slot);
			*slot = NULL;
		}
	}
}

void config_help(FILE *out)
{
	static const char *const type_names[] = { "string", "integer", "boolean" };

	fprintf(out, "Settings (file: name = value; environment: KILN_<NAME>, which wins):\n");
	for (size_t i = 0; i < config_table_len; i++) {
		const struct cfg_def *d = &config_table[i];
		char env[96];
		size_t j;

		for (j = 0; d->name[j] && j < sizeof(env) - 1; j++)
			env[j] = (char)toupper((unsigned char)d->name[j]);
		env[j] = '\0';
		fprintf(out, "  %-22s KILN_%-22s %s", d->name, env, type_names[d->type]);
		if (d->type == CFG_INT)
			fprintf(out, " %lld..%lld", d->min, d->max);
		if (d->choices) {
			fprintf(out, " (");
			for (const char *const *c = d->choices; *c; c++)
				fprintf(out, "%s%s", c == d->choices ? "" : "|", *c);
			fprintf(out, ")");
		}
		fprintf(out, ", default %s%s\n      %s\n", d->def ? d->def : "(none)",
			d->live ? ", live" : "", d->help);
	}
}
