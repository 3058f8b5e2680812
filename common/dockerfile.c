/*
 * dockerfile.c - the Dockerfile and .dockerignore parsers (dockerfile.h).
 *
 * The text is cut into instructions (continuations joined, comments and blank lines dropped),
 * each instruction into its keyword and arguments, and the arguments of the instructions Docker
 * expands into words by a small shell-like lexer: quotes, backslash escapes and ENV/ARG
 * substitution. Everything is bounded (input size, instruction length, expanded bytes, variables,
 * nesting), so hostile text costs at most a few MiB and linear time.
 */
#include "common/dockerfile.h"

#include <ctype.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_EXPANDED (16u << 20)	/* bytes all substitutions of one Dockerfile may produce */
#define MAX_VARS 1000			/* distinct ENV and ARG names */
#define MAX_NEST 16			/* ${a:-${b:-...}} depth */

struct str {
	char *p;
	size_t n, cap;
};

struct strv {
	char **v;
	size_t n, cap;
};

struct ps {
	struct dockerfile *df;
	struct kiln_error *err;
	unsigned line;
	enum kiln_err rc;		/* the first failure */
	struct strv vn, vv;		/* variables in scope: names and values (a value may be NULL) */
	struct strv mn, mv;		/* ARGs before FROM */
	size_t expanded;
	bool have_from;
	struct strv cmd, entry;
	bool cmd_set, cmd_shell, entry_set, entry_shell;
	int depth;
};

/* Records the first failure, prefixed with the line; returns its code. */
static enum kiln_err __attribute__((format(printf, 3, 4)))
fail(struct ps *p, enum kiln_err code, const char *fmt, ...)
{
	char msg[300];
	va_list ap;

	if (p->rc != KILN_OK)
		return p->rc;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (code == KILN_E_NOMEM)
		kiln_error_set(p->err, code, "out of memory");
	else if (p->line)
		kiln_error_set(p->err, code, "Dockerfile line %u: %s", p->line, msg);
	else
		kiln_error_set(p->err, code, "Dockerfile: %s", msg);
	return p->rc = code;
}

static enum kiln_err str_put(struct ps *p, struct str *s, const char *d, size_t n)
{
	if (p->rc != KILN_OK)
		return p->rc;
	if (s->n + n > DOCKERFILE_MAX_LINE)
		return fail(p, KILN_E_INVALID, "an argument is longer than %u bytes",
			    (unsigned)DOCKERFILE_MAX_LINE);
	if (s->n + n + 1 > s->cap) {
		size_t cap = s->cap ? s->cap : 64;
		char *q;

		while (cap < s->n + n + 1)
			cap *= 2;
		q = realloc(s->p, cap);
		if (!q)
			return fail(p, KILN_E_NOMEM, "out of memory");
		s->p = q;
		s->cap = cap;
	}
	memcpy(s->p + s->n, d, n);
	s->n += n;
	s->p[s->n] = '\0';
	return KILN_OK;
}

/* Appends `v` (taken; may be NULL) to `a`. */
static enum kiln_err strv_push(struct ps *p, struct strv *a, char *v)
{
	if (p->rc != KILN_OK) {
		free(v);
		return p->rc;
	}
	if (a->n + 2 > a->cap) {
		size_t cap = a->cap ? a->cap * 2 : 8;
		char **q = realloc(a->v, cap * sizeof(*q));

		if (!q) {
			free(v);
			return fail(p, KILN_E_NOMEM, "out of memory");
		}
		a->v = q;
		a->cap = cap;
	}
	a->v[a->n++] = v;
	a->v[a->n] = NULL;
	return KILN_OK;
}

static enum kiln_err strv_dup(struct ps *p, struct strv *a, const char *s)
{
	char *d = s ? strdup(s) : NULL;

	if (s && !d)
		return fail(p, KILN_E_NOMEM, "out of memory");
	return strv_push(p, a, d);
}

static void strv_free(struct strv *a)
{
	for (size_t i = 0; i < a->n; i++)
		free(a->v[i]);
	free(a->v);
	memset(a, 0, sizeof(*a));
}

/* The value of variable `name` (`n` bytes) in scope, or NULL. */
static const char *var_get(const struct strv *names, const struct strv *values, const char *name,
			   size_t n)
{
	for (size_t i = names->n; i-- > 0;)
		if (strlen(names->v[i]) == n && memcmp(names->v[i], name, n) == 0)
			return values->v[i];
	return NULL;
}

/* Sets `name` to `value` (NULL: declared without a value) in `names`/`values`. */
static enum kiln_err var_set(struct ps *p, struct strv *names, struct strv *values,
			     const char *name, const char *value)
{
	char *v = NULL;

	for (size_t i = 0; i < names->n; i++) {
		if (strcmp(names->v[i], name) != 0)
			continue;
		if (value && !(v = strdup(value)))
			return fail(p, KILN_E_NOMEM, "out of memory");
		free(values->v[i]);
		values->v[i] = v;
		return KILN_OK;
	}
	if (names->n >= MAX_VARS)
		return fail(p, KILN_E_INVALID, "more than %d variables", MAX_VARS);
	if (strv_dup(p, names, name) != KILN_OK)
		return p->rc;
	return strv_dup(p, values, value);
}

static enum kiln_err lex(struct ps *p, const char *s, bool split, bool expand, struct strv *out);

/* Substitutes the variable reference at s[*i] ('$') into `w`; advances *i past it. */
static enum kiln_err subst(struct ps *p, const char *s, size_t *i, struct str *w)
{
	size_t j = *i + 1, start, k;
	const char *val;
	char op = 0;

