/*
 * The systemd notification protocol end to end: kvblendd started with
 * NOTIFY_SOCKET pointing at this test's own datagram socket and a watchdog
 * interval must send READY=1 (after LMDB is open and the socket is bound: the
 * test connects right after it), WATCHDOG=1 pings, RELOADING=1 (with
 * MONOTONIC_USEC=) then READY=1 again on SIGHUP, and STOPPING=1 on SIGTERM, in
 * that order, and exit 0.
 */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "client/include/kvblend.h"

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Wait up to timeout_s for a datagram containing want; returns 1 if it came. */
static int wait_for(int fd, const char *want, double timeout_s, char *log, size_t loglen)
{
	double end = now_s() + timeout_s;

	while (now_s() < end) {
		char buf[512];
		struct timeval tv = { 0, 100000 };
		ssize_t n;

		setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
		n = recv(fd, buf, sizeof(buf) - 1, 0);
		if (n <= 0)
			continue;
		buf[n] = 0;
		strncat(log, buf, loglen - strlen(log) - 2);
		strcat(log, "|");
		if (strstr(buf, want))
			return 1;
	}
	return 0;
}

static void test_notify_order(void **state)
{
	char dir[] = "/tmp/kvb-notify-XXXXXX", sock_path[128], data[128], ep[160], log[8192] = "";
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	int fd, status;
	pid_t pid;

	(void)state;
	assert_non_null(mkdtemp(dir));
	snprintf(sock_path, sizeof(sock_path), "%s/notify", dir);
	snprintf(data, sizeof(data), "%s/data", dir);
	snprintf(ep, sizeof(ep), "ipc://%s/kvblend.sock", dir);
	fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	assert_true(fd >= 0);
	strcpy(a.sun_path, sock_path);
	assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		setenv("NOTIFY_SOCKET", sock_path, 1);
		setenv("WATCHDOG_USEC", "400000", 1); /* 0.4 s: pings every 0.2 s */
		unsetenv("WATCHDOG_PID");
		execl(KVBLENDD_PATH, KVBLENDD_PATH, "--data-dir", data, "--listen", ep, "--map-size",
		      "64M", "--log-level", "warn", (char *)NULL);
		_exit(127);
	}
	assert_true(wait_for(fd, "READY=1", 20, log, sizeof(log)));
	/* READY means serving: a client connects at once. */
	{
		struct kvb_connect_opts o = { .timeout_ms = 2000 };
		kvb_client *c = NULL;

		assert_int_equal(kvb_connect(ep, &o, &c, NULL, 0), 0);
		kvb_close(&c);
	}
	assert_true(wait_for(fd, "WATCHDOG=1", 5, log, sizeof(log)));
	assert_null(strstr(log, "STOPPING=1"));
	/* A reload: RELOADING=1, then READY=1 once done; the daemon keeps serving. */
	kill(pid, SIGHUP);
	assert_true(wait_for(fd, "RELOADING=1", 10, log, sizeof(log)));
	assert_true(wait_for(fd, "READY=1", 10, log, sizeof(log)));
	{
		struct kvb_connect_opts o = { .timeout_ms = 2000 };
		kvb_client *c = NULL;

		assert_int_equal(kvb_connect(ep, &o, &c, NULL, 0), 0);
		assert_int_equal(kvb_ping(c, NULL, 0), 0);
		kvb_close(&c);
	}
	kill(pid, SIGTERM);
	assert_true(wait_for(fd, "STOPPING=1", 20, log, sizeof(log)));
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	/* In order: READY before the first WATCHDOG before RELOADING, READY, STOPPING. */
	{
		char *r = strstr(log, "READY=1"), *w = strstr(log, "WATCHDOG=1");
		char *rl = strstr(log, "RELOADING=1"), *r2 = rl ? strstr(rl, "READY=1") : NULL;
		char *mono = rl ? strstr(rl, "MONOTONIC_USEC=") : NULL;
		char *s = strstr(log, "STOPPING=1");

		print_message("notifications: %s\n", log);
		assert_true(r && w && s && r < w && w < s);
		assert_true(rl && r2 && w < rl && r2 < s);
		/* in the RELOADING=1 datagram itself (datagrams are joined by '|') */
		assert_true(mono && mono < r2 && !memchr(rl, '|', (size_t)(mono - rl)));
	}
	close(fd);
	{
		char cmd[200];

		snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
		assert_int_equal(system(cmd), 0);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_notify_order),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
