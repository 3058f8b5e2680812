/*
 * agent_proto.c - frame header codec, the incremental frame decoder, bounded payload readers and
 * writers and the decoders of the guest's replies. Shared by kiln-agent and the host client; pure
 * functions only (see agent_proto.h).
 */
#include "agent_proto.h"

#include <errno.h>
#include <string.h>

static void put_be16(uint8_t *p, uint16_t v)
{
	p[0] = (uint8_t)(v >> 8);
	p[1] = (uint8_t)v;
}

static void put_be32(uint8_t *p, uint32_t v)
{
	p[0] = (uint8_t)(v >> 24);
	p[1] = (uint8_t)(v >> 16);
	p[2] = (uint8_t)(v >> 8);
	p[3] = (uint8_t)v;
}

static uint16_t get_be16(const uint8_t *p)
{
	return (uint16_t)((p[0] << 8) | p[1]);
}

static uint32_t get_be32(const uint8_t *p)
{
	return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

void agent_hdr_encode(const struct agent_hdr *h, uint8_t out[AGENT_HDR_SIZE])
{
	put_be32(out, AGENT_MAGIC);
	out[4] = h->version;
	out[5] = h->type;
	put_be16(out + 6, h->flags);
	put_be32(out + 8, h->id);
	put_be32(out + 12, h->len);
}

bool agent_type_from_guest(uint8_t type)
{
	switch (type) {
	case AGENT_T_FILE_DATA:
	case AGENT_T_FILE_END:
	case AGENT_T_HELLO_OK:
	case AGENT_T_OK:
	case AGENT_T_ERROR:
	case AGENT_T_STDOUT:
	case AGENT_T_STDERR:
	case AGENT_T_EXIT:
	case AGENT_T_PROC_ENTRY:
	case AGENT_T_WATCH_EVENTS:
	case AGENT_T_STREAM_DATA:
	case AGENT_T_STREAM_WINDOW:
	case AGENT_T_STREAM_END:
		return true;
	default:
		return false;
	}
}

bool agent_type_from_host(uint8_t type)
{
	switch (type) {
	case AGENT_T_HELLO:
	case AGENT_T_EXEC:
	case AGENT_T_FILE_WRITE:
	case AGENT_T_FILE_READ:
	case AGENT_T_SET_IDENTITY:
	case AGENT_T_CANCEL:
	case AGENT_T_GROW_ROOT:
	case AGENT_T_FILE_DATA:
	case AGENT_T_FILE_END:
	case AGENT_T_PORT_OPEN:
	case AGENT_T_PROC_ATTACH:
	case AGENT_T_PROC_LIST:
	case AGENT_T_PROC_SIGNAL:
	case AGENT_T_PROC_STDIN:
	case AGENT_T_PROC_RESIZE:
	case AGENT_T_WATCH_ADD:
	case AGENT_T_WATCH_READ:
	case AGENT_T_WATCH_REMOVE:
	case AGENT_T_STREAM_DATA:
	case AGENT_T_STREAM_WINDOW:
	case AGENT_T_STREAM_END:
		return true;
	default:
		return false;
	}
}

int agent_hdr_decode(const uint8_t in[AGENT_HDR_SIZE], struct agent_hdr *h)
{
	if (get_be32(in) != AGENT_MAGIC || in[4] != AGENT_PROTO_VERSION)
		return -EPROTO;
	h->version = in[4];
	h->type = in[5];
	h->flags = get_be16(in + 6);
	h->id = get_be32(in + 8);
	h->len = get_be32(in + 12);
	if (!agent_type_from_guest(h->type) && !agent_type_from_host(h->type))
		return -EPROTO;
	if (h->len > AGENT_MAX_PAYLOAD)
		return -EMSGSIZE;
	return 0;
}

void agent_decoder_init(struct agent_decoder *d, uint8_t *payload_buf)
{
	memset(d, 0, sizeof(*d));
	d->payload = payload_buf;
}

int agent_decoder_feed(struct agent_decoder *d, const uint8_t *in, size_t n, size_t *used)
{
	size_t off = 0;

	*used = 0;
	if (d->error)
		return d->error;
	/* A frame was returned last time: start the next one. */
	if (d->hdr_have == AGENT_HDR_SIZE && d->payload_have == d->hdr.len) {
		d->hdr_have = 0;
		d->payload_have = 0;
	}
	if (d->hdr_have < AGENT_HDR_SIZE) {
		size_t take = AGENT_HDR_SIZE - d->hdr_have;

		if (take > n)
			take = n;
		memcpy(d->hdr_buf + d->hdr_have, in, take);
		d->hdr_have += take;
		off += take;
		if (d->hdr_have < AGENT_HDR_SIZE) {
			*used = off;
			return 0;
		}
		int rc = agent_hdr_decode(d->hdr_buf, &d->hdr);

		if (rc < 0) {
			d->error = rc;
			*used = off;
			return rc;
		}
	}
	size_t want = d->hdr.len - d->payload_have;
	size_t take = n - off < want ? n - off : want;

	if (take)
		memcpy(d->payload + d->payload_have, in + off, take);
	d->payload_have += take;
	off += take;
	*used = off;
	return d->payload_have == d->hdr.len ? 1 : 0;
}

void agent_rd_init(struct agent_rd *r, const void *p, size_t len)
{
	r->p = p;
	r->len = len;
	r->off = 0;
	r->bad = false;
}

/* Returns a pointer to the next `n` bytes and advances, or NULL (and marks `r` bad). */
static const uint8_t *rd_take(struct agent_rd *r, size_t n)
{
	if (r->bad || r->len - r->off < n) {
		r->bad = true;
		return NULL;
	}
	const uint8_t *p = r->p + r->off;

	r->off += n;
	return p;
}

uint8_t agent_rd_u8(struct agent_rd *r)
{
	const uint8_t *p = rd_take(r, 1);

	return p ? p[0] : 0;
}

uint16_t agent_rd_u16(struct agent_rd *r)
{
	const uint8_t *p = rd_take(r, 2);

	return p ? get_be16(p) : 0;
}

uint32_t agent_rd_u32(struct agent_rd *r)
{
	const uint8_t *p = rd_take(r, 4);

	return p ? get_be32(p) : 0;
}

uint64_t agent_rd_u64(struct agent_rd *r)
{
	const uint8_t *p = rd_take(r, 8);

	return p ? ((uint64_t)get_be32(p) << 32) | get_be32(p + 4) : 0;
}

struct agent_bytes agent_rd_bytes(struct agent_rd *r, uint32_t max)
{
	struct agent_bytes b = { NULL, 0 };
	uint32_t n = agent_rd_u32(r);

	if (r->bad)
		return b;
	if (n > max) {
		r->bad = true;
		return b;
	}
	b.p = rd_take(r, n);
	if (!b.p)
		return b;
	b.len = n;
	return b;
}

struct agent_bytes agent_rd_text(struct agent_rd *r, uint32_t max)
{
	struct agent_bytes b = agent_rd_bytes(r, max);

	if (b.p && b.len && memchr(b.p, 0, b.len)) {
		r->bad = true;
		b.p = NULL;
		b.len = 0;
	}
	return b;
}

bool agent_rd_done(const struct agent_rd *r)
{
	return !r->bad && r->off == r->len;
}

void agent_wr_init(struct agent_wr *w, void *p, size_t cap)
{
	w->p = p;
	w->cap = cap;
	w->len = 0;
	w->overflow = false;
}

void agent_wr_raw(struct agent_wr *w, const void *p, size_t len)
{
	if (w->overflow)
		return;
	if (w->p && w->cap - w->len < len) {
		w->overflow = true;
		return;
	}
	if (w->p && len)
		memcpy(w->p + w->len, p, len);
	w->len += len;
}

void agent_wr_u8(struct agent_wr *w, uint8_t v)
{
	agent_wr_raw(w, &v, 1);
}

void agent_wr_u16(struct agent_wr *w, uint16_t v)
{
	uint8_t b[2];

	put_be16(b, v);
	agent_wr_raw(w, b, 2);
}

void agent_wr_u32(struct agent_wr *w, uint32_t v)
{
	uint8_t b[4];

	put_be32(b, v);
	agent_wr_raw(w, b, 4);
}

void agent_wr_u64(struct agent_wr *w, uint64_t v)
{
	uint8_t b[8];

	put_be32(b, (uint32_t)(v >> 32));
	put_be32(b + 4, (uint32_t)v);
	agent_wr_raw(w, b, 8);
}

void agent_wr_bytes(struct agent_wr *w, const void *p, size_t len)
{
	if (len > UINT32_MAX) {
		w->overflow = true;
		return;
	}
	agent_wr_u32(w, (uint32_t)len);
	agent_wr_raw(w, p, len);
}

void agent_wr_str(struct agent_wr *w, const char *s)
{
	agent_wr_bytes(w, s, s ? strlen(s) : 0);
}

int agent_parse_hello_ok(const uint8_t *p, size_t len, struct agent_hello_msg *m)
{
	struct agent_rd r;

	agent_rd_init(&r, p, len);
	m->version = agent_rd_u16(&r);
	m->kernel_release = agent_rd_text(&r, 256);
	m->boot_id = agent_rd_text(&r, 64);
	m->agent_version = agent_rd_text(&r, 64);
	m->uptime_ms = agent_rd_u64(&r);
	return agent_rd_done(&r) ? 0 : -EBADMSG;
}

int agent_parse_exit(const uint8_t *p, size_t len, struct agent_exit_msg *m)
{
	struct agent_rd r;

	agent_rd_init(&r, p, len);
	m->exit_code = (int32_t)agent_rd_u32(&r);
	m->signal = agent_rd_u32(&r);
	uint8_t to = agent_rd_u8(&r);

	m->timed_out = to != 0;
	m->duration_ms = agent_rd_u64(&r);
	if (!agent_rd_done(&r) || to > 1 || m->exit_code < 0 || m->exit_code > 255 ||
	    m->signal > 64)
		return -EBADMSG;
	return 0;
}

int agent_parse_error(const uint8_t *p, size_t len, struct agent_error_msg *m)
{
	struct agent_rd r;

	agent_rd_init(&r, p, len);
	m->status = agent_rd_u32(&r);
	m->sys_errno = agent_rd_u32(&r);
	m->message = agent_rd_text(&r, AGENT_MAX_TEXT);
	return agent_rd_done(&r) ? 0 : -EBADMSG;
}

/* Reads `n` text strings of at most `max` bytes each; the span they took goes to *raw. */
static void rd_text_list(struct agent_rd *r, uint32_t n, uint32_t max, struct agent_bytes *raw)
{
	size_t start = r->off;

	for (uint32_t i = 0; i < n && !r->bad; i++)
		agent_rd_text(r, max);
	raw->p = r->bad ? NULL : r->p + start;
	raw->len = r->bad ? 0 : (uint32_t)(r->off - start);
}

int agent_parse_proc_entry(const uint8_t *p, size_t len, struct agent_proc_entry_msg *m)
{
	struct agent_rd r;

	memset(m, 0, sizeof(*m));
	agent_rd_init(&r, p, len);
	m->pid = agent_rd_u32(&r);
	m->running = agent_rd_u8(&r);
	m->pty = agent_rd_u8(&r);
	m->exit_code = (int32_t)agent_rd_u32(&r);
	m->tag = agent_rd_text(&r, AGENT_MAX_TAG);
	m->cwd = agent_rd_text(&r, AGENT_MAX_PATH);
	m->argc = agent_rd_u32(&r);
	if (m->argc > AGENT_MAX_ARGS)
		r.bad = true;
	rd_text_list(&r, m->argc, AGENT_MAX_PAYLOAD, &m->argv_raw);
	m->envc = agent_rd_u32(&r);
	if (m->envc > AGENT_MAX_ENV)
		r.bad = true;
	rd_text_list(&r, m->envc, AGENT_MAX_PAYLOAD, &m->env_raw);
	if (!agent_rd_done(&r) || m->pid == 0 || m->pid > 0x7fffffffu || m->running > 1 ||
	    m->pty > 1 || m->exit_code < -1 || m->exit_code > 255 || (m->running && m->exit_code != -1))
		return -EBADMSG;
	return 0;
}

struct agent_bytes agent_list_next(struct agent_rd *r)
{
	return agent_rd_text(r, AGENT_MAX_PAYLOAD);
}

int agent_parse_watch_events(const uint8_t *p, size_t len, struct agent_watch_events_msg *m)
{
	struct agent_rd r;
	size_t start;

	memset(m, 0, sizeof(*m));
	agent_rd_init(&r, p, len);
	m->flags = agent_rd_u8(&r);
	m->count = agent_rd_u32(&r);
	if (m->count > AGENT_WATCH_MAX_EVENTS || (m->flags & ~(AGENT_WATCH_F_DROPPED | AGENT_WATCH_F_ENDED)))
		r.bad = true;
	start = r.off;
	for (uint32_t i = 0; i < m->count && !r.bad; i++) {
		uint8_t t = agent_rd_u8(&r);
		struct agent_bytes n = agent_rd_text(&r, AGENT_MAX_PATH);

		if (t < AGENT_WATCH_CREATE || t > AGENT_WATCH_CHMOD || n.len == 0)
			r.bad = true;
	}
	if (!agent_rd_done(&r))
		return -EBADMSG;
	m->events_raw.p = p + start;
	m->events_raw.len = (uint32_t)(len - start);
	return 0;
}

uint8_t agent_watch_next(struct agent_rd *r, struct agent_bytes *name)
{
	uint8_t t = agent_rd_u8(r);

	*name = agent_rd_text(r, AGENT_MAX_PATH);
	return t;
}

int agent_parse_u64(const uint8_t *p, size_t len, uint64_t *v)
{
	struct agent_rd r;

	agent_rd_init(&r, p, len);
	*v = agent_rd_u64(&r);
	return agent_rd_done(&r) ? 0 : -EBADMSG;
}

int agent_parse_u32(const uint8_t *p, size_t len, uint32_t *v)
{
	struct agent_rd r;

	agent_rd_init(&r, p, len);
	*v = agent_rd_u32(&r);
	return agent_rd_done(&r) ? 0 : -EBADMSG;
}

int agent_parse_u16(const uint8_t *p, size_t len, uint16_t *v)
{
	struct agent_rd r;

	agent_rd_init(&r, p, len);
	*v = agent_rd_u16(&r);
	return agent_rd_done(&r) ? 0 : -EBADMSG;
}

unsigned agent_version_major(const char *v)
{
	static const char prefix[] = "kiln-agent/";
	unsigned n = 0;
	size_t i = sizeof(prefix) - 1;

	if (strncmp(v, prefix, i) != 0 || v[i] < '0' || v[i] > '9')
		return 0;
	for (; v[i] >= '0' && v[i] <= '9' && n < 100000; i++)
		n = n * 10 + (unsigned)(v[i] - '0');
	return n;
}

bool agent_path_ok(const char *path, size_t len)
{
	return len > 0 && len <= AGENT_MAX_PATH && path[0] == '/' && !memchr(path, 0, len);
}

bool agent_hostname_ok(const char *name, size_t len)
{
	if (len == 0 || len > AGENT_MAX_HOSTNAME || name[0] == '-' || name[0] == '.')
		return false;
	for (size_t i = 0; i < len; i++) {
		char c = name[i];

		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '-' || c == '.'))
			return false;
	}
	return true;
}

bool agent_env_ok(const char *kv, size_t len)
{
	const char *eq = memchr(kv, '=', len);

	return eq && eq != kv && !memchr(kv, 0, len);
}

bool agent_user_ok(const char *name, size_t len)
{
	if (len == 0 || len > AGENT_MAX_USER ||
	    !((name[0] >= 'a' && name[0] <= 'z') || (name[0] >= 'A' && name[0] <= 'Z') || name[0] == '_'))
		return false;
	for (size_t i = 1; i < len; i++) {
		char c = name[i];

		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '_' || c == '.' || c == '-'))
			return false;
	}
	return true;
}

bool agent_rd_user(struct agent_rd *r, struct agent_bytes *user)
{
	user->p = NULL;
	user->len = 0;
	if (r->bad)
		return false;
	if (r->off == r->len)
		return true;	/* no field: root */
	*user = agent_rd_text(r, AGENT_MAX_USER);
	if (r->bad || !agent_user_ok((const char *)user->p, user->len)) {
		r->bad = true;
		user->p = NULL;
		user->len = 0;
		return false;
	}
	return true;
}
