/*
 * libkvblend — client of kvblendd; see include/kvblend.h for the contract. This file
 * holds a client's life: connect, ping, close, and the error texts. The requests live
 * in call.c, shared memory in shm.c, chunks in chunk.c, models in model.c, fuse
 * sessions in fuse.c and the daemon's counters in admin.c.
 */
#include <errno.h>
#include <pthread.h>
#include <sodium.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "client/client_impl.h"

#define DEFAULT_TIMEOUT_MS 5000
#define DEFAULT_SHM (64u << 20)
#define DEFAULT_ENDPOINT "ipc:///run/kvblend/kvblend.sock"

const char *kvb_last_error(const kvb_client *c)
{
	return c ? c->err : "";
}

int kvb_last_code(const kvb_client *c)
{
	/* a success clears err; a message set without kvbc_set_err() has no code of its own */
	if (!c || !c->err[0])
		return 0;
	return c->err_code ? c->err_code : KVB_E_INTERNAL;
}

const char *kvb_strerror(int code)
{
	static const char *const server[] = {
		[KVBP_BAD_REQUEST] = "bad request",
		[KVBP_BAD_VERSION] = "protocol version not supported",
		[KVBP_UNKNOWN_OP] = "unknown operation",
		[KVBP_BAD_SHAPE] = "bad shape",
		[KVBP_UNKNOWN_MODEL] = "unknown model",
		[KVBP_DTYPE_MISMATCH] = "dtype mismatch",
		[KVBP_BAD_FRAMES] = "wrong number of frames",
		[KVBP_TOO_LARGE] = "message too large",
		[KVBP_MODEL_CONFLICT] = "model exists with another layout",
		[KVBP_NOT_FOUND] = "not found",
		[KVBP_CORRUPT] = "stored chunk corrupt",
		[KVBP_FULL] = "store full",
		[KVBP_LIMIT] = "daemon resource limit reached",
		[KVBP_INTERNAL] = "internal daemon error",
		[KVBP_BAD_ARGUMENT] = "bad argument",
		[KVBP_BAD_SHM] = "bad shared-memory reference",
		[KVBP_UNKNOWN_SESSION] = "unknown fuse session",
		[KVBP_BUSY] = "chunk in use by a fuse session",
	};

	if (code == 0)
		return "success";
	if (code == KVB_E_PROTOCOL)
		return "unreadable reply";
	if (code <= -1001 && code > -1000 - KVBP_CODE_COUNT)
		return server[-code - 1000];
	return strerror(-code);
}

const char *kvb_default_endpoint(void)
{
	static __thread char buf[300];
	const char *e = getenv("KVBLEND_ENDPOINT"), *xdg = getenv("XDG_RUNTIME_DIR");

	if (e && *e)
		return e;
	/* Mirror kvblendd's default: the system socket, else the user's runtime dir. */
	if (access(DEFAULT_ENDPOINT + 6, F_OK) == 0 || !xdg || !*xdg || geteuid() == 0)
		return DEFAULT_ENDPOINT;
	snprintf(buf, sizeof(buf), "ipc://%s/kvblend.sock", xdg);
	return buf;
}


int kvb_curve_keypair(char public_key[41], char secret_key[41])
{
	return zmq_curve_keypair(public_key, secret_key) ? -ENOTSUP : 0;
}

int kvb_connect(const char *endpoint, const struct kvb_connect_opts *opts, kvb_client **out,
		char *err, size_t errlen)
{
	kvb_client *c;
	int rc;

	*out = NULL;
	if (!endpoint)
		endpoint = kvb_default_endpoint();
	if ((strncmp(endpoint, "ipc://", 6) && strncmp(endpoint, "tcp://", 6)) ||
	    strlen(endpoint) >= sizeof(c->endpoint)) {
		if (err)
			snprintf(err, errlen, "invalid endpoint '%s'; expected ipc://PATH or "
				 "tcp://HOST:PORT", endpoint);
		return -EINVAL;
	}
	if (sodium_init() < 0) {
		if (err)
			snprintf(err, errlen, "libsodium failed to initialise");
		return -EIO;
	}
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	snprintf(c->endpoint, sizeof(c->endpoint), "%s", endpoint);
	c->bulk_fd = -1;
	c->timeout_ms = opts && opts->timeout_ms > 0 ? opts->timeout_ms : DEFAULT_TIMEOUT_MS;
	c->shm_ok = !strncmp(endpoint, "ipc://", 6) && !(opts && opts->no_shm);
	c->shm_initial = opts && opts->shm_size ? opts->shm_size : DEFAULT_SHM;
	if (!strncmp(endpoint, "tcp://", 6)) {
		const char *sk = opts && opts->server_key ? opts->server_key
							  : getenv("KVBLEND_SERVER_KEY");
		const char *ck = opts && opts->client_secret_key ? opts->client_secret_key
								 : getenv("KVBLEND_CLIENT_KEY");
		uint8_t bin[32];

		if (sk && *sk) {
			if (strlen(sk) != 40 || !zmq_z85_decode(bin, sk) ||
			    (ck && *ck && (strlen(ck) != 40 || !zmq_z85_decode(bin, ck)))) {
				if (err)
					snprintf(err, errlen, "CURVE keys must be 40-character Z85 "
						 "strings (see kvblend keygen)");
				free(c);
				return -EINVAL;
			}
			c->curve = true;
			memcpy(c->server_key, sk, 41);
			if (ck && *ck) {
				memcpy(c->secret_key, ck, 41);
				rc = zmq_curve_public(c->public_key, c->secret_key);
			} else {
				rc = zmq_curve_keypair(c->public_key, c->secret_key);
			}
			if (rc) {
				if (err)
					snprintf(err, errlen, "this libzmq has no CURVE support");
				free(c);
				return -ENOTSUP;
			}
		}
	}
	c->ctx = zmq_ctx_new();
	rc = c->ctx ? kvbc_open_socket(c) : -ENOMEM;
	if (rc) {
		if (err)
			snprintf(err, errlen, "cannot connect to %s: %s", endpoint, zmq_strerror(-rc));
		kvb_close(&c);
		return rc;
	}
	rc = kvb_ping(c, NULL, 0);
	if (rc) {
		if (err)
			snprintf(err, errlen, "%s", rc == -ETIMEDOUT ? c->err : c->err);
		kvb_close(&c);
		return rc;
	}
	*out = c;
	return 0;
}


