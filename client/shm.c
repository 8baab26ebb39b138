/*
 * shm — the client's shared memory: the segment bulk tensors cross through
 * (kvb_shared_buffer), the regions that hold a node's own buffers
 * (kvb_region_alloc), and the descriptor hand-off from the daemon that maps them.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "client/client_impl.h"
#include "proto/fdsock.h"

void kvbc_shm_unmap(kvb_client *c, bool tell)
{
	if (!c->shm_base)
		return;
	munmap(c->shm_base, c->shm_size);
	if (tell) {
		struct call k = { .req = { .op = KVBP_OP_SHM_DETACH, .has_shm = true,
					   .shm_id = c->shm_id } };

		kvbc_call(c, &k);
		kvbc_call_done(&k);
	}
	c->shm_base = NULL;
	c->shm_size = 0;
	c->shm_id = 0;
}
int kvb_device_handle_from_fds(kvb_client *c, const int *fds, const uint64_t *offsets,
			       const uint64_t *sizes, size_t n, uint8_t handle[64])
{
	static const char *const why[] = {
		[1] = "the daemon cannot keep it", [2] = "no descriptor arrived",
		[3] = "it is one of kvblendd's own segments",
		[4] = "this process has handed in 16 already",
		[5] = "the daemon holds 64 from all clients already",
		[6] = "the segments' places are out of order, overlap, are not page-aligned, or "
		      "are too many",
	};
	struct call k = { .req = { .op = KVBP_OP_HELLO } };
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	struct timeval tv = { 2, 0 };
	char *ctl = NULL;
	uint8_t *req = NULL, rep[9];
	size_t req_len = 12 + 16 * n, ctl_len = CMSG_SPACE(n * sizeof(int));
	struct iovec iov;
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	struct cmsghdr *cm;
	uint64_t token = 0;
	ssize_t got = 0;
	int sock = -1, rc;

	if (!fds || !offsets || !sizes || !handle || !n || n > KVB_DEVICE_SEGMENTS_MAX)
		return kvbc_set_err(c, -EINVAL, "kvb_device_handle_from_fds: 1 to %d descriptors, "
				    "their places, and a handle to fill", KVB_DEVICE_SEGMENTS_MAX);
	for (size_t i = 0; i < n; i++)
		if (fds[i] < 0)
			return kvbc_set_err(c, -EINVAL, "kvb_device_handle_from_fds: descriptor %zu "
					    "is %d", i, fds[i]);
	req = calloc(1, req_len);
	ctl = calloc(1, ctl_len);
	if (!req || !ctl) {
		rc = kvbc_set_err(c, -ENOMEM, "out of memory");
		goto out;
	}
	rc = kvbc_call(c, &k);
	if (rc)
		goto out;
	if (!k.rep.shm_name[0] || strlen(k.rep.shm_name) >= sizeof(a.sun_path)) {
		rc = kvbc_set_err(c, -ENOTSUP, "kvblendd at %s takes no descriptors from this "
				  "client (not a local IPC client, or no shared memory)", c->endpoint);
		goto out;
	}
	strcpy(a.sun_path, k.rep.shm_name);
	/* the request (shm.h): the magic, the count, each descriptor's place; little-endian */
	for (int i = 0; i < 8; i++)
		req[i] = (uint8_t)(KVBP_DEPOSIT_REQUEST >> (8 * i));
	for (int i = 0; i < 4; i++)
		req[8 + i] = (uint8_t)((uint64_t)n >> (8 * i));
	for (size_t j = 0; j < n; j++)
		for (int i = 0; i < 8; i++) {
			req[12 + 16 * j + (size_t)i] = (uint8_t)(offsets[j] >> (8 * i));
			req[20 + 16 * j + (size_t)i] = (uint8_t)(sizes[j] >> (8 * i));
		}
	iov = (struct iovec){ req, req_len };
	mh.msg_control = ctl;
	mh.msg_controllen = ctl_len;
	cm = CMSG_FIRSTHDR(&mh);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(n * sizeof(int));
	memcpy(CMSG_DATA(cm), fds, n * sizeof(int));
	sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (sock < 0 || setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) ||
	    setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) ||
	    connect(sock, (struct sockaddr *)&a, sizeof(a)) ||
	    sendmsg(sock, &mh, MSG_NOSIGNAL) != (ssize_t)req_len) {
		rc = kvbc_set_err(c, -errno, "cannot hand the descriptors to kvblendd at %s: %s",
				  k.rep.shm_name, strerror(errno));
		goto out;
	}
	while (got < (ssize_t)sizeof(rep)) {
		ssize_t r = recv(sock, rep + got, sizeof(rep) - (size_t)got, 0);

		if (r <= 0)
			break;
		got += r;
		if (rep[0])
			break; /* refused: the status byte alone */
	}
	if (got < 1 || (!rep[0] && got < (ssize_t)sizeof(rep))) {
		rc = kvbc_set_err(c, -EIO, "kvblendd's descriptor socket %s did not answer",
				  k.rep.shm_name);
		goto out;
	}
	if (rep[0]) {
		rc = kvbc_set_err(c, rep[0] == 4 || rep[0] == 5 ? KVB_E_LIMIT : KVB_E_BAD_ARGUMENT,
				  "kvblendd refused the descriptors: %s",
				  rep[0] < sizeof(why) / sizeof(*why) && why[rep[0]] ? why[rep[0]]
										     : "refused");
		goto out;
	}
	for (int i = 8; i >= 1; i--)
		token = token << 8 | rep[i];
	memset(handle, 0, 64);
	snprintf((char *)handle, 64, "kvbfd:%016" PRIx64, token);
	rc = 0;