	if (s[j] == '{') {
		start = ++j;
		while (isalnum((unsigned char)s[j]) || s[j] == '_')
			j++;
		if (j == start)
			return fail(p, KILN_E_INVALID, "bad substitution: ${ without a name");
		val = var_get(&p->vn, &p->vv, s + start, j - start);
		if (s[j] == '}') {
			*i = j + 1;
		} else if (s[j] == ':' && (s[j + 1] == '-' || s[j + 1] == '+')) {
			int depth = 1;
			struct strv word = { 0 };
			char *text;

			op = s[j + 1];
			k = j + 2;
			for (; s[k] && depth > 0; k++) {
				if (s[k] == '\\' && s[k + 1])
					k++;
				else if (s[k] == '$' && s[k + 1] == '{')
					depth++, k++;
				else if (s[k] == '}')
					depth--;
			}
			if (depth > 0)
				return fail(p, KILN_E_INVALID, "bad substitution: no closing }");
			/* s[j + 2 .. k - 1) is the word. */
			if (++p->depth > MAX_NEST)
				return fail(p, KILN_E_INVALID, "substitutions nested deeper than %d",
					    MAX_NEST);
			text = strndup(s + j + 2, k - 1 - (j + 2));
			if (!text)
				return fail(p, KILN_E_NOMEM, "out of memory");
			if ((op == '-') == !(val && *val))
				lex(p, text, false, true, &word);
			p->depth--;
			free(text);
			val = word.n ? word.v[0] : "";
			if (p->rc == KILN_OK) {
				p->expanded += strlen(val);
				if (p->expanded > MAX_EXPANDED)
					fail(p, KILN_E_INVALID,
					     "substitutions make more than %u bytes", MAX_EXPANDED);
				str_put(p, w, val, strlen(val));
			}
			strv_free(&word);
			*i = k;
			return p->rc;
		} else {
			return fail(p, KILN_E_INVALID,
				    "bad substitution: only ${name}, ${name:-word} and ${name:+word}");
		}
	} else if (isalpha((unsigned char)s[j]) || s[j] == '_') {
		start = j;
		while (isalnum((unsigned char)s[j]) || s[j] == '_')
			j++;
		val = var_get(&p->vn, &p->vv, s + start, j - start);
		*i = j;
	} else {
		*i = j;
		return str_put(p, w, "$", 1);
	}
	if (!val)
		return KILN_OK;
	p->expanded += strlen(val);
	if (p->expanded > MAX_EXPANDED)
		return fail(p, KILN_E_INVALID, "substitutions make more than %u bytes", MAX_EXPANDED);
	return str_put(p, w, val, strlen(val));
}

/*
 * Cuts `s` into words (or, unless `split`, one word) with quote removal, backslash escapes and,
 * when `expand`, variable substitution; appends them to `out`.
 */
static enum kiln_err lex(struct ps *p, const char *s, bool split, bool expand, struct strv *out)
{
	struct str w = { 0 };
	bool inword = false;
	size_t i = 0;

	while (p->rc == KILN_OK && s[i]) {
		char c = s[i];

		if (split && isspace((unsigned char)c)) {
			if (inword) {
				char *v = w.p ? w.p : strdup("");

				memset(&w, 0, sizeof(w));
				if (!v) {
					fail(p, KILN_E_NOMEM, "out of memory");
					break;
				}
				strv_push(p, out, v);
			}
			inword = false;
			i++;
			continue;
		}
		inword = true;
		if (c == '\\') {
			if (s[i + 1]) {
				str_put(p, &w, s + i + 1, 1);
				i += 2;
			} else {
				i++;
			}
		} else if (c == '\'') {
			const char *e = strchr(s + i + 1, '\'');

			if (!e) {
				fail(p, KILN_E_INVALID, "a ' quote is not closed");
				break;
			}
			str_put(p, &w, s + i + 1, (size_t)(e - (s + i + 1)));
			i = (size_t)(e - s) + 1;
		} else if (c == '"') {
			i++;
			while (s[i] && s[i] != '"' && p->rc == KILN_OK) {
				if (s[i] == '\\' && (s[i + 1] == '"' || s[i + 1] == '\\' ||
						     s[i + 1] == '$')) {
					str_put(p, &w, s + i + 1, 1);
					i += 2;
				} else if (s[i] == '$' && expand) {
					subst(p, s, &i, &w);
				} else {
					str_put(p, &w, s + i, 1);
					i++;
				}
			}
			/* A failed substitution may have stopped at the string's end: never step
			 * past it. */
			if (p->rc != KILN_OK)
				break;
			if (s[i] != '"') {
				fail(p, KILN_E_INVALID, "a \" quote is not closed");
				break;
			}
			i++;
		} else if (c == '$' && expand) {
			subst(p, s, &i, &w);
		} else {
			str_put(p, &w, s + i, 1);
			i++;
		}
	}
	if (p->rc == KILN_OK && (inword || !split)) {
		char *v = w.p ? w.p : strdup("");

		memset(&w, 0, sizeof(w));
		if (!v)
			return fail(p, KILN_E_NOMEM, "out of memory");
		strv_push(p, out, v);
	}
	free(w.p);
	return p->rc;
}

/*
 * The exec (JSON array of strings) form of `args` into `out`: true when it is one, false (nothing
 * added) when `args` is the shell form.
 */
static bool exec_form(struct ps *p, const char *args, struct strv *out)
{
	json_error_t jerr;
	json_t *a, *v;
	size_t i;

	if (args[0] != '[')
		return false;
	a = json_loads(args, 0, &jerr);
	if (!json_is_array(a)) {
		json_decref(a);
		return false;
	}
	json_array_foreach(a, i, v) {
		if (!json_is_string(v)) {
			json_decref(a);
			return false;
		}
	}
	json_array_foreach(a, i, v) {
		if (strlen(json_string_value(v)) != json_string_length(v)) {
			fail(p, KILN_E_INVALID, "a NUL character in an argument");
			break;
		}
		if (strv_dup(p, out, json_string_value(v)) != KILN_OK)
			break;
	}
	json_decref(a);
	return true;
}

