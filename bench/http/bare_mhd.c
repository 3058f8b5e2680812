/*
 * bare_mhd.c - the baseline of the HTTP benchmarks: libmicrohttpd with the same threading model
 * as kiln-gateway (a thread per connection) answering every request with a fixed 200 JSON body
 * and doing nothing else. Usage: bench-bare-mhd PORT (runs until killed).
 */
#include <microhttpd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char body[] = "{\"status\":\"ok\",\"checks\":{\"postgres\":\"ok\",\"redis\":\"ok\"}}";

static enum MHD_Result answer(void *cls, struct MHD_Connection *c, const char *url,
			      const char *method, const char *version, const char *upload,
			      size_t *upload_size, void **con_cls)
{
	struct MHD_Response *r;
	enum MHD_Result ret;

	if (!*con_cls) {
		*con_cls = (void *)1;
		return MHD_YES;
	}
	r = MHD_create_response_from_buffer(strlen(body), (void *)body, MHD_RESPMEM_PERSISTENT);
	MHD_add_response_header(r, "Content-Type", "application/json");
	ret = MHD_queue_response(c, 200, r);
	MHD_destroy_response(r);
	return ret;
}

int main(int argc, char **argv)
{
	struct MHD_Daemon *d;

	if (argc != 2) {
		fprintf(stderr, "usage: bench-bare-mhd PORT\n");
		return 2;
	}
	d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
				     MHD_USE_POLL,
			     (uint16_t)atoi(argv[1]), NULL, NULL, answer, NULL, MHD_OPTION_END);
	if (!d)
		return 1;
	for (;;)
		pause();
}
