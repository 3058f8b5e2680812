/*
 * agent.h - the host's client for kiln-agent, the program that runs inside each guest.
 *
 * QEMU exposes the guest's virtio-serial port "kiln.agent" as a Unix socket (a chardev socket in
 * server mode); agent_connect() connects to it and starts one reader thread that sorts the guest's
 * frames by request id. Every call below blocks its caller until the request ends, and any number
 * of threads may call at once on one `struct agent` (several execs run side by side in the guest).
 *
 * Every byte from the guest is hostile input: frames are bounded (vmm/guest/agent_proto.h), each
 * field is validated, each wait has a timeout, and text from the guest is sanitised before it
 * reaches an error message. A guest that stops answering, closes the channel or breaks the protocol
 * gives KILN_E_SANDBOX_FAILED, and the connection is dead from then on (agent_alive() is false).
 * docs/agent-protocol.md describes the wire format.
 */
#ifndef KILN_VMM_AGENT_H
#define KILN_VMM_AGENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/err.h"

struct agent;

#define AGENT_DEFAULT_IO_TIMEOUT_MS 30000	/* a guest silent this long mid-transfer is dead */
#define AGENT_EXEC_GRACE_MS 10000	/* beyond an exec's own timeout before giving up on it */

struct agent_hello_info {
	unsigned version;		/* the agent's protocol version */
	char kernel_release[128];	/* the guest's `uname -r` */
	char boot_id[48];		/* /proc/sys/kernel/random/boot_id */
	char agent_version[48];
	uint64_t uptime_ms;		/* guest time since boot */
};

struct agent_exec_req {
	const char *const *argv;	/* NULL-terminated; ignored when `shell` is set */
	const char *shell;		/* shell code run with /bin/sh -c, or NULL */
	const char *const *env;		/* NULL-terminated "NAME=value" entries, or NULL */
	const char *cwd;		/* absolute path, or NULL for the user's home */
	const void *stdin_data;		/* bytes given to the command's stdin, or NULL */
	size_t stdin_len;		/* bytes; with the rest the request must fit one frame */
	uint32_t timeout_ms;		/* the guest kills the process group after it; 0: none */
	const char *user;		/* the guest's account to run as (agent_user_ok), NULL: root */
};

struct agent_exec_result {
	int exit_code;		/* 0..255; 127: program not found; 128+N: killed by signal N */
	int signal;		/* the signal that ended it, or 0 */
	bool timed_out;		/* killed because timeout_ms passed */
	uint64_t duration_ms;	/* measured by the guest */
	uint64_t stdout_bytes, stderr_bytes;
};

enum agent_stream { AGENT_STDOUT = 1, AGENT_STDERR = 2 };

/*
 * Receives one chunk of an exec's output as it arrives, on the caller's thread. Returns 0 to go
 * on; anything else kills the command and makes agent_exec() return KILN_E_IO.
 */
typedef int (*agent_output_fn)(void *ctx, enum agent_stream stream, const uint8_t *data,
			       size_t len);

/*
 * Supplies bytes of a file to write: fills up to `cap` bytes of `buf` and returns how many,
 * 0 at the end, or a negative errno.
 */
typedef long (*agent_source_fn)(void *ctx, uint8_t *buf, size_t cap);

/* Takes bytes of a file being read; returns 0 or a negative errno (which aborts the read). */
typedef int (*agent_sink_fn)(void *ctx, const uint8_t *data, size_t len);

struct agent_identity {
	const char *hostname;		/* [A-Za-z0-9.-], 1..63 bytes; NULL: unchanged */
	const char *sandbox_id;		/* printable, no spaces, <= 128 bytes; NULL: unchanged */
	uint64_t wall_clock_ns;		/* ns since the epoch to set the clock to; 0: unchanged */
	const void *entropy;		/* bytes mixed into the guest's kernel RNG, or NULL */
	size_t entropy_len;		/* 0, or 32..4096 bytes */
	const char *const *env;		/* NULL-terminated defaults for later execs (replace the old) */
};

/*
 * Connects to the agent socket at `sock_path`, retrying while it does not exist yet or refuses
 * (QEMU still starting) until `timeout_ms` passes. Does not wait for the guest: agent_hello()
 * does that. Returns a connection the caller frees with agent_free(), or NULL with `err` set
 * (KILN_E_UNAVAILABLE when nothing listens in time, KILN_E_INVALID for a path too long).
 */
struct agent *agent_connect(const char *sock_path, int timeout_ms, struct kiln_error *err);

/* The same over an already connected stream socket, whose ownership it takes (also on failure). */
struct agent *agent_open_fd(int fd, struct kiln_error *err);