/* Cleans the relative path `in` into `out`; false when it climbs out of its root. */
static bool path_clean(const char *in, struct str *out, struct ps *p)
{
	size_t depth = 0;
	const char *s = in;

	out->n = 0;
	if (out->p)
		out->p[0] = '\0';
	while (*s) {
		const char *e = strchr(s, '/');
		size_t n = e ? (size_t)(e - s) : strlen(s);

		if (n == 0 || (n == 1 && s[0] == '.')) {
			/* nothing */
		} else if (n == 2 && s[0] == '.' && s[1] == '.') {
			if (depth == 0)
				return false;
			depth--;
			while (out->n > 0 && out->p[out->n - 1] != '/')
				out->n--;
			if (out->n > 0)
				out->n--;
			out->p[out->n] = '\0';
		} else {
			if (out->n > 0)
				str_put(p, out, "/", 1);
			str_put(p, out, s, n);
			depth++;
		}
		s += n;
		if (*s == '/')
			s++;
	}
	return true;
}

/*
 * `dir` (absolute) joined with `rel` (an absolute `rel` stands alone), cleaned, as an absolute
 * path; ".." at the root stays at the root. NULL after fail().
 */
static char *path_abs(struct ps *p, const char *dir, const char *rel)
{
	struct str joined = { 0 }, clean = { 0 };
	char *save = NULL, *tok, *r = NULL;

	if (rel[0] != '/') {
		str_put(p, &joined, dir, strlen(dir));
		str_put(p, &joined, "/", 1);
	}
	str_put(p, &joined, rel, strlen(rel));
	str_put(p, &clean, "", 0);
	if (p->rc != KILN_OK)
		goto out;
	for (tok = strtok_r(joined.p, "/", &save); tok && p->rc == KILN_OK;
	     tok = strtok_r(NULL, "/", &save)) {
		if (strcmp(tok, ".") == 0)
			continue;
		if (strcmp(tok, "..") == 0) {
			while (clean.n > 0 && clean.p[clean.n - 1] != '/')
				clean.n--;
			if (clean.n > 0)
				clean.n--;
			clean.p[clean.n] = '\0';
			continue;
		}
		str_put(p, &clean, "/", 1);
		str_put(p, &clean, tok, strlen(tok));
	}
	if (p->rc == KILN_OK && clean.n == 0)
		str_put(p, &clean, "/", 1);
	if (p->rc == KILN_OK) {
		r = clean.p;
		clean.p = NULL;
	}
out:
	free(joined.p);
	free(clean.p);
	return r;
}

static enum kiln_err step_add(struct ps *p, enum df_kind kind, struct strv *args, bool shell,
			      char *chown)
{
	struct df_step *s;

	if (p->rc != KILN_OK) {
		free(chown);
		return p->rc;
	}
	if (p->df->nsteps >= DOCKERFILE_MAX_STEPS) {
		free(chown);
		return fail(p, KILN_E_INVALID, "more than %d instructions", DOCKERFILE_MAX_STEPS);
	}
	s = realloc(p->df->steps, (p->df->nsteps + 1) * sizeof(*s));
	if (!s) {
		free(chown);
		return fail(p, KILN_E_NOMEM, "out of memory");
	}
	p->df->steps = s;
	s += p->df->nsteps++;
	memset(s, 0, sizeof(*s));
	s->kind = kind;
	s->line = p->line;
	s->shell = shell;
	s->chown = chown;
	s->argv = args->v;
	s->argc = args->n;
	memset(args, 0, sizeof(*args));
	if (!s->argv) {
		s->argv = calloc(1, sizeof(char *));
		if (!s->argv)
			return fail(p, KILN_E_NOMEM, "out of memory");
	}
	return KILN_OK;
}

static bool valid_name_char(char c, const char *extra)
{
	return isalnum((unsigned char)c) || (c && strchr(extra, c));
}

/* FROM name: one, first, a template's name. */
static enum kiln_err do_from(struct ps *p, const char *args)
{
	struct strv w = { 0 };
	const char *n;
	size_t i;

	if (p->have_from) {
		fail(p, KILN_E_INVALID, "a second FROM: multi-stage builds are not supported");
		goto out;
	}
	/* FROM sees the ARGs declared before it, and only those. */
	{
		struct strv vn = p->vn, vv = p->vv;

		p->vn = p->mn;
		p->vv = p->mv;
		lex(p, args, true, true, &w);
		p->vn = vn;
		p->vv = vv;
	}
	if (p->rc != KILN_OK)
		goto out;
	if (w.n > 0 && strncmp(w.v[0], "--", 2) == 0) {
		fail(p, KILN_E_INVALID, "FROM %s is not supported", w.v[0]);
		goto out;
	}
	if (w.n != 1) {
		fail(p, KILN_E_INVALID, "FROM takes one template name%s",
		     w.n > 1 ? " (multi-stage builds are not supported)" : "");
		goto out;
	}
	n = w.v[0];
	for (i = 0; n[i]; i++)
		if (!(islower((unsigned char)n[i]) || isdigit((unsigned char)n[i]) ||
		      strchr("._-", n[i])))
			break;
	if (n[i] || i == 0 || i > 63 || !isalnum((unsigned char)n[0])) {
		fail(p, KILN_E_INVALID,
		     "FROM \"%.100s\": only `base`, `python` or the name of one of your templates",
		     n);
		goto out;
	}
	p->df->from = strdup(n);
	if (!p->df->from)
		fail(p, KILN_E_NOMEM, "out of memory");
	p->have_from = true;
out:
	strv_free(&w);
	return p->rc;
}

