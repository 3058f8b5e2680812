/*
 * main.c - kiln-node's start, heartbeat and stop.
 *
 * Start order is the table at the bottom, stop order its reverse. A thread of its own renews the
 * node's heartbeat in Postgres on a connection of its own; once a second a ticker thread discards
 * the VMs no longer this node's, marks lapsed nodes down and pauses sandboxes past their expiry.
 * A node that restarts after a crash first takes over what its previous run left (recovery.c).
 */
#include <curl/curl.h>
#include <errno.h>
#include <glob.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/daemon.h"
#include "common/log.h"
#include "auth/masterkey.h"
#include "migrations/migrate.h"
#include "netpolicy/dns.h"
#include "netpolicy/sniproxy.h"
#include "vmm/accel.h"
#include "common/fsutil.h"
#include "vmm/hv.h"
#include "vmm/orphan.h"
#include "node/images.h"
#include "node/inject.h"
#include "node/connlog.h"
#include "node/drain.h"
#include "node/lifecycle.h"
#include "node/netsetup.h"
#include "node/pause.h"
#include "node/recovery.h"
#include "node/node.h"
#include "node/storage_sync.h"
#include "node/template.h"
#include "node/warm.h"
#include "node/build.h"
#include "record/record.h"

static struct node node;

static int check_init(struct kiln_error *err)
{
	const char *need[] = { "guest_kernel", "guest_initrd", "guest_rootfs" };
	const char *have[] = { node.cfg.guest_kernel, node.cfg.guest_initrd, node.cfg.guest_rootfs };

	for (size_t i = 0; i < 3; i++)
		if (!have[i] || access(have[i], R_OK) != 0)
			return kiln_error_set(err, KILN_E_INVALID,
					      "setting \"%s\": cannot read \"%s\" "
					      "(vmm/guest/build-image.sh --print-env)",
					      need[i], have[i] ? have[i] : "");
	if (!hv_find(node.cfg.hypervisor))
		return kiln_error_set(err, KILN_E_INVALID, "setting \"hypervisor\": no driver \"%s\"",
				      node.cfg.hypervisor);
	if (node.cfg.free_page_reporting && vmm_cmdline_inits_on_free(node.cfg.guest_cmdline))
		return kiln_error_set(err, KILN_E_INVALID,
				      "setting \"guest_cmdline\": init_on_free with free_page_reporting "
				      "(a page given back from a sandbox of a template reads as the "
				      "template's, not as zeros: docs/vmm.md); turn one of them off");
	for (const char *p = node.cfg.node_id; *p; p++)
		if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '-'))
			return kiln_error_set(err, KILN_E_INVALID,
					      "setting \"node_id\": only a-z, 0-9 and - allowed");
	if (!node.cfg.node_id[0] || strlen(node.cfg.node_id) > 32)
		return kiln_error_set(err, KILN_E_INVALID, "setting \"node_id\": 1 to 32 characters");
	snprintf(node.vm_run_root, sizeof(node.vm_run_root), "%s/%s", VMM_RUN_ROOT_DEFAULT,
		 node.cfg.node_id);
	snprintf(node.vm_state_root, sizeof(node.vm_state_root), "%s/vms/%s", node.cfg.data_dir,
		 node.cfg.node_id);
	snprintf(node.snap_root, sizeof(node.snap_root), "%s/snaps/%s", node.cfg.data_dir,
		 node.cfg.node_id);
	if (fs_mkdir_p(node.cfg.run_dir, 0711) < 0 || fs_mkdir_p(node.vm_run_root, 0711) < 0 ||
	    fs_mkdir_p(node.vm_state_root, 0711) < 0 || fs_mkdir_p(node.snap_root, 0711) < 0)
		return kiln_error_set(err, KILN_E_IO, "cannot create \"%s\" or \"%s\"",
				      node.vm_run_root, node.vm_state_root);
	node.accel = accel_detect() == ACCEL_KVM ? "kvm" : "tcg";
	{
		/* The disk sandboxes' layers may be promised (create.c, the gateway's placement). */
		long long gib = node.cfg.node_disk_gib;
		struct statvfs vfs;

		if (gib == 0 && statvfs(node.vm_state_root, &vfs) == 0)
			gib = (long long)(((unsigned long long)vfs.f_blocks * vfs.f_frsize) >> 30);
		node.disk_gib = gib * node.cfg.node_disk_overcommit_pct / 100;
		if (node.cfg.node_disk_overcommit_pct > 100)
			log_warn("node_disk_overcommit_pct %lld: guests can fill the disk and get ENOSPC",
				 node.cfg.node_disk_overcommit_pct);
	}
	pthread_mutex_init(&node.reg_lock, NULL);
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);

	sem_init(&node.vm_starts, 0, cpus > 0 ? (unsigned)cpus : 1);
	return KILN_OK;
}

