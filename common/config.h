/*
 * config.h - the declarative configuration table.
 *
 * Every setting of every Kiln process is one row of `config_table` (config.c): its name, type,
 * bounds, default, the field of `struct kiln_config` it fills, whether it may change while running,
 * and a line of help. Values come from the defaults, then the file (`name = value` lines, `#`
 * comments), then environment variables named KILN_<NAME> (upper case), each overriding the last.
 * Everything is validated at load; the first bad value stops the load with a message naming it.
 */
#ifndef KILN_CONFIG_H
#define KILN_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "common/err.h"

struct kiln_config {
	/* every process */
	char *log_level;	/* debug, info, warn, error */
	bool log_json;
	char *database_url;	/* libpq connection string */
	char *redis_url;	/* host:port or unix:/path */
	char *redis_sentinels;	/* host:port,...: Sentinel discovery instead of redis_url */
	char *redis_master_name;	/* the primary's name in Sentinel */
	char *data_dir;		/* persistent state */
	char *run_dir;		/* sockets and pid files; short path */
	char *master_key_file;	/* file holding the hex master key */
	char *master_key;	/* hex master key; overrides the file */
	char *node_id;		/* this host's node id */
	char *storage_allow;	/* hosts/networks tenants' bucket endpoints may reach although
				   private, loopback or this host's (common/netaddr.h) */

	/* kiln-gateway */
	char *listen;		/* host:port */
	char *e2b_listen;	/* host:port of the E2B-compatible API; "" = off */
	char *e2b_sandbox_listen;	/* host:port of E2B's sandbox data plane; "" = off */
	long long db_pool_size;	/* Postgres connections per process */
	long long http_max_connections;
	long long http_body_max;	/* bytes, JSON bodies */
	long long http_timeout_s;	/* seconds of idle before a connection is closed */
	long long http_max_connections_per_addr;	/* concurrent connections per client address */
	long long http_header_timeout_s;	/* seconds a request's headers may take */
	long long http_body_min_rate;	/* bytes/s a request body must keep up (0 = no check) */
	char *http_trusted_proxies;	/* addresses/CIDRs whose PROXY header or XFF is believed */
	long long rate_limit_rps;	/* requests per second per key */
	long long rate_limit_burst;
	long long create_limit_rpm;	/* sandbox creations per minute per key */
	long long tenant_rate_limit_rps;	/* requests per second per tenant, all its keys */
	long long tenant_rate_limit_burst;
	long long tenant_create_limit_rpm;	/* sandbox creations per minute per tenant */
	long long tenant_max_in_flight;	/* a tenant's requests in progress at once, per gateway */
	long long idempotency_ttl_s;	/* an Idempotency-Key record's lifetime */
	long long idempotency_sweep_s;	/* seconds between sweeps of expired records */
	long long idempotency_finish_s;	/* seconds an outcome's record is retried over a failover */
	long long snapshot_delete_after_zero_days;	/* paused sandboxes of a tenant at/below zero
							   this long are deleted; 0: never */
	long long key_cache_s;		/* seconds an authenticated key is trusted from cache */
	char *admin_key_file;		/* where the operator's first admin key is written */
	long long template_max_per_tenant;	/* live templates of one tenant */
	long long template_max_versions;	/* versions of one template */
	long long template_source_max_bytes;	/* bytes of a build context upload */
	long long template_max_builds;	/* template builds of one tenant running at once */
	long long template_build_max_s;	/* seconds one template build may take */
	long long template_image_max_bytes;	/* bytes a built image (memory + disk) may take */
	long long template_build_log_max_bytes;	/* bytes of one build's log kept */

