/*
 * agent.h - kiln-agent's internals, shared by its files.
 *
 * kiln-agent runs in the guest as a child of init. main.c owns the session with the host (the
 * virtio-serial port, frame decoding, the bounded output queue, the poll loop) and the small
 * requests (HELLO, SET_IDENTITY); exec.c runs commands; files.c streams files in and out; ports.c
 * carries port streams to the guest's loopback. It is
 * single-threaded: every descriptor is non-blocking except regular files, and no step waits on the
 * host, so a slow host only stalls the bulk producers (child pipes, file reads), never the loop.
 */
#ifndef KILN_AGENT_INTERNAL_H
#define KILN_AGENT_INTERNAL_H

#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "agent_proto.h"

#define AGENT_VERSION_STRING "kiln-agent/4"	/* 2: port streams; 3: detached processes;
						   4: directory watches */
#define AGENT_MAX_PROCS 32	/* detached processes kept (running or ended), of the execs */
#define AGENT_PROC_RING (1u << 20)	/* bytes of output kept per detached process */
#define AGENT_PROC_STDIN_PENDING (256u << 10)	/* bytes of stdin a process may have unread */
#define AGENT_PROC_ENTRY_MAX 16384	/* bytes of one PROC_ENTRY: longer argv and env are cut */
#define AGENT_MAX_EXECS 64	/* concurrent execs */
#define AGENT_MAX_FILES 32	/* concurrent file transfers */
#define AGENT_MAX_PORTS 64	/* concurrent port streams */
#define AGENT_MAX_WATCHES 16	/* directory watches at once */
#define AGENT_WATCH_DIRS 4096	/* directories watched in all (recursive watches) */
#define AGENT_WATCH_QUEUE 4096	/* events queued, unread, in all watches */
#define AGENT_WATCH_IDLE_MS 60000	/* a watch nobody reads for this long ends */
#define AGENT_OUT_HIGH (2u << 20)	/* bytes queued for the host above which producers pause */
#define AGENT_OUT_MAX (AGENT_OUT_HIGH + 2 * (AGENT_HDR_SIZE + AGENT_MAX_PAYLOAD))	/* bytes */
#define AGENT_DRAIN_GRACE_MS 250	/* after exit, how long to wait for pipes held by others */
#define AGENT_MAX_ENV_DEFAULTS 256
/* the PATH of every exec that sets none: busybox's applets (build-image.sh) come last, so a
 * package installed later shadows them */
#define AGENT_BASE_PATH \
	"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/usr/local/lib/busybox"

struct session;

/* Milliseconds on CLOCK_MONOTONIC. */
uint64_t now_ms(void);

/*
 * Queues one frame for the host. Returns 0, or -ENOBUFS when the output queue is full (which the
 * producers' high-water checks make impossible for well-behaved callers).
 */
int session_send(struct session *s, uint8_t type, uint16_t flags, uint32_t id, const void *p,
		 size_t len);