/* False once the guest closed the channel, broke the protocol or stopped answering. */
bool agent_alive(struct agent *a);

/*
 * Health check and handshake: waits up to `timeout_ms` for the agent's answer (use the boot time
 * on the first call). Fills `out` (may be NULL). KILN_E_SANDBOX_FAILED when no valid answer came.
 * The first hello of a connection also tells the agent a new host session began: anything an
 * earlier connection left running in the guest is killed. Call it before any other request.
 */
enum kiln_err agent_hello(struct agent *a, int timeout_ms, struct agent_hello_info *out,
			  struct kiln_error *err);

/*
 * Runs a command in the guest and waits for it, passing its output to `on_output` (may be NULL
 * to drop it) chunk by chunk as it comes. KILN_OK means the command ran and ended: see
 * `res->exit_code` and `res->timed_out` (a missing program is exit 127 with a message on
 * stderr). KILN_E_INVALID for a bad request (relative cwd, empty argv, bad env entry, a user the
 * guest does not have),
 * KILN_E_NOT_FOUND when cwd does not exist, KILN_E_TOO_LARGE when the request exceeds a frame,
 * KILN_E_RATE_LIMITED when the guest runs too many execs already, KILN_E_SANDBOX_FAILED when the
 * guest stops answering (no EXIT within timeout_ms + AGENT_EXEC_GRACE_MS).
 */
enum kiln_err agent_exec(struct agent *a, const struct agent_exec_req *req,
			 agent_output_fn on_output, void *ctx, struct agent_exec_result *res,
			 struct kiln_error *err);

/*
 * Writes a file in the guest from `source`, streamed in chunks (never held whole), at most
 * `max_bytes` (KILN_E_TOO_LARGE beyond). The guest writes a temporary file and renames it over
 * `path` once all bytes arrived; `mode` is the permission bits (0: 0644). KILN_E_INVALID for a
 * relative path or a directory, KILN_E_NOT_FOUND when the parent directory does not exist,
 * KILN_E_IO for the source's or the guest's I/O errors.
 */
enum kiln_err agent_file_write(struct agent *a, const char *path, uint32_t mode,
			       agent_source_fn source, void *ctx, uint64_t max_bytes,
			       struct kiln_error *err);

/*
 * agent_file_write() for the guest's account `user` (NULL: root): the file is created with its
 * identity and belongs to it. KILN_E_INVALID also for a user the guest does not have,
 * KILN_E_FORBIDDEN when the user may not write there.
 */
enum kiln_err agent_file_write_as(struct agent *a, const char *path, uint32_t mode,
				  const char *user, agent_source_fn source, void *ctx,
				  uint64_t max_bytes, struct kiln_error *err);

/* agent_file_write() reading from descriptor `fd` until its end (the caller keeps `fd`). */
enum kiln_err agent_file_write_fd(struct agent *a, const char *path, uint32_t mode, int fd,
				  uint64_t max_bytes, struct kiln_error *err);

/*
 * Reads a file of the guest into `sink`, streamed, at most `max_bytes` (KILN_E_TOO_LARGE beyond;
 * the sink may have had part of it). Stores the size in *size (may be NULL). KILN_E_NOT_FOUND when
 * absent, KILN_E_INVALID for a relative path, a directory or a non-regular file.
 */
enum kiln_err agent_file_read(struct agent *a, const char *path, agent_sink_fn sink, void *ctx,
			      uint64_t max_bytes, uint64_t *size, struct kiln_error *err);

/*
 * agent_file_read() for the guest's account `user` (NULL: root), opened with its identity:
 * KILN_E_FORBIDDEN when the user may not read it, KILN_E_INVALID for a user the guest lacks.
 */
enum kiln_err agent_file_read_as(struct agent *a, const char *path, const char *user,
				 agent_sink_fn sink, void *ctx, uint64_t max_bytes, uint64_t *size,
				 struct kiln_error *err);

/* agent_file_read() writing to descriptor `fd` (the caller keeps `fd`). */
enum kiln_err agent_file_read_fd(struct agent *a, const char *path, int fd, uint64_t max_bytes,
				 uint64_t *size, struct kiln_error *err);

/*
 * Gives the guest its identity after a boot or a restore: hostname, sandbox id (also
 * KILN_SANDBOX_ID in later execs), clock, entropy, env defaults. KILN_E_INVALID for a bad field.
 */
enum kiln_err agent_set_identity(struct agent *a, const struct agent_identity *id,
				 struct kiln_error *err);