	/* kiln-node */
	char *node_listen;		/* unix:/path or host:port of the node's API */
	char *node_address;		/* how gateways reach the node (defaults to node_listen) */
	char *gateway_url;		/* where the node fetches the JWKS */
	long long node_max_sandboxes;
	long long node_vcpu_milli;	/* thousandths of a vCPU the node hands out */
	long long node_memory_mib;	/* guest memory the node hands out */
	long long node_disk_gib;	/* disk for sandboxes, GiB; 0: the size of data_dir's file system */
	long long node_disk_overcommit_pct;	/* disk promised to sandboxes, % of node_disk_gib */
	char *hypervisor;		/* qemu */
	char *hypervisor_binary;	/* the driver's program; "": its default */
	long long tcg_tb_size_mib;	/* TCG translation cache per VM */
	bool free_page_reporting;	/* booted VMs get the free page reporting balloon */
	char *guest_kernel;
	char *guest_initrd;
	char *guest_rootfs;
	char *guest_codeint_rootfs;	/* the code interpreter's image (code-interpreter-v1), or "" */
	char *guest_cmdline;
	char *guest_image_hash;
	char *guest_apt_mirror;		/* Debian mirror the image is built from and names */
	long long boot_timeout_s;	/* cold boot until the agent answers */
	long long exec_output_max;	/* bytes of stdout (and of stderr) an exec returns in JSON */
	long long node_exec_memory_max;	/* bytes all execs' output may hold at once on a node */
	long long exec_max_per_sandbox;	/* execs a sandbox runs at once */
	long long port_connect_timeout_ms;	/* a port stream's connect in the guest */
	long long port_streams_max_per_sandbox;	/* port streams a sandbox carries at once */
	long long port_streams_max_per_tenant;	/* port streams a tenant holds through a gateway */
	char *ports_listen;	/* the port URLs' listener, host:port (api/portproxy.c) */
	char *ports_domain;	/* port URLs are {port}-{id}.{ports_domain} */
	long long ports_max_connections;	/* connections the ports listener holds at once */
	long long port_url_ttl_max_s;	/* longest life of a signed port URL */
	long long port_public_max_per_sandbox;	/* ports one sandbox may make public */
	long long port_public_wakes_per_hour;	/* auto-resumes public requests may cause per sandbox */
	long long exec_max_per_tenant;	/* execs a tenant's sandboxes run at once on a node */
	long long console_max_bytes;	/* guest console kept on disk per sandbox */
	long long disk_iops_per_vcpu;	/* disk throttle per whole vCPU, 0 = none */
	long long disk_mibps_per_vcpu;
	bool node_network_setup;	/* install the node's nftables table, turn forwarding on */
	long long conntrack_max_per_sandbox;	/* a sandbox's masqueraded connections at once */
	char *dns_upstream;		/* resolver the guests' DNS proxy forwards to */
	long long conn_rate;		/* new connections per second a sandbox may open */
	long long conn_burst;
	char *egress_deny;		/* CIDRs no egress rule can open ("host": the host's own) */
	long long dns_pending_per_sandbox;	/* UDP queries one sandbox may have upstream */
	long long sniproxy_conns_per_sandbox;	/* name-checking proxy: connections at once */
	long long sniproxy_conns;
	long long sniproxy_handshakes_per_sandbox;	/* new connections a second */
	long long sniproxy_handshakes;
	long long connlog_max_per_minute;	/* connection-log rows a sandbox may add a minute */
	long long connlog_retention_days;	/* connection-log rows older are deleted */
	long long connlog_interval_s;		/* how often the node reads the connection logs */
	long long connlog_requests_per_conn;	/* injector requests logged per connection */
	long long secrets_max;			/* secrets one sandbox may hold */
	long long secret_value_max;		/* bytes of one secret's value */
	char *inject_ca_file;			/* upstream trust of the injecting proxy (NULL: system) */
	long long inject_connections_max;	/* connections the injecting proxy relays at once */
	long long inject_connections_per_sandbox;	/* of which one sandbox's */
	bool templates;			/* create sandboxes by restoring pre-booted templates */
	bool template_default;		/* build the default shape's template at start */
	long long template_warm_vms;	/* VMMs started ahead per ready template (node/warm.c) */
	long long template_warm_refill_ms;	/* from a take to the next begin (node/warm.c) */
	long long paused_warm_vms;	/* latest paused sandboxes with a VMM started ahead */
	long long node_down_after_s;	/* a node this long without a heartbeat is down */
	long long node_drain_wait_s;	/* a drain waits this long for each sandbox's move */
	long long template_idle_s;	/* retire a template unused this long */

	/* kiln-meter */
	long long meter_window_s;	/* ledger window, seconds */
	long long meter_series_s;	/* seconds of per-second usage kept in Redis */
	long long meter_live_ttl_s;	/* a stopped meter's live fields are dropped after this */
	long long meter_log_keep_s;	/* billed state changes are kept this long */
	long long meter_commit_wait_ms;	/* billing waits this long at most for an open transaction */
	char *meter_cgroup_root;	/* cgroup mount root (default /sys/fs/cgroup) */
	char *meter_pin_root;		/* eBPF pin root (default /sys/fs/bpf/kiln) */
	long long price_cpu_ucr_per_cpu_s;	/* µcr per CPU-second used */
	long long price_mem_ucr_per_gib_s;	/* µcr per GiB-second of memory, running */
	long long price_disk_ucr_per_gib_s;	/* µcr per GiB-second of disk, running */
	long long price_snapshot_ucr_per_gib_s;	/* µcr per GiB-second of a pause snapshot */
	long long plan_max_sandboxes;	/* default plan: sandboxes running at once */
	long long plan_max_vcpu_milli;	/* default plan: thousandths of vCPUs running */
	long long plan_max_memory_mib;	/* default plan: memory of running sandboxes */
	long long plan_max_snapshot_gib;	/* default plan: snapshot storage */
};

enum cfg_type { CFG_STRING, CFG_INT, CFG_BOOL };

struct cfg_def {
	const char *name;	/* lowercase, [a-z0-9_]; the env name is KILN_ + upper(name) */
	enum cfg_type type;
	size_t offset;		/* of the field in struct kiln_config */
	const char *def;	/* default as text; NULL means "no value" for strings */
	long long min, max;	/* CFG_INT bounds, inclusive */
	const char *const *choices;	/* CFG_STRING: NULL-terminated allowed values, or NULL */
	bool live;		/* may change without a restart */
	const char *help;
};

extern const struct cfg_def config_table[];
extern const size_t config_table_len;

/*
 * Fills `cfg` from the defaults, then `path` (if not NULL; a missing file is an error only when
 * `must_exist`), then the environment. On error returns KILN_E_INVALID with `err` naming the
 * setting, and `cfg` holds nothing that needs freeing. On success release with config_release().
 */
enum kiln_err config_load(struct kiln_config *cfg, const char *path, bool must_exist,
			  struct kiln_error *err);

/* Sets one setting from text, validating it; `origin` names where it came from in messages. */
enum kiln_err config_set(struct kiln_config *cfg, const char *name, const char *value,
			 const char *origin, struct kiln_error *err);

/* Frees the strings of `cfg`. Accepts NULL. */
void config_release(struct kiln_config *cfg);

/* Prints every setting: name, env variable, type, bounds, default, live, help. */
void config_help(FILE *out);

#endif