/* Queues an ERROR frame with a printf-style message. */
void session_error(struct session *s, uint32_t id, enum agent_status st, int sys_errno,
		   const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* True when bulk producers may queue another chunk. */
bool session_has_room(const struct session *s);
/* The env entries SET_IDENTITY made the default for later execs (NULL-terminated). */
char *const *session_env_defaults(const struct session *s);

/* grow.c: GROW_ROOT (u64 min disk bytes, u32 wait ms) -> OK(u64 fs bytes) or ERROR */
void grow_root(struct session *s, uint32_t id, const uint8_t *p, size_t len);

/* exec.c */
void exec_start(struct session *s, uint32_t id, uint16_t flags, const uint8_t *p, size_t len);
void exec_cancel(uint32_t id);
bool exec_active(uint32_t id);
/* Adds the descriptors of running execs to `pfd` (at most `max`), returns how many. */
int exec_poll_fill(struct session *s, struct pollfd *pfd, int max);
/* Handles the poll results for the entries exec_poll_fill added. */
void exec_poll_done(struct session *s, struct pollfd *pfd, int n);
/* Reaps children (after SIGCHLD), enforces timeouts, sends EXIT frames. */
void exec_tick(struct session *s);
/* Milliseconds until the next exec deadline, or -1. */
int exec_next_timeout(void);
/* Kills every foreground exec and forgets it (the host went away); detached processes go on,
 * unattached. */
void exec_reset(void);
/* Kills every exec and process, detached ones too (the agent itself ends: --fd mode). */
void exec_shutdown(void);
/* PROC_* requests (version 3), each answered at once; ATTACH's output follows from exec_tick. */
void proc_attach(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void proc_list(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void proc_signal(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void proc_stdin(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void proc_resize(struct session *s, uint32_t id, const uint8_t *p, size_t len);

/* watch.c: WATCH_ADD, WATCH_READ (answered when events come or its wait ends), WATCH_REMOVE */
void watch_add(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void watch_read(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void watch_remove(struct session *s, uint32_t id, const uint8_t *p, size_t len);
/* Forgets the pending read `id` (CANCEL); true while `id` is a pending read. */
void watch_cancel(uint32_t id);
bool watch_active(uint32_t id);
/* The inotify descriptor while a watch exists (0 or 1 entry). */
int watch_poll_fill(struct session *s, struct pollfd *pfd, int max);
void watch_poll_done(struct session *s, struct pollfd *pfd, int n);
/* Answers reads whose wait is over, ends watches nobody reads. */
void watch_tick(struct session *s);
/* Milliseconds until watch_tick has something to do, or -1. */
int watch_next_timeout(void);
/* Ends every watch (the host went away). */
void watch_reset(void);

/* user.c */
#define AGENT_MAX_GROUPS 64	/* supplementary groups of a user */

/* The identity a request runs as. */
struct agent_cred {
	bool switch_to;		/* false for root: nothing to change */
	uid_t uid;
	gid_t gid;
	int ngroups;
	gid_t groups[AGENT_MAX_GROUPS];
};

struct agent_user {
	struct agent_cred cred;
	char name[AGENT_MAX_USER + 1];
	char home[AGENT_MAX_PATH + 1];
	char shell[256];
};

/*
 * Fills `u` for the user `name` (agent_rd_user's field): empty means root as the agent always ran
 * commands (HOME /root, SHELL /bin/sh); otherwise the account of that name in /etc/passwd with its
 * primary group and the groups of /etc/group that list it. Returns 0, -ENOENT for no such user, or
 * a negative errno when /etc/passwd cannot be read.
 */
int user_lookup(const struct agent_bytes *name, struct agent_user *u);
/* In an exec's child: becomes `c` for good (groups, gid, uid). 0 or a negative errno. */
int user_become(const struct agent_cred *c);
/*
 * Takes c's file system identity (groups, fsgid, fsuid) until user_fs_leave(c): the kernel checks
 * its permissions and files created meanwhile are its own. 0 or a negative errno (nothing taken).
 */
int user_fs_enter(const struct agent_cred *c);
void user_fs_leave(const struct agent_cred *c);

/* files.c */
void file_write_open(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void file_write_data(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void file_write_end(struct session *s, uint32_t id);
void file_read_open(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void file_cancel(uint32_t id);
bool file_active(uint32_t id);
/* Queues the next chunk of each file being read while the output queue has room. */
void file_pump(struct session *s);
/* True when some file read waits for room in the output queue. */
bool file_pending(void);
/* Drops every transfer (the host went away). */
void file_reset(void);

/* ports.c: PORT_OPEN and the STREAM_* frames of a port stream */
void port_open(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void port_data(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void port_window(struct session *s, uint32_t id, const uint8_t *p, size_t len);
void port_end(struct session *s, uint32_t id);
void port_cancel(uint32_t id);
bool port_active(uint32_t id);
/* Adds the sockets of port streams that wait for something to `pfd` (at most `max`). */
int port_poll_fill(struct session *s, struct pollfd *pfd, int max);
/* Handles the poll results for the entries port_poll_fill added. */
void port_poll_done(struct session *s, struct pollfd *pfd, int n);
/* Closes every stream (the host went away). */
void port_reset(void);

#endif
