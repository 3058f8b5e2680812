/*
 * kiln.c - the command-line client: sandboxes, exec, files, snapshots, templates, egress and
 * billing through the public API (docs/cli.md).
 *
 *   kiln [--url URL] [--key KEY] [--json] COMMAND [ARG...]
 *
 * URL and KEY default to $KILN_URL and $KILN_API_KEY. Exit status: 0 done; for exec and run, the
 * program's own exit status; 1 the API or the connection failed (the reason on stderr); 2 the
 * command line is wrong.
 */
#include <curl/curl.h>
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <ftw.h>
#include <libgen.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/client.h"
#include "common/dockerfile.h"

#define EXIT_API 1
#define EXIT_USAGE 2
#define ENV_MAX 64	/* --env pairs of one command */

static struct client cli;
static bool as_json;

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "kiln: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\nTry 'kiln help'.\n");
	return EXIT_USAGE;
}

static int api_error(int status, const struct buf *body)
{
	char msg[600];

	if (!status)
		fprintf(stderr, "kiln: %s: %s\n", cli.url, cli.err);
	else {
		client_error_text(status, body, msg, sizeof(msg));
		fprintf(stderr, "kiln: %s\n", msg);
	}
	return EXIT_API;
}

/* Calls the API and parses a JSON answer into *out (NULL for an empty one). 0 or an exit code. */
static int call(const char *method, const char *path, json_t *body, json_t **out)
{
	struct client_body b = { 0 };
	struct buf reply;
	char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
	int status, rc = 0;

	buf_init(&reply, CLIENT_BODY_MAX);
	b.json = text;
	status = client_call(&cli, method, path, text ? &b : NULL, &reply);
	free(text);
	json_decref(body);
	if (status < 200 || status > 299)
		rc = api_error(status, &reply);
	else if (out)
		*out = reply.len ? json_loadb(reply.data, reply.len, 0, NULL) : NULL;
	buf_release(&reply);
	return rc;
}

static void print_json(json_t *v)
{
	char *s = json_dumps(v, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_ENCODE_ANY);

	if (s)
		printf("%s\n", s);
	free(s);
}

/* Prints one sandbox: its id, or (--json) all of it. */
static void print_sandbox(json_t *sb)
{
	if (as_json)
		print_json(sb);
	else
		printf("%s\t%s\n", json_string_value(json_object_get(sb, "id")),
		       json_string_value(json_object_get(sb, "state")));
}

/* "/v1/sandboxes/<id><suffix>" with the id checked to be one word. */
static int sandbox_path(char *out, size_t len, const char *id, const char *suffix)
{
	if (!id || !*id || strspn(id, "abcdefghijklmnopqrstuvwxyz0123456789_") != strlen(id))
		return usage_error("'%s' is not a sandbox id", id ? id : "");
	snprintf(out, len, "/v1/sandboxes/%s%s", id, suffix);
	return 0;
}

/* Adds --env NAME=value to the object `env`; 0 or EXIT_USAGE. */
static int add_env(json_t *env, const char *pair)
{
	const char *eq = strchr(pair, '=');
	char name[256];

	if (!eq || eq == pair || (size_t)(eq - pair) >= sizeof(name))
		return usage_error("--env wants NAME=value, not '%s'", pair);
	snprintf(name, sizeof(name), "%.*s", (int)(eq - pair), pair);
	json_object_set_new(env, name, json_string(eq + 1));
	return 0;
}

static bool parse_num(const char *s, double *out)
{
	char *end;

	errno = 0;
	*out = strtod(s, &end);
	return *s && !*end && !errno;
}

/* ---- sandboxes ---- */

static int cmd_create(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "vcpus", required_argument, NULL, 'c' },   { "memory", required_argument, NULL, 'm' },
		{ "disk", required_argument, NULL, 'd' },    { "timeout", required_argument, NULL, 't' },
		{ "env", required_argument, NULL, 'e' },     { "snapshot", required_argument, NULL, 's' },
		{ "allow", required_argument, NULL, 'a' },   { "template", required_argument, NULL, 'T' },
		{ NULL, 0, NULL, 0 },
	};
	json_t *body = json_object(), *env = json_object(), *rules = json_array(), *sb = NULL;
	int o, rc = 0;
	double v;

	while (rc == 0 && (o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if (o == 'e') {
			rc = add_env(env, optarg);
		} else if (o == 's') {
			json_object_set_new(body, "snapshot_id", json_string(optarg));
		} else if (o == 'T') {
			json_object_set_new(body, "template", json_string(optarg));
		} else if (o == 'a') {
			json_array_append_new(rules, json_string(optarg));
		} else if (o == '?') {
			rc = EXIT_USAGE;
		} else if (!parse_num(optarg, &v)) {
			rc = usage_error("'%s' is not a number", optarg);
		} else {
			const char *name = o == 'c' ? "vcpus" : o == 'm' ? "memory_mib" : o == 'd' ? "disk_gib" : "timeout_s";

			json_object_set_new(body, name, o == 'c' ? json_real(v) : json_integer((json_int_t)v));
		}
	}
	if (rc == 0 && optind < argc)
		rc = usage_error("create takes no argument '%s'", argv[optind]);
	if (json_object_size(env))
		json_object_set(body, "env", env);
	if (json_array_size(rules))
		json_object_set_new(body, "egress", json_pack("{s:O}", "rules", rules));
	json_decref(env);
	json_decref(rules);
	if (rc) {
		json_decref(body);
		return rc;
	}
	rc = call("POST", "/v1/sandboxes", body, &sb);
	if (rc == 0)
		as_json ? print_json(sb) : (void)printf("%s\n", json_string_value(json_object_get(sb, "id")));
	json_decref(sb);
	return rc;
}

static int cmd_list(int argc, char **argv)
{
	char path[256];
	json_t *page = NULL;
	int rc;

	if (argc > 2 || (argc == 2 && strspn(argv[1], "abcdefghijklmnopqrstuvwxyz") != strlen(argv[1])))
		return usage_error("list takes at most a state, not '%s'", argv[argc - 1]);
	snprintf(path, sizeof(path), "/v1/sandboxes?limit=100%s%s", argc == 2 ? "&state=" : "",
		 argc == 2 ? argv[1] : "");
	rc = call("GET", path, NULL, &page);
	if (rc == 0 && as_json) {
		print_json(page);
	} else if (rc == 0) {
		json_t *sb;
		size_t i;

		json_array_foreach(json_object_get(page, "sandboxes"), i, sb)
			printf("%s\t%-8s\t%g vCPU\t%lld MiB\t%s\n", json_string_value(json_object_get(sb, "id")),
			       json_string_value(json_object_get(sb, "state")),
			       json_number_value(json_object_get(sb, "vcpus")),
			       (long long)json_integer_value(json_object_get(sb, "memory_mib")),
			       json_string_value(json_object_get(sb, "created_at")));
	}
	json_decref(page);
	return rc;
}

