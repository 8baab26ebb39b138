/* curve — CURVE keys and ZAP authentication for kvblendd; see curve.h. */
#include "daemon/curve.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "daemon/log.h"

#define KEY_Z85 40
#define KEY_BIN 32

struct curve_auth {
	void *sock;
	pthread_t thread;
	atomic_bool stop;
	bool check_keys; /* an authorized-keys file was given */
	uint8_t (*keys)[KEY_BIN];
	size_t n_keys;
	struct auth_limits lim;
};

/* The first non-blank, non-comment token of a line, if it is a Z85 key. */
static bool parse_key_line(const char *line, char *key)
{
	size_t n = 0;

	while (isspace((unsigned char)*line))
		line++;
	if (*line == '#' || !*line)
		return false;
	while (line[n] && !isspace((unsigned char)line[n]))
		n++;
	if (n != KEY_Z85)
		return false;
	memcpy(key, line, KEY_Z85);
	key[KEY_Z85] = 0;
	return true;
}

int curve_load_secret(const char *path, char *secret, char *public_key, char *err,
		      size_t errlen)
{
	char line[256], key[KEY_Z85 + 1];
	uint8_t bin[KEY_BIN];
	FILE *f = fopen(path, "r");
	bool found = false;

	if (!f) {
		int e = errno;

		snprintf(err, errlen, "curve_secret_key_file %s: %s", path, strerror(e));
		return -e;
	}
	while (!found && fgets(line, sizeof(line), f))
		found = parse_key_line(line, key);
	fclose(f);
	if (!found || !zmq_z85_decode(bin, key)) {
		snprintf(err, errlen, "curve_secret_key_file %s: no 40-character Z85 key in it "
			 "(make one with `kvblend keygen`)", path);
		return -EINVAL;
	}
	memcpy(secret, key, KEY_Z85 + 1);
	if (zmq_curve_public(public_key, secret)) {
		snprintf(err, errlen, "curve_secret_key_file %s: cannot derive the public key", path);
		return -EINVAL;
	}
	return 0;
}

static int load_authorized(struct curve_auth *a, const char *path, char *err, size_t errlen)
{
	char line[256], key[KEY_Z85 + 1];
	FILE *f = fopen(path, "r");
	unsigned lineno = 0;

	if (!f) {
		int e = errno;

		snprintf(err, errlen, "curve_authorized_keys %s: %s", path, strerror(e));
		return -e;
	}
	while (fgets(line, sizeof(line), f)) {
		uint8_t (*nk)[KEY_BIN];

		lineno++;
		if (!parse_key_line(line, key)) {
			const char *p = line;

			while (isspace((unsigned char)*p))
				p++;
			if (*p && *p != '#') {
				snprintf(err, errlen, "curve_authorized_keys %s:%u: not a 40-character "
					 "Z85 public key", path, lineno);
				fclose(f);
				return -EINVAL;
			}
			continue;
		}
		nk = realloc(a->keys, (a->n_keys + 1) * KEY_BIN);
		if (!nk) {
			fclose(f);
			return -ENOMEM;
		}
		a->keys = nk;
		if (!zmq_z85_decode(a->keys[a->n_keys], key)) {
			snprintf(err, errlen, "curve_authorized_keys %s:%u: not a Z85 key", path,
				 lineno);
			fclose(f);
			return -EINVAL;
		}
		a->n_keys++;
	}
	fclose(f);
	return 0;
}

/* Send one ZAP reply frame; more frames follow unless last. */
static void zap_send(void *sock, const void *data, size_t len, bool last)
{
	zmq_send(sock, data, len, last ? 0 : ZMQ_SNDMORE);
}

/*
 * One ZAP request (RFC 27): frames version, request id, domain, address, identity,
 * mechanism, credentials... Every handshake on every endpoint comes here: refused
 * (400) beyond max_clients connections; with CURVE and an authorized-keys file, a
 * key not in it is refused too. An admitted CURVE client's user id is its public
 * key (Z85), which names it as a client of the daemon.
 */
