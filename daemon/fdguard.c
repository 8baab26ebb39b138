/* fdguard — accept() that survives EMFILE; see fdguard.h. */
#include "daemon/fdguard.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int spare = -1;
static atomic_uint_fast64_t dropped;

int fdguard_init(void)
{
	pthread_mutex_lock(&lock);
	if (spare < 0)
		spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
	pthread_mutex_unlock(&lock);
	return spare < 0 ? -errno : 0;
}

uint64_t fdguard_dropped(void)
{
	return atomic_load(&dropped);
}

/* Out of descriptors: take the pending connection with the spare one and drop it. */
static int drop_pending(int s)
{
	pthread_mutex_lock(&lock);
	if (spare >= 0) {
		int fd;

		close(spare);
		fd = (int)syscall(SYS_accept4, s, NULL, NULL, SOCK_CLOEXEC);
		if (fd >= 0)
			close(fd);
		spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
	}
	pthread_mutex_unlock(&lock);
	atomic_fetch_add(&dropped, 1);
	errno = ECONNABORTED;
	return -1;
}

/*
 * These replace the C library's for the whole process (libzmq's calls included):
 * the executable's definitions come first in symbol lookup.
 */
int accept4(int s, struct sockaddr *addr, socklen_t *len, int flags)
{
	int fd = (int)syscall(SYS_accept4, s, addr, len, flags);

	if (fd < 0 && (errno == EMFILE || errno == ENFILE))
		return drop_pending(s);
	return fd;
}

int accept(int s, struct sockaddr *addr, socklen_t *len)
{
	return accept4(s, addr, len, 0);
}