/* get, delete, pause, resume: one sandbox id, one call. */
static int cmd_simple(int argc, char **argv)
{
	const char *verb = argv[0];
	char path[256];
	json_t *sb = NULL;
	int rc;

	if (argc != 2)
		return usage_error("%s takes one sandbox id", verb);
	if ((rc = sandbox_path(path, sizeof(path), argv[1],
			       !strcmp(verb, "pause") ? "/pause" : !strcmp(verb, "resume") ? "/resume" : "")))
		return rc;
	rc = call(!strcmp(verb, "get") ? "GET" : !strcmp(verb, "delete") ? "DELETE" : "POST", path, NULL, &sb);
	if (rc == 0 && sb)
		print_sandbox(sb);
	json_decref(sb);
	return rc;
}

static int cmd_fork(int argc, char **argv)
{
	static const struct option opts[] = { { "count", required_argument, NULL, 'n' }, { NULL, 0, NULL, 0 } };
	char path[256];
	json_t *res = NULL, *sb;
	double count = 1;
	size_t i;
	int o, rc;

	while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1)
		if (o != 'n' || !parse_num(optarg, &count))
			return o == '?' ? EXIT_USAGE : usage_error("'%s' is not a number", optarg);
	if (optind + 1 != argc)
		return usage_error("fork takes one sandbox id");
	if ((rc = sandbox_path(path, sizeof(path), argv[optind], "/fork")))
		return rc;
	rc = call("POST", path, json_pack("{s:I}", "count", (json_int_t)count), &res);
	json_array_foreach(json_object_get(res, "sandboxes"), i, sb)
		print_sandbox(sb);
	json_decref(res);
	return rc;
}

static int cmd_timeout(int argc, char **argv)
{
	char path[256];
	json_t *sb = NULL;
	double s;
	int rc;

	if (argc != 3 || !parse_num(argv[2], &s))
		return usage_error("timeout takes a sandbox id and seconds");
	if ((rc = sandbox_path(path, sizeof(path), argv[1], "/timeout")))
		return rc;
	rc = call("PUT", path, json_pack("{s:I}", "timeout_s", (json_int_t)s), &sb);
	if (rc == 0)
		print_sandbox(sb);
	json_decref(sb);
	return rc;
}

/* ---- exec ---- */

struct exec_state {
	int exit_code;
	bool exited, failed;
};

static void on_event(void *ctx, const char *event, const char *data)
{
	struct exec_state *st = ctx;
	json_t *doc = json_loads(data, 0, NULL);
	const char *text = json_string_value(json_object_get(doc, "data"));

	if (!strcmp(event, "stdout") || !strcmp(event, "stderr")) {
		FILE *f = !strcmp(event, "stdout") ? stdout : stderr;

		if (text) {
			fputs(text, f);
			fflush(f);
		}
	} else if (!strcmp(event, "exit")) {
		st->exit_code = (int)json_integer_value(json_object_get(doc, "exit_code"));
		st->exited = true;
		if (json_is_true(json_object_get(doc, "timed_out")))
			fprintf(stderr, "kiln: the program timed out\n");
	} else if (!strcmp(event, "error")) {
		json_t *e = json_object_get(doc, "error") ?: doc;	/* older nodes sent it flat */

		fprintf(stderr, "kiln: %s (%s)\n", json_string_value(json_object_get(e, "message")) ?: data,
			json_string_value(json_object_get(e, "code")) ?: "error");
		st->failed = true;
	}
	json_decref(doc);
}

/* Runs `req` (an exec body) in sandbox `id`, streaming its output; returns its exit status. */
static int exec_stream(const char *id, json_t *req)
{
	struct exec_state st = { 0 };
	struct buf reply;
	char path[256], *text;
	int status, rc;

	if ((rc = sandbox_path(path, sizeof(path), id, "/exec"))) {
		json_decref(req);
		return rc;
	}
	text = json_dumps(req, JSON_COMPACT);
	json_decref(req);
	buf_init(&reply, CLIENT_BODY_MAX);
	status = client_stream(&cli, path, text, on_event, &st, &reply);
	free(text);
	if (status != 200)
		rc = api_error(status, &reply);
	else if (!st.exited)
		rc = st.failed ? EXIT_API : (fprintf(stderr, "kiln: the stream ended early\n"), EXIT_API);
	else
		rc = st.exit_code;
	buf_release(&reply);
	return rc;
}

/*
 * Options shared by exec and run into `req`, from argv[1] on (argv[0] is the sandbox id); they end
 * at the first other word, so the program's own options stay its own. Returns 0 or an exit code;
 * optind is then the index of that word.
 */
static int exec_options(int argc, char **argv, json_t *req, bool run)
{
	static const struct option opts[] = {
		{ "env", required_argument, NULL, 'e' },     { "cwd", required_argument, NULL, 'w' },
		{ "timeout", required_argument, NULL, 't' }, { "lang", required_argument, NULL, 'l' },
		{ "user", required_argument, NULL, 'u' },    { NULL, 0, NULL, 0 },
	};
	json_t *env = json_object();
	double v;
	int o, rc = 0;

	optind = 0;
	while (rc == 0 && (o = getopt_long(argc, argv, "+", opts, NULL)) != -1) {
		if (o == 'e')
			rc = add_env(env, optarg);
		else if (o == 'w')
			json_object_set_new(req, "cwd", json_string(optarg));
		else if (o == 't' && parse_num(optarg, &v))
			json_object_set_new(req, "timeout_s", json_integer((json_int_t)v));
		else if (o == 'l' && run)
			json_object_set_new(req, "language", json_string(optarg));
		else if (o == 'u')
			json_object_set_new(req, "user", json_string(optarg));
		else
			rc = o == '?' ? EXIT_USAGE : usage_error("bad option value '%s'", optarg);
	}
	if (json_object_size(env))
		json_object_set(req, "env", env);
	json_decref(env);
	return rc;
}

static int cmd_exec(int argc, char **argv)
{
	json_t *req = json_object(), *cmd = json_array();
	int rc = argc < 3 ? usage_error("exec takes a sandbox id and a command")
			  : exec_options(argc - 1, argv + 1, req, false);

	if (rc == 0 && optind >= argc - 1)
		rc = usage_error("exec takes a sandbox id and a command");
	for (int i = optind + 1; rc == 0 && i < argc; i++)
		json_array_append_new(cmd, json_string(argv[i]));
	json_object_set_new(req, "cmd", cmd);
	if (rc) {
		json_decref(req);
		return rc;
	}
	return exec_stream(argv[1], req);
}

/* Reads all of `f` (at most `max` bytes) into a string the caller frees; NULL on error. */
static char *read_all(FILE *f, size_t max)
{
	struct buf b;
	char chunk[65536];
	size_t n;

	buf_init(&b, max);
	while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0)
		if (buf_append(&b, chunk, n) < 0) {
			buf_release(&b);
			return NULL;
		}
	return ferror(f) ? (buf_release(&b), NULL) : buf_detach(&b, NULL);
}

