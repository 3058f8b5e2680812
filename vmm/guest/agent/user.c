/*
 * user.c - kiln-agent's users: the account an exec or a file transfer runs as.
 *
 * The agent runs as root. A request may name a user (agent_rd_user); the agent looks the name up in
 * the guest's own /etc/passwd and /etc/group (read directly with fgetpwent/fgetgrent, so the static
 * agent needs no NSS modules) and then either becomes that user for good in an exec's child, or
 * takes its file system identity (setfsuid, setfsgid and its groups) around the calls of a file
 * transfer, so the kernel checks the user's permissions and new files belong to it. The agent is
 * single-threaded, so the identity it takes for a moment is never seen by another request.
 */
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <string.h>
#include <sys/fsuid.h>
#include <unistd.h>

#include "agent.h"

/* Builtin root: what a request without a user runs as, whatever /etc/passwd says. */
static void user_root(struct agent_user *u)
{
	memset(u, 0, sizeof(*u));
	snprintf(u->name, sizeof(u->name), "root");
	snprintf(u->home, sizeof(u->home), "/root");
	snprintf(u->shell, sizeof(u->shell), "/bin/sh");
}

/* Adds `gid` to u's groups unless there already or full. */
static void add_group(struct agent_user *u, gid_t gid)
{
	for (int i = 0; i < u->cred.ngroups; i++)
		if (u->cred.groups[i] == gid)
			return;
	if (u->cred.ngroups < AGENT_MAX_GROUPS)
		u->cred.groups[u->cred.ngroups++] = gid;
}

int user_lookup(const struct agent_bytes *name, struct agent_user *u)
{
	struct passwd *pw;
	struct group *gr;
	FILE *f;
	int rc = -ENOENT;

	user_root(u);
	if (name->len == 0)
		return 0;
	if (name->len > AGENT_MAX_USER)
		return -EINVAL;
	memcpy(u->name, name->p, name->len);
	u->name[name->len] = '\0';
	f = fopen("/etc/passwd", "re");
	if (!f)
		return -errno;
	while ((pw = fgetpwent(f)) != NULL) {
		if (strcmp(pw->pw_name, u->name) != 0)
			continue;
		u->cred.uid = pw->pw_uid;
		u->cred.gid = pw->pw_gid;
		snprintf(u->home, sizeof(u->home), "%s", pw->pw_dir && pw->pw_dir[0] == '/' ? pw->pw_dir : "/");
		snprintf(u->shell, sizeof(u->shell), "%s",
			 pw->pw_shell && pw->pw_shell[0] ? pw->pw_shell : "/bin/sh");
		rc = 0;
		break;
	}
	fclose(f);
	if (rc < 0)
		return rc;
	/* initgroups without NSS: the primary group and every group naming the user */
	add_group(u, u->cred.gid);
	f = fopen("/etc/group", "re");
	if (f) {
		while ((gr = fgetgrent(f)) != NULL)
			for (char **m = gr->gr_mem; m && *m; m++)
				if (strcmp(*m, u->name) == 0)
					add_group(u, gr->gr_gid);
		fclose(f);
	}
	u->cred.switch_to = u->cred.uid != 0 || u->cred.gid != 0;
	return 0;
}

int user_become(const struct agent_cred *c)
{
	if (!c->switch_to)
		return 0;
	if (setgroups((size_t)c->ngroups, c->groups) < 0 || setgid(c->gid) < 0 || setuid(c->uid) < 0)
		return -errno;
	/* a process that can get root back is still root */
	if (setuid(0) == 0)
		return -EPERM;
	return 0;
}

static gid_t saved_groups[AGENT_MAX_GROUPS];
static int saved_ngroups = -1;	/* -1: no identity taken */

int user_fs_enter(const struct agent_cred *c)
{
	if (!c->switch_to)
		return 0;
	saved_ngroups = getgroups(AGENT_MAX_GROUPS, saved_groups);
	if (saved_ngroups < 0)
		saved_ngroups = 0;
	if (setgroups((size_t)c->ngroups, c->groups) < 0) {
		int e = errno;

		user_fs_leave(c);
		return -e;
	}
	setfsgid(c->gid);
	setfsuid(c->uid);
	/* setfs*id report no error: check that both took */
	if ((uid_t)setfsuid((uid_t)-1) != c->uid || (gid_t)setfsgid((gid_t)-1) != c->gid) {
		user_fs_leave(c);
		return -EPERM;
	}
	return 0;
}

void user_fs_leave(const struct agent_cred *c)
{
	if (!c->switch_to || saved_ngroups < 0)
		return;
	setfsuid(0);
	setfsgid(0);
	setgroups((size_t)saved_ngroups, saved_groups);
	saved_ngroups = -1;
}
