/* fault.c - named fault points (fault.h). */
#include "common/fault.h"

#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

/* Whether the comma-separated `list` names `name`. */
static bool listed(const char *list, const char *name)
{
	size_t n = strlen(name);

	for (const char *p = list; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
		if (strncmp(p, name, n) == 0 && (p[n] == ',' || p[n] == '\0'))
			return true;
	return false;
}

void kiln_fault(const char *name)
{
	const char *hold = getenv("KILN_FAULT_HOLD"), *file = getenv("KILN_FAULT_HOLD_FILE");

	if (listed(getenv("KILN_FAULT"), name)) {
		log_warn("fault point \"%s\": killing this process", name);
		raise(SIGKILL);
	}
	if (file && listed(hold, name)) {
		struct timespec tick = { .tv_nsec = 20 * 1000000 };
		int fd = open(file, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);

		if (fd >= 0)
			close(fd);
		log_warn("fault point \"%s\": held until \"%s\" is removed", name, file);
		for (int i = 0; i < 6000 && access(file, F_OK) == 0; i++)
			nanosleep(&tick, NULL);
	}
}