static void zap_one(struct curve_auth *a)
{
	zmq_msg_t f[8];
	size_t n = 0;
	int more = 1;
	bool ok = true, curve;
	const char *code, *why = "OK";
	char user[KEY_Z85 + 1] = "";

	while (more && n < 8) {
		zmq_msg_init(&f[n]);
		if (zmq_msg_recv(&f[n], a->sock, 0) < 0) {
			zmq_msg_close(&f[n]);
			break;
		}
		more = zmq_msg_more(&f[n++]);
	}
	while (more) { /* more frames than a request has: drain them */
		zmq_msg_t t;

		zmq_msg_init(&t);
		if (zmq_msg_recv(&t, a->sock, 0) < 0)
			break;
		more = zmq_msg_more(&t);
		zmq_msg_close(&t);
	}
	curve = n >= 7 && zmq_msg_size(&f[5]) == 5 && !memcmp(zmq_msg_data(&f[5]), "CURVE", 5) &&
		zmq_msg_size(&f[6]) == KEY_BIN;
	if (n < 6 || (!curve && !(zmq_msg_size(&f[5]) == 4 &&
				  !memcmp(zmq_msg_data(&f[5]), "NULL", 4)))) {
		ok = false;
		why = "mechanism not accepted";
	} else if (a->lim.connections &&
		   atomic_load(a->lim.connections) > a->lim.max_clients) {
		ok = false;
		why = "too many connections (max_clients)";
		if (a->lim.refused)
			atomic_fetch_add(a->lim.refused, 1);
	} else if (curve && a->check_keys) {
		ok = false;
		for (size_t i = 0; i < a->n_keys && !ok; i++)
			ok = !memcmp(a->keys[i], zmq_msg_data(&f[6]), KEY_BIN);
		if (!ok) {
			why = "key not authorized";
			if (a->lim.key_refused)
				atomic_fetch_add(a->lim.key_refused, 1);
			log_info("CURVE client from %.*s refused: key not in curve_authorized_keys",
				 (int)zmq_msg_size(&f[3]), (const char *)zmq_msg_data(&f[3]));
		}
	}
	if (ok && curve)
		zmq_z85_encode(user, zmq_msg_data(&f[6]), KEY_BIN);
	code = ok ? "200" : "400";
	zap_send(a->sock, "1.0", 3, false);
	if (n >= 2)
		zap_send(a->sock, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), false);
	else
		zap_send(a->sock, "", 0, false);
	zap_send(a->sock, code, 3, false);
	zap_send(a->sock, why, strlen(why), false);
	zap_send(a->sock, user, strlen(user), false); /* user id */
	zap_send(a->sock, "", 0, true);		       /* metadata */
	for (size_t i = 0; i < n; i++)
		zmq_msg_close(&f[i]);
}

static void *zap_main(void *arg)
{
	struct curve_auth *a = arg;

	while (!atomic_load(&a->stop)) {
		zmq_pollitem_t it = { a->sock, 0, ZMQ_POLLIN, 0 };

		if (zmq_poll(&it, 1, 200) > 0 && (it.revents & ZMQ_POLLIN))
			zap_one(a);
	}
	return NULL;
}

int curve_auth_start(void *zctx, const char *authorized_path, const struct auth_limits *lim,
		     struct curve_auth **out, char *err, size_t errlen)
{
	struct curve_auth *a = calloc(1, sizeof(*a));
	int zero = 0, rc = 0;
	sigset_t all, old;

	if (!a)
		return -ENOMEM;
	if (lim)
		a->lim = *lim;
	a->check_keys = authorized_path && authorized_path[0];
	if (a->check_keys)
		rc = load_authorized(a, authorized_path, err, errlen);
	if (rc)
		goto fail;
	a->sock = zmq_socket(zctx, ZMQ_REP);
	if (!a->sock || zmq_setsockopt(a->sock, ZMQ_LINGER, &zero, sizeof(zero)) ||
	    zmq_bind(a->sock, "inproc://zeromq.zap.01")) {
		rc = -errno;
		snprintf(err, errlen, "cannot start the ZAP handler: %s", zmq_strerror(-rc));
		goto fail;
	}
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	rc = -pthread_create(&a->thread, NULL, zap_main, a);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc)
		goto fail;
	if (a->check_keys)
		log_info("CURVE: %zu authorized client keys", a->n_keys);
	*out = a;
	return 0;
fail:
	if (a->sock)
		zmq_close(a->sock);
	free(a->keys);
	free(a);
	return rc;
}

void curve_auth_stop(struct curve_auth **ap)
{
	struct curve_auth *a = ap ? *ap : NULL;

	if (!a)
		return;
	atomic_store(&a->stop, true);
	pthread_join(a->thread, NULL);
	zmq_close(a->sock);
	free(a->keys);
	free(a);
	*ap = NULL;
}
