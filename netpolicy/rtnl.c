/*
 * rtnl.c - route netlink requests for a sandbox's network, and its namespace and TAP (see
 * rtnl.h). Each request asks for the kernel's acknowledgement and waits for it, so a call
 * returns once its change is made, as `ip` did.
 */
#include "netpolicy/rtnl.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/fib_rules.h>
#include <linux/if_tun.h>
#include <linux/nsfs.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/veth.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define RTNL_MSG_MAX 512	/* bytes: the largest request here, the veth pair, is about 100 */
#define NETNS_RUN_DIR "/run/netns"

struct rtnl_req {
	struct nlmsghdr h;
	char body[RTNL_MSG_MAX];
};

int rtnl_open(struct rtnl *r)
{
	struct sockaddr_nl sa = { .nl_family = AF_NETLINK };
	/* an answer that never comes fails the request instead of blocking its thread */
	struct timeval tmo = { .tv_sec = 5 };

	r->seq = 0;
	r->fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
	if (r->fd < 0)
		return -errno;
	if (setsockopt(r->fd, SOL_SOCKET, SO_RCVTIMEO, &tmo, sizeof(tmo)) < 0 ||
	    bind(r->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		int e = -errno;

		close(r->fd);
		r->fd = -1;
		return e;
	}
	return 0;
}

void rtnl_close(struct rtnl *r)
{
	if (r->fd >= 0)
		close(r->fd);
	r->fd = -1;
}

/* Starts request `type` with `flags` (plus the request and acknowledgement flags). */
static void *req_init(struct rtnl_req *q, uint16_t type, uint16_t flags, size_t hdr)
{
	memset(q, 0, sizeof(*q));
	q->h.nlmsg_len = NLMSG_LENGTH(hdr);
	q->h.nlmsg_type = type;
	q->h.nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK | flags;
	return NLMSG_DATA(&q->h);
}

/* Appends attribute `type` with `len` bytes of `data`; the request's buffer is sized for all. */
static struct rtattr *req_put(struct rtnl_req *q, uint16_t type, const void *data, size_t len)
{
	struct rtattr *a = (struct rtattr *)((char *)q + NLMSG_ALIGN(q->h.nlmsg_len));

	a->rta_type = type;
	a->rta_len = (unsigned short)RTA_LENGTH(len);
	if (len)
		memcpy(RTA_DATA(a), data, len);
	q->h.nlmsg_len = NLMSG_ALIGN(q->h.nlmsg_len) + RTA_ALIGN(a->rta_len);
	return a;
}

static void req_put_str(struct rtnl_req *q, uint16_t type, const char *s)
{
	req_put(q, type, s, strlen(s) + 1);
}

/* An attribute holding those appended until req_nest_end. */
static struct rtattr *req_nest(struct rtnl_req *q, uint16_t type)
{
	return req_put(q, type, NULL, 0);
}

static void req_nest_end(struct rtnl_req *q, struct rtattr *nest)
{
	nest->rta_len = (unsigned short)((char *)q + q->h.nlmsg_len - (char *)nest);
}

/* Sends `q` and waits for its acknowledgement: 0, or the kernel's negative errno. */
static int req_send(struct rtnl *r, struct rtnl_req *q)
{
	char buf[1024] __attribute__((aligned(NLMSG_ALIGNTO)));
	ssize_t got;

	q->h.nlmsg_seq = ++r->seq;
	if (send(r->fd, &q->h, q->h.nlmsg_len, 0) < 0)
		return -errno;
	for (;;) {
		int len;

		got = recv(r->fd, buf, sizeof(buf), MSG_TRUNC);
		if (got < 0 && errno == EINTR)
			continue;
		if (got < 0)
			return errno == EAGAIN || errno == EWOULDBLOCK ? -ETIMEDOUT : -errno;
		if ((size_t)got > sizeof(buf))
			return -EMSGSIZE;	/* cut short: its acknowledgement may be lost with it */
		len = (int)got;
		for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, len);
		     h = NLMSG_NEXT(h, len)) {
			if (h->nlmsg_seq != r->seq || h->nlmsg_type != NLMSG_ERROR)
				continue;
			return ((struct nlmsgerr *)NLMSG_DATA(h))->error;
		}
	}
}

