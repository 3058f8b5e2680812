/*
 * test_errdoc.c - checks that the documentation lists exactly the error table of common/err.h
 * (KILN_ERR_TABLE, read through kiln_err_name(), kiln_err_api_code() and kiln_err_status()).
 *
 *   test_errdoc ERRORS_MD OPENAPI_YAML
 *       the table of docs/errors.md (enum | name | API `code` | HTTP | meaning) has one row per
 *       code, with the code's name, API code and status, and no other row; the table of
 *       docs/openapi.yaml (HTTP | code | when) has one row per API code replies show, with its
 *       status, and no other row
 *   test_errdoc --self-test ERRORS_MD OPENAPI_YAML
 *       the same, then proves the comparisons can fail: it plants differences in copies of the
 *       docs (in the working directory) and in a copy of the code's rows, one at a time, and
 *       fails unless each one is caught
 *
 * Exits 0 when all holds, 1 otherwise; every disagreement is printed.
 */
#include "common/err.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DOC_MAX (1 << 20)
#define CELLS_MAX 8
#define ROWS_MAX 64
#define CELL_MAX 128

/* One code as the documentation must show it. */
struct code_row {
	const char *ident; /* "KILN_E_NOT_FOUND" */
	const char *name;
	const char *api; /* the API `code`; "—" for success, which has none */
	int status;
};

/* One row of a markdown table, cells trimmed. */
struct doc_row {
	int line;
	int ncells;
	char cells[CELLS_MAX][CELL_MAX];
};

static const char *const doc_header[] = { "enum", "name", "API `code`", "HTTP", "meaning" };
#define DOC_COLS (int)(sizeof(doc_header) / sizeof(doc_header[0]))
/* The error table of docs/openapi.yaml: one row per API `code` (in backquotes). */
static const char *const api_header[] = { "HTTP", "code", "when" };
#define API_COLS (int)(sizeof(api_header) / sizeof(api_header[0]))

static const struct {
	const char *ident;
	enum kiln_err code;
} idents[] = {
#define IDENT_ROW(id, name, status, shown, text) { #id, id },
	KILN_ERR_TABLE(IDENT_ROW)
#undef IDENT_ROW
};
#define NCODES (sizeof(idents) / sizeof(idents[0]))

/* Whether messages of a comparison are printed (not for the planted differences). */
static int verbose = 1;

