/*
 * test_errdoc.c - checks that the documentation lists exactly the error table of common/err.h
 * (KILN_ERR_TABLE, read through kiln_err_name(), kiln_err_api_code() and kiln_err_status()).
 *
 *   test_errdoc ERRORS_MD                the table of docs/errors.md (enum | name | API `code` |
 *                                        HTTP | meaning) has one row per code, with the code's
 *                                        name, API code and status, and no other row
 *   test_errdoc --self-test ERRORS_MD    the same, then proves the comparison can fail: it plants
 *                                        differences in a copy of the doc (in the working
 *                                        directory) and in a copy of the code's rows, one at a
 *                                        time, and fails unless each one is caught
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
 * Reads the rows of the table of `path` whose header is doc_header into rows[]. Returns the number
 * of rows, or -1 (printed) when the file cannot be read or holds no such table.
 */
static int doc_rows_load(const char *path, struct doc_row *rows, int max)
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

			if (!is_row || r.ncells != DOC_COLS)
				continue;
			while (i < DOC_COLS && strcmp(r.cells[i], doc_header[i]) == 0)
				i++;
			if (i == DOC_COLS) {
				state = 1;
				n = 0;
			}
		} else if (state == 1) {
			if (!is_row || strspn(r.cells[0], "-:") == 0) {
				problem("%s:%d: the header is not followed by |---|", path, line + 1);
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
		problem("%s: no table headed | enum | name | API `code` | HTTP | meaning |", path);
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
	int ndoc = doc_rows_load(path, doc, ROWS_MAX), bad = 0;

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

static int self_failures;

/* Plants one difference in a copy of the doc; counts a failure unless compare() catches it. */
static void expect_doc_caught(const char *what, const struct code_row *code, const char *doc,
			      const char *line, const char *from, const char *to)
{
	char *copy = plant(doc, line, from, to);
	int n;

	if (!copy) {
		fprintf(stderr, "FAIL cannot plant %s: \"%s\" not in %s\n", what, line, doc);
		self_failures++;
		return;
	}
	verbose = 0;
	n = compare(code, NCODES, copy);
	verbose = 1;
	unlink(copy);
	free(copy);
	fprintf(stderr, "%s planted in the doc: %s: %d differences\n", n ? "ok  " : "FAIL", what, n);
	if (!n)
		self_failures++;
}

/* Compares the doc with code rows holding one planted difference; counts a failure unless caught. */
static void expect_code_caught(const char *what, const struct code_row *code, size_t ncode,
			       const char *doc)
{
	int n;

	verbose = 0;
	n = compare(code, ncode, doc);
	verbose = 1;
	fprintf(stderr, "%s planted in the code: %s: %d differences\n", n ? "ok  " : "FAIL", what, n);
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

static void self_test(const struct code_row *code, const char *doc)
{
	struct code_row copy[NCODES + 1];
	size_t i;

	expect_doc_caught("a status", code, doc, "| KILN_E_NOT_FOUND |", "| 404 |", "| 405 |");
	expect_doc_caught("a name", code, doc, "| KILN_E_QUOTA |", "| quota_exceeded |",
			  "| quota_exceded |");
	expect_doc_caught("an API code", code, doc, "| KILN_E_IO |", "| internal |",
			  "| io_error |");
	expect_doc_caught("a shown code made internal", code, doc, "| KILN_E_UNAVAILABLE |",
			  "| unavailable | 503", "| internal | 503");
	expect_doc_caught("a missing row", code, doc, "| KILN_E_CONFLICT |", NULL, NULL);
	expect_doc_caught("an extra row", code, doc, "| KILN_E_INTERNAL |", NULL,
			  "| KILN_E_TEAPOT | teapot | teapot | 418 | short and stout |\n");
	expect_doc_caught("a row listed twice", code, doc, "| KILN_E_INVALID |", NULL,
			  "| KILN_E_INVALID | invalid | invalid | 422 | again |\n");
	expect_doc_caught("a renamed column", code, doc, "| enum |", "| HTTP |", "| status |");

	memcpy(copy, code, sizeof(copy[0]) * NCODES);
	i = code_index(copy, "KILN_E_CREDITS");
	copy[i].status = 403;
	expect_code_caught("a status", copy, NCODES, doc);

	memcpy(copy, code, sizeof(copy[0]) * NCODES);
	i = code_index(copy, "KILN_E_RATE_LIMITED");
	copy[i].name = "throttled";
	expect_code_caught("a name", copy, NCODES, doc);

	memcpy(copy, code, sizeof(copy[0]) * NCODES);
	i = code_index(copy, "KILN_E_NOMEM");
	copy[i].api = copy[i].name;
	expect_code_caught("an API code", copy, NCODES, doc);

	memcpy(copy, code, sizeof(copy[0]) * NCODES);
	copy[NCODES] = (struct code_row){ "KILN_E_TEAPOT", "teapot", "teapot", 418 };
	expect_code_caught("a new code", copy, NCODES + 1, doc);

	memcpy(copy, code, sizeof(copy[0]) * NCODES);
	i = code_index(copy, "KILN_E_TOO_LARGE");
	memmove(&copy[i], &copy[i + 1], sizeof(copy[0]) * (NCODES - i - 1));
	expect_code_caught("a removed code", copy, NCODES - 1, doc);
}

int main(int argc, char **argv)
{
	struct code_row code[NCODES];
	bool selftest = argc == 3 && strcmp(argv[1], "--self-test") == 0;
	const char *doc = argv[argc - 1];
	int bad;

	if (argc != 2 && !selftest) {
		fprintf(stderr, "usage: test_errdoc [--self-test] docs/errors.md\n");
		return 2;
	}
	bad = code_rows_load(code);
	if (!bad)
		bad = compare(code, NCODES, doc);
	fprintf(stderr, "%s the table of %s and common/err.h: %d differences\n",
		bad ? "FAIL" : "ok  ", doc, bad);
	if (selftest && !bad) {
		self_test(code, doc);
		bad = self_failures;
	}
	return bad ? 1 : 0;
}