static void check_exit(void)
{
	rmdir(node.vm_run_root);	/* only when empty: what a VM left is for orphan cleanup */
	pthread_mutex_destroy(&node.reg_lock);
	sem_destroy(&node.vm_starts);
}

static volatile sig_atomic_t db_wait_stop;

static void db_wait_signal(int sig)
{
	db_wait_stop = sig;
}

/*
 * Waits until Postgres answers, logging every few seconds. Nothing of an earlier run is touched
 * meanwhile: what its VMs hold is only known from Postgres, so a node never cleans up on doubt.
 * SIGTERM or SIGINT ends the wait (and the start) with KILN_E_UNAVAILABLE.
 */
static enum kiln_err db_wait(struct kiln_error *err)
{
	void (*old_term)(int) = signal(SIGTERM, db_wait_signal);
	void (*old_int)(int) = signal(SIGINT, db_wait_signal);
	time_t last_log = 0;
	enum kiln_err rc;

	for (;;) {
		kiln_error_clear(err);
		rc = pg_ping(node.pg, err);
		if (rc != KILN_E_UNAVAILABLE || db_wait_stop)
			break;
		if (time(NULL) - last_log >= 5) {
			log_warn("postgres is unavailable (%s): waiting for it; the VMs of an earlier "
				 "run are kept",
				 err->msg);
			last_log = time(NULL);
		}
		sleep(1);
	}
	signal(SIGTERM, old_term);
	signal(SIGINT, old_int);
	if (db_wait_stop)
		return node_error(err, KILN_E_UNAVAILABLE, "stopped while waiting for postgres");
	if (last_log)
		log_info("postgres is back");
	return rc;
}

static int db_init(struct kiln_error *err)
{
	int applied = 0;
	enum kiln_err rc;

	node.pg = pg_new(node.cfg.database_url, (int)node.cfg.db_pool_size);
	if (!node.pg)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = db_wait(err);
	if (rc == KILN_OK)
		rc = migrate_apply(node.pg, migrations, migrations_count, &applied, err);
	/* before recovery, which may pause VMs of an earlier run's image */
	if (rc == KILN_OK)
		rc = images_register(&node, err);
	return rc;
}

static void db_exit(void)
{
	pg_free(node.pg);
	node.pg = NULL;
}

static int recover_init(struct kiln_error *err)
{
	return recovery_run(&node, err);
}

static void recover_exit(void)
{
}

static const char *node_address(void)
{
	static char addr[160];

	if (node.cfg.node_address)
		return node.cfg.node_address;
	if (node.listen_path[0])
		snprintf(addr, sizeof(addr), "unix:%s", node.listen_path);
	else
		snprintf(addr, sizeof(addr), "http://%s", node.cfg.node_listen);
	return addr;
}

/*
 * The heartbeat runs on a thread of its own with a Postgres connection of its own (node.beat_pg,
 * a pool of one, reopened by the next beat when it broke), so that neither the ticker's slow work
 * (pauses at expiry, deletes, image pins) nor requests holding every connection of the node's
 * pool delay it: a beat later than node_down_after_s gets a live node marked down by another and
 * its running sandboxes reported lost. It beats every node_down_after_s / 5 (at most every 2 s)
 * and does only that; the ticker marks other nodes down and fences VMs.
 *
 * heartbeat_lock serialises the upsert (which clears a clean stop's mark) with the start of a
 * clean stop: a heartbeat in flight when the stop begins commits before the stop's mark, never
 * after. The thread holds it but while it waits for its next beat.
 */