/*
 * zmq_ctx_term() with a bound: libzmq can block in it for good after a CURVE
 * handshake the server refused, on a loaded machine, whatever the linger. Past
 * the bound the context is left to a detached thread (and leaked if it never
 * ends), so that closing a client never hangs its caller.
 */
struct term_job {
	void *ctx;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool done, abandoned;
};

static void term_job_free(struct term_job *j)
{
	pthread_cond_destroy(&j->cond);
	pthread_mutex_destroy(&j->lock);
	free(j);
}

static void *term_main(void *arg)
{
	struct term_job *j = arg;
	bool orphan;

	zmq_ctx_term(j->ctx);
	pthread_mutex_lock(&j->lock);
	j->done = true;
	orphan = j->abandoned;
	pthread_cond_signal(&j->cond);
	pthread_mutex_unlock(&j->lock);
	if (orphan)
		term_job_free(j);
	return NULL;
}

static void ctx_term_bounded(void *ctx, int ms)
{
	struct term_job *j = calloc(1, sizeof(*j));
	struct timespec until;
	pthread_t t;
	bool done;

	if (!j) {
		zmq_ctx_term(ctx);
		return;
	}
	j->ctx = ctx;
	pthread_mutex_init(&j->lock, NULL);
	pthread_cond_init(&j->cond, NULL);
	if (pthread_create(&t, NULL, term_main, j)) {
		term_job_free(j);
		zmq_ctx_term(ctx);
		return;
	}
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += ms / 1000;
	until.tv_nsec += (long)(ms % 1000) * 1000000;
	if (until.tv_nsec >= 1000000000) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000;
	}
	pthread_mutex_lock(&j->lock);
	while (!j->done && pthread_cond_timedwait(&j->cond, &j->lock, &until) == 0)
		;
	done = j->done;
	j->abandoned = !done;
	pthread_mutex_unlock(&j->lock);
	pthread_detach(t);
	if (done)
		term_job_free(j);
}

void kvb_close(kvb_client **cp)
{
	kvb_client *c = cp ? *cp : NULL;

	if (!c)
		return;
	if (c->sock)
		kvbc_shm_unmap(c, true);
	for (unsigned i = 0; i < REGION_MAX; i++)
		if (c->regions[i].id)
			kvb_region_free(c, c->regions[i].base + REGION_HEAD);
	if (c->sock)
		zmq_close(c->sock);
	kvbc_bulk_close(c);
	kvbc_wait_payloads(c);
	if (c->ctx)
		ctx_term_bounded(c->ctx, 2000);
	for (unsigned i = 0; i < c->n_lost; i++)
		munmap(c->lost_base[i], c->lost_size[i]);
	kvb_cuda_free(&c->cuda);
	free(c);
	*cp = NULL;
}


int kvb_set_timeout(kvb_client *c, int timeout_ms)
{
	if (!c || timeout_ms <= 0)
		return -EINVAL;
	c->timeout_ms = timeout_ms;
	return 0;
}


int kvb_ping(kvb_client *c, char *version, size_t len)
{
	struct call k = { .req = { .op = KVBP_OP_HELLO } };
	int rc = kvbc_call(c, &k);

	if (!rc && version && len)
		snprintf(version, len, "%s", k.rep.server_version);
	kvbc_call_done(&k);
	return rc;
}
