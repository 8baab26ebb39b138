/* harness — real kvblendd for integration tests; see harness.h. */
#include "tests/integration/harness.h"

#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

static void spawn(struct daemon *d, const char *const *extra)
{
	const char *argv[64];
	int n = 0;

	argv[n++] = KVBLENDD_PATH;
	argv[n++] = "--data-dir";
	argv[n++] = d->data_dir;
	argv[n++] = "--listen";
	argv[n++] = d->endpoint;
	argv[n++] = "--map-size";
	argv[n++] = "1G";
	argv[n++] = "--workers";
	argv[n++] = "3";
	argv[n++] = "--log-level";
	argv[n++] = "debug";
	/* The parity suite (tests/gpu_run.sh) runs the same tests with the fuse on a GPU. */
	if (getenv("KVBLEND_TEST_DEVICE")) {
		argv[n++] = "--device";
		argv[n++] = getenv("KVBLEND_TEST_DEVICE");
	}
	for (int i = 0; extra && extra[i] && n < 62; i++)
		argv[n++] = extra[i];
	argv[n] = NULL;
	d->pid = fork();
	assert_true(d->pid >= 0);
	if (d->pid == 0) {
		int fd = open(d->log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);

		if (fd >= 0) {
			dup2(fd, 2);
			dup2(fd, 1);
		}
		execv(KVBLENDD_PATH, (char *const *)argv);
		_exit(127);
	}
	/* Ready when a ping through the real client succeeds. */
	for (int i = 0; i < 200; i++) {
		struct kvb_connect_opts o = { .timeout_ms = 200 };
		kvb_client *c = NULL;
		int status;

		if (kvb_connect(d->endpoint, &o, &c, NULL, 0) == 0) {
			kvb_close(&c);
			return;
		}
		if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
			char cmd[400];

			d->pid = 0;
			snprintf(cmd, sizeof(cmd), "tail -n 20 %s >&2", d->log_path);
			if (system(cmd) < 0)
				perror("system");
			fail_msg("kvblendd exited during start-up; see %s", d->log_path);
		}
		usleep(50000);
	}
	fail_msg("kvblendd did not answer within 10 s; see %s", d->log_path);
}

void daemon_start(struct daemon *d, const char *const *extra)
{
	char tmpl[] = "/tmp/kvb-test-XXXXXX";

	memset(d, 0, sizeof(*d));
	assert_non_null(mkdtemp(tmpl));
	snprintf(d->dir, sizeof(d->dir), "%s", tmpl);
	snprintf(d->data_dir, sizeof(d->data_dir), "%s/data", d->dir);
	snprintf(d->endpoint, sizeof(d->endpoint), "ipc://%s/kvblend.sock", d->dir);
	snprintf(d->log_path, sizeof(d->log_path), "%s/kvblendd.log", d->dir);
	spawn(d, extra);
}

void daemon_restart(struct daemon *d, const char *const *extra)
{
	daemon_stop(d);
	spawn(d, extra);
}

void daemon_stop(struct daemon *d)
{
	if (!d->pid)
		return;
	kill(d->pid, SIGTERM);
	daemon_wait(d);
}

void daemon_wait(struct daemon *d)
{
	int status = 0;

	if (!d->pid)
		return;
	for (int i = 0; i < 600; i++) {
		if (waitpid(d->pid, &status, WNOHANG) == d->pid)
			break;
		usleep(50000);
		if (i == 599) {
			kill(d->pid, SIGKILL);
			waitpid(d->pid, &status, 0);
			d->pid = 0;
			fail_msg("kvblendd did not stop within 30 s of SIGTERM");
		}
	}
	d->pid = 0;
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		char cmd[400];

		snprintf(cmd, sizeof(cmd), "tail -n 40 %s >&2", d->log_path);
		if (system(cmd) < 0)
			perror("system");
		fail_msg("kvblendd exited with status 0x%x (sanitizer finding or crash?)", status);
	}
}

void daemon_cleanup(struct daemon *d)
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