static int cmd_run(int argc, char **argv)
{
	json_t *req = json_object();
	const char *src;
	char *code;
	int rc = argc < 3 ? usage_error("run takes a sandbox id and the code (or - to read it)")
			  : exec_options(argc - 1, argv + 1, req, true);

	if (rc == 0 && optind != argc - 2)
		rc = usage_error("run takes a sandbox id and the code (or - to read it)");
	if (rc) {
		json_decref(req);
		return rc;
	}
	src = argv[optind + 1];
	code = strcmp(src, "-") ? strdup(src) : read_all(stdin, 1 << 20);
	if (!code) {
		json_decref(req);
		fprintf(stderr, "kiln: cannot read the code from stdin (at most 1 MiB)\n");
		return EXIT_USAGE;
	}
	json_object_set_new(req, "code", json_string(code));
	free(code);
	return exec_stream(argv[1], req);
}

/* ---- files ---- */

/*
 * Takes `--user NAME` (or --user=NAME) out of argv[1..] of put and cat, wherever it stands, into
 * *user (NULL without it). Returns 0 or EXIT_USAGE.
 */
static int user_option(int *argc, char **argv, const char **user)
{
	int j = 1;

	*user = NULL;
	for (int i = 1; i < *argc; i++) {
		if (strcmp(argv[i], "--user") == 0) {
			if (i + 1 >= *argc)
				return usage_error("--user wants a user name");
			*user = argv[++i];
		} else if (strncmp(argv[i], "--user=", 7) == 0) {
			*user = argv[i] + 7;
		} else {
			argv[j++] = argv[i];
		}
	}
	*argc = j;
	argv[j] = NULL;
	return 0;
}

/* "/v1/sandboxes/<id>/files?path=<escaped remote>[&user=<escaped user>]" */
static int files_path(char *out, size_t len, const char *id, const char *remote, const char *user)
{
	char *esc;
	int rc;

	if (!remote || remote[0] != '/')
		return usage_error("the path in the sandbox must be absolute, not '%s'", remote ? remote : "");
	if ((rc = sandbox_path(out, len, id, "/files?path=")))
		return rc;
	esc = curl_easy_escape(NULL, remote, 0);
	if (!esc || strlen(out) + strlen(esc) >= len) {
		curl_free(esc);
		return usage_error("path too long: '%s'", remote);
	}
	strcat(out, esc);
	curl_free(esc);
	if (user) {
		esc = curl_easy_escape(NULL, user, 0);
		if (!esc || strlen(out) + strlen(esc) + 6 >= len) {
			curl_free(esc);
			return usage_error("user too long: '%s'", user);
		}
		strcat(out, "&user=");
		strcat(out, esc);
		curl_free(esc);
	}
	return 0;
}

static int cmd_put(int argc, char **argv)
{
	char path[8192];
	struct client_body b = { 0 };
	struct buf reply;
	struct stat st;
	const char *user;
	int rc, status;

	if ((rc = user_option(&argc, argv, &user)))
		return rc;
	if (argc != 4)
		return usage_error("put takes a sandbox id, a local file and a path in the sandbox");
	if ((rc = files_path(path, sizeof(path), argv[1], argv[3], user)))
		return rc;
	b.file = strcmp(argv[2], "-") ? fopen(argv[2], "rb") : NULL;
	if (!b.file || fstat(fileno(b.file), &st) != 0 || !S_ISREG(st.st_mode)) {
		fprintf(stderr, "kiln: cannot read '%s': %s\n", argv[2], b.file ? "not a regular file" : strerror(errno));
		if (b.file)
			fclose(b.file);
		return EXIT_USAGE;
	}
	b.file_size = st.st_size;
	buf_init(&reply, 1 << 20);
	status = client_call(&cli, "PUT", path, &b, &reply);
	fclose(b.file);
	rc = status >= 200 && status <= 299 ? 0 : api_error(status, &reply);
	buf_release(&reply);
	return rc;
}

static int cmd_get_file(int argc, char **argv)
{
	char path[8192];
	struct buf reply;
	FILE *out;
	const char *user;
	int rc, status;

	if ((rc = user_option(&argc, argv, &user)))
		return rc;
	if (argc != 3 && argc != 4)
		return usage_error("cat takes a sandbox id, a path in the sandbox and an optional local file");
	if ((rc = files_path(path, sizeof(path), argv[1], argv[2], user)))
		return rc;
	buf_init(&reply, CLIENT_BODY_MAX);
	status = client_call(&cli, "GET", path, NULL, &reply);
	if (status != 200) {
		rc = api_error(status, &reply);
	} else {
		out = argc == 4 && strcmp(argv[3], "-") ? fopen(argv[3], "wb") : stdout;
		if (!out || fwrite(reply.data ? reply.data : "", 1, reply.len, out) != reply.len ||
		    fflush(out) != 0) {
			fprintf(stderr, "kiln: cannot write '%s': %s\n", argc == 4 ? argv[3] : "stdout", strerror(errno));
			rc = EXIT_API;
		}
		if (out && out != stdout)
			fclose(out);
	}
	buf_release(&reply);
	return rc;
}

/* ---- snapshots, egress, billing, raw calls ---- */

static int cmd_snapshot(int argc, char **argv)
{
	char path[256];
	json_t *snap = NULL;
	int rc;

	if (argc != 2 && argc != 3)
		return usage_error("snapshot takes a sandbox id and an optional name");
	if ((rc = sandbox_path(path, sizeof(path), argv[1], "/snapshots")))
		return rc;
	rc = call("POST", path, argc == 3 ? json_pack("{s:s}", "name", argv[2]) : json_object(), &snap);
	if (rc == 0)
		as_json ? print_json(snap) : (void)printf("%s\n", json_string_value(json_object_get(snap, "id")));
	json_decref(snap);
	return rc;
}

/*
 * The id of the caller's template `arg`: `arg` itself when it is an id (tmpl_…), else the id of
 * the template of that name, found in the listing. 0 or an exit code (1 when there is none).
 */