static pthread_mutex_t heartbeat_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t heartbeat_wake;	/* signalled when the heartbeat is to end */
static bool heartbeat_quit;		/* under heartbeat_lock */
static pthread_t heartbeat_thread;

/* A beat's period in milliseconds: node_down_after_s / 5, at most 2 s. */
static long long heartbeat_period_ms(void)
{
	long long ms = node.cfg.node_down_after_s * 1000 / 5;

	return ms > 2000 ? 2000 : ms;
}

/*
 * One beat, heartbeat_lock held. Before a clean stop: the node's row with its capacity and image,
 * its time renewed and any mark of down or of a stop cleared (a mark of down found there is logged:
 * this node's heartbeat had lapsed). While stopping: only the time, so that the pauses of its stop
 * (seconds each) do not let it lapse and its sandboxes be reported lost meanwhile; the stop's mark
 * stays.
 */
static enum kiln_err heartbeat(struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char vcpu[24], mem[24], max[24], disk[24];
	enum kiln_err rc = pg_acquire(node.beat_pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	if (node.stopping) {
		rc = PGQ(c, NULL, err,
			 "UPDATE nodes SET heartbeat_at = now() WHERE id = $1 AND down_at IS NULL",
			 node.cfg.node_id);
		pg_release(node.beat_pg, c);
		return rc;
	}
	snprintf(vcpu, sizeof(vcpu), "%lld", node.cfg.node_vcpu_milli);
	snprintf(mem, sizeof(mem), "%lld", node.cfg.node_memory_mib);
	snprintf(max, sizeof(max), "%lld", node.cfg.node_max_sandboxes);
	snprintf(disk, sizeof(disk), "%lld", node.disk_gib);
	/* The row locked first, so the mark of down it returns is the one this update clears. */
	rc = PGQ(c, &res, err,
		 "UPDATE nodes n SET address = $2, vcpu_milli = $3::int, memory_mib = $4::int, "
		 "max_sandboxes = $5::int, hypervisor = $6, accelerator = $7, image_hash = $8, "
		 "disk_gib = $9::bigint, heartbeat_at = now(), down_at = NULL, stopped_at = NULL "
		 "FROM (SELECT id, down_at FROM nodes WHERE id = $1 FOR UPDATE) p WHERE n.id = p.id "
		 "RETURNING to_char(p.down_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')",
		 node.cfg.node_id, node_address(), vcpu, mem, max, node.cfg.hypervisor, node.accel,
		 node.cfg.guest_image_hash, disk);
	if (rc == KILN_OK && pg_res_rows(res) == 0)	/* its first start: the row is made */
		rc = PGQ(c, NULL, err,
			 "INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, "
			 "hypervisor, accelerator, image_hash, disk_gib) "
			 "VALUES ($1, $2, $3::int, $4::int, $5::int, $6, $7, $8, $9::bigint)",
			 node.cfg.node_id, node_address(), vcpu, mem, max, node.cfg.hypervisor,
			 node.accel, node.cfg.guest_image_hash, disk);
	else if (rc == KILN_OK && pg_res_get(res, 0, 0))
		log_warn("this node had been marked down at %s: its heartbeat lapsed "
			 "(node_down_after_s %lld); its sandboxes that ran then are lost",
			 pg_res_get(res, 0, 0), node.cfg.node_down_after_s);
	pg_res_free(res);
	pg_release(node.beat_pg, c);
	return rc;
}

static void *heartbeat_main(void *arg)
{
	long long period = heartbeat_period_ms();
	struct timespec at, now;

	clock_gettime(CLOCK_MONOTONIC, &at);
	pthread_mutex_lock(&heartbeat_lock);
	for (;;) {
		struct kiln_error err = { 0 };

		at.tv_sec += period / 1000;
		at.tv_nsec += (period % 1000) * 1000000;
		if (at.tv_nsec >= 1000000000) {
			at.tv_sec++;
			at.tv_nsec -= 1000000000;
		}
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (at.tv_sec < now.tv_sec || (at.tv_sec == now.tv_sec && at.tv_nsec < now.tv_nsec))
			at = now;	/* a beat took longer than the period: the next one at once */
		while (!heartbeat_quit &&
		       pthread_cond_timedwait(&heartbeat_wake, &heartbeat_lock, &at) != ETIMEDOUT)
			;
		if (heartbeat_quit)
			break;
		if (heartbeat(&err) != KILN_OK)
			log_warn("heartbeat failed: %s", err.msg);
	}
	pthread_mutex_unlock(&heartbeat_lock);
	return NULL;
}

/* The first beat (the node registers), then the heartbeat's thread. */
static enum kiln_err heartbeat_start(struct kiln_error *err)
{
	enum kiln_err rc;

	node.beat_pg = pg_new(node.cfg.database_url, 1);
	if (!node.beat_pg)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	pthread_mutex_lock(&heartbeat_lock);
	rc = heartbeat(err);
	pthread_mutex_unlock(&heartbeat_lock);
	if (rc != KILN_OK)
		return rc;
	clock_cond_init(&heartbeat_wake, CLOCK_MONOTONIC);
	if (pthread_create(&heartbeat_thread, NULL, heartbeat_main, NULL) != 0)
		return kiln_error_set(err, KILN_E_NOMEM, "cannot start the heartbeat");
	return KILN_OK;
}

/* Ends the heartbeat (a beat in flight finishes first) and closes its connection. */
static void heartbeat_stop(void)
{
	if (heartbeat_thread) {
		pthread_mutex_lock(&heartbeat_lock);
		heartbeat_quit = true;
		pthread_cond_signal(&heartbeat_wake);
		pthread_mutex_unlock(&heartbeat_lock);
		pthread_join(heartbeat_thread, NULL);
		heartbeat_thread = 0;
		pthread_cond_destroy(&heartbeat_wake);
	}
	pg_free(node.beat_pg);
	node.beat_pg = NULL;
}

/*
 * The VMs of sandboxes that are no longer this node's are stopped and discarded, and the other
 * nodes whose heartbeat lapsed are marked down (whoever sees a lapse first marks it;
 * record_nodes_down). Run by the ticker, about once a second, on the node's pool.
 */
static void fence_and_mark_down(void)
{
	struct kiln_error err = { 0 };
	int marked = 0;

	recovery_fence(&node);
	if (record_nodes_down(node.pg, NULL, node.cfg.node_down_after_s, &marked, &err) != KILN_OK)
		log_warn("cannot mark the nodes whose heartbeat lapsed as down: %s", err.msg);
	else if (marked)
		log_warn("%d other nodes marked down: no heartbeat for %lld s", marked,
			 node.cfg.node_down_after_s);
}

/* Stops every sandbox past its expiry (the VM and its resources; the record stays). */
static void expire_sandboxes(void)
{
	time_t now = time(NULL);

	for (;;) {
		struct sandbox *sb = NULL;

		pthread_mutex_lock(&node.reg_lock);
		for (struct sandbox *it = node.sandboxes; it; it = it->next) {
			if (it->state == SB_RUNNING && it->expires_at && it->expires_at <= now) {
				sb = it;
				sb->refs++;
				break;
			}
		}
		pthread_mutex_unlock(&node.reg_lock);
		if (!sb)
			return;
		pthread_mutex_lock(&sb->lock);
		if (sb->state == SB_RUNNING) {
			struct kiln_error err = { 0 };
			/* A sandbox past its timeout is paused, never destroyed. */
			log_info("sandbox \"%s\" reached its timeout", sb->id);
			if (sb_pause(&node, sb, true, true, &err) != KILN_OK) {
				log_error("pausing \"%s\" at its timeout failed: %s", sb->id, err.msg);
				sb->expires_at = now + 60;	/* try again later */
			}
		}
		pthread_mutex_unlock(&sb->lock);
		sb_put(&node, sb);
	}
}

/*
 * The clean stop's mark (nodes.stopped_at, migrations/0029): from here no gateway places a new
 * sandbox, move or build on this node; the next start's first heartbeat clears it.
 */
static void mark_stopped(void)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	if (pg_acquire(node.pg, &c, &err) == KILN_OK) {
		if (PGQ(c, NULL, &err, "UPDATE nodes SET stopped_at = now() WHERE id = $1",
			node.cfg.node_id) == KILN_OK)
			log_info("node \"%s\" stopping: out of placement", node.cfg.node_id);
		pg_release(node.pg, c);
	}
	if (err.code != KILN_OK)
		log_warn("the stop of the node not recorded (it stays placed on until its heartbeat "
			 "lapses): %s", err.msg);
}

