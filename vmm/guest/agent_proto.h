/*
 * agent_proto.h - the wire protocol between the host (vmm/agent.c) and kiln-agent in the guest.
 *
 * Both sides compile agent_proto.c: kiln-agent statically into the guest, the host into the
 * kiln_agentclient library. Everything here is pure (no I/O, no allocation), so the fuzz target
 * can drive the decoders directly. docs/agent-protocol.md is the normative description.
 *
 * A frame is a 16-byte header followed by `len` payload bytes; all integers are big-endian.
 *
 *   offset 0  u32 magic    AGENT_MAGIC ("KLNA")
 *          4  u8  version  AGENT_PROTO_VERSION
 *          5  u8  type     enum agent_type
 *          6  u16 flags    per type; unknown bits must be zero
 *          8  u32 id       request id chosen by the host; every frame of one request carries it
 *         12  u32 len      payload bytes, at most AGENT_MAX_PAYLOAD
 *
 * Payload fields are u8/u16/u32/u64 integers and byte strings (u32 length + bytes). Text strings
 * are byte strings that hold no NUL byte.
 */
#ifndef KILN_AGENT_PROTO_H
#define KILN_AGENT_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AGENT_MAGIC 0x4B4C4E41u		/* "KLNA" */
#define AGENT_PROTO_VERSION 1
#define AGENT_HDR_SIZE 16		/* bytes */
#define AGENT_MAX_PAYLOAD (1u << 20)	/* bytes; a hard cap on every frame */
#define AGENT_CHUNK 65536		/* bytes of data per STDOUT/STDERR/FILE_DATA frame, at most */
#define AGENT_MAX_ARGS 4096		/* argv entries */
#define AGENT_MAX_ENV 4096		/* env entries */
#define AGENT_MAX_PATH 4095		/* bytes of a path */
#define AGENT_MAX_HOSTNAME 63		/* bytes */
#define AGENT_MAX_SANDBOX_ID 128	/* bytes */
#define AGENT_MIN_ENTROPY 32		/* bytes of host entropy in SET_IDENTITY, when present */
#define AGENT_MAX_ENTROPY 4096		/* bytes */
#define AGENT_MAX_TEXT 4096		/* bytes of a message or a release string */
#define AGENT_MAX_USER 32		/* bytes of a user name */
#define AGENT_MAX_GROW_WAIT_MS 60000	/* GROW_ROOT: longest wait for the guest to see its disk */
#define AGENT_STREAM_WINDOW 262144	/* bytes of a port stream either side may have unacknowledged */
#define AGENT_PORT_STREAMS_MIN_VERSION 2	/* agents "kiln-agent/N" with N >= this serve PORT_OPEN */
#define AGENT_PROCS_MIN_VERSION 3	/* ... with N >= this serve the PROC_* frames and EXEC's
					   DETACHED and PTY flags */
#define AGENT_WATCH_MIN_VERSION 4	/* ... with N >= this serve the WATCH_* frames */
#define AGENT_WATCH_WAIT_MAX_MS 30000	/* WATCH_READ: longest wait for an event */
#define AGENT_MAX_TAG 64		/* bytes of a process's tag */
#define AGENT_PROC_STDIN_MAX 65536	/* bytes of one PROC_STDIN frame's data */