static int template_id(const char *arg, char *out, size_t len)
{
	char path[512], *cursor = NULL;
	json_t *page = NULL, *t;
	size_t i;
	int rc = 0;

	if (strncmp(arg, "tmpl_", 5) == 0) {
		if (strspn(arg, "abcdefghijklmnopqrstuvwxyz0123456789_") != strlen(arg) ||
		    strlen(arg) >= len)
			return usage_error("'%s' is not a template id", arg);
		snprintf(out, len, "%s", arg);
		return 0;
	}
	for (;;) {
		snprintf(path, sizeof(path), "/v1/templates?limit=100%s%s", cursor ? "&cursor=" : "",
			 cursor ? cursor : "");
		free(cursor);
		cursor = NULL;
		if ((rc = call("GET", path, NULL, &page)))
			return rc;
		json_array_foreach(json_object_get(page, "templates"), i, t) {
			if (strcmp(json_string_value(json_object_get(t, "name")) ?: "", arg) == 0) {
				snprintf(out, len, "%s", json_string_value(json_object_get(t, "id")));
				json_decref(page);
				return 0;
			}
		}
		if (json_is_string(json_object_get(page, "next_cursor")))
			cursor = strdup(json_string_value(json_object_get(page, "next_cursor")));
		json_decref(page);
		page = NULL;
		if (!cursor)
			break;
	}
	fprintf(stderr, "kiln: no template \"%s\"\n", arg);
	return EXIT_API;
}

/* ---- template build ---- */

/* The context walk of `template build`: paths kept, NUL-separated, for tar -T. */
static struct {
	const char *root;
	size_t root_len;
	struct dockerignore *di;
	FILE *list;
	size_t kept, left_out;
} walk;

static int walk_one(const char *path, const struct stat *st, int type, struct FTW *f)
{
	const char *rel = path + walk.root_len;

	(void)st;
	(void)f;
	while (*rel == '/')
		rel++;
	if (!*rel)
		return 0;
	if (type == FTW_DNR || type == FTW_NS) {
		fprintf(stderr, "kiln: %s cannot be read\n", path);
		return 1;
	}
	if (dockerignore_excluded(walk.di, rel)) {
		walk.left_out++;
		return 0;
	}
	/* Directories go in without their contents (--no-recursion): only kept paths travel. */
	fwrite(rel, 1, strlen(rel) + 1, walk.list);
	walk.kept++;
	return 0;
}

/* The whole of a small file into a malloc'd buffer; NULL (errno set) when it cannot be read. */
static char *read_small(const char *path, size_t max, size_t *len)
{
	FILE *f = fopen(path, "rb");
	char *data = f ? malloc(max + 1) : NULL;

	if (!data) {
		if (f)
			fclose(f);
		return NULL;
	}
	*len = fread(data, 1, max + 1, f);
	fclose(f);
	if (*len > max) {
		free(data);
		errno = EFBIG;
		return NULL;
	}
	data[*len] = '\0';
	return data;
}

/* Prints the build log's events as they come; remembers the end. */
struct follow {
	char status[16];
	char reason[1024];
};

static void follow_event(void *ctx, const char *event, const char *data)
{
	struct follow *f = ctx;
	json_t *j = json_loads(data, 0, NULL);

	if (!strcmp(event, "log")) {
		fputs(json_string_value(json_object_get(j, "text")) ?: "", stderr);
	} else if (!strcmp(event, "end")) {
		snprintf(f->status, sizeof(f->status), "%s",
			 json_string_value(json_object_get(j, "status")) ?: "");
		snprintf(f->reason, sizeof(f->reason), "%s",
			 json_string_value(json_object_get(j, "reason")) ?: "");
	} else if (!strcmp(event, "error")) {
		snprintf(f->reason, sizeof(f->reason), "%s",
			 json_string_value(json_object_get(j, "message")) ?: data);
	}
	json_decref(j);
}

/* PUTs the file `path` to `url_path`. 0 or an exit code. */
static int put_file(const char *url_path, const char *path, json_t **out)
{
	struct client_body b = { 0 };
	struct buf reply;
	struct stat st;
	int status, rc = 0;

	b.file = fopen(path, "rb");
	if (!b.file || fstat(fileno(b.file), &st) != 0) {
		fprintf(stderr, "kiln: %s: %s\n", path, strerror(errno));
		if (b.file)
			fclose(b.file);
		return EXIT_API;
	}
	b.file_size = st.st_size;
	buf_init(&reply, CLIENT_BODY_MAX);
	status = client_call(&cli, "PUT", url_path, &b, &reply);
	fclose(b.file);
	if (status < 200 || status > 299)
		rc = api_error(status, &reply);
	else if (out)
		*out = reply.len ? json_loadb(reply.data, reply.len, 0, NULL) : NULL;
	buf_release(&reply);
	return rc;
}

/* The build context's list and tar, and their temporary directory. */
static void context_remove(const char *tmpdir, const char *listp, const char *tarp)
{
	unlink(listp);
	unlink(tarp);
	rmdir(tmpdir);
}

/*
 * template build [-f Dockerfile] [--name N] [--vcpus N] [--memory MIB] [--disk GIB] [--start CMD]
 * [--ready CMD] [--allow RULE]... DIR: a new version of template N (default: DIR's name) built
 * from DIR, tarred with tar(1) without what its .dockerignore excludes; the log as it comes.
 */
