/*
 * inject_serve.c - the injecting proxy (node/inject.c) on loopback, for test_inject.py: it stands
 * in for the name-checking proxy, handing every connection it accepts to inject_connection() as
 * one to --host at 127.0.0.1:--upstream, after reading its first --pre bytes itself (as the
 * name-checking proxy reads the ClientHello).
 *
 * Usage: inject_serve --host NAME --upstream PORT --ca-file PEM --ca-out PEM [--pre N]
 *                     [--max N] [--per-sandbox N] [--deny-loopback] [--handoff-from-netns] [--secret HOST HEADER VALUE]...
 * Writes the tenant CA's certificate to --ca-out, prints the port it listens on, then serves
 * until killed.
 */
#include <arpa/inet.h>
#include <sched.h>
#include <stdbool.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "node/inject.h"
#include "node/tenantca.h"

#define MAX_SECRETS 16

int main(int argc, char **argv)
{
	const char *host = NULL, *ca_file = NULL, *ca_out = NULL;
	struct inject_secret s[MAX_SECRETS];
	struct inject_opts o = { 0 };
	struct kiln_error err = { 0 };
	struct sockaddr_storage up = { 0 };
	struct sockaddr_in *up4 = (struct sockaddr_in *)&up, me = { 0 };
	socklen_t mlen = sizeof(me);
	struct tenant_ca *ca = NULL;
	struct inject *inj = NULL;
	char *cert = NULL, *key = NULL;
	size_t n = 0, pre = 0;
	bool from_netns = false;
	int lfd;
	FILE *f;

	memset(s, 0, sizeof(s));
	up4->sin_family = AF_INET;
	up4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--host") == 0 && i + 1 < argc) {
			host = argv[++i];
		} else if (strcmp(argv[i], "--upstream") == 0 && i + 1 < argc) {
			o.port = (unsigned short)atoi(argv[++i]);
			up4->sin_port = htons(o.port);
		} else if (strcmp(argv[i], "--ca-file") == 0 && i + 1 < argc) {
			ca_file = argv[++i];
		} else if (strcmp(argv[i], "--ca-out") == 0 && i + 1 < argc) {
			ca_out = argv[++i];
		} else if (strcmp(argv[i], "--max") == 0 && i + 1 < argc) {
			o.connections_max = atoi(argv[++i]);
		} else if (strcmp(argv[i], "--per-sandbox") == 0 && i + 1 < argc) {
			o.per_sandbox_max = atoi(argv[++i]);
		} else if (strcmp(argv[i], "--handoff-from-netns") == 0) {
			from_netns = true;
		} else if (strcmp(argv[i], "--deny-loopback") == 0) {
			static struct kiln_cidr lo = { .family = 4, .plen = 8, .addr = { 127 } };
			o.deny = &lo;
			o.ndeny = 1;
		} else if (strcmp(argv[i], "--pre") == 0 && i + 1 < argc) {
			pre = (size_t)atoi(argv[++i]);
		} else if (strcmp(argv[i], "--secret") == 0 && i + 3 < argc && n < MAX_SECRETS) {
			snprintf(s[n].host, sizeof(s[n].host), "%s", argv[i + 1]);
			snprintf(s[n].header, sizeof(s[n].header), "%s", argv[i + 2]);
			s[n].value = strdup(argv[i + 3]);
			s[n].value_len = strlen(argv[i + 3]);
			if (!inject_header_ok(s[n].header)) {
				fprintf(stderr, "inject_serve: header \"%s\" refused\n", s[n].header);
				return 2;
			}
			n++;
			i += 3;
		} else {
			fprintf(stderr, "inject_serve: bad argument \"%s\"\n", argv[i]);
			return 2;
		}
	}
	if (!host || !o.port || !ca_out) {
		fprintf(stderr, "inject_serve: --host, --upstream and --ca-out are required\n");
		return 2;
	}
	o.ca_file = ca_file;
	o.idle_timeout_s = 20;
	if (tenantca_generate("tn_test", &cert, &key, &err) != KILN_OK ||
	    tenantca_from_pem("tn_test", cert, key, &ca, &err) != KILN_OK ||
	    inject_new(&o, &inj, &err) != KILN_OK ||
	    inject_set(inj, "sb_test", ca, s, n, &err) != KILN_OK) {
		fprintf(stderr, "inject_serve: %s\n", err.msg);
		return 1;
	}
	f = fopen(ca_out, "w");
	if (!f || fputs(tenantca_cert_pem(ca), f) < 0 || fclose(f) != 0) {
		perror(ca_out);
		return 1;
	}
	lfd = socket(AF_INET, SOCK_STREAM, 0);
	me.sin_family = AF_INET;
	me.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (lfd < 0 || bind(lfd, (struct sockaddr *)&me, sizeof(me)) != 0 || listen(lfd, 64) != 0 ||
	    getsockname(lfd, (struct sockaddr *)&me, &mlen) != 0) {
		perror("listen");
		return 1;
	}
	/*
	 * As the name-checking proxy may: hand connections over from a thread in another network
	 * namespace (an empty one here, whose loopback is down): the injector must dial from its own.
	 */
	if (from_netns && unshare(CLONE_NEWNET) != 0) {
		perror("unshare");
		return 1;
	}
	printf("%u\n", ntohs(me.sin_port));
	fflush(stdout);
	for (;;) {
		int fd = accept(lfd, NULL, NULL);
		unsigned char buf[4096];
		ssize_t got = 0;

		if (fd < 0)
			continue;
		if (pre) {
			got = recv(fd, buf, pre < sizeof(buf) ? pre : sizeof(buf), 0);
			if (got < 0)
				got = 0;
		}
		if (inject_connection(inj, "sb_test", fd, buf, (size_t)got, host, &up) != 1) {
			fprintf(stderr, "inject_serve: connection not taken\n");
			close(fd);
		}
	}
}