enum agent_type {
	/* host -> guest */
	AGENT_T_HELLO = 0x01,		/* u16 host version */
	AGENT_T_EXEC = 0x02,		/* see vmm/guest/agent/exec.c; [str user] ends it */
	AGENT_T_FILE_WRITE = 0x03,	/* str path, u32 mode, [str user]; FILE_DATA* and FILE_END follow */
	AGENT_T_FILE_READ = 0x04,	/* str path, [str user] */
	AGENT_T_SET_IDENTITY = 0x05,	/* see struct agent_identity_msg */
	AGENT_T_CANCEL = 0x06,		/* (empty) abort request `id`: kill an exec, drop a write */
	AGENT_T_GROW_ROOT = 0x07,	/* u64 min disk bytes, u32 wait ms: grow the root fs online */
	AGENT_T_PORT_OPEN = 0x08,	/* u16 port: a TCP stream to 127.0.0.1:port; OK or ERROR */
	/* version 3 (AGENT_PROCS_MIN_VERSION): detached processes, by pid */
	AGENT_T_PROC_ATTACH = 0x09,	/* u32 pid, u8 replay: OK(u64 dropped bytes), then output, EXIT */
	AGENT_T_PROC_LIST = 0x0a,	/* (empty): PROC_ENTRY per process, then OK(u64 count) */
	AGENT_T_PROC_SIGNAL = 0x0b,	/* u32 pid, u32 signo (1..64): OK or ERROR */
	AGENT_T_PROC_STDIN = 0x0c,	/* u32 pid, u8 eof, bytes data: OK or ERROR */
	AGENT_T_PROC_RESIZE = 0x0d,	/* u32 pid, u16 rows, u16 cols (a PTY's): OK or ERROR */
	/* version 4 (AGENT_WATCH_MIN_VERSION): directory watches (inotify), by watch id */
	AGENT_T_WATCH_ADD = 0x0e,	/* u8 recursive, str path, [str user]: OK(u64 watch id) */
	AGENT_T_WATCH_READ = 0x0f,	/* u32 watch id, u32 wait ms: WATCH_EVENTS when events are
					   queued or the wait is over, or ERROR */
	AGENT_T_WATCH_REMOVE = 0x15,	/* u32 watch id: OK or ERROR */
	/* both directions */
	AGENT_T_FILE_DATA = 0x10,	/* raw bytes of the file */
	AGENT_T_FILE_END = 0x11,	/* host->guest: commit the write (empty); guest->host: u64 size */
	AGENT_T_STREAM_DATA = 0x12,	/* raw bytes of a port stream, within the peer's window */
	AGENT_T_STREAM_WINDOW = 0x13,	/* u32 bytes of STREAM_DATA consumed: the peer may send more */
	AGENT_T_STREAM_END = 0x14,	/* (empty) the sender's direction of the stream ended */
	/* guest -> host */
	AGENT_T_HELLO_OK = 0x81,	/* see struct agent_hello_msg */
	AGENT_T_OK = 0x82,		/* u64 value (bytes written; 0 otherwise) */
	AGENT_T_ERROR = 0x83,		/* u32 enum agent_status, u32 errno, str message */
	AGENT_T_STDOUT = 0x84,		/* raw bytes */
	AGENT_T_STDERR = 0x85,		/* raw bytes */
	AGENT_T_EXIT = 0x86,		/* see struct agent_exit_msg */
	AGENT_T_PROC_ENTRY = 0x87,	/* see struct agent_proc_entry_msg */
	AGENT_T_WATCH_EVENTS = 0x88,	/* see struct agent_watch_events_msg */
};

/* HELLO flags */
#define AGENT_HELLO_F_NEW_SESSION 0x0001	/* first HELLO of a connection: drop older requests */

/* EXEC flags */
#define AGENT_EXEC_F_SHELL 0x0001	/* argv has one entry: code for /bin/sh -c */
/*
 * Version 3. With either flag the payload ends with a trailer every field of which is present:
 * str user (empty: root), str tag (<= AGENT_MAX_TAG, may be empty), u16 rows, u16 cols (both
 * 1..AGENT_MAX_PTY_DIM with PTY, 0 otherwise).
 */
#define AGENT_EXEC_F_DETACHED 0x0002	/* the process outlives the request: OK(u64 pid) at once, its
					   output kept in a ring for PROC_ATTACH */
#define AGENT_EXEC_F_PTY 0x0004		/* on a pseudo-terminal of rows x cols; needs DETACHED */
#define AGENT_MAX_PTY_DIM 1000		/* rows or columns of a PTY */

/* Error statuses in an ERROR frame. */
enum agent_status {
	AGENT_S_INVALID = 1,	/* a field out of range: relative path, bad hostname */
	AGENT_S_NOT_FOUND = 2,	/* a path (or its parent) does not exist */
	AGENT_S_IO = 3,		/* an I/O error in the guest */
	AGENT_S_TOO_LARGE = 4,	/* over a cap */
	AGENT_S_PROTO = 5,	/* a malformed frame; with id 0 the session is over */
	AGENT_S_BUSY = 6,	/* too many requests at once */
	AGENT_S_EXISTS = 7,	/* the id is already in use */
	AGENT_S_INTERNAL = 8,	/* anything else */
	AGENT_S_DENIED = 9,	/* the user the request runs as may not do it (EACCES, EPERM) */
	AGENT_S_REFUSED = 10,	/* PORT_OPEN: nothing listens on the port */
	AGENT_S_TAKEN_OVER = 11,	/* PROC_ATTACH: a later attach took the process's output over */
};

struct agent_hdr {
	uint8_t version;
	uint8_t type;
	uint16_t flags;
	uint32_t id;
	uint32_t len;	/* payload bytes */
};

/* A view into a received payload: `p` is not owned and not NUL-terminated unless said. */
struct agent_bytes {
	const uint8_t *p;
	uint32_t len;
};

/* Bounded payload reader: a failed read sets `bad` and every later read fails too. */
struct agent_rd {
	const uint8_t *p;
	size_t len;
	size_t off;
	bool bad;
};

/*
 * Bounded payload writer over a caller's buffer of `cap` bytes. With p == NULL it only counts,
 * so a caller can size a buffer first. Writing past `cap` sets `overflow` and writes nothing.
 */
