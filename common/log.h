/*
 * log.h - the one log module.
 *
 * Lines go to stderr as text or JSON lines, each with the level, the process name and the request,
 * tenant and sandbox ids of the calling thread's context (log_ctx_set). The level is checked before
 * the arguments are evaluated. Messages are lowercase, quote their subject and have no trailing
 * period. Never log keys, tokens or tenant payloads.
 */
#ifndef KILN_LOG_H
#define KILN_LOG_H

#include <stdbool.h>

enum log_level { KLOG_DEBUG = 0, KLOG_INFO, KLOG_WARN, KLOG_ERROR };

extern enum log_level log_min_level;

/* Sets the process name, minimum level and output format; call once at start. */
void log_init(const char *ident, enum log_level min, bool json);

/* Parses "debug", "info", "warn" or "error"; returns -1 for anything else. */
int log_level_parse(const char *s);

/*
 * Sets the calling thread's context, shown on each of its lines until log_ctx_clear().
 * Any argument may be NULL. The strings are copied (truncated to 63 bytes).
 */
void log_ctx_set(const char *request_id, const char *tenant_id, const char *sandbox_id);
void log_ctx_clear(void);

void log_write(enum log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define log_at(lvl, ...)                                \
	do {                                            \
		if ((lvl) >= log_min_level)             \
			log_write((lvl), __VA_ARGS__);  \
	} while (0)
#define log_debug(...) log_at(KLOG_DEBUG, __VA_ARGS__)
#define log_info(...) log_at(KLOG_INFO, __VA_ARGS__)
#define log_warn(...) log_at(KLOG_WARN, __VA_ARGS__)
#define log_error(...) log_at(KLOG_ERROR, __VA_ARGS__)

#endif