static int template_build(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "file", required_argument, NULL, 'f' },    { "name", required_argument, NULL, 'n' },
		{ "vcpus", required_argument, NULL, 'c' },   { "memory", required_argument, NULL, 'm' },
		{ "disk", required_argument, NULL, 'd' },    { "start", required_argument, NULL, 's' },
		{ "ready", required_argument, NULL, 'r' },   { "allow", required_argument, NULL, 'a' },
		{ NULL, 0, NULL, 0 },
	};
	const char *file = NULL, *name = NULL, *dir;
	char dfpath[4096], dipath[4096], tmpdir[4096], listp[4200], tarp[4200];
	char path[512], namebuf[256];
	double vcpus = 1, mem = 512, disk = 10;
	json_t *body = json_object(), *rules = json_array(), *made = NULL;
	struct dockerignore di = { 0 };
	struct kiln_error kerr = { 0 };
	struct follow fol = { 0 };
	struct buf reply;
	char *text = NULL;
	size_t len = 0;
	int o, rc = 0, status;
	bool tmp = false;

	while (rc == 0 && (o = getopt_long(argc, argv, "f:", opts, NULL)) != -1) {
		if (o == 'f')
			file = optarg;
		else if (o == 'n')
			name = optarg;
		else if (o == 's')
			json_object_set_new(body, "start_cmd", json_string(optarg));
		else if (o == 'r')
			json_object_set_new(body, "ready_cmd", json_string(optarg));
		else if (o == 'a')
			json_array_append_new(rules, json_string(optarg));
		else if (o == '?')
			rc = EXIT_USAGE;
		else if (!parse_num(optarg, o == 'c' ? &vcpus : o == 'm' ? &mem : &disk))
			rc = usage_error("'%s' is not a number", optarg);
	}
	if (rc == 0 && optind + 1 != argc)
		rc = usage_error("template build takes one directory, the build context");
	if (rc)
		goto out;
	dir = argv[optind];
	snprintf(dfpath, sizeof(dfpath), "%s", file ? file : "");
	if (!file)
		snprintf(dfpath, sizeof(dfpath), "%s/Dockerfile", dir);
	if (!name) {
		snprintf(namebuf, sizeof(namebuf), "%s", dir);
		name = basename(namebuf);
	}
	text = read_small(dfpath, DOCKERFILE_MAX_BYTES, &len);
	if (!text) {
		fprintf(stderr, "kiln: %s: %s\n", dfpath, strerror(errno));
		rc = EXIT_API;
		goto out;
	}
	/* The .dockerignore, as the builder will apply it again. */
	snprintf(dipath, sizeof(dipath), "%s/.dockerignore", dir);
	{
		size_t dlen = 0;
		char *ign = read_small(dipath, 16u << 20, &dlen);
		if (ign && dockerignore_parse(ign, dlen, &di, &kerr) != KILN_OK) {
			fprintf(stderr, "kiln: %s: %s\n", dipath, kerr.msg);
			rc = EXIT_USAGE;
		}
		free(ign);
		if (rc)
			goto out;
	}
	snprintf(tmpdir, sizeof(tmpdir), "%s/kiln-build-XXXXXX",	/* TMPDIR, as other tools */
		 getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
	if (!mkdtemp(tmpdir)) {
		fprintf(stderr, "kiln: %s: %s\n", tmpdir, strerror(errno));
		rc = EXIT_API;
		goto out;
	}
	tmp = true;
	snprintf(listp, sizeof(listp), "%s/list", tmpdir);
	snprintf(tarp, sizeof(tarp), "%s/context.tar", tmpdir);
	walk.root = dir;
	walk.root_len = strlen(dir);
	walk.di = &di;
	walk.list = fopen(listp, "wb");
	if (!walk.list || nftw(dir, walk_one, 32, FTW_PHYS) != 0 || fclose(walk.list) != 0) {
		fprintf(stderr, "kiln: %s: the build context cannot be read\n", dir);
		rc = EXIT_API;
		goto out;
	}
	{
		pid_t pid = fork();
		int st = 0;

		if (pid == 0) {
			execlp("tar", "tar", "-c", "-f", tarp, "-C", dir, "--null", "--no-recursion",
			       "-T", listp, (char *)NULL);
			_exit(127);
		}
		if (pid < 0 || waitpid(pid, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
			fprintf(stderr, "kiln: tar of %s failed\n", dir);
			rc = EXIT_API;
			goto out;
		}
	}
	fprintf(stderr, "kiln: context %s: %zu paths, %zu left out by .dockerignore\n", dir, walk.kept,
		walk.left_out);
	json_object_set_new(body, "name", json_string(name));
	json_object_set_new(body, "vcpus", json_real(vcpus));
	json_object_set_new(body, "memory_mib", json_integer((json_int_t)mem));
	json_object_set_new(body, "disk_gib", json_integer((json_int_t)disk));
	if (json_array_size(rules))
		json_object_set_new(body, "egress", json_pack("{s:O}", "rules", rules));
	rc = call("POST", "/v1/templates", body, &made);
	body = NULL;
	if (rc)
		goto out;
	snprintf(path, sizeof(path), "/v1/templates/%s/dockerfile?version=%lld",
		 json_string_value(json_object_get(made, "id")),
		 (long long)json_integer_value(json_object_get(made, "version")));
	if ((rc = put_file(path, dfpath, NULL)))
		goto out;
	snprintf(path, sizeof(path), "/v1/templates/%s/source?version=%lld",
		 json_string_value(json_object_get(made, "id")),
		 (long long)json_integer_value(json_object_get(made, "version")));
	rc = put_file(path, tarp, NULL);
	context_remove(tmpdir, listp, tarp);	/* uploaded: none left if the log's wait is cut */
	tmp = false;
	if (rc)
		goto out;
	snprintf(path, sizeof(path), "/v1/templates/%s/log?version=%lld",
		 json_string_value(json_object_get(made, "id")),
		 (long long)json_integer_value(json_object_get(made, "version")));
	buf_init(&reply, CLIENT_BODY_MAX);
	status = client_stream(&cli, path, NULL, follow_event, &fol, &reply);
	if (status != 200)
		rc = api_error(status, &reply);
	buf_release(&reply);
	if (rc)
		goto out;
	if (strcmp(fol.status, "ready") != 0) {
		fprintf(stderr, "kiln: the build %s: %s\n", fol.status[0] ? fol.status : "did not end",
			fol.reason);
		rc = EXIT_API;
		goto out;
	}
	if (as_json)
		print_json(made);
	else
		printf("%s\t%s\tv%lld\n", json_string_value(json_object_get(made, "id")), name,
		       (long long)json_integer_value(json_object_get(made, "version")));
out:
	if (tmp)
		context_remove(tmpdir, listp, tarp);
	dockerignore_free(&di);
	free(text);
	json_decref(made);
	json_decref(rules);
	json_decref(body);
	return rc;
}

/* template list | template rm NAME|ID | template build ... DIR */
static int cmd_template(int argc, char **argv)
{
	char id[128], path[256];
	json_t *page = NULL, *t;
	size_t i;
	int rc;

	if (argc == 2 && !strcmp(argv[1], "list")) {
		rc = call("GET", "/v1/templates?limit=100", NULL, &page);
		if (rc == 0 && as_json) {
			print_json(page);
		} else if (rc == 0) {
			json_array_foreach(json_object_get(page, "templates"), i, t) {
				json_t *v = json_object_get(t, "latest_version");
				json_t *ready = json_object_get(t, "latest_ready_version");

				char r[32] = "none";

				if (json_is_integer(ready))
					snprintf(r, sizeof(r), "v%lld", (long long)json_integer_value(ready));
				printf("%s\t%s\tv%lld %s\tready: %s\n",
				       json_string_value(json_object_get(t, "id")),
				       json_string_value(json_object_get(t, "name")),
				       (long long)json_integer_value(json_object_get(v, "version")),
				       json_string_value(json_object_get(v, "status")) ?: "", r);
			}
		}
		json_decref(page);
		return rc;
	}
	if (argc == 3 && !strcmp(argv[1], "rm")) {
		if ((rc = template_id(argv[2], id, sizeof(id))))
			return rc;
		snprintf(path, sizeof(path), "/v1/templates/%s", id);
		return call("DELETE", path, NULL, NULL);
	}
	if (argc >= 2 && !strcmp(argv[1], "build"))
		return template_build(argc - 1, argv + 1);
	return usage_error("template takes 'list', 'rm NAME|ID' or 'build [-f DOCKERFILE] [--name N] DIR'");
}

static int cmd_egress(int argc, char **argv)
{
	char path[256];
	json_t *res = NULL, *rules = json_array(), *r;
	size_t i;
	int rc;

	if (argc < 2)
		return usage_error("egress takes a sandbox id and the rules (none: show them; 'open': none)");
	if ((rc = sandbox_path(path, sizeof(path), argv[1], "/egress"))) {
		json_decref(rules);
		return rc;
	}
	for (int k = 2; k < argc; k++)
		if (strcmp(argv[k], "open") != 0)
			json_array_append_new(rules, json_string(argv[k]));
	if (argc == 2) {
		json_decref(rules);
		rc = call("GET", path, NULL, &res);
	} else {
		rc = call("PUT", path, json_pack("{s:o}", "rules", rules), &res);
	}
	if (rc == 0 && as_json) {
		print_json(res);
	} else if (rc == 0) {
		printf("mode: %s\n", json_string_value(json_object_get(res, "mode")) ?: "?");
		json_array_foreach(json_object_get(res, "rules"), i, r)
			printf("%s\n", json_string_value(r));
	}
	json_decref(res);
	return rc;
}

/*
 * kiln port ID PORT [--public | --private | --signed SECONDS]: prints the port's URL (making the
 * port public or private first, or a signed URL valid SECONDS); --json prints the answer.
 */
static int cmd_port(int argc, char **argv)
{
	char path[256], suffix[64];
	const char *method = "GET", *mode = argc > 3 ? argv[3] : NULL;
	json_t *res = NULL, *body = NULL;
	long port;
	char *end;
	int rc;

	if (argc < 3 || argc > 5)
		return usage_error("port takes a sandbox id, a port and --public, --private or "
				   "--signed SECONDS");
	port = strtol(argv[2], &end, 10);
	if (*end || port < 1 || port > 65535 || argv[2][0] == '0' || argv[2][0] == '+')
		return usage_error("'%s' is not a port (1..65535)", argv[2]);
	snprintf(suffix, sizeof(suffix), "/ports/%ld", port);
	if (mode && !strcmp(mode, "--public") && argc == 4) {
		method = "PUT";
		strcat(suffix, "/public");
	} else if (mode && !strcmp(mode, "--private") && argc == 4) {
		method = "DELETE";
		strcat(suffix, "/public");
	} else if (mode && !strcmp(mode, "--signed") && argc == 5) {
		double secs;

		if (!parse_num(argv[4], &secs) || secs < 1 || secs != (long long)secs)
			return usage_error("--signed takes whole seconds, not '%s'", argv[4]);
		method = "POST";
		strcat(suffix, "/url");
		body = json_pack("{s:I}", "expires_in_s", (json_int_t)secs);
	} else if (mode) {
		return usage_error("port takes --public, --private or --signed SECONDS, not '%s'", mode);
	}
	if ((rc = sandbox_path(path, sizeof(path), argv[1], suffix))) {
		json_decref(body);
		return rc;
	}
	rc = call(method, path, body, &res);
	if (rc == 0 && as_json)
		print_json(res);
	else if (rc == 0)
		printf("%s\n", json_string_value(json_object_get(res, "url")) ?: "?");
	json_decref(res);
	return rc;
}

/* Prints a secret list: "host<TAB>header" lines, or (--json) the answer. */
static void print_secrets(json_t *res)
{
	size_t i;
	json_t *s;

	if (as_json) {
		print_json(res);
		return;
	}
	json_array_foreach(json_object_get(res, "secrets"), i, s)
		printf("%s\t%s\n", json_string_value(json_object_get(s, "host")),
		       json_string_value(json_object_get(s, "header")));
}

/*
 * kiln secret ls ID; kiln secret ID --clear; kiln secret ID HOST HEADER [--value V]: the value
 * from --value or stdin (one trailing newline dropped). The API replaces the whole set, and never
 * returns values: setting one secret this way replaces the sandbox's others.
 */
static int cmd_secret(int argc, char **argv)
{
	char path[256], *value = NULL;
	const char *given = NULL;
	json_t *res = NULL, *set;
	int rc, k = 0;
	const char *pos[4];

	if (argc >= 2 && strcmp(argv[1], "ls") == 0) {
		if (argc != 3)
			return usage_error("secret ls takes a sandbox id");
		if ((rc = sandbox_path(path, sizeof(path), argv[2], "/secrets")))
			return rc;
		rc = call("GET", path, NULL, &res);
		if (rc == 0)
			print_secrets(res);
		json_decref(res);
		return rc;
	}
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--value") == 0 && i + 1 < argc)
			given = argv[++i];
		else if (strncmp(argv[i], "--value=", 8) == 0)
			given = argv[i] + 8;
		else if (strcmp(argv[i], "--clear") == 0)
			pos[k < 4 ? k++ : 3] = "";
		else if (k < 4)
			pos[k++] = argv[i];
		else
			return usage_error("secret takes ID HOST HEADER");
	}
	if (k == 0 || (sandbox_path(path, sizeof(path), pos[0], "/secrets")))
		return k ? EXIT_USAGE : usage_error("secret takes ID HOST HEADER, ID --clear, or ls ID");
	if (k == 2 && !pos[1][0]) {
		set = json_array();	/* --clear */
	} else if (k == 3 && pos[1][0] && pos[2][0]) {
		if (given) {
			value = strdup(given);
		} else {
			value = read_all(stdin, 65536);
			if (value && strlen(value) && value[strlen(value) - 1] == '\n')
				value[strlen(value) - 1] = '\0';
			if (value && strlen(value) && value[strlen(value) - 1] == '\r')
				value[strlen(value) - 1] = '\0';
		}
		if (!value || !value[0]) {
			free(value);
			return usage_error("the secret's value comes from --value or stdin, and is empty");
		}
		set = json_pack("[{s:s, s:s, s:s}]", "host", pos[1], "header", pos[2], "value", value);
		explicit_bzero(value, strlen(value));
		free(value);
	} else {
		return usage_error("secret takes ID HOST HEADER, ID --clear, or ls ID");
	}
	rc = call("PUT", path, json_pack("{s:o}", "secrets", set), &res);
	if (rc == 0)
		print_secrets(res);
	json_decref(res);
	return rc;
}

