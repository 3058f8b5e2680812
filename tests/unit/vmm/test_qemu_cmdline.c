/*
 * test_qemu_cmdline.c - the QEMU command line of a jailed microVM, the accelerator choice from
 * /proc/cpuinfo text, and the shape arithmetic and checks of a VM spec.
 */
#include <errno.h>
#include <stdio.h>
#include <time.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"
#include "vmm/accel.h"
#include "vmm/hv.h"
#include "vmm/qemu.h"

/* The argument after `opt` whose text starts with `prefix`, or NULL. */
static const char *opt_value(char **argv, const char *opt, const char *prefix)
{
	for (char **p = argv; *p && p[1]; p++)
		if (strcmp(*p, opt) == 0 && strncmp(p[1], prefix, strlen(prefix)) == 0)
			return p[1];
	return NULL;
}

static bool has_arg(char **argv, const char *arg)
{
	for (char **p = argv; *p; p++)
		if (strcmp(*p, arg) == 0)
			return true;
	return false;
}

static struct qemu_args base_args(void)
{
	return (struct qemu_args){
		.accel = ACCEL_TCG,
		.vcpus = 2,
		.mem_mib = 256,
		.mem_path = "mem",
		.mem_share = true,
		.kernel = "kernel",
		.initrd = "initrd",
		.cmdline_extra = "root=/dev/vda",
		.disk = "disk",
		.tap = "tap0",
		.qmp_sock = "/run/kiln/n1/vm1/qmp.sock",
		.agent_sock = "/run/kiln/n1/vm1/agent.sock",
		.serial_sock = "/run/kiln/n1/vm1/serial.sock",
		.disk_iops = 2000,
		.disk_bps = 52428800,
		.chroot = "/run/kiln/n1/vm1/jail",
		.uid = 64001,
		.gid = 64001,
	};
}

static void test_cmdline_cold_boot_jailed_tcg(void)
{
	struct qemu_args a = base_args();
	char **argv = NULL;

	CHECK_INT(qemu_argv_build(&a, &argv), 0);
	if (!argv)
		return;
	CHECK_STR(argv[0], QEMU_BINARY_DEFAULT);
	CHECK_STR(opt_value(argv, "-M", "microvm"), "microvm,memory-backend=mem");
	CHECK_STR(opt_value(argv, "-accel", ""), "tcg,tb-size=64");
	/* an Intel model TCG runs whole, never QEMU's default qemu64 (read as a 3DNow! Opteron) */
	CHECK_STR(opt_value(argv, "-cpu", ""), "Nehalem-v1,enforce");
	CHECK_STR(opt_value(argv, "-smp", ""), "2");
	CHECK_STR(opt_value(argv, "-object", "memory-backend-file"),
		  "memory-backend-file,id=mem,size=256M,mem-path=mem,share=on");
	CHECK_STR(opt_value(argv, "-sandbox", ""), "on,obsolete=deny,spawn=deny,resourcecontrol=deny");
	CHECK_STR(opt_value(argv, "-runas", ""), "64001:64001");
	CHECK_STR(opt_value(argv, "-chroot", ""), "/run/kiln/n1/vm1/jail");
	CHECK_STR(opt_value(argv, "-device", "virtserialport"), "virtserialport,chardev=agent,name=kiln.agent");
	CHECK_STR(opt_value(argv, "-chardev", "socket,id=agent"),
		  "socket,id=agent,path=/run/kiln/n1/vm1/agent.sock,server=on,wait=off");
	CHECK_STR(opt_value(argv, "-netdev", ""), "tap,id=n0,ifname=tap0,script=no,downscript=no");
	CHECK_STR(opt_value(argv, "-device", "virtio-net"), "virtio-net-device,netdev=n0,mac=" VMM_GUEST_MAC);
	CHECK_STR(opt_value(argv, "-drive", ""),
		  "id=root,file=disk,format=qcow2,if=none,discard=unmap,throttling.group=io0,"
		  "throttling.iops-total=2000,throttling.bps-total=52428800");
	CHECK_STR(opt_value(argv, "-object", "throttle-group"),
		  "throttle-group,id=io0,x-iops-total=2000,x-bps-total=52428800");
	/* the console is a socket the node drains into a capped file, never a chardev file */
	CHECK_STR(opt_value(argv, "-chardev", "socket,id=serial"),
		  "socket,id=serial,path=/run/kiln/n1/vm1/serial.sock,server=on,wait=off");
	CHECK_STR(opt_value(argv, "-serial", ""), "chardev:serial");
	for (char **p = argv; *p; p++)
		CHECK(strncmp(*p, "file,", 5) != 0);
	CHECK(strstr(opt_value(argv, "-append", "") ?: "", "tsc=reliable") != NULL);
	/* no rate given: the fallback, never none (the calibration hang) */
	CHECK(strstr(opt_value(argv, "-append", "") ?: "", " tsc_early_khz=2000000 ") != NULL);
	CHECK(strstr(opt_value(argv, "-append", "") ?: "", " mitigations=off") != NULL);
	CHECK(strstr(opt_value(argv, "-append", "") ?: "", " root=/dev/vda") != NULL);
	CHECK(!has_arg(argv, "-incoming"));
	CHECK(!has_arg(argv, "-S"));
	/* elevateprivileges=deny kills QEMU together with -runas */
	for (char **p = argv; *p; p++)
		CHECK(strstr(*p, "elevateprivileges") == NULL);
	qemu_argv_free(argv);
}

