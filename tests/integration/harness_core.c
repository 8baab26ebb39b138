/* harness_core — a real kvblendd for tests and benchmarks; see harness_core.h. */
#include "tests/integration/harness_core.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/include/kvblend.h"

int daemon_prepare(struct daemon *d, const char *prefix)
{
	char tmpl[200];

	memset(d, 0, sizeof(*d));
	snprintf(tmpl, sizeof(tmpl), "%s-XXXXXX", prefix);
	if (!mkdtemp(tmpl))
		return -errno;
	snprintf(d->dir, sizeof(d->dir), "%s", tmpl);
	snprintf(d->data_dir, sizeof(d->data_dir), "%s/data", d->dir);
	snprintf(d->endpoint, sizeof(d->endpoint), "ipc://%s/kvblend.sock", d->dir);
	snprintf(d->log_path, sizeof(d->log_path), "%s/kvblendd.log", d->dir);
	return 0;
}

void daemon_log_tail(const struct daemon *d, int lines)
{
	char cmd[400];

	snprintf(cmd, sizeof(cmd), "tail -n %d '%s' >&2", lines, d->log_path);
	if (system(cmd) < 0)
		perror("system");
}

int daemon_spawn(struct daemon *d, const char *path, const char *const *defaults,
		 const char *const *extra)
{
	const char *argv[64] = { path, "--data-dir", d->data_dir, "--listen", d->endpoint };
	int n = 5;

	for (int i = 0; defaults && defaults[i] && n < 62; i++)
		argv[n++] = defaults[i];
	for (int i = 0; extra && extra[i] && n < 62; i++)
		argv[n++] = extra[i];
	argv[n] = NULL;
	d->pid = fork();
	if (d->pid < 0) {
		d->pid = 0;
		return -errno;
	}
	if (d->pid == 0) {
		int fd = open(d->log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);

		if (fd >= 0) {
			dup2(fd, 2);
			dup2(fd, 1);
		}
		execv(path, (char *const *)argv);
		_exit(127);
	}
	/* Ready when a ping through the real client succeeds. */
	for (int i = 0; i < 200; i++) {
		struct kvb_connect_opts o = { .timeout_ms = 200 };
		kvb_client *c = NULL;

		if (kvb_connect(d->endpoint, &o, &c, NULL, 0) == 0) {
			kvb_close(&c);
			return 0;
		}
		if (waitpid(d->pid, NULL, WNOHANG) == d->pid) {
			d->pid = 0;
			daemon_log_tail(d, 20);
			return -ECHILD;
		}
		usleep(50000);
	}
	return -ETIMEDOUT;
}

int daemon_reap(struct daemon *d, int terminate)
{
	int status = 0;

	if (!d->pid)
		return 0;
	if (terminate)
		kill(d->pid, SIGTERM);
	for (int i = 0; waitpid(d->pid, &status, WNOHANG) != d->pid; i++) {
		if (i == 600) {
			kill(d->pid, SIGKILL);
			waitpid(d->pid, &status, 0);
			d->pid = 0;
			return -ETIMEDOUT;
		}
		usleep(50000);
	}
	d->pid = 0;
	if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
		return 0;
	daemon_log_tail(d, 40);
	return status ? status : -1;
}

void daemon_remove(struct daemon *d)
{
	char cmd[300];

	if (d->pid) {
		kill(d->pid, SIGKILL);
		waitpid(d->pid, NULL, 0);
		d->pid = 0;
	}
	if (d->dir[0] && !getenv("KVB_KEEP_TMP")) {
		snprintf(cmd, sizeof(cmd), "rm -rf '%s'", d->dir);
		if (system(cmd) < 0)
			perror("system");
	}
}

void fill_f16(uint16_t *p, size_t n, uint32_t seed)
{
	uint32_t x = seed * 2654435761u + 7;

	for (size_t i = 0; i < n; i++) {
		x = x * 1103515245u + 12345u;
		p[i] = (uint16_t)((x >> 31) << 15 | (13 + (x >> 28 & 3)) << 10 | (x >> 8 & 0x3ff));
	}
}

/*
 * A port below the kernel's ephemeral range (ip_local_port_range), free now and never
 * handed out before by this process: a port the kernel picks for bind(0) is an ephemeral
 * one, which any outgoing connection may take between this check and the daemon's
 * bind (CI once saw a daemon fail to start with "Address already in use"), and the
 * kernel may hand the same one out twice in a row.
 */
int free_tcp_port(void)
{
	static int given[256];
	static size_t n_given;
	static unsigned seed;
	int low = 32768;
	FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");

	if (f) {
		if (fscanf(f, "%d", &low) != 1)
			low = 32768;
		fclose(f);
	}
	if (!seed)
		seed = (unsigned)getpid() ^ (unsigned)time(NULL);
	for (int tries = 0; tries < 4000; tries++) {
		struct sockaddr_in a = { .sin_family = AF_INET,
					 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
		socklen_t len = sizeof(a);
		int fd = socket(AF_INET, SOCK_STREAM, 0), port = 0, ok;
		bool seen = false;

		if (fd < 0)
			break;
		/* below the ephemeral range when it leaves room (10000 and up), else the kernel's */
		if (low > 12000)
			a.sin_port = htons((uint16_t)(10000 + rand_r(&seed) % (unsigned)(low - 10000)));
		ok = bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
		     getsockname(fd, (struct sockaddr *)&a, &len) == 0;
		close(fd);
		if (!ok)
			continue;
		port = ntohs(a.sin_port);
		for (size_t i = 0; i < n_given; i++)
			seen = seen || given[i] == port;
		if (seen)
			continue;
		if (n_given < sizeof(given) / sizeof(given[0]))
			given[n_given++] = port;
		return port;
	}
	fprintf(stderr, "free_tcp_port: no free port found\n");
	return -1;
}