static int cmd_balance(int argc, char **argv)
{
	json_t *b = NULL;
	int rc;

	if (argc != 1)
		return usage_error("balance takes no argument");
	rc = call("GET", "/v1/billing/balance", NULL, &b);
	if (rc == 0 && as_json)
		print_json(b);
	else if (rc == 0) {
		printf("%.6f credits (used %.6f of %.6f granted; burning %.6f an hour)\n",
		       (double)json_integer_value(json_object_get(b, "balance_ucr")) / 1e6,
		       (double)json_integer_value(json_object_get(b, "used_ucr")) / 1e6,
		       (double)json_integer_value(json_object_get(b, "granted_ucr")) / 1e6,
		       (double)json_integer_value(json_object_get(b, "burn_rate_ucr_s")) * 3600 / 1e6);
		/* A negative balance is a debt (and zero refuses new sandboxes too): say so, and
		 * since when. */
		if (json_integer_value(json_object_get(b, "debt_ucr")) > 0 ||
		    json_is_string(json_object_get(b, "debt_since")))
			printf("IN DEBT: %.6f credits owed%s%s; new sandboxes are refused until a grant "
			       "covers it\n",
			       (double)json_integer_value(json_object_get(b, "debt_ucr")) / 1e6,
			       json_is_string(json_object_get(b, "debt_since")) ? ", at or below zero since " : "",
			       json_is_string(json_object_get(b, "debt_since"))
				       ? json_string_value(json_object_get(b, "debt_since"))
				       : "");
		if (json_is_string(json_object_get(b, "snapshots_delete_at")))
			printf("paused sandboxes and their snapshots will be DELETED at %s unless a grant "
			       "takes the balance above zero\n",
			       json_string_value(json_object_get(b, "snapshots_delete_at")));
	}
	json_decref(b);
	return rc;
}