/* Once a second until a clean stop begins: fencing, expiries, then every 10 s the slower work. */
static void *ticker(void *arg)
{
	unsigned tick = 0;

	while (!node.stopping) {
		struct kiln_error err = { 0 };

		fence_and_mark_down();
		expire_sandboxes();
		if (++tick % 10 == 0) {
			if (recovery_deletes(&node, &err) != KILN_OK)
				log_warn("requested deletes not carried out: %s", err.msg);
			build_layers_gc(&node, NULL);
			snap_gc(&node);
			images_pin(&node);
			tpl_evict_idle(&node, node.cfg.template_idle_s);
		}
		sleep(1);
	}
	return NULL;
}

/* The resolver behind the DNS proxy: the setting, or the first nameserver of resolv.conf. */
static void dns_upstream(char *out, size_t len)
{
	char line[256];
	FILE *f;

	snprintf(out, len, "127.0.0.53");
	if (node.cfg.dns_upstream) {
		snprintf(out, len, "%s", node.cfg.dns_upstream);
		return;
	}
	f = fopen("/etc/resolv.conf", "r");
	if (!f)
		return;
	while (fgets(line, sizeof(line), f)) {
		char addr[128];
		if (sscanf(line, "nameserver %127s", addr) == 1) {
			if (strchr(addr, ':'))
				snprintf(out, len, "[%s]:53", addr);
			else
				snprintf(out, len, "%s", addr);
			break;
		}
	}
	fclose(f);
}