/*
 * Grows the guest's mounted root file system (ext4, online) to fill its disk, once the guest sees
 * that disk at `min_bytes` at least: the host has just made it that large (a new layer, a QMP
 * block_resize) and the guest learns of it asynchronously, so the agent waits up to `wait_ms`
 * (<= AGENT_MAX_GROW_WAIT_MS) for it. A file system that fills its disk already is left as it is.
 * Stores in *fs_bytes (may be NULL) the file system's size as df shows it. KILN_E_IO when the disk
 * does not reach `min_bytes` in time or the resize fails, KILN_E_TOO_LARGE when the guest's
 * kernel finds no room for the new metadata, KILN_E_INVALID when the root is not ext4,
 * KILN_E_SANDBOX_FAILED when the guest stops answering (no reply within wait_ms +
 * AGENT_GROW_GRACE_MS) or is an agent older than the request (its decoder refuses the type and
 * ends the session).
 */
#define AGENT_GROW_GRACE_MS 120000	/* beyond the wait, for the resize itself */
enum kiln_err agent_grow_root(struct agent *a, uint64_t min_bytes, uint32_t wait_ms,
			      uint64_t *fs_bytes, struct kiln_error *err);

/*
 * Port streams: a TCP connection to 127.0.0.1:`port` inside the guest, its bytes carried over the
 * agent's channel both ways with per-stream windows (docs/agent-protocol.md), so a slow reader
 * on either side slows that stream only. One thread may read while another writes; neither call
 * may run twice at once on one stream.
 */
struct agent_port;

/*
 * Opens a stream to `port`, waiting up to `timeout_ms` for the guest's connect. KILN_E_PORT_CLOSED
 * when nothing listens there, KILN_E_PORT_TIMEOUT when the connect did not finish in time,
 * KILN_E_RATE_LIMITED when the guest carries too many streams (64), KILN_E_NOT_IMPLEMENTED for an
 * agent older than port streams, KILN_E_SANDBOX_FAILED when the guest stops answering.
 */
enum kiln_err agent_port_open(struct agent *a, uint16_t port, int timeout_ms,
			      struct agent_port **out, struct kiln_error *err);

/*
 * Reads up to `cap` bytes the guest's server sent, waiting up to `timeout_ms` (-1: until some
 * come). Returns the bytes read, 0 when the server ended its side, -ETIMEDOUT, -ECONNRESET when
 * the guest's socket failed, -ECANCELED after agent_port_abort(), -EPIPE when the channel died.
 */
ssize_t agent_port_read(struct agent_port *p, void *buf, size_t cap, int timeout_ms);

/*
 * Sends all of `data` to the guest's server, waiting while the stream's window is full. Returns
 * 0, or -ECONNRESET, -ECANCELED, -EPIPE as agent_port_read().
 */
int agent_port_write(struct agent_port *p, const void *data, size_t len);

/* Ends the host's direction (the server reads EOF); reading goes on. 0 or -EPIPE. */
int agent_port_shutdown(struct agent_port *p);

/* From any thread: makes every wait of `p` return -ECANCELED (its peer went away). */
void agent_port_abort(struct agent_port *p);

/* Ends the stream (cancelling it in the guest unless both sides ended cleanly) and frees it. */
void agent_port_close(struct agent_port *p);

/*
 * Detached processes (agents of version 3, "kiln-agent/3", and later; an older agent gives
 * KILN_E_NOT_IMPLEMENTED without anything sent, since its decoder would end the session). A
 * process outlives the request that started it, until it ends, its timeout passes or a signal
 * kills it; the guest keeps its last AGENT_PROC_RING_BYTES of output for a later attach. Processes
 * are named by their pid in the guest. Each call below waits at most the io timeout for the
 * guest's answer (an attach: for its first answer) and gives KILN_E_NOT_FOUND for a pid the guest
 * does not keep.
 */
#define AGENT_PROC_RING_BYTES (1u << 20)	/* the guest's per-process output ring */
#define AGENT_PROC_MAX 32			/* processes a guest keeps, running or ended */
#define AGENT_PROC_STDIN_CHUNK 65536		/* bytes of one agent_proc_stdin() call, at most */
#define AGENT_PROC_PTY_MAX 1000			/* rows or columns of a PTY */

struct agent_proc_req {
	struct agent_exec_req exec;	/* stdin_data is the first stdin; timeout_ms its lifetime */
	const char *tag;		/* <= 64 bytes, no NUL; NULL: none */
	uint16_t rows, cols;		/* both 1..AGENT_PROC_PTY_MAX for a PTY, both 0 for pipes */
};

/*
 * Starts a detached process and stores its pid. Errors as agent_exec(), KILN_E_RATE_LIMITED also
 * when the guest keeps AGENT_PROC_MAX processes that all still run.
 */