/* Whether `t` looks like an RFC 3339 time (the gateway checks it). */
static bool time_arg(const char *t)
{
	return *t && strlen(t) < 40 && strspn(t, "0123456789-:.TZ") == strlen(t);
}

/*
 * Prints `s` (NULL or empty: "-"), every control character as '?': a name or path a guest chose
 * can neither end the line nor move to another column.
 */
static void print_clean(const char *s)
{
	if (!s || !*s) {
		fputs("-", stdout);
		return;
	}
	for (; *s; s++)
		putchar((unsigned char)*s < 0x20 || *s == 0x7f ? '?' : *s);
}

/*
 * One connection's requests through the injecting proxy, "METHOD HOST PATH STATUS" each (with
 * " +secret" when a secret header was added), "; " between them; "-" when none.
 */
static void print_requests(const json_t *reqs)
{
	const json_t *q;
	size_t i;

	if (!json_is_array(reqs) || json_array_size(reqs) == 0) {
		fputs("-", stdout);
		return;
	}
	json_array_foreach(reqs, i, q) {
		if (i)
			fputs("; ", stdout);
		print_clean(json_string_value(json_object_get(q, "method")));
		putchar(' ');
		print_clean(json_string_value(json_object_get(q, "host")));
		putchar(' ');
		print_clean(json_string_value(json_object_get(q, "path")));
		printf(" %lld%s", (long long)json_integer_value(json_object_get(q, "status")),
		       json_is_true(json_object_get(q, "secret")) ? " +secret" : "");
	}
}

/*
 * kiln admin connections SANDBOX [SINCE [UNTIL]] (the operator's admin key): the sandbox's
 * connection log, newest first, every page: opened, last seen, verdict, protocol, destination,
 * port, bytes and packets out and in, the name the name-checking proxy checked and its decision,
 * and the injecting proxy's requests ("-" for none); then what the log lost, when anything.
 */
static int admin_connections(int argc, char **argv)
{
	char path[512], cursor[64] = "";
	json_t *r = NULL, *c;
	size_t i;
	int rc = 0;

	if (argc < 3 || argc > 5)
		return usage_error("admin connections takes a sandbox id and optional since and until");
	if (sandbox_path(path, sizeof(path), argv[2], ""))
		return EXIT_USAGE;
	for (int k = 3; k < argc; k++)
		if (!time_arg(argv[k]))
			return usage_error("'%s' is not an RFC 3339 time (2026-01-02T03:04:05Z)", argv[k]);
	do {
		snprintf(path, sizeof(path), "/v1/admin/sandboxes/%s/connections?limit=1000%s%s%s%s%s%s",
			 argv[2], argc > 3 ? "&since=" : "", argc > 3 ? argv[3] : "",
			 argc > 4 ? "&until=" : "", argc > 4 ? argv[4] : "", cursor[0] ? "&cursor=" : "",
			 cursor);
		json_decref(r);
		r = NULL;
		rc = call("GET", path, NULL, &r);
		if (rc)
			break;
		if (as_json) {
			print_json(r);
		} else {
			json_array_foreach(json_object_get(r, "connections"), i, c) {
				printf("%s\t%s\t%s\t%s\t%s\t%lld\t%lld\t%lld\t%lld\t%lld\t",
				       json_string_value(json_object_get(c, "opened_at")),
				       json_string_value(json_object_get(c, "last_seen_at")),
				       json_string_value(json_object_get(c, "verdict")),
				       json_string_value(json_object_get(c, "proto")),
				       json_string_value(json_object_get(c, "dst")),
				       (long long)json_integer_value(json_object_get(c, "dst_port")),
				       (long long)json_integer_value(json_object_get(c, "bytes_out")),
				       (long long)json_integer_value(json_object_get(c, "bytes_in")),
				       (long long)json_integer_value(json_object_get(c, "packets_out")),
				       (long long)json_integer_value(json_object_get(c, "packets_in")));
				print_clean(json_string_value(json_object_get(c, "dns_name")));
				putchar('\t');
				print_clean(json_string_value(json_object_get(c, "proxy_decision")));
				putchar('\t');
				print_requests(json_object_get(c, "requests"));
				putchar('\n');
			}
		}
		const char *next = json_string_value(json_object_get(r, "next_cursor"));
		snprintf(cursor, sizeof(cursor), "%s", next ? next : "");
	} while (cursor[0]);
	if (rc == 0 && !as_json) {
		json_t *lost = json_object_get(r, "lost");
		long long ring = (long long)json_integer_value(json_object_get(lost, "ring_full"));
		long long cap = (long long)json_integer_value(json_object_get(lost, "over_cap"));
		if (ring || cap)
			fprintf(stderr, "kiln: the log lost %lld connections (kernel ring full) and %lld "
				"(over connlog_max_per_minute)\n", ring, cap);
	}
	json_decref(r);
	return rc;
}

/*
 * kiln admin suspend|unsuspend TENANT (the operator's admin key): prints the tenant's id and state,
 * and for a suspension the sandboxes paused and not paused. kiln admin connections: above.
 */
static int cmd_admin(int argc, char **argv)
{
	char path[160];
	json_t *r = NULL, *a;
	size_t i;
	int rc;

	if (argc >= 2 && !strcmp(argv[1], "connections"))
		return admin_connections(argc, argv);
	if (argc != 3 || (strcmp(argv[1], "suspend") != 0 && strcmp(argv[1], "unsuspend") != 0))
		return usage_error("admin takes suspend, unsuspend and a tenant id, or connections and a "
				   "sandbox id");
	if (strncmp(argv[2], "tn_", 3) != 0 || strlen(argv[2]) > 100 ||
	    strspn(argv[2], "abcdefghijklmnopqrstuvwxyz0123456789_") != strlen(argv[2]))
		return usage_error("'%s' is not a tenant id", argv[2]);
	snprintf(path, sizeof(path), "/v1/tenants/%s/%s", argv[2], argv[1]);
	rc = call("POST", path, NULL, &r);
	if (rc == 0 && as_json) {
		print_json(r);
	} else if (rc == 0) {
		printf("%s\t%s\n", argv[2], strcmp(argv[1], "suspend") ? "active" : "suspended");
		json_array_foreach(json_object_get(r, "paused"), i, a)
			printf("%s\tpaused\n", json_string_value(a));
		json_array_foreach(json_object_get(r, "not_paused"), i, a)
			printf("%s\tnot paused\n", json_string_value(a));
	}
	json_decref(r);
	return rc;
}