int rtnl_veth_add(struct rtnl *r, const char *name, const char *peer, int peer_netns_fd)
{
	struct rtnl_req q;
	struct rtattr *info, *data, *pa;
	struct ifinfomsg *peer_ifi;
	uint32_t fd = (uint32_t)peer_netns_fd;

	req_init(&q, RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, sizeof(struct ifinfomsg));
	req_put_str(&q, IFLA_IFNAME, name);
	info = req_nest(&q, IFLA_LINKINFO);
	req_put_str(&q, IFLA_INFO_KIND, "veth");
	data = req_nest(&q, IFLA_INFO_DATA);
	/* the peer: an ifinfomsg of its own, then its attributes */
	pa = req_nest(&q, VETH_INFO_PEER);
	peer_ifi = (struct ifinfomsg *)((char *)&q + q.h.nlmsg_len);
	memset(peer_ifi, 0, sizeof(*peer_ifi));
	q.h.nlmsg_len += NLMSG_ALIGN(sizeof(*peer_ifi));
	req_put_str(&q, IFLA_IFNAME, peer);
	req_put(&q, IFLA_NET_NS_FD, &fd, sizeof(fd));
	req_nest_end(&q, pa);
	req_nest_end(&q, data);
	req_nest_end(&q, info);
	return req_send(r, &q);
}

int rtnl_link_up(struct rtnl *r, int ifindex)
{
	struct rtnl_req q;
	struct ifinfomsg *ifi = req_init(&q, RTM_NEWLINK, 0, sizeof(*ifi));

	ifi->ifi_index = ifindex;
	ifi->ifi_flags = IFF_UP;
	ifi->ifi_change = IFF_UP;
	return req_send(r, &q);
}

int rtnl_link_set_mac(struct rtnl *r, int ifindex, const uint8_t mac[6])
{
	struct rtnl_req q;
	struct ifinfomsg *ifi = req_init(&q, RTM_NEWLINK, 0, sizeof(*ifi));

	ifi->ifi_index = ifindex;
	req_put(&q, IFLA_ADDRESS, mac, 6);
	return req_send(r, &q);
}

int rtnl_addr_add(struct rtnl *r, int ifindex, int family, const uint8_t *addr, unsigned plen)
{
	struct rtnl_req q;
	struct ifaddrmsg *ifa = req_init(&q, RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, sizeof(*ifa));
	size_t len = family == AF_INET ? 4 : 16;

	ifa->ifa_family = (uint8_t)family;
	ifa->ifa_prefixlen = (uint8_t)plen;
	ifa->ifa_index = (uint32_t)ifindex;
	if (family == AF_INET6)
		ifa->ifa_flags = IFA_F_NODAD;	/* the other end is ours: nothing to detect */
	req_put(&q, IFA_LOCAL, addr, len);
	req_put(&q, IFA_ADDRESS, addr, len);
	return req_send(r, &q);
}

int rtnl_route_default(struct rtnl *r, int family, const uint8_t *gw, int oif)
{
	struct rtnl_req q;
	struct rtmsg *rt = req_init(&q, RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, sizeof(*rt));
	uint32_t dev = (uint32_t)oif;

	rt->rtm_family = (uint8_t)family;
	rt->rtm_table = RT_TABLE_MAIN;
	rt->rtm_protocol = RTPROT_BOOT;
	rt->rtm_scope = RT_SCOPE_UNIVERSE;
	rt->rtm_type = RTN_UNICAST;
	req_put(&q, RTA_GATEWAY, gw, family == AF_INET ? 4 : 16);
	req_put(&q, RTA_OIF, &dev, sizeof(dev));
	return req_send(r, &q);
}

int rtnl_rule_fwmark(struct rtnl *r, int family, uint32_t mark, uint32_t table, bool add)
{
	struct rtnl_req q;
	struct fib_rule_hdr *fr = req_init(&q, add ? RTM_NEWRULE : RTM_DELRULE,
					   add ? NLM_F_CREATE | NLM_F_EXCL : 0, sizeof(*fr));

	fr->family = (uint8_t)family;
	fr->action = FR_ACT_TO_TBL;
	fr->table = table < 256 ? (uint8_t)table : RT_TABLE_UNSPEC;
	req_put(&q, FRA_TABLE, &table, sizeof(table));
	req_put(&q, FRA_FWMARK, &mark, sizeof(mark));
	return req_send(r, &q);
}

