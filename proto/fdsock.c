/* fdsock — the asking side of the daemon's descriptor socket; see fdsock.h. */
#include "proto/fdsock.h"

#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

int kvbp_segment_fd(const char *path, uint64_t id)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	struct timeval tv = { 2, 0 };
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} u;
	uint8_t req[8], status = 1;
	struct iovec iov = { &status, 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf) };
	struct cmsghdr *cm;
	int sock, fd = -1;

	if (strlen(path) >= sizeof(a.sun_path))
		return -1;
	strcpy(a.sun_path, path);
	sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (sock < 0)
		return -1;
	for (int i = 0; i < 8; i++)
		req[i] = (uint8_t)(id >> (8 * i));
	setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	memset(&u, 0, sizeof(u));
	if (connect(sock, (struct sockaddr *)&a, sizeof(a)) ||
	    send(sock, req, sizeof(req), MSG_NOSIGNAL) != (ssize_t)sizeof(req) ||
	    recvmsg(sock, &mh, MSG_CMSG_CLOEXEC) != 1)
		goto out;
	cm = CMSG_FIRSTHDR(&mh);
	if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS &&
	    cm->cmsg_len == CMSG_LEN(sizeof(int)))
		memcpy(&fd, CMSG_DATA(cm), sizeof(int));
	if (status != 0 && fd >= 0) {
		close(fd);
		fd = -1;
	}
out:
	close(sock);
	return fd;
}