struct agent_wr {
	uint8_t *p;
	size_t cap;
	size_t len;
	bool overflow;
};

/* Messages, decoded; every string points into the payload it came from. */
struct agent_hello_msg {
	uint16_t version;
	struct agent_bytes kernel_release;	/* text */
	struct agent_bytes boot_id;		/* text */
	struct agent_bytes agent_version;	/* text */
	uint64_t uptime_ms;
};

struct agent_exit_msg {
	int32_t exit_code;	/* 0..255 as a shell reports: 128+N when killed by signal N */
	uint32_t signal;	/* the signal that ended the process, 0 if it exited */
	bool timed_out;
	uint64_t duration_ms;
};

/* One process of a PROC_LIST reply (PROC_ENTRY). */
struct agent_proc_entry_msg {
	uint32_t pid;
	uint8_t running;		/* 1 while it runs, 0 once it ended */
	uint8_t pty;			/* 1 for a PTY process */
	int32_t exit_code;		/* as agent_exit_msg; -1 while it runs */
	struct agent_bytes tag;		/* text */
	struct agent_bytes cwd;		/* text */
	uint32_t argc;			/* argv: argc text strings from argv_at */
	struct agent_bytes argv_raw;	/* the argc strings, each u32 length + bytes */
	uint32_t envc;			/* names of the env it was given (no values) */
	struct agent_bytes env_raw;	/* the envc names, each u32 length + bytes */
};

/* Event types of a watch: E2B's (envd's EventType) numbers. */
enum agent_watch_event {
	AGENT_WATCH_CREATE = 1,	/* IN_CREATE, IN_MOVED_TO */
	AGENT_WATCH_WRITE = 2,	/* IN_MODIFY */
	AGENT_WATCH_REMOVE = 3,	/* IN_DELETE */
	AGENT_WATCH_RENAME = 4,	/* IN_MOVED_FROM */
	AGENT_WATCH_CHMOD = 5,	/* IN_ATTRIB */
};

/* WATCH_EVENTS flags */
#define AGENT_WATCH_F_DROPPED 0x01	/* events were dropped since the last read (a full queue) */
#define AGENT_WATCH_F_ENDED 0x02	/* the watch is over (its directory went away): these are
					   its last events */
#define AGENT_WATCH_MAX_EVENTS 256	/* events of one WATCH_EVENTS frame, at most */

/*
 * WATCH_EVENTS: u8 flags, u32 count, count x (u8 type, str name). A name is relative to the
 * watched directory ("sub/file" below a subdirectory of a recursive watch), never empty.
 */
struct agent_watch_events_msg {
	uint8_t flags;
	uint32_t count;			/* <= AGENT_WATCH_MAX_EVENTS */
	struct agent_bytes events_raw;	/* the count events, checked */
};

struct agent_error_msg {
	uint32_t status;	/* enum agent_status; other values are possible from a bad guest */
	uint32_t sys_errno;
	struct agent_bytes message;	/* text */
};

/* Encodes `h` (magic included) into `out`. */
void agent_hdr_encode(const struct agent_hdr *h, uint8_t out[AGENT_HDR_SIZE]);

/*
 * Decodes and validates a header: magic, version, a known type, len <= AGENT_MAX_PAYLOAD.
 * Returns 0, or -EPROTO (bad magic/version/type) or -EMSGSIZE (len over the cap).
 */
int agent_hdr_decode(const uint8_t in[AGENT_HDR_SIZE], struct agent_hdr *h);

/* True when a guest may send frames of `type`, resp. when a host may. */
bool agent_type_from_guest(uint8_t type);
bool agent_type_from_host(uint8_t type);

/*
 * Incremental frame decoder for a byte stream. Feed it whatever arrived; it returns each frame
 * once whole. Holds at most one header and one payload, so its memory is bounded by the cap.
 */
struct agent_decoder {
	uint8_t hdr_buf[AGENT_HDR_SIZE];
	size_t hdr_have;
	struct agent_hdr hdr;
	uint8_t *payload;	/* caller-provided buffer of AGENT_MAX_PAYLOAD bytes */
	size_t payload_have;
	int error;		/* sticky: once set, the stream cannot be trusted again */
};

/* Prepares `d` to decode into `payload_buf`, which holds AGENT_MAX_PAYLOAD bytes. */
void agent_decoder_init(struct agent_decoder *d, uint8_t *payload_buf);

/*
 * Consumes up to `n` bytes of `in`, storing in *used how many it took. Returns 1 when a whole
 * frame is ready (header in d->hdr, payload in d->payload; valid until the next call), 0 when it
 * needs more bytes, or a negative errno from agent_hdr_decode (sticky).
 */
int agent_decoder_feed(struct agent_decoder *d, const uint8_t *in, size_t n, size_t *used);

