/*
 * buf.h - growable byte buffers with a hard cap set at creation (as curl's dynbuf).
 *
 * Every buffer that receives outside data is a `struct buf` whose `max` bounds it. The data is
 * always NUL-terminated (the terminator is not counted in `len` nor in `max`).
 */
#ifndef KILN_BUF_H
#define KILN_BUF_H

#include <stdarg.h>
#include <stddef.h>

struct buf {
	char *data;	/* NULL until the first append */
	size_t len;	/* bytes used */
	size_t cap;	/* bytes allocated */
	size_t max;	/* bytes allowed at most */
};

/* Prepares an empty buffer that may hold at most `max` bytes. Allocates nothing. */
void buf_init(struct buf *b, size_t max);

/* Frees the buffer's memory and empties it; the cap stays. Accepts NULL. */
void buf_release(struct buf *b);

/* Empties the buffer without freeing its memory. */
void buf_reset(struct buf *b);

/* Appends `n` bytes. Returns 0, -E2BIG past the cap (nothing appended) or -ENOMEM. */
int buf_append(struct buf *b, const void *data, size_t n);
int buf_appends(struct buf *b, const char *s);
int buf_appendf(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int buf_vappendf(struct buf *b, const char *fmt, va_list ap);

/*
 * Hands the data to the caller, who frees it with free(); the buffer is left empty. Returns an
 * empty allocated string when nothing was appended, NULL only when out of memory.
 */
char *buf_detach(struct buf *b, size_t *len);

#endif