/* The tenants' buckets: snapshots are uploaded there in the background and fetched back. */
static int store_init(struct kiln_error *err)
{
	struct kiln_error kerr = { 0 };
	struct snapstore_config sc = { 0 };
	unsigned pending;

	if (netaddr_allow_parse(node.cfg.storage_allow, &node.storage_allow, err) != KILN_OK)
		return err->code;
	if (masterkey_load(&node.cfg, &node.mk, &kerr) != KILN_OK) {
		log_warn("snapshots stay on this node: %s", kerr.msg);
		return KILN_OK;
	}
	{	/* secrets need the master key too (node/secrets.h) */
		static struct kiln_cidr deny[2 * KILN_DENY_MAX];
		struct inject_opts io = { .ca_file = node.cfg.inject_ca_file,
					  .connections_max = (int)node.cfg.inject_connections_max,
					  .per_sandbox_max =
						  (int)node.cfg.inject_connections_per_sandbox,
					  .deny = deny,
					  .note = connlog_note,
					  .note_arg = &node,
					  .requests_per_conn =
						  (int)node.cfg.connlog_requests_per_conn };
		if (kiln_policy_deny_ranges(node.cfg.egress_deny, deny, 2 * KILN_DENY_MAX, &io.ndeny,
					    err) != KILN_OK ||
		    inject_new(&io, &node.inject, err) != KILN_OK)
			return err->code;
	}
	node.s3.retries = 2;	/* s3_client_new's default */
	node.s3.allow = node.storage_allow;
	sc.s3 = &node.s3;
	sc.pg = node.pg;
	sc.mk = &node.mk;
	sc.node_id = node.cfg.node_id;
	sc.snap_root = node.snap_root;
	sc.base_image = node.cfg.guest_rootfs;
	sc.codeint_image = node.cfg.guest_codeint_rootfs;
	sc.image_hash = node_image_hash(&node);
	sc.kernel = node.cfg.guest_kernel;
	sc.initrd = node.cfg.guest_initrd;
	node.store = snapstore_open(&sc, err);
	if (!node.store)
		return err->code ? err->code : KILN_E_INTERNAL;
	pending = snapstore_resume_pending(node.store);
	if (pending)
		log_info("resuming %u snapshot uploads", pending);
	return KILN_OK;
}