enum kiln_err agent_proc_start(struct agent *a, const struct agent_proc_req *req, uint32_t *pid,
			       struct kiln_error *err);

/*
 * Streams process `pid`'s output to `on_output` until it ends, then fills `res` (duration and
 * byte counts as agent_exec's). With `replay` the output the guest kept comes first (*dropped
 * (may be NULL) is how many bytes of the process's output the guest had to drop before it); without,
 * only what comes next. On a second of silence `on_output` is called with len 0 so the caller may
 * stop (a client gone). When `on_output` returns non-zero the attach ends (KILN_E_IO) and the
 * process goes on. KILN_E_CONFLICT when a later attach took the process over.
 */
enum kiln_err agent_proc_attach(struct agent *a, uint32_t pid, bool replay,
				agent_output_fn on_output, void *ctx, uint64_t *dropped,
				struct agent_exec_result *res, struct kiln_error *err);

/* One process as agent_proc_list() reports it; everything valid during the callback only. */
struct agent_proc_info {
	uint32_t pid;
	bool running;
	bool pty;
	int exit_code;		/* -1 while it runs */
	const char *tag;	/* "" when none */
	const char *cwd;
	char **argv;		/* NULL-terminated, as run (shell code as /bin/sh -c CODE) */
	char **env_names;	/* NULL-terminated names of the env it was given */
};

/* Returns 0 to go on; anything else stops the listing (the call still reads the guest's reply). */
typedef int (*agent_proc_fn)(void *ctx, const struct agent_proc_info *p);

/* Lists the processes the guest keeps, running and ended, calling `fn` for each. */
enum kiln_err agent_proc_list(struct agent *a, agent_proc_fn fn, void *ctx, struct kiln_error *err);

/* Sends signal `signo` (1..64) to process `pid`'s process group. */
enum kiln_err agent_proc_signal(struct agent *a, uint32_t pid, int signo, struct kiln_error *err);

/*
 * Queues `len` (<= AGENT_PROC_STDIN_CHUNK) bytes for process `pid`'s stdin, then with `eof`
 * closes it (a PTY gets ^D instead). KILN_E_RATE_LIMITED when the process has too much unread
 * (256 KiB), KILN_E_INVALID when its stdin is closed.
 */
enum kiln_err agent_proc_stdin(struct agent *a, uint32_t pid, const void *data, size_t len,
			       bool eof, struct kiln_error *err);

/* Resizes process `pid`'s PTY. KILN_E_INVALID for a process without one. */
enum kiln_err agent_proc_resize(struct agent *a, uint32_t pid, uint16_t rows, uint16_t cols,
				struct kiln_error *err);

/*
 * Directory watches (agents of version 4, "kiln-agent/4", and later; an older agent gives
 * KILN_E_NOT_IMPLEMENTED without anything sent). A watch is inotify in the guest on a directory
 * (recursive: and every directory below it), as `user` (NULL: root), whose events the guest
 * queues until read. The guest holds at most AGENT_WATCH_MAX watches (KILN_E_RATE_LIMITED beyond)
 * and a bounded queue; a watch nobody reads for a minute, and every watch when the host
 * reconnects, ends (KILN_E_NOT_FOUND after).
 */
#define AGENT_WATCH_MAX 16
#define AGENT_WATCH_WAIT_MS_MAX 30000	/* longest wait of a read */

/* Adds a watch on directory `path`: KILN_E_NOT_FOUND missing, KILN_E_INVALID not a directory,
 * KILN_E_FORBIDDEN not readable by the user. */
enum kiln_err agent_watch_add(struct agent *a, const char *path, bool recursive, const char *user,
			      uint32_t *wid, struct kiln_error *err);

/* One event: `type` an enum agent_watch_event, `name` relative to the directory. 0 to go on. */
typedef int (*agent_watch_fn)(void *ctx, int type, const char *name);

/*
 * Reads watch `wid`'s queued events, waiting up to `wait_ms` (<= AGENT_WATCH_WAIT_MS_MAX) for the
 * first; none is not an error. *dropped: events were lost to a full queue; *ended: the directory
 * went away, these were its last events and the watch is gone.
 */
enum kiln_err agent_watch_read(struct agent *a, uint32_t wid, uint32_t wait_ms, agent_watch_fn fn,
			       void *ctx, bool *dropped, bool *ended, struct kiln_error *err);

/* Ends watch `wid`. */
enum kiln_err agent_watch_remove(struct agent *a, uint32_t wid, struct kiln_error *err);

/* Closes the connection, stops the reader thread and frees `a`. Accepts NULL. No call may be
 * running on `a`. */
void agent_free(struct agent *a);

#endif
