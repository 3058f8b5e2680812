/*
 * daemon.c - the stage table runner shared by kiln-gateway, kiln-node and kiln-meter.
 */
#include "daemon.h"

#include <signal.h>
#include <unistd.h>

#include "common/log.h"

static volatile sig_atomic_t stop_requested;

static void on_signal(int sig)
{
	stop_requested = sig;
}

bool daemon_stopping(void)
{
	return stop_requested != 0;
}

int daemon_run_loop(const struct daemon_stage *stages, size_t n, void (*main_loop)(void))
{
	struct kiln_error err = { 0 };
	size_t started = 0;
	int status = 0;

	signal(SIGPIPE, SIG_IGN);
	signal(SIGTERM, on_signal);
	signal(SIGINT, on_signal);
	for (; started < n; started++) {
		if (stages[started].init(&err) != KILN_OK) {
			log_error("start failed at \"%s\": %s", stages[started].name, err.msg);
			status = 1;
			break;
		}
	}
	if (!status && main_loop)
		main_loop();
	while (!status && !stop_requested)
		pause();
	if (stop_requested)
		log_info("stopping on signal %d", (int)stop_requested);
	while (started > 0)
		stages[--started].exit();
	return status;
}

int daemon_run(const struct daemon_stage *stages, size_t n)
{
	return daemon_run_loop(stages, n, NULL);
}