static void store_exit(void)
{
	snapstore_shutdown(node.store);
	node.store = NULL;
	inject_free(node.inject);
	node.inject = NULL;
	auth_master_key_wipe(&node.mk);
	netaddr_allow_free(node.storage_allow);
	node.storage_allow = NULL;
}

/* The host side of the sandboxes' network: the node's nftables table, forwarding (netsetup.h). */
static int hostnet_init(struct kiln_error *err)
{
	struct netsetup_config nc = {
		.node_id = node.cfg.node_id,
		.conntrack_max = node.cfg.conntrack_max_per_sandbox,
		.max_sandboxes = node.cfg.node_max_sandboxes,
	};

	if (!node.cfg.node_network_setup) {
		log_info("node_network_setup is off: the host's forwarding, NAT and firewall are left "
			 "as they are");
		return KILN_OK;
	}
	if (netsetup_apply(&nc, err) == KILN_OK)
		return KILN_OK;
	netsetup_remove(node.cfg.node_id, NULL);	/* this stage failed: its exit does not run */
	return err->code;
}

/* The table goes with the node (its sandboxes are paused or stopped by now); forwarding stays. */
static void hostnet_exit(void)
{
	struct kiln_error err = { 0 };

	if (!node.cfg.node_network_setup)
		return;
	if (netsetup_remove(node.cfg.node_id, &err) != KILN_OK)
		log_warn("%s", err.msg);
	else
		log_info("nftables table of node \"%s\" removed", node.cfg.node_id);
}

/*
 * The name-checking proxy's hand-off (kiln_sniproxy_handoff_fn): connections to a host the
 * sandbox holds secrets for go to the injector, every other one is spliced by the proxy. The
 * proxy knows a sandbox by its network id (a shortened id, kiln_sniproxy_add), the injector by its
 * id: the registry maps one to the other (a sandbox gone meanwhile: spliced, its flows are cut).
 */
static int sni_handoff(void *arg, const char *net_id, int guest_fd, const void *pre,
		       size_t pre_len, const char *host, const struct sockaddr_storage *upstream)
{
	struct node *n = arg;
	char id[sizeof(n->sandboxes->id)] = "";

	pthread_mutex_lock(&n->reg_lock);
	for (struct sandbox *it = n->sandboxes; it && !id[0]; it = it->next)
		if (strcmp(it->net_id, net_id) == 0)
			snprintf(id, sizeof(id), "%s", it->id);
	pthread_mutex_unlock(&n->reg_lock);
	return id[0] ? inject_handoff(n, id, guest_fd, pre, pre_len, host, upstream) : 0;
}

/* The name-checking proxy's notes for the connection log: its network id to the sandbox's id. */
static void sni_note(void *arg, const char *net_id, const struct kiln_conn_note *note)
{
	struct node *n = arg;
	char id[sizeof(n->sandboxes->id)] = "";

	pthread_mutex_lock(&n->reg_lock);
	for (struct sandbox *it = n->sandboxes; it && !id[0]; it = it->next)
		if (strcmp(it->net_id, net_id) == 0)
			snprintf(id, sizeof(id), "%s", it->id);
	pthread_mutex_unlock(&n->reg_lock);
	if (id[0])
		connlog_note(n, id, note);
}

static int net_init(struct kiln_error *err)
{
	char upstream[160];
	struct kiln_dns_config dc = {
		.upstream = upstream,
		.max_pending = (uint32_t)node.cfg.dns_pending_per_sandbox,
	};
	struct kiln_cidr deny[2 * KILN_DENY_MAX];
	size_t ndeny;

	/* a bad egress_deny stops the node here, not at its first sandbox */
	if (kiln_policy_deny_ranges(node.cfg.egress_deny, deny, 2 * KILN_DENY_MAX, &ndeny, err) !=
	    KILN_OK)
		return err->code;
	dns_upstream(upstream, sizeof(upstream));
	if (kiln_dns_proxy_start(&dc, &node.dns, err) != KILN_OK)
		return err->code;
	log_info("guests' DNS goes to \"%s\"", upstream);
	struct kiln_sniproxy_config sc = {
		.max_conns_per_sandbox = (uint32_t)node.cfg.sniproxy_conns_per_sandbox,
		.max_conns = (uint32_t)node.cfg.sniproxy_conns,
		.handshakes_per_sandbox = (uint32_t)node.cfg.sniproxy_handshakes_per_sandbox,
		.handshakes = (uint32_t)node.cfg.sniproxy_handshakes,
		.handoff = sni_handoff,
		.handoff_arg = &node,
		.note = sni_note,
		.note_arg = &node,
	};
	if (kiln_sniproxy_start(&sc, &node.sni, err) != KILN_OK)
		return err->code;
	return KILN_OK;
}