static void problem(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void problem(const char *fmt, ...)
{
	va_list ap;

	if (!verbose)
		return;
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

/*
 * Fills rows[NCODES] from the code's table. Returns the number of problems with the table itself
 * (a code missing from it, listed twice, or without a name or text).
 */
static int code_rows_load(struct code_row *rows)
{
	int bad = 0, seen[KILN_E__COUNT] = { 0 };

	if (NCODES != KILN_E__COUNT) {
		problem("the table has %zu rows for %d codes", NCODES, (int)KILN_E__COUNT);
		bad++;
	}
	for (size_t i = 0; i < NCODES; i++) {
		enum kiln_err e = idents[i].code;

		if ((unsigned)e >= KILN_E__COUNT || seen[e]++) {
			problem("%s is out of the enum or listed twice", idents[i].ident);
			bad++;
			continue;
		}
		rows[i].ident = idents[i].ident;
		rows[i].name = kiln_err_name(e);
		rows[i].api = e == KILN_OK ? "—" : kiln_err_api_code(e);
		rows[i].status = kiln_err_status(e);
		if (!kiln_strerror(e)[0] || !rows[i].name[0] || rows[i].status < 100 ||
		    rows[i].status > 599) {
			problem("%s has no name, text or status", idents[i].ident);
			bad++;
		}
	}
	return bad;
}

/* Splits a table line "| a | b |" into trimmed cells; false when it is not one. */
static bool split_row(const char *line, size_t len, struct doc_row *r)
{
	const char *p = line, *end = line + len;

	while (p < end && (*p == ' ' || *p == '\t'))
		p++;
	if (p == end || *p != '|')
		return false;
	p++;
	r->ncells = 0;
	while (p < end) {
		const char *bar = memchr(p, '|', (size_t)(end - p));
		const char *a = p, *b;

		if (!bar)
			break; /* text after the last bar is not a cell */
		b = bar;
		while (a < b && (*a == ' ' || *a == '\t'))
			a++;
		while (b > a && (b[-1] == ' ' || b[-1] == '\t'))
			b--;
		if (r->ncells < CELLS_MAX) {
			snprintf(r->cells[r->ncells], CELL_MAX, "%.*s", (int)(b - a), a);
			r->ncells++;
		}
		p = bar + 1;
	}
	return true;
}

/*
 * Reads the rows of the first table of `path` whose header cells are header[0..ncols) into
 * rows[]. Returns the number of rows, or -1 (printed) when the file cannot be read or holds no
 * such table.
 */
static int doc_rows_load(const char *path, const char *const *header, int ncols,
			 struct doc_row *rows, int max)
{
	FILE *f = fopen(path, "r");
	char *text = NULL;
	size_t len;
	int n = -1, line = 0, state = 0; /* 0 before the header, 1 after it, 2 in the rows */
	const char *p, *end;

	if (!f) {
		problem("%s: %s", path, strerror(errno));
		goto cleanup;
	}
	text = malloc(DOC_MAX);
	if (!text)
		goto cleanup;
	len = fread(text, 1, DOC_MAX, f);
	if (len == DOC_MAX) {
		problem("%s: larger than %d bytes", path, DOC_MAX);
		goto cleanup;
	}
	for (p = text, end = text + len; p < end && state < 3; line++) {
		const char *nl = memchr(p, '\n', (size_t)(end - p));
		size_t l = nl ? (size_t)(nl - p) : (size_t)(end - p);
		struct doc_row r = { .line = line + 1 };
		bool is_row = split_row(p, l, &r);

		p += l + 1;
		if (state == 0) {
			int i = 0;

			if (!is_row || r.ncells != ncols)
				continue;
			while (i < ncols && strcmp(r.cells[i], header[i]) == 0)
				i++;
			if (i == ncols) {
				state = 1;
				n = 0;
			}
		} else if (state == 1) {
			if (!is_row || strspn(r.cells[0], "-:") == 0) {
				problem("%s:%d: the header is not followed by |---|", path,
					line + 1);
				n = -1;
				goto cleanup;
			}
			state = 2;
		} else if (!is_row) {
			state = 3;
		} else if (n == max) {
			problem("%s:%d: more than %d rows", path, line + 1, max);
			n = -1;
			goto cleanup;
		} else {
			rows[n++] = r;
		}
	}
	if (n < 0)
		problem("%s: no table headed | %s | ... |", path, header[0]);
cleanup:
	free(text);
	if (f)
		fclose(f);
	return n;
}

/* Compares the code's rows with the table of the doc at `path`. Returns the number of problems. */
static int compare(const struct code_row *code, size_t ncode, const char *path)
{
	static struct doc_row doc[ROWS_MAX];
	int ndoc = doc_rows_load(path, doc_header, DOC_COLS, doc, ROWS_MAX), bad = 0;

	if (ndoc < 0)
		return 1;
	for (int i = 0; i < ndoc; i++) {
		const struct doc_row *d = &doc[i];
		const struct code_row *c = NULL;
		char status[16];

		if (d->ncells != DOC_COLS) {
			problem("%s:%d: %d cells, expected %d", path, d->line, d->ncells, DOC_COLS);
			bad++;
			continue;
		}
		for (int j = 0; j < i; j++) {
			if (strcmp(doc[j].cells[0], d->cells[0]) == 0) {
				problem("%s:%d: %s is listed twice", path, d->line, d->cells[0]);
				bad++;
			}
		}
		for (size_t j = 0; j < ncode && !c; j++)
			if (strcmp(code[j].ident, d->cells[0]) == 0)
				c = &code[j];
		if (!c) {
			problem("%s:%d: %s is no code of common/err.h", path, d->line, d->cells[0]);
			bad++;
			continue;
		}
		if (strcmp(d->cells[1], c->name) != 0) {
			problem("%s:%d: %s is named \"%s\", the code says \"%s\"", path, d->line,
				c->ident, d->cells[1], c->name);
			bad++;
		}
		if (strcmp(d->cells[2], c->api) != 0) {
			problem("%s:%d: %s shows as \"%s\", the code says \"%s\"", path, d->line,
				c->ident, d->cells[2], c->api);
			bad++;
		}
		snprintf(status, sizeof(status), "%d", c->status);
		if (strcmp(d->cells[3], status) != 0) {
			problem("%s:%d: %s has HTTP status \"%s\", the code says %d", path, d->line,
				c->ident, d->cells[3], c->status);
			bad++;
		}
	}
	for (size_t j = 0; j < ncode; j++) {
		int i = 0;

		while (i < ndoc && strcmp(doc[i].cells[0], code[j].ident) != 0)
			i++;
		if (i == ndoc) {
			problem("%s: no row for %s", path, code[j].ident);
			bad++;
		}
	}
	return bad;
}

/*
 * Compares the codes API replies show (each distinct API `code` of the code's rows but success's,
 * with its status) with the table of docs/openapi.yaml at `path`. Returns the number of problems.
 */
static int compare_api(const struct code_row *code, size_t ncode, const char *path)
{
	static struct doc_row doc[ROWS_MAX];
	int ndoc = doc_rows_load(path, api_header, API_COLS, doc, ROWS_MAX), bad = 0;

	if (ndoc < 0)
		return 1;
	for (int i = 0; i < ndoc; i++) {
		const struct doc_row *d = &doc[i];
		char name[CELL_MAX], status[16];
		size_t len = strlen(d->cells[1]);
		bool known = false;

		if (d->ncells != API_COLS || len < 2 || d->cells[1][0] != '`' ||
		    d->cells[1][len - 1] != '`') {
			problem("%s:%d: expected | status | `code` | text |", path, d->line);
			bad++;
			continue;
		}
		snprintf(name, sizeof(name), "%.*s", (int)len - 2, d->cells[1] + 1);
		for (int j = 0; j < i; j++) {
			if (strcmp(doc[j].cells[1], d->cells[1]) == 0) {
				problem("%s:%d: %s is listed twice", path, d->line, name);
				bad++;
			}
		}
		for (size_t j = 0; j < ncode; j++) {
			if (strcmp(code[j].ident, "KILN_OK") == 0 || strcmp(code[j].api, name) != 0)
				continue;
			known = true;
			snprintf(status, sizeof(status), "%d", code[j].status);
			if (strcmp(d->cells[0], status) != 0) {
				problem("%s:%d: %s has HTTP status \"%s\", %s says %d", path,
					d->line, name, d->cells[0], code[j].ident, code[j].status);
				bad++;
			}
		}
		if (!known) {
			problem("%s:%d: no code shows as %s", path, d->line, name);
			bad++;
		}
	}
	for (size_t j = 0; j < ncode; j++) {
		int i = 0;
		char quoted[CELL_MAX];

		if (strcmp(code[j].ident, "KILN_OK") == 0)
			continue;
		snprintf(quoted, sizeof(quoted), "`%s`", code[j].api);
		while (i < ndoc && strcmp(doc[i].cells[1], quoted) != 0)
			i++;
		if (i == ndoc) {
			problem("%s: no row for %s (%s)", path, quoted, code[j].ident);
			bad++;
		}
	}
	return bad;
}

/* ---- self-test: planted differences must be caught ---- */

/*
 * Writes to a new file of the working directory `doc` with, in the line starting with `line`,
 * `from` replaced by `to`; or with that line removed (from == NULL, to == NULL), or `to` inserted
 * after it (from == NULL). Returns the file's path (the caller's to unlink and free) or NULL when
 * the line or `from` is absent: then the planted difference cannot be made, a failure.
 */
static char *plant(const char *doc, const char *line, const char *from, const char *to)
{
	FILE *f = fopen(doc, "r");
	char *text = NULL, *path = NULL, *at, *eol, *hit = NULL;
	size_t len;
	int fd = -1;
	FILE *out = NULL;
	bool ok = false;

	if (!f)
		goto cleanup;
	text = calloc(1, DOC_MAX + 1);
	if (!text)
		goto cleanup;
	len = fread(text, 1, DOC_MAX, f);
	for (at = text; (at = strstr(at, line)); at++)
		if (at == text || at[-1] == '\n')
			break;
	if (!at)
		goto cleanup;
	eol = strchr(at, '\n');
	eol = eol ? eol + 1 : text + len;
	if (from) {
		hit = strstr(at, from);
		if (!hit || hit >= eol)
			goto cleanup;
	}
	path = strdup("errors.md.planted.XXXXXX");
	if (!path || (fd = mkstemp(path)) < 0)
		goto cleanup;
	out = fdopen(fd, "w");
	if (!out)
		goto cleanup;
	fd = -1;
	if (from)
		ok = fprintf(out, "%.*s%s%s", (int)(hit - text), text, to, hit + strlen(from)) >= 0;
	else if (!to)
		ok = fprintf(out, "%.*s%s", (int)(at - text), text, eol) >= 0;
	else
		ok = fprintf(out, "%.*s%s%s", (int)(eol - text), text, to, eol) >= 0;
	ok = fclose(out) == 0 && ok;
	out = NULL;
cleanup:
	if (out)
		fclose(out);
	if (fd >= 0)
		close(fd);
	if (!ok && path) {
		unlink(path);
		free(path);
		path = NULL;
	}
	free(text);
	if (f)
		fclose(f);
	return path;
}

typedef int (*comparer)(const struct code_row *code, size_t ncode, const char *path);

/* Both comparisons: docs/errors.md and docs/openapi.yaml. */
struct docs {
	const char *errors;
	const char *openapi;
};

static int compare_all(const struct code_row *code, size_t ncode, const struct docs *d)
{
	return compare(code, ncode, d->errors) + compare_api(code, ncode, d->openapi);
}

static int self_failures;

/* Plants one difference in a copy of `doc`; counts a failure unless `cmp` catches it. */
static void expect_doc_caught(const char *what, const struct code_row *code, comparer cmp,
			      const char *doc, const char *line, const char *from, const char *to)
{
	char *copy = plant(doc, line, from, to);
	int n;

	if (!copy) {
		fprintf(stderr, "FAIL cannot plant %s: \"%s\" not in %s\n", what, line, doc);
		self_failures++;
		return;
	}
	verbose = 0;
	n = cmp(code, NCODES, copy);
	verbose = 1;
	unlink(copy);
	free(copy);
	fprintf(stderr, "%s planted in %s: %s: %d differences\n", n ? "ok  " : "FAIL",
		strrchr(doc, '/') ? strrchr(doc, '/') + 1 : doc, what, n);
	if (!n)
		self_failures++;
}

/* Compares the docs with code rows holding one planted difference; a failure unless caught. */
static void expect_code_caught(const char *what, const struct code_row *code, size_t ncode,
			       const struct docs *d)
{
	int n;

	verbose = 0;
	n = compare_all(code, ncode, d);
	verbose = 1;
	fprintf(stderr, "%s planted in the code: %s: %d differences\n", n ? "ok  " : "FAIL", what,
		n);
	if (!n)
		self_failures++;
}

/* Index of `ident` in the code's rows. */
static size_t code_index(const struct code_row *code, const char *ident)
{
	size_t i = 0;

	while (i < NCODES && strcmp(code[i].ident, ident) != 0)
		i++;
	if (i == NCODES) {
		fprintf(stderr, "FAIL %s is no code\n", ident);
		exit(1);
	}
	return i;
}

static void self_test(const struct code_row *code, const struct docs *d)
{
	struct code_row copy[NCODES + 1];
	const char *e = d->errors, *o = d->openapi;
	size_t i;

	expect_doc_caught("a status", code, compare, e, "| KILN_E_NOT_FOUND |", "| 404 |",
			  "| 405 |");
	expect_doc_caught("a name", code, compare, e, "| KILN_E_QUOTA |", "| quota_exceeded |",
			  "| quota_exceded |");
	expect_doc_caught("an API code", code, compare, e, "| KILN_E_IO |", "| internal |",
			  "| io_error |");
	expect_doc_caught("a shown code made internal", code, compare, e,
			  "| KILN_E_UNAVAILABLE |", "| unavailable | 503", "| internal | 503");
	expect_doc_caught("a missing row", code, compare, e, "| KILN_E_CONFLICT |", NULL, NULL);
	expect_doc_caught("an extra row", code, compare, e, "| KILN_E_INTERNAL |", NULL,
			  "| KILN_E_TEAPOT | teapot | teapot | 418 | short and stout |\n");
	expect_doc_caught("a row listed twice", code, compare, e, "| KILN_E_INVALID |", NULL,
			  "| KILN_E_INVALID | invalid | invalid | 422 | again |\n");
	expect_doc_caught("a renamed column", code, compare, e, "| enum |", "| HTTP |",
			  "| status |");

	expect_doc_caught("a status", code, compare_api, o, "    | 409 | `conflict` |", "| 409 |",
			  "| 410 |");
	expect_doc_caught("a code", code, compare_api, o, "    | 429 | `rate_limited` |",
			  "`rate_limited`", "`throttled`");
	expect_doc_caught("a missing row", code, compare_api, o, "    | 413 | `too_large` |", NULL,
			  NULL);
	expect_doc_caught("an extra row", code, compare_api, o, "    | 500 | `internal` |", NULL,
			  "    | 500 | `io_error` | a local I/O error |\n");
	expect_doc_caught("a row listed twice", code, compare_api, o, "    | 404 | `not_found` |",
			  NULL, "    | 404 | `not_found` | again |\n");
	expect_doc_caught("a renamed column", code, compare_api, o, "    | HTTP | code | when |",
			  "| when |", "| why |");

	memcpy(copy, code, sizeof(copy[0]) * NCODES);
	i = code_index(copy, "KILN_E_CREDITS");
	copy[i].status = 403;
	expect_code_caught("a status", copy, NCODES, d);

	memcpy(copy, code, sizeof(copy[0]) * NCODES);
	i = code_index(copy, "KILN_E_RATE_LIMITED");
	copy[i].name = "throttled";
	expect_code_caught("a name", copy, NCODES, d);

	memcpy(copy, code, sizeof(copy[0]) * NCODES);
	i = code_index(copy, "KILN_E_NOMEM");
	copy[i].api = copy[i].name;
	expect_code_caught("an API code", copy, NCODES, d);

	memcpy(copy, code, sizeof(copy[0]) * NCODES);
	copy[NCODES] = (struct code_row){ "KILN_E_TEAPOT", "teapot", "teapot", 418 };
	expect_code_caught("a new code", copy, NCODES + 1, d);

	memcpy(copy, code, sizeof(copy[0]) * NCODES);
	i = code_index(copy, "KILN_E_TOO_LARGE");
	memmove(&copy[i], &copy[i + 1], sizeof(copy[0]) * (NCODES - i - 1));
	expect_code_caught("a removed code", copy, NCODES - 1, d);
}

int main(int argc, char **argv)
{
	struct code_row code[NCODES];
	bool selftest = argc == 4 && strcmp(argv[1], "--self-test") == 0;
	struct docs d = { argv[argc - 2], argv[argc - 1] };
	int bad;

	if (argc != 3 && !selftest) {
		fprintf(stderr,
			"usage: test_errdoc [--self-test] docs/errors.md docs/openapi.yaml\n");
		return 2;
	}
	bad = code_rows_load(code);
	if (!bad)
		bad = compare_all(code, NCODES, &d);
	fprintf(stderr, "%s the tables of %s, %s and common/err.h: %d differences\n",
		bad ? "FAIL" : "ok  ", d.errors, d.openapi, bad);
	if (selftest && !bad) {
		self_test(code, &d);
		bad = self_failures;
	}
	return bad ? 1 : 0;
}