static enum kiln_err do_run(struct ps *p, const char *args, enum df_kind kind)
{
	struct strv a = { 0 };
	bool shell = false;

	(void)kind;
	if (strncmp(args, "--", 2) == 0)
		return fail(p, KILN_E_INVALID, "RUN options (%.40s) are not supported", args);
	if (strncmp(args, "<<", 2) == 0)
		return fail(p, KILN_E_INVALID, "RUN heredocs (<<) are not supported");
	if (!exec_form(p, args, &a)) {
		if (!*args)
			return fail(p, KILN_E_INVALID, "RUN needs a command");
		shell = true;
		strv_dup(p, &a, args);
	}
	if (p->rc == KILN_OK && a.n == 0)
		fail(p, KILN_E_INVALID, "RUN needs a command");
	step_add(p, DF_RUN, &a, shell, NULL);
	strv_free(&a);
	return p->rc;
}

/* CMD or ENTRYPOINT: the start command. */
static enum kiln_err do_start(struct ps *p, const char *args, bool entry)
{
	struct strv *a = entry ? &p->entry : &p->cmd;
	bool shell = false;

	strv_free(a);
	if (!exec_form(p, args, a)) {
		shell = true;
		if (!*args)
			return fail(p, KILN_E_INVALID, "%s needs a command",
				    entry ? "ENTRYPOINT" : "CMD");
		strv_dup(p, a, args);
	}
	if (entry) {
		p->entry_set = true;
		p->entry_shell = shell;
	} else {
		p->cmd_set = true;
		p->cmd_shell = shell;
	}
	return p->rc;
}

static bool is_url(const char *s)
{
	return strstr(s, "://") || strncmp(s, "git@", 4) == 0;
}

static enum kiln_err do_copy(struct ps *p, const char *args, enum df_kind kind)
{
	const char *name = kind == DF_ADD ? "ADD" : "COPY";
	struct strv w = { 0 }, a = { 0 };
	struct str clean = { 0 };
	char *chown = NULL;
	size_t i, first = 0;
	const char *rest = args;

	/* Options first: --chown only. */
	while (p->rc == KILN_OK && strncmp(rest, "--", 2) == 0) {
		size_t n = strcspn(rest, " \t");

		if (strncmp(rest, "--chown=", 8) == 0 && n > 8) {
			struct strv o = { 0 };
			char *opt = strndup(rest + 8, n - 8);

			if (!opt) {
				fail(p, KILN_E_NOMEM, "out of memory");
				break;
			}
			lex(p, opt, false, true, &o);
			free(opt);
			if (p->rc == KILN_OK) {
				for (i = 0; o.v[0][i]; i++)
					if (!valid_name_char(o.v[0][i], "_.-:"))
						break;
				if (o.v[0][i] || i == 0)
					fail(p, KILN_E_INVALID, "%s --chown=%.60s: not a user[:group]",
					     name, o.v[0]);
				free(chown);
				chown = o.v[0];
				o.v[0] = NULL;
			}
			strv_free(&o);
		} else if (strncmp(rest, "--from", 6) == 0) {
			fail(p, KILN_E_INVALID, "%s --from: multi-stage builds are not supported", name);
		} else {
			fail(p, KILN_E_INVALID, "%s option %.*s is not supported", name,
			     (int)(n > 40 ? 40 : n), rest);
		}
		rest += n;
		while (*rest == ' ' || *rest == '\t')
			rest++;
	}
	if (p->rc == KILN_OK && strncmp(rest, "<<", 2) == 0)
		fail(p, KILN_E_INVALID, "%s heredocs (<<) are not supported", name);
	if (p->rc != KILN_OK)
		goto out;
	if (exec_form(p, rest, &w)) {
		/* The exec form still expands variables in each item. */
		struct strv x = { 0 };

		for (i = 0; i < w.n && p->rc == KILN_OK; i++) {
			struct strv one = { 0 };
			struct str q = { 0 };

			/* Quote nothing: expand only (escape the lexer's quote and \ handling). */
			for (const char *c = w.v[i]; *c && p->rc == KILN_OK; c++) {
				if (*c == '\\' || *c == '\'' || *c == '"')
					str_put(p, &q, "\\", 1);
				str_put(p, &q, c, 1);
			}
			if (p->rc == KILN_OK)
				lex(p, q.p ? q.p : "", false, true, &one);
			if (p->rc == KILN_OK) {
				strv_push(p, &x, one.v[0]);
				one.v[0] = NULL;
			}
			strv_free(&one);
			free(q.p);
		}
		strv_free(&w);
		w = x;
	} else {
		lex(p, rest, true, true, &w);
	}
	if (p->rc != KILN_OK)
		goto out;
	if (w.n < 2) {
		fail(p, KILN_E_INVALID, "%s needs a source and a destination", name);
		goto out;
	}
	for (i = first; i + 1 < w.n && p->rc == KILN_OK; i++) {
		const char *src = w.v[i];

		if (is_url(src)) {
			fail(p, KILN_E_INVALID,
			     "%s from a URL (%.100s) is not supported: fetch it in a RUN step", name,
			     src);
			break;
		}
		while (*src == '/')
			src++;
		if (!path_clean(src, &clean, p)) {
			fail(p, KILN_E_INVALID, "%s source %.100s leaves the build context", name,
			     w.v[i]);
			break;
		}
		strv_dup(p, &a, clean.n ? clean.p : ".");
	}
	if (p->rc != KILN_OK)
		goto out;
	{
		const char *dst = w.v[w.n - 1];
		size_t dl = strlen(dst);
		bool dir = dl > 0 && (dst[dl - 1] == '/' || strcmp(dst, ".") == 0);
		char *abs;

		if (w.n > 2 && !dir) {
			fail(p, KILN_E_INVALID,
			     "%s of more than one source needs a destination directory ending in /",
			     name);
			goto out;
		}
		if (dl == 0) {
			fail(p, KILN_E_INVALID, "%s needs a destination", name);
			goto out;
		}
		abs = path_abs(p, p->df->workdir, dst);
		if (!abs)
			goto out;
		if (dir && strcmp(abs, "/") != 0) {
			struct str d = { abs, strlen(abs), strlen(abs) + 1 };

			str_put(p, &d, "/", 1);
			abs = d.p;
		}
		strv_push(p, &a, abs);
	}
	step_add(p, kind, &a, false, chown);
	chown = NULL;
out:
	free(chown);
	free(clean.p);
	strv_free(&w);
	strv_free(&a);
	return p->rc;
}