/*
 * The guest is told the TSC rate it is given, and the host's is measured: under TCG the guest's
 * TSC is the host's counter, so a wrong rate makes the guest's clock run at the ratio.
 */
static void test_cmdline_tsc_rate(void)
{
	struct qemu_args a = base_args();
	struct timespec t0, t1, gap = { 1, 0 };
	unsigned long long c0a, c0b, c1a, c1b;
	double us, lo, hi, measured = accel_host_tsc_khz();
	char **argv = NULL;

	a.tsc_khz = 2596136;
	CHECK_INT(qemu_argv_build(&a, &argv), 0);
	CHECK(strstr(opt_value(argv, "-append", "") ?: "", " tsc_early_khz=2596136 ") != NULL);
	qemu_argv_free(argv);
	CHECK_INT((int)accel_host_tsc_khz(), (int)measured);	/* measured once */
#if defined(__x86_64__)
	/*
	 * Against the host's TSC over 1 s, each clock reading between two counter readings: the
	 * counts over the clock's second lie between the inner and the outer pair, whatever
	 * preempts this thread.
	 */
	c0a = __rdtsc();
	clock_gettime(CLOCK_MONOTONIC, &t0);
	c0b = __rdtsc();
	nanosleep(&gap, NULL);
	c1a = __rdtsc();
	clock_gettime(CLOCK_MONOTONIC, &t1);
	c1b = __rdtsc();
	us = (t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3;
	lo = (double)(c1a - c0b) * 1e3 / us;
	hi = (double)(c1b - c0a) * 1e3 / us;
	printf("host TSC: %.0f to %.0f kHz here, %.0f kHz by accel_host_tsc_khz\n", lo, hi, measured);
	CHECK(measured > lo * 0.999 && measured < hi * 1.001);
#else
	(void)t0, (void)t1, (void)gap, (void)c0a, (void)c0b, (void)c1a, (void)c1b, (void)us, (void)lo,
	(void)hi;
#endif
}

/* A restore runs under the model the snapshot was taken under; an unknown one is refused. */
static void test_cmdline_cpu_model(void)
{
	struct qemu_args a = base_args();
	char **argv = NULL;

	a.cpu = "qemu64";
	CHECK_INT(qemu_argv_build(&a, &argv), 0);
	CHECK_STR(opt_value(argv, "-cpu", ""), "qemu64,enforce");
	qemu_argv_free(argv);
	argv = NULL;
	a.cpu = "host";		/* KVM's, not TCG's */
	CHECK_INT(qemu_argv_build(&a, &argv), -EINVAL);
	a.cpu = "qemu64,+3dnow";
	CHECK_INT(qemu_argv_build(&a, &argv), -EINVAL);
	a.accel = ACCEL_KVM;
	a.cpu = "Nehalem-v1";
	CHECK_INT(qemu_argv_build(&a, &argv), -EINVAL);
	CHECK(argv == NULL);
	CHECK(accel_cpu_valid(ACCEL_KVM, "host"));
	CHECK(!accel_cpu_valid(ACCEL_TCG, NULL));
}

static void test_cmdline_restore_private_without_net_and_disk(void)
{
	struct qemu_args a = base_args();
	char **argv = NULL;

	a.accel = ACCEL_KVM;
	a.mem_share = false;
	a.incoming = true;
	a.tap = NULL;
	a.disk = NULL;
	a.initrd = NULL;
	CHECK_INT(qemu_argv_build(&a, &argv), 0);
	if (!argv)
		return;
	CHECK_STR(opt_value(argv, "-accel", ""), "kvm");
	CHECK_STR(opt_value(argv, "-cpu", ""), "host");
	CHECK_STR(opt_value(argv, "-object", "memory-backend-file"),
		  "memory-backend-file,id=mem,size=256M,mem-path=mem,share=off");
	CHECK_STR(opt_value(argv, "-incoming", ""), "defer");
	CHECK(has_arg(argv, "-S"));
	CHECK(opt_value(argv, "-netdev", "") == NULL);
	CHECK(opt_value(argv, "-drive", "") == NULL);
	CHECK(opt_value(argv, "-object", "throttle-group") == NULL);	/* no disk: nothing to throttle */
	CHECK(opt_value(argv, "-initrd", "") == NULL);
	CHECK(strstr(opt_value(argv, "-append", "") ?: "", "lpj=") == NULL);
	qemu_argv_free(argv);
}

/* The free page reporting balloon: last on the bus, only when asked for. */
static void test_cmdline_balloon(void)
{
	struct qemu_args a = base_args();
	char **argv = NULL, **last = NULL;

	CHECK_INT(qemu_argv_build(&a, &argv), 0);
	CHECK(argv && opt_value(argv, "-device", "virtio-balloon") == NULL);
	qemu_argv_free(argv);
	argv = NULL;
	a.balloon = true;
	CHECK_INT(qemu_argv_build(&a, &argv), 0);
	if (!argv)
		return;
	CHECK_STR(opt_value(argv, "-device", "virtio-balloon"), "virtio-balloon-device,free-page-reporting=on");
	for (char **p = argv; *p; p++)
		if (strcmp(*p, "-device") == 0)
			last = p;
	CHECK(last && strncmp(last[1], "virtio-balloon-device,", 22) == 0);
	qemu_argv_free(argv);
}

/* init_on_free as the guest kernel reads it: the last word wins, booleans as kstrtobool(). */
static void test_cmdline_init_on_free(void)
{
	CHECK(!vmm_cmdline_inits_on_free(NULL));
	CHECK(!vmm_cmdline_inits_on_free(""));
	CHECK(!vmm_cmdline_inits_on_free("root=/dev/vda rootfstype=ext4 rw"));
	CHECK(vmm_cmdline_inits_on_free("root=/dev/vda init_on_free=1 rw"));
	CHECK(vmm_cmdline_inits_on_free("init_on_free=on"));
	CHECK(vmm_cmdline_inits_on_free("init_on_free=Y"));
	CHECK(!vmm_cmdline_inits_on_free("init_on_free=0"));
	CHECK(!vmm_cmdline_inits_on_free("init_on_free=off"));
	CHECK(!vmm_cmdline_inits_on_free("init_on_free=1 init_on_free=0"));
	CHECK(vmm_cmdline_inits_on_free("init_on_free=0\tinit_on_free=1"));
	CHECK(!vmm_cmdline_inits_on_free("init_on_free= init_on_free"));
	CHECK(!vmm_cmdline_inits_on_free("xinit_on_free=1 init_on_alloc=1"));
}

static void test_cmdline_refuses_commas_in_paths(void)
{
	struct qemu_args a = base_args();
	char **argv = NULL;

	a.disk = "disk,file.locking=off";
	CHECK_INT(qemu_argv_build(&a, &argv), -EINVAL);
	CHECK(argv == NULL);
	a = base_args();
	a.serial_sock = "/run/x,server=off";
	CHECK_INT(qemu_argv_build(&a, &argv), -EINVAL);
}

/* Only the limits set reach the throttle group; none set: the disk is not throttled. */
static void test_cmdline_disk_throttle(void)
{
	struct qemu_args a = base_args();
	char **argv = NULL;

	a.disk_bps = 0;
	CHECK_INT(qemu_argv_build(&a, &argv), 0);
	CHECK_STR(opt_value(argv, "-object", "throttle-group"), "throttle-group,id=io0,x-iops-total=2000");
	CHECK_STR(opt_value(argv, "-drive", ""),
		  "id=root,file=disk,format=qcow2,if=none,discard=unmap,throttling.group=io0,"
		  "throttling.iops-total=2000");
	qemu_argv_free(argv);
	a.disk_iops = 0;
	CHECK_INT(qemu_argv_build(&a, &argv), 0);
	CHECK(opt_value(argv, "-object", "throttle-group") == NULL);
	CHECK_STR(opt_value(argv, "-drive", ""), "id=root,file=disk,format=qcow2,if=none,discard=unmap");
	qemu_argv_free(argv);
}

static void test_accel_from_cpuinfo(void)
{
	char arg[32];

	CHECK(accel_cpuinfo_has_hwvirt("processor\t: 0\nflags\t\t: fpu vme de pse vmx ept\n"));
	CHECK(accel_cpuinfo_has_hwvirt("flags\t\t: fpu svm\nprocessor\t: 1\n"));
	/* nested PVM: no vmx/svm, even with words that contain them */
	CHECK(!accel_cpuinfo_has_hwvirt("flags\t\t: fpu vmxe svmx hypervisor\n"));
	CHECK(!accel_cpuinfo_has_hwvirt("model name\t: vmx svm\nflags\t\t: fpu\n"));
	CHECK_INT(accel_qemu_arg(ACCEL_TCG, 32, arg, sizeof(arg)), 0);
	CHECK_STR(arg, "tcg,tb-size=32");
	CHECK_INT(accel_qemu_arg(ACCEL_TCG, 0, arg, 8), -ENOSPC);
}

static void test_spec_shape_and_checks(void)
{
	struct kiln_error err = { 0 };
	struct vmm_spec s = {
		.id = "sb_1", .node = "n1", .vcpu_milli = 250, .mem_mib = 256, .kernel = "/k",
		.run_dir = "/run/kiln/n1/sb_1", .state_dir = "/var/lib/kiln/n1/sb_1", .uid = 64000, .gid = 64000,
	};

	CHECK_INT(vmm_vcpus_whole(250), 1);
	CHECK_INT(vmm_vcpus_whole(1000), 1);
	CHECK_INT(vmm_vcpus_whole(1001), 2);
	CHECK_INT(vmm_vcpus_whole(8000), 8);
	CHECK_INT(vmm_spec_check(&s, &err), KILN_OK);
	s.vcpu_milli = 100;
	CHECK_INT(vmm_spec_check(&s, &err), KILN_E_INVALID);
	CHECK(strncmp(err.msg, "vcpus", 5) == 0);
	s.vcpu_milli = 500;
	s.uid = 0;
	kiln_error_clear(&err);
	CHECK_INT(vmm_spec_check(&s, &err), KILN_E_INVALID);
	s.uid = 64000;
	s.id = "../x";
	CHECK_INT(vmm_spec_check(&s, NULL), KILN_E_INVALID);
	s.id = "ok";
	s.run_dir = "/run/kiln/a-very-long-node-directory-name-that-goes-on/and-on-and-on/until-sockets-break";
	CHECK_INT(vmm_spec_check(&s, NULL), KILN_E_INVALID);
	s.run_dir = "/run/kiln/n1/sb_1";
	s.console_max = 1024;	/* under VMM_CONSOLE_MAX_MIN */
	kiln_error_clear(&err);
	CHECK_INT(vmm_spec_check(&s, &err), KILN_E_INVALID);
	CHECK(strncmp(err.msg, "console_max", 11) == 0);
	s.console_max = VMM_CONSOLE_MAX_DEFAULT;
	CHECK_INT(vmm_spec_check(&s, NULL), KILN_OK);
	CHECK(hv_find("qemu") == &hv_qemu_ops);
	CHECK(hv_find("firecracker") != NULL);
}

/* Writes `len` bytes of a counting pattern to `path`, a bzImage's signature and setup sectors in it. */
static void fake_kernel(const char *path, size_t len, unsigned char setup_sects, bool signed_)
{
	FILE *f = fopen(path, "wb");

	for (size_t i = 0; f && i < len; i++) {
		unsigned char c = (unsigned char)(i * 7 + 3);

		if (i == 0x1f1)
			c = setup_sects;
		else if (signed_ && i >= 0x202 && i < 0x206)
			c = (unsigned char)"HdrS"[i - 0x202];
		fputc(c, f);
	}
	if (f)
		fclose(f);
}

/* `head` is the first bytes of `whole`, and `want` long. */
static bool is_head_of(const char *head, const char *whole, long want)
{
	FILE *h = fopen(head, "rb"), *w = fopen(whole, "rb");
	bool ok = h && w;
	long n = 0;
	int c;

	while (ok && (c = fgetc(h)) != EOF) {
		ok = fgetc(w) == c;
		n++;
	}
	if (h)
		fclose(h);
	if (w)
		fclose(w);
	return ok && n == want;
}

/* A restore's kernel: the boot sector, the setup sectors and a page, at least 8 KiB (QEMU's read). */
static void test_kernel_head(void)
{
	char dir[] = "/tmp/kiln-khead-XXXXXX", k[64], h[64];

	if (!mkdtemp(dir)) {
		CHECK(false);
		return;
	}
	snprintf(k, sizeof(k), "%s/vmlinuz", dir);
	snprintf(h, sizeof(h), "%s/kernel.head", dir);
	fake_kernel(k, 1 << 20, 39, true);
	CHECK_INT(qemu_kernel_head(k, h), 0);
	CHECK(is_head_of(h, k, 40 * 512 + 4096));
	/* written afresh over an older head */
	fake_kernel(k, 1 << 20, 0, true);	/* 0 setup sectors means 4 */
	CHECK_INT(qemu_kernel_head(k, h), 0);
	CHECK(is_head_of(h, k, 8192));
	/* not a bzImage (an ELF vmlinux, say), or shorter than its setup: no head, no file */
	fake_kernel(k, 1 << 20, 39, false);
	CHECK_INT(qemu_kernel_head(k, h), -ENOEXEC);
	CHECK(access(h, F_OK) < 0);
	fake_kernel(k, 40 * 512, 39, true);
	CHECK_INT(qemu_kernel_head(k, h), -ENOEXEC);
	CHECK(access(h, F_OK) < 0);
	CHECK_INT(qemu_kernel_head("/nonexistent/vmlinuz", h), -ENOENT);
	unlink(k);
	rmdir(dir);
}

int main(void)
{
	TEST(test_cmdline_cold_boot_jailed_tcg);
	TEST(test_cmdline_restore_private_without_net_and_disk);
	TEST(test_cmdline_refuses_commas_in_paths);
	TEST(test_cmdline_balloon);
	TEST(test_cmdline_init_on_free);
	TEST(test_cmdline_disk_throttle);
	TEST(test_accel_from_cpuinfo);
	TEST(test_cmdline_cpu_model);
	TEST(test_cmdline_tsc_rate);
	TEST(test_spec_shape_and_checks);
	TEST(test_kernel_head);
	return test_summary();
}