static void net_exit(void)
{
	kiln_sniproxy_stop(node.sni);
	node.sni = NULL;
	kiln_dns_proxy_stop(node.dns);
	node.dns = NULL;
}

static int api_init(struct kiln_error *err)
{
	struct http_server_opts o = {
		.max_connections = 4096,
		.body_max = 2 << 20,
		.timeout_s = 3600,
		.routes = node_routes,
		.nroutes = node_routes_len,
		.before = node_before,
		.app = &node,
		.trust_request_id = true,
	};
	char *listen = node.cfg.node_listen;

	node.keys = jwks_new(node.cfg.gateway_url);
	if (!node.keys)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if (!listen || strncmp(listen, "unix:", 5) == 0) {
		if (listen)
			snprintf(node.listen_path, sizeof(node.listen_path), "%s", listen + 5);
		else
			snprintf(node.listen_path, sizeof(node.listen_path), "%s/node.sock",
				 node.cfg.run_dir);
		o.unix_path = node.listen_path;
	} else {
		o.listen = listen;
	}
	node.http = http_server_start(&o, err);
	if (!node.http)
		return err->code;
	if (node.listen_path[0])
		chmod(node.listen_path, 0600);
	if (heartbeat_start(err) != KILN_OK)
		return err->code;
	images_pin(&node);
	if (pthread_create(&node.ticker, NULL, ticker, NULL) != 0)
		return kiln_error_set(err, KILN_E_NOMEM, "cannot start the ticker");
	if (connlog_start(&node, err) != KILN_OK)
		return err->code;
	/* Measured before the first boot (the templates'), which tells its guest the figure. */
	if (strcmp(node.accel, "tcg") == 0)
		log_info("host TSC: %u kHz, the rate guests are booted with", accel_host_tsc_khz());
	tpl_init(&node);
	build_init(&node);
	log_info("node \"%s\" serving at \"%s\" (%s, %s)", node.cfg.node_id, node_address(),
		 node.cfg.hypervisor, node.accel);
	return KILN_OK;
}

/* Removes the node's own (empty) cgroup directories, kiln/<node>, in every hierarchy. */
static void node_cgroups_remove(void)
{
	char pattern[160];
	glob_t g;

	snprintf(pattern, sizeof(pattern), "/sys/fs/cgroup/*/kiln/%s", node.cfg.node_id);
	if (glob(pattern, GLOB_ONLYDIR, NULL, &g) == 0) {
		for (size_t i = 0; i < g.gl_pathc; i++)
			if (rmdir(g.gl_pathv[i]) != 0 && errno != ENOENT)
				log_warn("cannot remove \"%s\": %s", g.gl_pathv[i], strerror(errno));
		globfree(&g);
	}
	snprintf(pattern, sizeof(pattern), "/sys/fs/cgroup/kiln/%s", node.cfg.node_id);
	rmdir(pattern);
}