static bool valid_var(const char *s, size_t n)
{
	if (n == 0 || !(isalpha((unsigned char)s[0]) || s[0] == '_'))
		return false;
	for (size_t i = 1; i < n; i++)
		if (!(isalnum((unsigned char)s[i]) || s[i] == '_'))
			return false;
	return true;
}

/* ENV k=v ... or ENV k v; ARG n[=v] ... */
static enum kiln_err do_env(struct ps *p, const char *args, enum df_kind kind)
{
	const char *name = kind == DF_ENV ? "ENV" : "ARG";
	struct strv w = { 0 }, a = { 0 };
	size_t i;

	lex(p, args, true, true, &w);
	if (p->rc != KILN_OK)
		goto out;
	if (w.n == 0) {
		fail(p, KILN_E_INVALID, "%s needs a name", name);
		goto out;
	}
	if (kind == DF_ENV && !strchr(w.v[0], '=')) {
		/* ENV key value: the rest of the line, as it is (blanks kept), is the value. */
		const char *rest = args + strcspn(args, " \t");
		struct strv v = { 0 };

		rest += strspn(rest, " \t");
		if (!valid_var(w.v[0], strlen(w.v[0])))
			fail(p, KILN_E_INVALID, "ENV %.60s: not a variable name", w.v[0]);
		else if (w.n < 2)
			fail(p, KILN_E_INVALID, "ENV %.60s needs a value", w.v[0]);
		else
			lex(p, rest, false, true, &v);
		if (p->rc == KILN_OK) {
			strv_dup(p, &a, w.v[0]);
			strv_push(p, &a, v.v[0]);
			v.v[0] = NULL;
		}
		strv_free(&v);
	} else {
		for (i = 0; i < w.n && p->rc == KILN_OK; i++) {
			char *eq = strchr(w.v[i], '=');
			size_t n = eq ? (size_t)(eq - w.v[i]) : strlen(w.v[i]);
			char *k;

			if (!valid_var(w.v[i], n)) {
				fail(p, KILN_E_INVALID, "%s %.60s: not a variable name", name,
				     w.v[i]);
				break;
			}
			if (kind == DF_ENV && !eq) {
				fail(p, KILN_E_INVALID, "ENV %.60s needs a value (name=value)",
				     w.v[i]);
				break;
			}
			k = strndup(w.v[i], n);
			if (!k) {
				fail(p, KILN_E_NOMEM, "out of memory");
				break;
			}
			strv_push(p, &a, k);
			if (eq) {
				strv_dup(p, &a, eq + 1);
			} else {
				/* ARG n: its value from an ARG before FROM, or none. */
				const char *m = var_get(&p->mn, &p->mv, k, n);

				strv_dup(p, &a, p->have_from ? m : NULL);
			}
		}
	}
	if (p->rc != KILN_OK)
		goto out;
	for (i = 0; i + 1 < a.n + 1 && i < a.n; i += 2) {
		if (!p->have_from)
			var_set(p, &p->mn, &p->mv, a.v[i], a.v[i + 1]);
		else if (kind == DF_ARG && !a.v[i + 1] && var_get(&p->vn, &p->vv, a.v[i],
								   strlen(a.v[i])))
			continue;	/* ARG n again keeps its value */
		else
			var_set(p, &p->vn, &p->vv, a.v[i], a.v[i + 1]);
	}
	if (p->have_from)
		step_add(p, kind, &a, false, NULL);
out:
	strv_free(&w);
	strv_free(&a);
	return p->rc;
}

static enum kiln_err do_workdir(struct ps *p, const char *args)
{
	struct strv w = { 0 }, a = { 0 };
	char *abs;

	lex(p, args, false, true, &w);
	if (p->rc != KILN_OK)
		goto out;
	if (!w.v[0][0]) {
		fail(p, KILN_E_INVALID, "WORKDIR needs a path");
		goto out;
	}
	abs = path_abs(p, p->df->workdir, w.v[0]);
	if (!abs)
		goto out;
	free(p->df->workdir);
	p->df->workdir = strdup(abs);
	if (!p->df->workdir) {
		free(abs);
		fail(p, KILN_E_NOMEM, "out of memory");
		goto out;
	}
	strv_push(p, &a, abs);
	step_add(p, DF_WORKDIR, &a, false, NULL);
out:
	strv_free(&w);
	strv_free(&a);
	return p->rc;
}

static enum kiln_err do_user(struct ps *p, const char *args)
{
	struct strv w = { 0 }, a = { 0 };
	const char *u;
	size_t i, colons = 0;