/* kiln api METHOD PATH [JSON]: any route, the answer printed as it comes. */
static int cmd_api(int argc, char **argv)
{
	struct client_body b = { 0 };
	struct buf reply;
	int status, rc = 0;

	if (argc != 3 && argc != 4)
		return usage_error("api takes a method, a path and an optional JSON body");
	if (argv[2][0] != '/')
		return usage_error("the path must start with /, not '%s'", argv[2]);
	b.json = argc == 4 ? argv[3] : NULL;
	buf_init(&reply, CLIENT_BODY_MAX);
	status = client_call(&cli, argv[1], argv[2], b.json ? &b : NULL, &reply);
	if (status < 200 || status > 299)
		rc = api_error(status, &reply);
	else if (reply.len)
		printf("%s%s", reply.data, reply.data[reply.len - 1] == '\n' ? "" : "\n");
	buf_release(&reply);
	return rc;
}

static int cmd_help(int argc, char **argv);

static const struct command {
	const char *name;
	int (*fn)(int argc, char **argv);
	const char *args, *what;
} commands[] = {
	{ "create", cmd_create, "[--vcpus N] [--memory MIB] [--disk GIB] [--timeout S] [--env K=V]... [--allow RULE]... [--snapshot ID | --template NAME]", "create a sandbox (from the base, a snapshot or your template); prints its id" },
	{ "list", cmd_list, "[STATE]", "your sandboxes" },
	{ "get", cmd_simple, "ID", "one sandbox" },
	{ "delete", cmd_simple, "ID", "delete a sandbox (and its pause snapshot)" },
	{ "exec", cmd_exec, "ID [--user NAME] [--env K=V]... [--cwd DIR] [--timeout S] [--] CMD [ARG]...", "run a program as NAME (default root; cwd its home); its output as it comes, its exit status as kiln's" },
	{ "run", cmd_run, "ID [--user NAME] [--lang python|bash] CODE|-", "run code (from stdin with -), as exec" },
	{ "put", cmd_put, "ID [--user NAME] LOCAL_FILE /PATH", "upload a file (as NAME's: its own, where it may write)" },
	{ "cat", cmd_get_file, "ID [--user NAME] /PATH [LOCAL_FILE]", "download a file (read as NAME; to stdout without LOCAL_FILE)" },
	{ "pause", cmd_simple, "ID", "pause: memory and disk into a snapshot, the VM released" },
	{ "resume", cmd_simple, "ID", "resume a paused sandbox where it was" },
	{ "fork", cmd_fork, "ID [--count N]", "children of a running sandbox in its state" },
	{ "timeout", cmd_timeout, "ID SECONDS", "set the sandbox's timeout from now" },
	{ "snapshot", cmd_snapshot, "ID [NAME]", "a named snapshot; prints its id" },
	{ "template", cmd_template, "list | rm NAME|ID", "your templates (id, name, newest version and its status, the ready one); delete one with all its versions" },
	{ "template", cmd_template, "build [-f DOCKERFILE] [--name N] [--vcpus N] [--memory MIB] [--disk GIB] [--start CMD] [--ready CMD] [--allow RULE]... DIR", "a new version of template N (default: DIR's name) built from DIR (tarred without what .dockerignore excludes); its log as it comes" },
	{ "egress", cmd_egress, "ID [RULE... | open]", "show, set or reopen outbound rules" },
	{ "port", cmd_port, "ID PORT [--public | --private | --signed SECONDS]", "the URL of a server in the sandbox (docs/ports.md); make the port public (no credential needed) or private again, or a signed URL valid SECONDS" },
	{ "secret", cmd_secret, "ID HOST HEADER [--value V] | ID --clear | ls ID", "bind a secret header to a host rule (value from stdin; replaces the set), remove them, list them" },
	{ "balance", cmd_balance, "", "your credits" },
	{ "api", cmd_api, "METHOD /PATH [JSON]", "any API call; the answer as it is" },
	{ "admin", cmd_admin, "suspend|unsuspend TENANT", "operator: suspend a tenant (its keys refused, its sandboxes paused) or lift it" },
	{ "admin", cmd_admin, "connections SANDBOX [SINCE [UNTIL]]", "operator: the sandbox's connection log (opened, last seen, verdict, proto, address, port, bytes and packets out and in, checked name, proxy decision, injected requests)" },
	{ "help", cmd_help, "", "this text" },
};

static int cmd_help(int argc, char **argv)
{
	printf("kiln [--url URL] [--key KEY] [--json] COMMAND [ARG]...\n\n"
	       "URL and KEY default to $KILN_URL and $KILN_API_KEY. Exit status: 0 done, or the\n"
	       "program's own for exec and run; 1 the API or the connection failed; 2 a bad command line.\n\n");
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		printf("  %-9s %s\n  %9s %s\n", commands[i].name, commands[i].args, "", commands[i].what);
	return 0;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "url", required_argument, NULL, 'u' },   { "key", required_argument, NULL, 'k' },
		{ "json", no_argument, NULL, 'j' },	   { "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	static char url[2048];
	const char *u = getenv("KILN_URL");
	int o, rc;

	cli.key = getenv("KILN_API_KEY");
	while ((o = getopt_long(argc, argv, "+", opts, NULL)) != -1) {
		if (o == 'u')
			u = optarg;
		else if (o == 'k')
			cli.key = optarg;
		else if (o == 'j')
			as_json = true;
		else if (o == 'h')
			return cmd_help(0, NULL);
		else
			return usage_error("unknown option");
	}
	if (optind >= argc)
		return usage_error("no command");
	if (!strcmp(argv[optind], "help"))
		return cmd_help(0, NULL);
	if (!u || !*u)
		return usage_error("no server: set KILN_URL or --url");
	snprintf(url, sizeof(url), "%s", u);
	while (strlen(url) > 0 && url[strlen(url) - 1] == '/')
		url[strlen(url) - 1] = '\0';
	cli.url = url;
	argc -= optind;
	argv += optind;
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++) {
		if (strcmp(argv[0], commands[i].name) != 0)
			continue;
		if (!cli.key && commands[i].fn != cmd_help && commands[i].fn != cmd_api)
			return usage_error("no API key: set KILN_API_KEY or --key");
		optind = 0;	/* getopt starts afresh: each command parses its own options */
		curl_global_init(CURL_GLOBAL_DEFAULT);
		rc = commands[i].fn(argc, argv);
		curl_global_cleanup();
		return rc;
	}
	return usage_error("unknown command '%s'", argv[0]);
}