/* Reader and writer primitives. */
void agent_rd_init(struct agent_rd *r, const void *p, size_t len);
uint8_t agent_rd_u8(struct agent_rd *r);
uint16_t agent_rd_u16(struct agent_rd *r);
uint32_t agent_rd_u32(struct agent_rd *r);
uint64_t agent_rd_u64(struct agent_rd *r);
/* A byte string of at most `max` bytes. */
struct agent_bytes agent_rd_bytes(struct agent_rd *r, uint32_t max);
/* A text string of at most `max` bytes that holds no NUL. */
struct agent_bytes agent_rd_text(struct agent_rd *r, uint32_t max);
/* True when the whole payload was read without error. */
bool agent_rd_done(const struct agent_rd *r);

void agent_wr_init(struct agent_wr *w, void *p, size_t cap);
void agent_wr_u8(struct agent_wr *w, uint8_t v);
void agent_wr_u16(struct agent_wr *w, uint16_t v);
void agent_wr_u32(struct agent_wr *w, uint32_t v);
void agent_wr_u64(struct agent_wr *w, uint64_t v);
void agent_wr_bytes(struct agent_wr *w, const void *p, size_t len);
/* A NUL-terminated string written as a byte string without the NUL. */
void agent_wr_str(struct agent_wr *w, const char *s);
void agent_wr_raw(struct agent_wr *w, const void *p, size_t len);

/* Payload decoders for the guest's replies. Each returns 0 or -EBADMSG. */
int agent_parse_hello_ok(const uint8_t *p, size_t len, struct agent_hello_msg *m);
int agent_parse_exit(const uint8_t *p, size_t len, struct agent_exit_msg *m);
int agent_parse_error(const uint8_t *p, size_t len, struct agent_error_msg *m);
/*
 * PROC_ENTRY: u32 pid, u8 running, u8 pty, u32 exit code (as two's complement, -1 while it runs),
 * str tag, str cwd, u32 argc, argc x str, u32 envc, envc x str (env names). Checks every string
 * (text, bounded, argc <= AGENT_MAX_ARGS, envc <= AGENT_MAX_ENV); 0 or -EBADMSG.
 */
int agent_parse_proc_entry(const uint8_t *p, size_t len, struct agent_proc_entry_msg *m);
/*
 * The next string of a list checked by agent_parse_proc_entry (argv_raw or env_raw), read with
 * `r` initialised over that list. Never fails on a list the parser accepted.
 */
struct agent_bytes agent_list_next(struct agent_rd *r);
/* WATCH_EVENTS: checks every event (a known type, a text name of 1..AGENT_MAX_PATH bytes). */
int agent_parse_watch_events(const uint8_t *p, size_t len, struct agent_watch_events_msg *m);
/* The next event of events_raw, read with `r` initialised over it; returns its type. */
uint8_t agent_watch_next(struct agent_rd *r, struct agent_bytes *name);
/* OK and the guest's FILE_END carry one u64. */
int agent_parse_u64(const uint8_t *p, size_t len, uint64_t *v);
/* STREAM_WINDOW and PORT_OPEN's port: one u32, resp. one u16. */
int agent_parse_u32(const uint8_t *p, size_t len, uint32_t *v);
int agent_parse_u16(const uint8_t *p, size_t len, uint16_t *v);

/*
 * The major version of an agent version string "kiln-agent/N" (HELLO_OK), or 0 when it has
 * another form. PORT_OPEN needs AGENT_PORT_STREAMS_MIN_VERSION.
 */
unsigned agent_version_major(const char *agent_version);

/*
 * True when `path` (len bytes, no NUL inside) is acceptable to the agent: absolute, at most
 * AGENT_MAX_PATH bytes, not empty.
 */
bool agent_path_ok(const char *path, size_t len);

/* True when `name` is a valid hostname label sequence: [A-Za-z0-9-.], 1..63 bytes. */
bool agent_hostname_ok(const char *name, size_t len);

/* True when `kv` is an environment entry "NAME=value" with a non-empty name and no NUL. */
bool agent_env_ok(const char *kv, size_t len);

/*
 * True when `name` is an acceptable user name: 1..AGENT_MAX_USER bytes of [A-Za-z0-9_.-], the first
 * one a letter or '_'. The same rule as the gateway's (api/apireq.c apireq_user).
 */
bool agent_user_ok(const char *name, size_t len);

/*
 * Reads the optional `user` field that ends EXEC, FILE_WRITE and FILE_READ payloads. Nothing left
 * in `r` means root (the frames of hosts that predate the field): *user is then empty. Otherwise a
 * text string passing agent_user_ok. Returns false, with `r` marked bad, for anything else.
 */
bool agent_rd_user(struct agent_rd *r, struct agent_bytes *user);

#endif