int rtnl_route_local_all(struct rtnl *r, int family, uint32_t table, int oif)
{
	struct rtnl_req q;
	struct rtmsg *rt = req_init(&q, RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE, sizeof(*rt));
	uint32_t dev = (uint32_t)oif;

	rt->rtm_family = (uint8_t)family;
	rt->rtm_table = table < 256 ? (uint8_t)table : RT_TABLE_UNSPEC;
	rt->rtm_protocol = RTPROT_BOOT;
	rt->rtm_scope = RT_SCOPE_HOST;
	rt->rtm_type = RTN_LOCAL;
	req_put(&q, RTA_TABLE, &table, sizeof(table));
	req_put(&q, RTA_OIF, &dev, sizeof(dev));
	return req_send(r, &q);
}

int rtnl_tap_add(const char *name, uid_t owner)
{
	struct ifreq ifr = { .ifr_flags = IFF_TAP | IFF_NO_PI | IFF_TUN_EXCL };
	int fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC), e = 0;

	if (fd < 0)
		return -errno;
	snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", name);
	/* the device lives in the namespace the descriptor was opened in: this thread's */
	if (ioctl(fd, TUNSETIFF, &ifr) < 0 ||
	    (owner != (uid_t)-1 && ioctl(fd, TUNSETOWNER, (unsigned long)owner) < 0) ||
	    ioctl(fd, TUNSETPERSIST, 1UL) < 0)
		e = -errno;
	close(fd);
	return e;
}

/*
 * Makes /run/netns a mount point with shared propagation, once, under a lock of the directory
 * (`ip netns add` does the same, under the same lock: concurrent first uses would otherwise
 * stack bind mounts on each other).
 */
static int netns_run_dir_shared(void)
{
	bool made = false;
	int lock, e = 0;

	if (mkdir(NETNS_RUN_DIR, 0755) < 0 && errno != EEXIST)
		return -errno;
	lock = open(NETNS_RUN_DIR, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (lock >= 0)
		flock(lock, LOCK_EX);
	while (mount("", NETNS_RUN_DIR, "none", MS_SHARED | MS_REC, NULL) < 0) {
		if (errno != EINVAL || made) {
			e = -errno;
			break;
		}
		if (mount(NETNS_RUN_DIR, NETNS_RUN_DIR, "none", MS_BIND | MS_REC, NULL) < 0) {
			e = -errno;
			break;
		}
		made = true;
	}
	if (lock >= 0) {
		flock(lock, LOCK_UN);
		close(lock);
	}
	return e;
}

int rtnl_netns_add(const char *path)
{
	int saved, fd, ns = -1, e;

	if ((e = netns_run_dir_shared()) < 0)
		return e;
	fd = open(path, O_RDONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	close(fd);
	saved = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
	if (saved < 0) {
		e = -errno;
		unlink(path);
		return e;
	}
	/* a namespace of this thread only, bound to the file, then the thread goes back */
	if (unshare(CLONE_NEWNET) < 0) {
		e = -errno;
		close(saved);
		unlink(path);
		return e;
	}
	if (mount("/proc/thread-self/ns/net", path, "none", MS_BIND, NULL) < 0)
		e = -errno;
	else if ((ns = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC)) < 0)
		e = -errno;
	if (setns(saved, CLONE_NEWNET) < 0)
		abort();	/* in a namespace of its own for good: nothing sane to go on with */
	close(saved);
	if (e < 0) {
		umount2(path, MNT_DETACH);
		unlink(path);
		return e;
	}
	return ns;
}

int rtnl_netns_bind(const char *from, const char *path)
{
	char src[64];
	int fd, ns, e;

	if ((e = netns_run_dir_shared()) < 0)
		return e;
	fd = open(from, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	if (ioctl(fd, NS_GET_NSTYPE) != CLONE_NEWNET) {
		close(fd);
		return -EINVAL;
	}
	/* bound from the descriptor checked, not from the name again */
	snprintf(src, sizeof(src), "/proc/self/fd/%d", fd);
	ns = open(path, O_RDONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0);
	if (ns < 0) {
		e = -errno;
		close(fd);
		return e;
	}
	close(ns);
	e = mount(src, path, "none", MS_BIND, NULL) < 0 ? -errno : 0;
	close(fd);
	if (e == 0 && (ns = open(path, O_RDONLY | O_CLOEXEC)) < 0)
		e = -errno;
	if (e < 0) {
		umount2(path, MNT_DETACH);
		unlink(path);
		return e;
	}
	return ns;
}

int rtnl_netns_unbind(const char *path)
{
	/* EINVAL: not a mount point (a file left by a bind that failed half way): unlinked anyway */
	if (umount2(path, MNT_DETACH) < 0 && errno != EINVAL)
		return -errno;
	return unlink(path) < 0 ? -errno : 0;
}
