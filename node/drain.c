/*
 * drain.c - `kiln-node drain`: asks the gateway (gateway_url) to drain this node (node_id) with
 * POST /v1/admin/nodes/{id}/drain under an admin API key (KILN_ADMIN_KEY, else the file
 * admin_key_file names), and prints its answer: no new placement here, each sandbox paused, its
 * snapshot in its tenant's bucket and the running ones resumed on other nodes.
 */
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/buf.h"
#include "common/fsutil.h"
#include "node/drain.h"

static size_t drain_body(char *p, size_t size, size_t n, void *arg)
{
	fwrite(p, size, n, (FILE *)arg);
	return size * n;
}

int drain_command(const struct kiln_config *cfg)
{
	char key[512] = "", url[1024], auth[600];
	const char *env = getenv("KILN_ADMIN_KEY");
	struct curl_slist *h = NULL;
	CURL *c;
	CURLcode cc;
	long status = 0;

	if (env && *env) {
		snprintf(key, sizeof(key), "%s", env);
	} else if (cfg->admin_key_file) {
		ssize_t r = fs_read_small(cfg->admin_key_file, key, sizeof(key) - 1);

		key[r > 0 ? r : 0] = '\0';
		key[strcspn(key, "\r\n")] = '\0';
	}
	if (!key[0]) {
		fprintf(stderr, "kiln-node drain: no admin API key: set KILN_ADMIN_KEY or "
				"admin_key_file\n");
		return 2;
	}
	snprintf(url, sizeof(url), "%s/v1/admin/nodes/%s/drain", cfg->gateway_url, cfg->node_id);
	snprintf(auth, sizeof(auth), "Authorization: Bearer %s", key);
	c = curl_easy_init();
	if (!c) {
		fprintf(stderr, "kiln-node drain: out of memory\n");
		return 1;
	}
	h = curl_slist_append(h, auth);
	curl_easy_setopt(c, CURLOPT_URL, url);
	curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
	curl_easy_setopt(c, CURLOPT_POST, 1L);
	curl_easy_setopt(c, CURLOPT_POSTFIELDS, "");
	curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, drain_body);
	curl_easy_setopt(c, CURLOPT_WRITEDATA, stdout);
	cc = curl_easy_perform(c);
	if (cc == CURLE_OK)
		curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
	curl_slist_free_all(h);
	curl_easy_cleanup(c);
	printf("\n");
	if (cc != CURLE_OK) {
		fprintf(stderr, "kiln-node drain: %s: %s\n", url, curl_easy_strerror(cc));
		return 1;
	}
	if (status != 200) {
		fprintf(stderr, "kiln-node drain: the gateway answered %ld\n", status);
		return 1;
	}
	return 0;
}