static void api_exit(void)
{
	pthread_mutex_lock(&heartbeat_lock);
	node.stopping = true;	/* the heartbeat renews only its time from here; the ticker ends */
	pthread_mutex_unlock(&heartbeat_lock);
	mark_stopped();
	tpl_exit(&node);
	warm_exit(&node);
	build_exit(&node);
	http_server_stop(node.http, 30);
	node.http = NULL;
	/*
	 * A stopped node leaves nothing running: running sandboxes are paused (resumed later, here or
	 * on another node); the rest, and any whose pause fails, are stopped.
	 */
	for (;;) {
		struct kiln_error err = { 0 };
		struct sandbox *sb;

		pthread_mutex_lock(&node.reg_lock);
		sb = node.sandboxes;
		if (sb)
			sb->refs++;
		pthread_mutex_unlock(&node.reg_lock);
		if (!sb)
			break;
		pthread_mutex_lock(&sb->lock);
		if (sb->state != SB_RUNNING || sb_pause(&node, sb, true, false, &err) != KILN_OK) {
			struct record_fence f = sb_fence(&node, sb);

			if (err.code != KILN_OK)
				log_error("sandbox \"%s\" stops with the node: %s", sb->id, err.msg);
			sb_teardown(&node, sb);
			sb->state = SB_STOPPED;
			kiln_error_clear(&err);
			if (record_stopped(node.pg, NULL, &f, "the node stopped", &err) != KILN_OK)
				log_error("the stop of \"%s\" not recorded: %s", sb->id, err.msg);
		}
		pthread_mutex_unlock(&sb->lock);
		sb_put(&node, sb);
	}
	if (node.ticker)
		pthread_join(node.ticker, NULL);
	heartbeat_stop();
	connlog_stop(&node);	/* after the pauses, which flushed their sandboxes' logs */
	node_cgroups_remove();
	jwks_free(node.keys);
	node.keys = NULL;
}

static const struct daemon_stage stages[] = {
	{ "settings", check_init, check_exit },
	{ "postgres", db_init, db_exit },
	{ "storage", store_init, store_exit },	/* before recovery: it uploads what it pauses */
	{ "recovery", recover_init, recover_exit },
	{ "host network", hostnet_init, hostnet_exit },
	{ "network", net_init, net_exit },
	{ "api", api_init, api_exit },
};
#define NSTAGES (sizeof(stages) / sizeof(stages[0]))

static void usage(FILE *out)
{
	fprintf(out, "usage: kiln-node [--config FILE] [drain]\n\n"
		     "  drain  ask the gateway (gateway_url) to drain this node (node_id): no new\n"
		     "         sandboxes here, each paused and moved through its tenant's bucket,\n"
		     "         the running ones resumed on other nodes (an admin key: KILN_ADMIN_KEY\n"
		     "         or admin_key_file)\n\n");
	config_help(out);
}

static int64_t host_mono_ns(void *ctx)
{
	struct timespec ts;

	(void)ctx;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* This host's boot id and CLOCK_MONOTONIC witness each state change the node records
 * (record_witness_clock()); none when the boot id cannot be read (the changes are then placed
 * by the meter's frames alone). */
static void witness_clock_set(void)
{
	char boot[64];	/* copied by record_witness_clock() */
	FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");

	if (!f)
		return;
	if (fgets(boot, (int)sizeof(boot), f)) {
		boot[strcspn(boot, "\n")] = '\0';
		if (boot[0])
			record_witness_clock(boot, host_mono_ns, NULL);
	}
	fclose(f);
}

int main(int argc, char **argv)
{
	struct kiln_error err = { 0 };
	const char *config_path = NULL;
	bool drain = false;
	int status = 0;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
			usage(stdout);
			return 0;
		} else if (!strcmp(argv[i], "--config") && i + 1 < argc) {
			config_path = argv[++i];
		} else if (!strcmp(argv[i], "drain")) {
			drain = true;
		} else {
			usage(stderr);
			return 2;
		}
	}
	if (config_load(&node.cfg, config_path, config_path != NULL, &err) != KILN_OK) {
		fprintf(stderr, "kiln-node: %s\n", err.msg);
		return 2;
	}
	log_init("kiln-node", (enum log_level)log_level_parse(node.cfg.log_level),
		 node.cfg.log_json);
	curl_global_init(CURL_GLOBAL_DEFAULT);
	witness_clock_set();
	if (drain) {
		status = drain_command(&node.cfg);
		config_release(&node.cfg);
		curl_global_cleanup();
		return status;
	}
	status = daemon_run(stages, NSTAGES);
	config_release(&node.cfg);
	curl_global_cleanup();
	return status;
}