	lex(p, args, true, true, &w);
	if (p->rc != KILN_OK)
		goto out;
	if (w.n != 1) {
		fail(p, KILN_E_INVALID, "USER takes one user[:group]");
		goto out;
	}
	u = w.v[0];
	for (i = 0; u[i]; i++) {
		colons += u[i] == ':';
		if (!valid_name_char(u[i], "_.-:") || (u[i] == ':' && (i == 0 || !u[i + 1])))
			break;
	}
	if (u[i] || colons > 1 || i > 65 || !(isalnum((unsigned char)u[0]) || u[0] == '_')) {
		fail(p, KILN_E_INVALID, "USER %.60s: not a user[:group] of letters, digits, _ . -", u);
		goto out;
	}
	free(p->df->user);
	p->df->user = strdup(u);
	if (!p->df->user) {
		fail(p, KILN_E_NOMEM, "out of memory");
		goto out;
	}
	strv_dup(p, &a, u);
	step_add(p, DF_USER, &a, false, NULL);
out:
	strv_free(&w);
	strv_free(&a);
	return p->rc;
}

/* One instruction: `text` is its keyword and arguments, continuations joined. */
static enum kiln_err instruction(struct ps *p, char *text)
{
	static const char *const unsupported[] = { "EXPOSE", "LABEL", "VOLUME", "HEALTHCHECK",
						   "SHELL", "STOPSIGNAL", "ONBUILD", "MAINTAINER",
						   NULL };
	char kw[16];
	size_t n = 0, i;
	char *args, *end;

	while (isspace((unsigned char)*text))
		text++;
	while (text[n] && !isspace((unsigned char)text[n]))
		n++;
	args = text + n;
	while (isspace((unsigned char)*args))
		args++;
	end = args + strlen(args);
	while (end > args && isspace((unsigned char)end[-1]))
		*--end = '\0';
	if (n >= sizeof(kw))
		return fail(p, KILN_E_INVALID, "unknown instruction %.20s", text);
	for (i = 0; i < n; i++)
		kw[i] = (char)toupper((unsigned char)text[i]);
	kw[n] = '\0';
	if (strcmp(kw, "FROM") == 0)
		return do_from(p, args);
	if (strcmp(kw, "ARG") == 0)
		return do_env(p, args, DF_ARG);
	for (i = 0; unsupported[i]; i++)
		if (strcmp(kw, unsupported[i]) == 0)
			return fail(p, KILN_E_INVALID, "%s is not supported", kw);
	if (strcmp(kw, "RUN") && strcmp(kw, "COPY") && strcmp(kw, "ADD") && strcmp(kw, "ENV") &&
	    strcmp(kw, "WORKDIR") && strcmp(kw, "USER") && strcmp(kw, "CMD") &&
	    strcmp(kw, "ENTRYPOINT"))
		return fail(p, KILN_E_INVALID, "unknown instruction %s", kw);
	if (!p->have_from)
		return fail(p, KILN_E_INVALID, "%s before FROM", kw);
	if (strcmp(kw, "RUN") == 0)
		return do_run(p, args, DF_RUN);
	if (strcmp(kw, "COPY") == 0)
		return do_copy(p, args, DF_COPY);
	if (strcmp(kw, "ADD") == 0)
		return do_copy(p, args, DF_ADD);
	if (strcmp(kw, "ENV") == 0)
		return do_env(p, args, DF_ENV);
	if (strcmp(kw, "WORKDIR") == 0)
		return do_workdir(p, args);
	if (strcmp(kw, "USER") == 0)
		return do_user(p, args);
	return do_start(p, args, strcmp(kw, "ENTRYPOINT") == 0);
}

/* The start command from ENTRYPOINT and CMD, Docker's way. */
static enum kiln_err start_command(struct ps *p)
{
	struct strv a = { 0 };
	size_t i;

	if (p->entry_set) {
		if (p->entry_shell) {
			strv_dup(p, &a, "/bin/sh");
			strv_dup(p, &a, "-c");
			strv_dup(p, &a, p->entry.v[0]);
		} else {
			for (i = 0; i < p->entry.n; i++)
				strv_dup(p, &a, p->entry.v[i]);
		}
	}
	if (p->cmd_set && !(p->entry_set && p->entry_shell)) {
		if (p->cmd_shell) {
			strv_dup(p, &a, "/bin/sh");
			strv_dup(p, &a, "-c");
			strv_dup(p, &a, p->cmd.v[0]);
		} else {
			for (i = 0; i < p->cmd.n; i++)
				strv_dup(p, &a, p->cmd.v[i]);
		}
	}
	if (p->rc == KILN_OK && a.n > 0) {
		p->df->start_argv = a.v;
		p->df->start_argc = a.n;
		memset(&a, 0, sizeof(a));
	}
	strv_free(&a);
	return p->rc;
}

/* Whether line [s, e) is blank or a comment. */
static bool line_skippable(const char *s, const char *e)
{
	while (s < e && isspace((unsigned char)*s))
		s++;
	return s == e || *s == '#';
}

enum kiln_err dockerfile_parse(const char *text, size_t len, struct dockerfile *out,
			       struct kiln_error *err)
{
	struct ps p = { .df = out, .err = err };
	struct str ins = { 0 };
	size_t pos = 0;
	unsigned lineno = 0, start = 0;
	bool directives = true, cont = false;