out:
	if (sock >= 0)
		close(sock);
	free(req);
	free(ctl);
	kvbc_call_done(&k);
	return rc;
}

int kvb_device_handle_from_fd(kvb_client *c, int fd, uint8_t handle[64])
{
	const uint64_t zero = 0;

	return kvb_device_handle_from_fds(c, &fd, &zero, &zero, 1, handle);
}

/* Make sure a segment of at least size bytes is mapped; false if shared memory is unusable. */
bool kvbc_shm_ensure(kvb_client *c, size_t size)
{
	struct call k = { .req = { .op = KVBP_OP_SHM_ATTACH } };
	size_t want;
	void *base;
	int fd, rc;
	struct stat st;

	if (!c->shm_ok)
		return false;
	if (c->shm_base && c->shm_size >= size)
		return true;
	want = size > c->shm_initial ? size : c->shm_initial;
	want = (want + (1u << 20) - 1) & ~(size_t)((1u << 20) - 1);
	kvbc_shm_unmap(c, true);
	k.req.shm_size = want;
	rc = kvbc_call(c, &k);
	if (rc) {
		/* The daemon refuses this size (or any): fall back to frames for it. */
		if (rc != KVB_E_BAD_ARGUMENT && rc != KVB_E_LIMIT)
			c->shm_ok = false;
		kvbc_call_done(&k);
		return false;
	}
	fd = kvbp_segment_fd(k.rep.shm_name, k.rep.shm_id);
	if (fd < 0 || fstat(fd, &st) || (uint64_t)st.st_size < want) {
		if (fd >= 0)
			close(fd);
		c->shm_ok = false; /* e.g. another user without access: use the socket */
		kvbc_call_done(&k);
		return false;
	}
	base = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (base == MAP_FAILED) {
		c->shm_ok = false;
		kvbc_call_done(&k);
		return false;
	}
	c->shm_base = base;
	c->shm_size = want;
	c->shm_id = k.rep.shm_id;
	kvbc_call_done(&k);
	return true;
}

void *kvb_shared_buffer(kvb_client *c, size_t size)
{
	return kvbc_shm_ensure(c, size) ? c->shm_base : NULL;
}

bool kvbc_in_shm(const kvb_client *c, const void *p, size_t len)
{
	const uint8_t *b = c->shm_base, *q = p;

	return b && q >= b && len <= c->shm_size && (size_t)(q - b) <= c->shm_size - len;
}
/*
 * The daemon no longer knows our segment (it restarted, or let it expire): forget
 * it, so the next call attaches a new one. Data the caller placed in the old
 * segment is still mapped; a retry copies it again.
 */
