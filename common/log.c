/*
 * log.c - leveled logging to stderr, text or JSON lines (see log.h).
 */
#include "log.h"

#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

enum log_level log_min_level = KLOG_INFO;

static char log_ident[32] = "kiln";
static bool log_json;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;

static _Thread_local char ctx_req[64], ctx_tenant[64], ctx_sandbox[64];

static const char *const level_names[] = { "debug", "info", "warn", "error" };

void log_init(const char *ident, enum log_level min, bool json)
{
	snprintf(log_ident, sizeof(log_ident), "%s", ident ? ident : "kiln");
	log_min_level = min;
	log_json = json;
}

int log_level_parse(const char *s)
{
	for (int i = 0; i < 4; i++)
		if (s && strcmp(s, level_names[i]) == 0)
			return i;
	return -1;
}

static void copy_ctx(char *dst, const char *src)
{
	snprintf(dst, 64, "%s", src ? src : "");
}

void log_ctx_set(const char *request_id, const char *tenant_id, const char *sandbox_id)
{
	copy_ctx(ctx_req, request_id);
	copy_ctx(ctx_tenant, tenant_id);
	copy_ctx(ctx_sandbox, sandbox_id);
}

void log_ctx_clear(void)
{
	ctx_req[0] = ctx_tenant[0] = ctx_sandbox[0] = '\0';
}

void log_write(enum log_level lvl, const char *fmt, ...)
{
	char msg[2048], ts[64];
	struct timeval tv;
	struct tm tm;
	va_list ap;

	if ((unsigned)lvl > KLOG_ERROR)
		lvl = KLOG_ERROR;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	gettimeofday(&tv, NULL);
	gmtime_r(&tv.tv_sec, &tm);
	snprintf(ts, sizeof(ts), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
		 tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000) % 1000);

	pthread_mutex_lock(&log_lock);
	if (log_json) {
		json_t *o = json_pack("{s:s, s:s, s:s, s:s}", "ts", ts, "level", level_names[lvl],
				      "proc", log_ident, "msg", msg);
		if (o) {
			if (ctx_req[0])
				json_object_set_new(o, "request_id", json_string(ctx_req));
			if (ctx_tenant[0])
				json_object_set_new(o, "tenant_id", json_string(ctx_tenant));
			if (ctx_sandbox[0])
				json_object_set_new(o, "sandbox_id", json_string(ctx_sandbox));
			char *line = json_dumps(o, JSON_COMPACT);
			if (line)
				fprintf(stderr, "%s\n", line);
			free(line);
			json_decref(o);
		}
	} else {
		fprintf(stderr, "%s %s %-5s", ts, log_ident, level_names[lvl]);
		if (ctx_req[0])
			fprintf(stderr, " req=%s", ctx_req);
		if (ctx_tenant[0])
			fprintf(stderr, " tenant=%s", ctx_tenant);
		if (ctx_sandbox[0])
			fprintf(stderr, " sandbox=%s", ctx_sandbox);
		fprintf(stderr, " %s\n", msg);
	}
	fflush(stderr);
	pthread_mutex_unlock(&log_lock);
}