	memset(out, 0, sizeof(*out));
	if (len > DOCKERFILE_MAX_BYTES)
		return kiln_error_set(err, KILN_E_TOO_LARGE, "the Dockerfile is larger than %u bytes",
				      (unsigned)DOCKERFILE_MAX_BYTES);
	if (memchr(text, '\0', len))
		return kiln_error_set(err, KILN_E_INVALID, "the Dockerfile holds a NUL byte");
	out->workdir = strdup("/");
	if (!out->workdir)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	while (pos < len && p.rc == KILN_OK) {
		const char *s = text + pos, *nl = memchr(s, '\n', len - pos);
		const char *e = nl ? nl : text + len;
		const char *t;

		pos = (size_t)(e - text) + (nl ? 1 : 0);
		lineno++;
		if (e > s && e[-1] == '\r')
			e--;
		if (line_skippable(s, e)) {
			/* Parser directives: only the first lines, before any other comment. */
			const char *c = s;

			while (c < e && isspace((unsigned char)*c))
				c++;
			if (directives && c < e && *c == '#') {
				const char *k = c + 1;

				while (k < e && (*k == ' ' || *k == '\t'))
					k++;
				if (e - k >= 6 && strncasecmp(k, "escape", 6) == 0) {
					const char *v = memchr(k, '=', (size_t)(e - k));

					while (v && ++v < e && isspace((unsigned char)*v))
						;
					if (v && v < e && *v != '\\') {
						p.line = lineno;
						fail(&p, KILN_E_INVALID,
						     "the escape directive %c is not supported (only \\)",
						     *v);
						break;
					}
				} else if (!(e - k >= 6 && strncasecmp(k, "syntax", 6) == 0)) {
					directives = false;
				}
			} else {
				directives = false;
			}
			continue;	/* blank and comment lines vanish, in continuations too */
		}
		directives = false;
		if (!cont) {
			start = lineno;
			ins.n = 0;
		}
		/* A trailing backslash (then only blanks) continues the instruction. */
		t = e;
		while (t > s && (t[-1] == ' ' || t[-1] == '\t'))
			t--;
		cont = t > s && t[-1] == '\\';
		p.line = start;
		str_put(&p, &ins, s, (size_t)((cont ? t - 1 : e) - s));
		if (cont)
			continue;
		str_put(&p, &ins, "", 0);
		if (p.rc == KILN_OK)
			instruction(&p, ins.p);
	}
	if (p.rc == KILN_OK && cont && ins.n > 0) {
		str_put(&p, &ins, "", 0);
		if (p.rc == KILN_OK)
			instruction(&p, ins.p);
	}
	p.line = 0;
	if (p.rc == KILN_OK && !p.have_from)
		fail(&p, KILN_E_INVALID, "no FROM");
	if (p.rc == KILN_OK)
		start_command(&p);
	free(ins.p);
	strv_free(&p.vn);
	strv_free(&p.vv);
	strv_free(&p.mn);
	strv_free(&p.mv);
	strv_free(&p.cmd);
	strv_free(&p.entry);
	if (p.rc != KILN_OK)
		dockerfile_free(out);
	return p.rc;
}

void dockerfile_free(struct dockerfile *df)
{
	size_t i, j;

	if (!df)
		return;
	for (i = 0; i < df->nsteps; i++) {
		for (j = 0; j < df->steps[i].argc; j++)
			free(df->steps[i].argv[j]);
		free(df->steps[i].argv);
		free(df->steps[i].chown);
	}
	free(df->steps);
	for (i = 0; i < df->start_argc; i++)
		free(df->start_argv[i]);
	free(df->start_argv);
	free(df->from);
	free(df->workdir);
	free(df->user);
	memset(df, 0, sizeof(*df));
}

const char *dockerfile_kind_name(enum df_kind kind)
{
	static const char *const names[] = { "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER" };

	return (unsigned)kind < sizeof(names) / sizeof(names[0]) ? names[kind] : "?";
}

/* ---- .dockerignore ---- */

/* Matches the bracket class at p[i] ('[') against c: 1, 0, or -1 when it has no closing ']'. */
static int glob_class(const char *p, size_t i, char c, size_t *end)
{
	bool neg = false, hit = false;

	i++;
	if (p[i] == '^')	/* Go's negation; '!' is an ordinary member there */
		neg = true, i++;
	if (p[i] == ']') {
		if (c == ']')
			hit = true;
		i++;
	}
	while (p[i] && p[i] != ']') {
		char lo = p[i], hi;

		if (lo == '\\' && p[i + 1])
			lo = p[++i];
		i++;
		hi = lo;
		if (p[i] == '-' && p[i + 1] && p[i + 1] != ']') {
			hi = p[++i];
			if (hi == '\\' && p[i + 1])
				hi = p[++i];
			i++;
		}
		if (lo <= c && c <= hi)
			hit = true;
	}
	if (p[i] != ']')
		return -1;
	if (end)
		*end = i + 1;
	return (hit != neg) && c != '/';
}

#define GLOB_MAX 4096	/* bytes of a pattern (longer ones are refused when parsed) */

enum { T_LIT, T_ONE, T_CLASS, T_STAR, T_ANY, T_DIRS };

struct gtok {
	unsigned char t;
	char c;
	size_t at;	/* T_CLASS: the '[' in the pattern */
};

/*
 * Docker's rules, as its regular expression translation: `*` is [^/]*, `?` is [^/], `**` at the
 * end is .*, `**` (and `**` followed by '/') elsewhere is (.*\/)?, anchored at both ends. Run as
 * an NFA over the pattern's tokens: linear in pattern times name.
 */