bool kvbc_shm_lost(kvb_client *c, int rc, bool used_shm)
{
	if (rc != KVB_E_BAD_SHM || !used_shm || !c->shm_base)
		return false;
	if (c->n_lost == 8) {
		munmap(c->lost_base[0], c->lost_size[0]);
		memmove(c->lost_base, c->lost_base + 1, 7 * sizeof(void *));
		memmove(c->lost_size, c->lost_size + 1, 7 * sizeof(size_t));
		c->n_lost--;
	}
	c->lost_base[c->n_lost] = c->shm_base;
	c->lost_size[c->n_lost++] = c->shm_size;
	c->shm_base = NULL;
	c->shm_size = 0;
	c->shm_id = 0;
	return true;
}


int kvbc_map_segment(kvb_client *c, const char *path, uint64_t id, size_t size, int prot,
		     int flags, void **out)
{
	struct stat st;
	void *p;
	int fd = kvbp_segment_fd(path, id);

	if (fd < 0)
		return kvbc_set_err(c, -EACCES, "cannot fetch shared-memory segment %" PRIu64
				    " from %s", id, path);
	if (fstat(fd, &st) || (uint64_t)st.st_size < size) {
		close(fd);
		return kvbc_set_err(c, -EIO, "shared-memory segment %" PRIu64
				    " is smaller than %zu bytes", id, size);
	}
	p = mmap(NULL, size, prot, flags, fd, 0);
	close(fd);
	if (p == MAP_FAILED)
		return kvbc_set_err(c, -errno, "cannot map shared-memory segment: %s",
				    strerror(errno));
	*out = p;
	return 0;
}

void *kvb_region_alloc(kvb_client *c, size_t size)
{
	struct call k = { .req = { .op = KVBP_OP_SHM_ATTACH } };
	struct region *r = NULL;
	size_t page = (size_t)sysconf(_SC_PAGESIZE), want;
	void *base;

	for (unsigned i = 0; i < REGION_MAX && !r; i++)
		if (!c->regions[i].id)
			r = &c->regions[i];
	if (!r) {
		kvbc_set_err(c, -EMFILE, "this client holds %d regions already", REGION_MAX);
		return NULL;
	}
	if (!size || size > SIZE_MAX - REGION_HEAD - page) {
		kvbc_set_err(c, -EINVAL, "region of %zu bytes", size);
		return NULL;
	}
	if (strncmp(c->endpoint, "ipc://", 6)) {
		kvbc_set_err(c, -ENOTSUP, "regions are shared memory: only on ipc:// endpoints, "
			     "not %s", c->endpoint);
		return NULL;
	}
	want = (size + REGION_HEAD + page - 1) / page * page;
	k.req.shm_size = want;
	if (kvbc_call(c, &k) ||
	    kvbc_map_segment(c, k.rep.shm_name, k.rep.shm_id, want, PROT_READ | PROT_WRITE,
			     MAP_SHARED, &base)) {
		if (k.rep.shm_id) {
			struct call d = { .req = { .op = KVBP_OP_SHM_DETACH, .has_shm = true,
						   .shm_id = k.rep.shm_id } };

			kvbc_call_quiet(c, &d);
		}
		kvbc_call_done(&k);
		return NULL;
	}
	memset(r, 0, sizeof(*r));
	r->id = k.rep.shm_id;
	r->base = base;
	r->size = want;
	kvbc_call_done(&k);
	return r->base + REGION_HEAD;
}

int kvb_region_free(kvb_client *c, void *region)
{
	for (unsigned i = 0; i < REGION_MAX; i++) {
		struct region *r = &c->regions[i];
		struct call k = { .req = { .op = KVBP_OP_SHM_DETACH, .has_shm = true } };
		int rc;

		if (!r->id || (uint8_t *)region != r->base + REGION_HEAD)
			continue;
		k.req.shm_id = r->id;
		rc = kvbc_call(c, &k);
		kvbc_call_done(&k);
		munmap(r->base, r->size);
		memset(r, 0, sizeof(*r));
		/* A daemon that restarted no longer has it: unmapped here all the same. */
		return rc == KVB_E_BAD_SHM ? 0 : rc;
	}
	return kvbc_set_err(c, -EINVAL, "not a region of this client");
}

/* The region holding [p, p + len), or NULL. */
struct region *kvbc_region_of(kvb_client *c, const void *p, size_t len)
{
	const uint8_t *q = p;

	for (unsigned i = 0; i < REGION_MAX; i++) {
		struct region *r = &c->regions[i];

		if (r->id && q >= r->base && len <= r->size && (size_t)(q - r->base) <= r->size - len)
			return r;
	}
	return NULL;
}