kvb_client *daemon_client(const struct daemon *d, int no_shm)
{
	struct kvb_connect_opts o = { .timeout_ms = 10000, .no_shm = no_shm };
	kvb_client *c = NULL;
	char err[512];
	int rc = kvb_connect(d->endpoint, &o, &c, err, sizeof(err));

	if (rc)
		fail_msg("connect: %s", err);
	return c;
}

void fill_f16(uint16_t *p, size_t n, uint32_t seed)
{
	uint32_t x = seed * 2654435761u + 7;

	for (size_t i = 0; i < n; i++) {
		x = x * 1103515245u + 12345u;
		p[i] = (uint16_t)((x >> 31) << 15 | (13 + (x >> 28 & 3)) << 10 | (x >> 8 & 0x3ff));
	}
}

double daemon_stat(kvb_client *c, const char *name)
{
	struct kvb_stat *s;
	size_t n;
	double v = -1;

	assert_int_equal(kvb_stats(c, &s, &n), 0);
	for (size_t i = 0; i < n; i++)
		if (!strcmp(s[i].name, name))
			v = s[i].value;
	free(s);
	if (v < 0)
		fail_msg("no stat %s", name);
	return v;
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

		assert_true(fd >= 0);
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
	fail_msg("free_tcp_port: no free port found");
	return -1;
}

void daemon_curve_key(const struct daemon *d, char keyfile[400], char pub[41])
{
	char sec[41];
	FILE *f;

	snprintf(keyfile, 400, "%s/server.key", d->dir);
	assert_int_equal(kvb_curve_keypair(pub, sec), 0);
	f = fopen(keyfile, "w");
	assert_non_null(f);
	fprintf(f, "%s\n", sec);
	fclose(f);
}

int daemon_setup(void **state, const char *const *extra_args)
{
	struct daemon *d = calloc(1, sizeof(*d));

	assert_non_null(d);
	daemon_start(d, extra_args);
	*state = d;
	return 0;
}

int daemon_teardown(void **state)
{
	struct daemon *d = *state;

	daemon_stop(d);
	daemon_cleanup(d);
	free(d);
	return 0;
}

int daemon_segment_fd(const char *path, uint64_t id)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} u;
	uint8_t req[8], status = 1;
	struct iovec iov = { &status, 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf) };
	struct cmsghdr *cm;
	int sock = socket(AF_UNIX, SOCK_STREAM, 0), fd = -1;

	snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
	for (int i = 0; i < 8; i++)
		req[i] = (uint8_t)(id >> (8 * i));
	memset(&u, 0, sizeof(u));
	if (sock >= 0 && !connect(sock, (struct sockaddr *)&a, sizeof(a)) &&
	    send(sock, req, 8, 0) == 8 && recvmsg(sock, &mh, 0) == 1 && !status &&
	    (cm = CMSG_FIRSTHDR(&mh)) && cm->cmsg_type == SCM_RIGHTS)
		memcpy(&fd, CMSG_DATA(cm), sizeof(int));
	if (sock >= 0)
		close(sock);
	return fd;
}

MDB_cursor *data_layers_open(const char *data_dir)
{
	MDB_env *env;
	MDB_txn *txn;
	MDB_dbi dbi;
	MDB_cursor *cur;

	assert_int_equal(mdb_env_create(&env), 0);
	assert_int_equal(mdb_env_set_maxdbs(env, 8), 0);
	assert_int_equal(mdb_env_set_mapsize(env, 1u << 30), 0);
	assert_int_equal(mdb_env_open(env, data_dir, 0, 0640), 0);
	assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
	assert_int_equal(mdb_dbi_open(txn, "layers", 0, &dbi), 0);
	assert_int_equal(mdb_cursor_open(txn, dbi, &cur), 0);
	return cur;
}

void data_layers_close(MDB_cursor *cur)
{
	MDB_txn *txn = mdb_cursor_txn(cur);
	MDB_env *env = mdb_txn_env(txn);

	mdb_cursor_close(cur);
	assert_int_equal(mdb_txn_commit(txn), 0);
	mdb_env_close(env);
}

void write_text_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");

	assert_non_null(f);
	fputs(text, f);
	fclose(f);
}