bool dockerignore_glob(const char *pat, const char *name)
{
	size_t plen = strlen(pat), nt = 0, i, end;
	struct gtok *tok;
	unsigned char *st;	/* per token: bit 1 active, bit 2 inside a (.*\/)? */
	unsigned char *nx;
	bool ok = false;

	if (plen > GLOB_MAX)
		return false;
	tok = calloc(plen + 1, sizeof(*tok));
	st = calloc(plen + 2, 1);
	nx = calloc(plen + 2, 1);
	if (!tok || !st || !nx)
		goto out;
	for (i = 0; pat[i];) {
		struct gtok *k = &tok[nt++];

		if (pat[i] == '*' && pat[i + 1] == '*') {
			i += 2;	/* exactly two: "***" is "**" then "*", as in Docker */
			if (pat[i] == '/')
				i++;
			k->t = pat[i] ? T_DIRS : T_ANY;
		} else if (pat[i] == '*') {
			i++;
			k->t = T_STAR;
		} else if (pat[i] == '?') {
			i++;
			k->t = T_ONE;
		} else if (pat[i] == '[' && glob_class(pat, i, 'a', &end) >= 0) {
			k->t = T_CLASS;
			k->at = i;
			i = end;
		} else {
			if (pat[i] == '\\' && pat[i + 1])
				i++;
			k->t = T_LIT;
			k->c = pat[i++];
		}
	}
	st[0] = 1;
	for (const char *c = name;; c++) {
		/* Empty matches: a star, ** or (.*\/)? may match nothing. */
		for (i = 0; i < nt; i++)
			if ((st[i] & 1) && tok[i].t >= T_STAR)
				st[i + 1] |= 1;
		if (!*c)
			break;
		memset(nx, 0, nt + 1);
		for (i = 0; i < nt; i++) {
			bool a = st[i] & 1;

			switch (tok[i].t) {
			case T_LIT:
				if (a && *c == tok[i].c)
					nx[i + 1] |= 1;
				break;
			case T_ONE:
				if (a && *c != '/')
					nx[i + 1] |= 1;
				break;
			case T_CLASS:
				if (a && glob_class(pat, tok[i].at, *c, NULL) == 1)
					nx[i + 1] |= 1;
				break;
			case T_STAR:
				if (a && *c != '/')
					nx[i] |= 1;
				break;
			case T_ANY:
				if (a)
					nx[i] |= 1;
				break;
			case T_DIRS:
				if (a || (st[i] & 2)) {
					nx[i] |= 2;
					if (*c == '/')
						nx[i + 1] |= 1;
				}
				break;
			}
		}
		memcpy(st, nx, nt + 1);
	}
	ok = st[nt] & 1;
out:
	free(tok);
	free(st);
	free(nx);
	return ok;
}

void dockerignore_free(struct dockerignore *di)
{
	if (!di)
		return;
	for (size_t i = 0; i < di->n; i++)
		free(di->rules[i].pattern);
	free(di->rules);
	memset(di, 0, sizeof(*di));
}

enum kiln_err dockerignore_parse(const char *text, size_t len, struct dockerignore *out,
				 struct kiln_error *err)
{
	struct ps p = { .err = err };
	struct str clean = { 0 };
	size_t pos = 0;
	unsigned lineno = 0;

	memset(out, 0, sizeof(*out));
	if (len > DOCKERFILE_MAX_BYTES)
		return kiln_error_set(err, KILN_E_TOO_LARGE, ".dockerignore is larger than %u bytes",
				      (unsigned)DOCKERFILE_MAX_BYTES);
	while (pos < len && p.rc == KILN_OK) {
		const char *s = text + pos, *nl = memchr(s, '\n', len - pos);
		const char *e = nl ? nl : text + len;
		struct dockerignore_rule *r;
		bool neg = false;
		char *raw;

		pos = (size_t)(e - text) + (nl ? 1 : 0);
		lineno++;
		while (s < e && isspace((unsigned char)*s))
			s++;
		while (e > s && isspace((unsigned char)e[-1]))
			e--;
		if (s == e || *s == '#')
			continue;
		if (*s == '!') {
			neg = true;
			s++;
			while (s < e && isspace((unsigned char)*s))
				s++;
		}
		while (s < e && *s == '/')
			s++;
		if (memchr(s, '\0', (size_t)(e - s))) {
			kiln_error_set(err, KILN_E_INVALID, ".dockerignore line %u: a NUL byte", lineno);
			p.rc = KILN_E_INVALID;
			break;
		}
		if (out->n >= DOCKERIGNORE_MAX_RULES) {
			kiln_error_set(err, KILN_E_INVALID, ".dockerignore: more than %d patterns",
				       DOCKERIGNORE_MAX_RULES);
			p.rc = KILN_E_INVALID;
			break;
		}
		if ((size_t)(e - s) > GLOB_MAX) {
			kiln_error_set(err, KILN_E_INVALID,
				       ".dockerignore line %u: a pattern longer than %d bytes", lineno,
				       GLOB_MAX);
			p.rc = KILN_E_INVALID;
			break;
		}
		raw = strndup(s, (size_t)(e - s));
		if (!raw) {
			p.rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			break;
		}
		if (!path_clean(raw, &clean, &p)) {
			free(raw);
			/* Above the context: matches nothing there. */
			continue;
		}
		free(raw);
		if (p.rc != KILN_OK)
			break;
		r = realloc(out->rules, (out->n + 1) * sizeof(*r));
		if (!r) {
			p.rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			break;
		}
		out->rules = r;
		r[out->n].negate = neg;
		r[out->n].pattern = strdup(clean.n ? clean.p : ".");
		if (!r[out->n].pattern) {
			p.rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			break;
		}
		out->n++;
	}
	free(clean.p);
	if (p.rc != KILN_OK)
		dockerignore_free(out);
	return p.rc;
}

bool dockerignore_excluded(const struct dockerignore *di, const char *path)
{
	bool excluded = false;
	char buf[4096];
	size_t n;

	while (path[0] == '.' && path[1] == '/')
		path += 2;
	while (*path == '/')
		path++;
	n = strlen(path);
	if (n >= sizeof(buf))
		n = sizeof(buf) - 1;
	for (size_t i = 0; i < di->n; i++) {
		bool hit = false;

		/* The path itself or one of its parent directories. */
		memcpy(buf, path, n);
		buf[n] = '\0';
		for (;;) {
			char *slash;

			if (dockerignore_glob(di->rules[i].pattern, buf)) {
				hit = true;
				break;
			}
			slash = strrchr(buf, '/');
			if (!slash)
				break;
			*slash = '\0';
		}
		if (hit)
			excluded = !di->rules[i].negate;
	}
	return excluded;
}
