/* etcd — etcd v3 through its JSON gateway; see etcd.h. */
#include "cluster/etcd.h"

#include <curl/curl.h>
#include <errno.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ENDPOINTS_MAX 8
#define URL_MAX 256
#define REPLY_MAX (64u << 20) /* a gateway answer larger than this is refused */
#define TOKEN_MAX 1024		    /* an auth token longer than this is refused */
#define AUTH_PATH "/v3/auth/authenticate"
#define EKEYEXPIRED_ETCD (-EKEYEXPIRED) /* inside call(): the token is no longer taken */

struct etcd {
	CURL *curl;
	char urls[ENDPOINTS_MAX][URL_MAX];
	unsigned n_urls, cur;
	int timeout_ms;
	char *ca_file, *cert_file, *key_file, *user, *password; /* NULL: not set */
	char token[TOKEN_MAX + 1];				 /* "" until authenticated */
	char error[CURL_ERROR_SIZE + 512];
	/* the answer being read */
	char *buf;
	size_t len, cap;
	bool overflow;
	/* a watch stream */
	json_tokener *tok;
	int (*watch_fn)(void *, bool, const char *, const char *, size_t, int64_t);
	void *watch_ctx;
	const atomic_bool *stop;
	int watch_rc;
	bool watch_created;
};

int etcd_global_init(void)
{
	return curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK ? 0 : -ENOMEM;
}

static bool set(const char *s)
{
	return s && *s;
}

/* The endpoint list into e->urls; *tls whether any is https://, *plain any http://. */
static int parse_endpoints(struct etcd *e, const char *s, bool *tls, bool *plain, char *err,
			   size_t errlen)
{
	while (*s) {
		size_t n = strcspn(s, ", \t"), scheme;

		if (!n) {
			s++;
			continue;
		}
		scheme = !strncmp(s, "http://", 7) ? 7 : !strncmp(s, "https://", 8) ? 8 : 0;
		if (!scheme || n <= scheme || n >= URL_MAX - 16) {
			snprintf(err, errlen, "cluster_etcd: '%.*s' is not http://HOST:PORT or "
				 "https://HOST:PORT", (int)n, s);
			return -EINVAL;
		}
		if (e->n_urls == ENDPOINTS_MAX) {
			snprintf(err, errlen, "cluster_etcd: more than %d endpoints", ENDPOINTS_MAX);
			return -EINVAL;
		}
		*(scheme == 8 ? tls : plain) = true;
		memcpy(e->urls[e->n_urls], s, n);
		/* no trailing slash: paths are appended as /v3/... */
		while (n > scheme && e->urls[e->n_urls][n - 1] == '/')
			e->urls[e->n_urls][--n] = 0;
		e->n_urls++;
		s += n;
		while (*s == '/')
			s++;
	}
	if (!e->n_urls) {
		snprintf(err, errlen, "cluster_etcd: no endpoint");
		return -EINVAL;
	}
	return 0;
}

/* A copy of file setting key's path, after checking it can be read; NULL with err. */
static char *readable_copy(const char *key, const char *path, char *err, size_t errlen)
{
	FILE *f = fopen(path, "r");
	char *copy;

	if (!f) {
		snprintf(err, errlen, "%s: cannot read '%s': %s", key, path, strerror(errno));
		return NULL;
	}
	fclose(f);
	copy = strdup(path);
	if (!copy)
		snprintf(err, errlen, "%s: out of memory", key);
	return copy;
}

/* o's TLS and authentication settings checked and copied into e. */
static int take_opts(struct etcd *e, const struct etcd_opts *o, bool plain, char *err,
		     size_t errlen)
{
	if ((set(o->ca_file) || set(o->cert_file) || set(o->key_file)) && plain) {
		snprintf(err, errlen, "cluster_etcd_%s is set but cluster_etcd has an http:// "
			 "endpoint: TLS settings need https:// endpoints",
			 set(o->ca_file) ? "ca_file" : set(o->cert_file) ? "cert_file" : "key_file");
		return -EINVAL;
	}
	if (set(o->cert_file) != set(o->key_file)) {
		snprintf(err, errlen, "cluster_etcd_%s is set without cluster_etcd_%s: a client "
			 "certificate needs its key", set(o->cert_file) ? "cert_file" : "key_file",
			 set(o->cert_file) ? "key_file" : "cert_file");
		return -EINVAL;
	}
	if (set(o->user) && !set(o->password)) {
		snprintf(err, errlen, "cluster_etcd_user is set without a password "
			 "(cluster_etcd_password_file)");
		return -EINVAL;
	}
	if (!set(o->user) && set(o->password)) {
		snprintf(err, errlen, "cluster_etcd_password_file is set without cluster_etcd_user");
		return -EINVAL;
	}
	if ((set(o->ca_file) &&
	     !(e->ca_file = readable_copy("cluster_etcd_ca_file", o->ca_file, err, errlen))) ||
	    (set(o->cert_file) &&
	     !(e->cert_file = readable_copy("cluster_etcd_cert_file", o->cert_file, err, errlen))) ||
	    (set(o->key_file) &&
	     !(e->key_file = readable_copy("cluster_etcd_key_file", o->key_file, err, errlen))))
		return -EINVAL;
	if (set(o->user) && (!(e->user = strdup(o->user)) || !(e->password = strdup(o->password)))) {
		snprintf(err, errlen, "cluster_etcd_user: out of memory");
		return -ENOMEM;
	}
	return 0;
}

int etcd_new(const char *endpoints, const struct etcd_opts *o, struct etcd **out, char *err,
	     size_t errlen)
{
	struct etcd *e = calloc(1, sizeof(*e));
	bool tls = false, plain = false; /* tls: for the record; any mix is allowed */
	int rc;

	*out = NULL;
	if (!e)
		return -ENOMEM;
	rc = parse_endpoints(e, endpoints, &tls, &plain, err, errlen);
	if (!rc)
		rc = take_opts(e, o, plain, err, errlen);
	if (!rc && !(e->curl = curl_easy_init()))
		rc = -ENOMEM;
	if (rc) {
		etcd_free(&e);
		return rc;
	}
	e->timeout_ms = o->timeout_ms;
	*out = e;
	return 0;
}

void etcd_free(struct etcd **ep)
{
	struct etcd *e = ep ? *ep : NULL;

	if (!e)
		return;
	if (e->curl)
		curl_easy_cleanup(e->curl);
	if (e->tok)
		json_tokener_free(e->tok);
	free(e->buf);
	free(e->ca_file);
	free(e->cert_file);
	free(e->key_file);
	free(e->user);
	if (e->password)
		explicit_bzero(e->password, strlen(e->password));
	free(e->password);
	explicit_bzero(e->token, sizeof(e->token));
	free(e);
	*ep = NULL;
}

const char *etcd_endpoint(const struct etcd *e)
{
	return e->urls[e->cur];
}

const char *etcd_error(const struct etcd *e)
{
	return e->error;
}

/* ---- base64 ---- */

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

void etcd_b64_encode(const void *in, size_t n, char *out)
{
	const uint8_t *p = in;
	size_t i = 0;

	for (; i + 3 <= n; i += 3) {
		uint32_t v = (uint32_t)p[i] << 16 | (uint32_t)p[i + 1] << 8 | p[i + 2];

		*out++ = B64[v >> 18];
		*out++ = B64[(v >> 12) & 63];
		*out++ = B64[(v >> 6) & 63];
		*out++ = B64[v & 63];
	}
	if (n - i == 1) {
		uint32_t v = (uint32_t)p[i] << 16;

		*out++ = B64[v >> 18];
		*out++ = B64[(v >> 12) & 63];
		*out++ = '=';
		*out++ = '=';
	} else if (n - i == 2) {
		uint32_t v = (uint32_t)p[i] << 16 | (uint32_t)p[i + 1] << 8;

		*out++ = B64[v >> 18];
		*out++ = B64[(v >> 12) & 63];
		*out++ = B64[(v >> 6) & 63];
		*out++ = '=';
	}
	*out = 0;
}

static int b64_val(char c)
{
	const char *p = c ? strchr(B64, c) : NULL;

	return p ? (int)(p - B64) : -1;
}

long etcd_b64_decode(const char *in, uint8_t *out)
{
	size_t n = strlen(in), o = 0;

	if (n % 4)
		return -1;
	for (size_t i = 0; i < n; i += 4) {
		int a = b64_val(in[i]), b = b64_val(in[i + 1]), c = in[i + 2], d = in[i + 3];
		int cv = c == '=' ? 0 : b64_val((char)c), dv = d == '=' ? 0 : b64_val((char)d);
		bool last = i + 4 == n;

		if (a < 0 || b < 0 || cv < 0 || dv < 0 || ((c == '=' || d == '=') && !last) ||
		    (c == '=' && d != '='))
			return -1;
		out[o++] = (uint8_t)(a << 2 | b >> 4);
		if (c != '=')
			out[o++] = (uint8_t)((b & 15) << 4 | cv >> 2);
		if (d != '=')
			out[o++] = (uint8_t)((cv & 3) << 6 | dv);
	}
	out[o] = 0;
	return (long)o;
}

/* A JSON string member of o holding base64, decoded into a malloc'd NUL-terminated buffer. */
static char *b64_member(json_object *o, const char *name, size_t *len)
{
	json_object *v;
	const char *s;
	char *out;
	long n;

	*len = 0;
	if (!json_object_object_get_ex(o, name, &v) || !json_object_is_type(v, json_type_string))
		return calloc(1, 1); /* absent: the empty string (the gateway omits empty fields) */
	s = json_object_get_string(v);
	out = malloc(3 * (strlen(s) / 4) + 1);
	if (!out)
		return NULL;
	n = etcd_b64_decode(s, (uint8_t *)out);
	if (n < 0) {
		free(out);
		return NULL;
	}
	*len = (size_t)n;
	return out;
}

/* An int64 member (the gateway writes them as decimal strings); def when absent. */
static int64_t int_member(json_object *o, const char *name, int64_t def)
{
	json_object *v;

	if (!o || !json_object_object_get_ex(o, name, &v))
		return def;
	if (json_object_is_type(v, json_type_string))
		return strtoll(json_object_get_string(v), NULL, 10);
	return json_object_get_int64(v);
}

/* ---- calls ---- */

static size_t on_data(char *p, size_t size, size_t nmemb, void *ctx)
{
	struct etcd *e = ctx;
	size_t n = size * nmemb;

	if (e->len + n + 1 > REPLY_MAX) {
		e->overflow = true;
		return 0;
	}
	if (e->len + n + 1 > e->cap) {
		size_t cap = e->cap ? e->cap : 4096;
		char *b;

		while (cap < e->len + n + 1)
			cap *= 2;
		b = realloc(e->buf, cap);
		if (!b)
			return 0;
		e->buf = b;
		e->cap = cap;
	}
	memcpy(e->buf + e->len, p, n);
	e->len += n;
	e->buf[e->len] = 0;
	return n;
}

/* The request's headers: JSON, and the token once authenticated (not for authenticating). */
static struct curl_slist *headers(const struct etcd *e, const char *path)
{
	struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json"), *t;
	char auth[TOKEN_MAX + 32];

	if (!h || !e->token[0] || !strcmp(path, AUTH_PATH))
		return h;
	snprintf(auth, sizeof(auth), "Authorization: %s", e->token);
	t = curl_slist_append(h, auth);
	explicit_bzero(auth, sizeof(auth));
	if (!t) {
		curl_slist_free_all(h);
		return NULL;
	}
	return t;
}

static void setup(struct etcd *e, const char *path, const char *body,
		  struct curl_slist *headers, char *url)
{
	snprintf(url, URL_MAX + 32, "%s%s", e->urls[e->cur], path);
	curl_easy_reset(e->curl);
	curl_easy_setopt(e->curl, CURLOPT_URL, url);
	curl_easy_setopt(e->curl, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(e->curl, CURLOPT_PROTOCOLS_STR, "http,https");
	if (e->ca_file)
		curl_easy_setopt(e->curl, CURLOPT_CAINFO, e->ca_file);
	if (e->cert_file) {
		curl_easy_setopt(e->curl, CURLOPT_SSLCERT, e->cert_file);
		curl_easy_setopt(e->curl, CURLOPT_SSLKEY, e->key_file);
	}
	curl_easy_setopt(e->curl, CURLOPT_POSTFIELDS, body);
	curl_easy_setopt(e->curl, CURLOPT_HTTPHEADER, headers);
	curl_easy_setopt(e->curl, CURLOPT_ERRORBUFFER, e->error);
	curl_easy_setopt(e->curl, CURLOPT_CONNECTTIMEOUT_MS, (long)e->timeout_ms);
	e->error[0] = 0;
	e->len = 0;
	e->overflow = false;
}

/* The gateway's {"error": ..., "message": ...} answer as -errno. */
static int gateway_error(struct etcd *e, json_object *o, long status)
{
	json_object *m;
	const char *msg = "";

	if (o && (json_object_object_get_ex(o, "message", &m) ||
		  json_object_object_get_ex(o, "error", &m)))
		msg = json_object_get_string(m);
	snprintf(e->error, sizeof(e->error), "HTTP %ld from %s: %.200s", status, e->urls[e->cur],
		 msg);
	if (strstr(msg, "lease not found"))
		return -ENOENT;
	/* a token etcd no longer takes (its TTL passed, etcd restarted, auth revision moved) */
	if (strstr(msg, "invalid auth token") || strstr(msg, "revision of auth store is old"))
		return EKEYEXPIRED_ETCD;
	if (strstr(msg, "authentication failed") || strstr(msg, "permission denied") ||
	    strstr(msg, "user name is empty") || strstr(msg, "authentication is not enabled") ||
	    strstr(msg, "user name not found")) {
		if (strstr(msg, "user name is empty"))
			snprintf(e->error + strlen(e->error), sizeof(e->error) - strlen(e->error),
				 " (etcd has authentication on: set cluster_etcd_user and "
				 "cluster_etcd_password_file)");
		return -EACCES;
	}
	return -EPROTO;
}

/* A failed transfer's curl code as -errno, with a hint in e->error for TLS failures. */
static int transfer_error(struct etcd *e, CURLcode cc)
{
	const char *hint = NULL;
	size_t n;

	if (!e->error[0])
		snprintf(e->error, sizeof(e->error), "%s", curl_easy_strerror(cc));
	if (e->overflow) {
		snprintf(e->error, sizeof(e->error), "answer from %s over %u bytes", e->urls[e->cur],
			 REPLY_MAX);
		return -EPROTO;
	}
	switch (cc) {
	case CURLE_OPERATION_TIMEDOUT:
		return -ETIMEDOUT;
	case CURLE_PEER_FAILED_VERIFICATION:
	case CURLE_SSL_ISSUER_ERROR:
		hint = "etcd's certificate is not trusted: is cluster_etcd_ca_file the CA that "
		       "signed it, and the endpoint's host in it?";
		break;
	case CURLE_SSL_CERTPROBLEM:
	case CURLE_SSL_CACERT_BADFILE:
	case CURLE_SSL_CRL_BADFILE:
		hint = "a certificate or key file could not be used (cluster_etcd_ca_file, "
		       "cluster_etcd_cert_file, cluster_etcd_key_file)";
		break;
	case CURLE_SSL_CONNECT_ERROR:
	case CURLE_SSL_CIPHER:
	case CURLE_USE_SSL_FAILED:
		hint = "the TLS handshake failed (an https:// endpoint on a plain http:// etcd?)";
		break;
	case CURLE_RECV_ERROR:
	case CURLE_SEND_ERROR:
		/*
		 * Connected, then cut off over TLS: with TLS 1.3 a client certificate etcd
		 * refuses (or none where it wants one) shows only here, as an alert on the
		 * first read or a reset, depending on timing.
		 */
		if (!strncmp(e->urls[e->cur], "https://", 8))
			hint = e->cert_file ? "etcd closed the TLS connection: does it trust the "
					      "client certificate (cluster_etcd_cert_file)?"
					    : "etcd closed the TLS connection: it may want a client "
					      "certificate (cluster_etcd_cert_file, "
					      "cluster_etcd_key_file)";
		break;
	default:
		break;
	}
	if (!hint)
		return -ECONNREFUSED;
	n = strlen(e->error);
	snprintf(e->error + n, sizeof(e->error) - n, " [%s]", hint);
	return -EPROTO;
}

/*
 * POST text to path on the first endpoint that answers; *out is the parsed
 * answer (json_object_put it). Returns 0 or -errno (EKEYEXPIRED_ETCD: the
 * token was refused).
 */
static int call_once(struct etcd *e, const char *path, const char *text, json_object **out)
{
	struct curl_slist *h = headers(e, path);
	int rc = -ECONNREFUSED;

	*out = NULL;
	if (!h)
		return -ENOMEM;
	for (unsigned tries = 0; tries < e->n_urls; tries++) {
		char url[URL_MAX + 32];
		CURLcode cc;
		long status = 0;
		json_object *o;

		setup(e, path, text, h, url);
		curl_easy_setopt(e->curl, CURLOPT_TIMEOUT_MS, (long)e->timeout_ms);
		curl_easy_setopt(e->curl, CURLOPT_WRITEFUNCTION, on_data);
		curl_easy_setopt(e->curl, CURLOPT_WRITEDATA, e);
		cc = curl_easy_perform(e->curl);
		if (cc != CURLE_OK) {
			rc = transfer_error(e, cc);
			e->cur = (e->cur + 1) % e->n_urls; /* the next endpoint, next time too */
			continue;
		}
		curl_easy_getinfo(e->curl, CURLINFO_RESPONSE_CODE, &status);
		o = e->len ? json_tokener_parse(e->buf) : NULL;
		if (!o || !json_object_is_type(o, json_type_object)) {
			size_t n = strcspn(e->len ? e->buf : "", "\r\n");

			snprintf(e->error, sizeof(e->error), "HTTP %ld from %s: not the gateway's JSON: "
				 "'%.*s'", status, e->urls[e->cur], (int)(n > 160 ? 160 : n),
				 e->len ? e->buf : "");
			json_object_put(o);
			rc = -EPROTO;
			break;
		}
		if (status != 200) {
			rc = gateway_error(e, o, status);
			json_object_put(o);
			break;
		}
		*out = o;
		rc = 0;
		break;
	}
	curl_slist_free_all(h);
	return rc;
}

/* A token for e->user into e->token. 0, or -EACCES (refused) and the call's errors. */
static int authenticate(struct etcd *e)
{
	json_object *q = json_object_new_object(), *r, *t;
	const char *text;
	int rc;

	e->token[0] = 0;
	json_object_object_add(q, "name", json_object_new_string(e->user));
	json_object_object_add(q, "password", json_object_new_string(e->password));
	text = json_object_to_json_string_ext(q, JSON_C_TO_STRING_PLAIN);
	rc = call_once(e, AUTH_PATH, text, &r);
	explicit_bzero((char *)text, strlen(text));
	json_object_put(q);
	if (rc) {
		size_t n = strlen(e->error);

		snprintf(e->error + n, sizeof(e->error) - n, " (authenticating as etcd user '%.64s')",
			 e->user);
		return rc == EKEYEXPIRED_ETCD ? -EACCES : rc;
	}
	if (!json_object_object_get_ex(r, "token", &t) || !json_object_is_type(t, json_type_string) ||
	    !json_object_get_string_len(t) || json_object_get_string_len(t) > TOKEN_MAX ||
	    strpbrk(json_object_get_string(t), "\r\n")) {
		snprintf(e->error, sizeof(e->error), "authenticating at %s: no usable token in the "
			 "answer (is authentication enabled in etcd?)", e->urls[e->cur]);
		json_object_put(r);
		return -EPROTO;
	}
	snprintf(e->token, sizeof(e->token), "%s", json_object_get_string(t));
	json_object_put(r);
	return 0;
}

/*
 * POST body (a JSON object, consumed) to path, authenticated when e has a
 * user: a token first if there is none yet, a new one and the call again when
 * etcd no longer takes it. Returns 0 or -errno.
 */
static int call(struct etcd *e, const char *path, json_object *body, json_object **out)
{
	const char *text = json_object_to_json_string_ext(body, JSON_C_TO_STRING_PLAIN);
	int rc = 0;

	*out = NULL;
	if (e->user && !e->token[0])
		rc = authenticate(e);
	if (!rc)
		rc = call_once(e, path, text, out);
	if (rc == EKEYEXPIRED_ETCD && e->user) {
		rc = authenticate(e);
		if (!rc)
			rc = call_once(e, path, text, out);
	}
	json_object_put(body);
	return rc == EKEYEXPIRED_ETCD ? -EACCES : rc;
}

static json_object *b64_string(const void *p, size_t n)
{
	char *s = malloc(4 * ((n + 2) / 3) + 1);
	json_object *o;

	if (!s)
		return NULL;
	etcd_b64_encode(p, n, s);
	o = json_object_new_string(s);
	free(s);
	return o;
}

static json_object *int_string(int64_t v)
{
	char s[24];

	snprintf(s, sizeof(s), "%" PRId64, v);
	return json_object_new_string(s);
}

/* {"key": prefix, "range_end": prefix with its last byte + 1} into o. */
static void add_prefix(json_object *o, const char *prefix)
{
	size_t n = strlen(prefix);
	char end[512];

	snprintf(end, sizeof(end), "%s", prefix);
	if (n && n < sizeof(end))
		end[n - 1]++; /* a prefix ends in '/', so no carry */
	json_object_object_add(o, "key", b64_string(prefix, n));
	json_object_object_add(o, "range_end", b64_string(end, n));
}

int etcd_probe(struct etcd *e, const char *prefix)
{
	json_object *q = json_object_new_object(), *r;
	int rc;

	add_prefix(q, prefix);
	json_object_object_add(q, "count_only", json_object_new_boolean(1));
	rc = call(e, "/v3/kv/range", q, &r);
	json_object_put(r);
	return rc;
}

int etcd_lease_grant(struct etcd *e, int64_t ttl_s, int64_t *id)
{
	json_object *q = json_object_new_object(), *r;
	int rc;

	json_object_object_add(q, "TTL", int_string(ttl_s));
	rc = call(e, "/v3/lease/grant", q, &r);
	if (rc)
		return rc;
	*id = int_member(r, "ID", 0);
	json_object_put(r);
	if (!*id) {
		snprintf(e->error, sizeof(e->error), "lease grant from %s: no lease id", e->urls[e->cur]);
		return -EPROTO;
	}
	return 0;
}

int etcd_lease_keepalive(struct etcd *e, int64_t id, int64_t *ttl_s)
{
	json_object *q = json_object_new_object(), *r, *res;
	int rc;

	json_object_object_add(q, "ID", int_string(id));
	rc = call(e, "/v3/lease/keepalive", q, &r);
	if (rc)
		return rc;
	/* one streamed message: {"result": {..., "TTL": "10"}}; no TTL once the lease is gone */
	if (!json_object_object_get_ex(r, "result", &res))
		res = r;
	*ttl_s = int_member(res, "TTL", 0);
	json_object_put(r);
	return *ttl_s > 0 ? 0 : -ENOENT;
}

int etcd_lease_revoke(struct etcd *e, int64_t id)
{
	json_object *q = json_object_new_object(), *r;
	int rc;

	json_object_object_add(q, "ID", int_string(id));
	rc = call(e, "/v3/lease/revoke", q, &r);
	json_object_put(r);
	return rc;
}

int etcd_put(struct etcd *e, const char *key, const void *val, size_t vlen, int64_t lease)
{
	json_object *q = json_object_new_object(), *r;
	int rc;

	json_object_object_add(q, "key", b64_string(key, strlen(key)));
	json_object_object_add(q, "value", b64_string(val, vlen));
	if (lease)
		json_object_object_add(q, "lease", int_string(lease));
	rc = call(e, "/v3/kv/put", q, &r);
	json_object_put(r);
	return rc;
}

/* fn for one {"key", "value"} object. */
static int one_kv(json_object *kv, bool put,
		  int (*fn)(void *, bool, const char *, const char *, size_t, int64_t), void *ctx,
		  int64_t rev)
{
	size_t kl, vl;
	char *k = b64_member(kv, "key", &kl), *v = put ? b64_member(kv, "value", &vl) : NULL;
	int rc;

	if (!k || (put && !v)) {
		free(k);
		free(v);
		return -EPROTO;
	}
	rc = fn(ctx, put, k, v, put ? vl : 0, rev);
	free(k);
	free(v);
	return rc;
}

struct range_ctx {
	int (*fn)(void *ctx, const char *key, const char *val, size_t vlen);
	void *ctx;
};

static int range_one(void *ctx, bool put, const char *k, const char *v, size_t vl, int64_t rev)
{
	struct range_ctx *rc = ctx;

	(void)put;
	(void)rev;
	return rc->fn(rc->ctx, k, v, vl);
}

int etcd_range_prefix(struct etcd *e, const char *prefix,
		      int (*fn)(void *ctx, const char *key, const char *val, size_t vlen),
		      void *ctx, int64_t *revision)
{
	json_object *q = json_object_new_object(), *r, *kvs, *hdr;
	struct range_ctx rctx = { fn, ctx };
	int rc;

	add_prefix(q, prefix);
	rc = call(e, "/v3/kv/range", q, &r);
	if (rc)
		return rc;
	*revision = json_object_object_get_ex(r, "header", &hdr) ? int_member(hdr, "revision", 0) : 0;
	if (json_object_object_get_ex(r, "kvs", &kvs) && json_object_is_type(kvs, json_type_array))
		for (size_t i = 0; !rc && i < json_object_array_length(kvs); i++)
			rc = one_kv(json_object_array_get_idx(kvs, i), true, range_one, &rctx, 0);
	json_object_put(r);
	return rc;
}

/* ---- watch: a stream of JSON objects ---- */

static int watch_message(struct etcd *e, json_object *o)
{
	json_object *res, *evs, *hdr;

	if (!json_object_object_get_ex(o, "result", &res)) {
		int rc = gateway_error(e, o, 200);

		if (rc == EKEYEXPIRED_ETCD) {
			e->token[0] = 0; /* the next call authenticates again */
			rc = -EACCES;
		}
		return rc == -EACCES ? rc : -EPROTO;
	}
	if (int_member(res, "compact_revision", 0) > 0) {
		snprintf(e->error, sizeof(e->error), "watch start compacted away (at %" PRId64 ")",
			 int_member(res, "compact_revision", 0));
		return -ESTALE;
	}
	if (json_object_object_get_ex(res, "created", &hdr))
		e->watch_created = true;
	if (json_object_object_get_ex(res, "canceled", &hdr) && json_object_get_boolean(hdr)) {
		json_object *why;
		const char *reason = json_object_object_get_ex(res, "cancel_reason", &why)
					     ? json_object_get_string(why)
					     : "";

		snprintf(e->error, sizeof(e->error), "watch canceled by %s: %.200s", e->urls[e->cur],
			 reason);
		if (strstr(reason, "auth token") || strstr(reason, "auth store")) {
			e->token[0] = 0; /* the next call authenticates again */
			return -EACCES;
		}
		return strstr(reason, "permission denied") ? -EACCES : -ECONNRESET;
	}
	if (!json_object_object_get_ex(res, "events", &evs) ||
	    !json_object_is_type(evs, json_type_array))
		return 0;
	for (size_t i = 0; i < json_object_array_length(evs); i++) {
		json_object *ev = json_object_array_get_idx(evs, i), *kv, *type;
		bool put = !(json_object_object_get_ex(ev, "type", &type) &&
			     !strcmp(json_object_get_string(type), "DELETE"));
		int rc;

		if (!json_object_object_get_ex(ev, "kv", &kv))
			continue;
		rc = one_kv(kv, put, e->watch_fn, e->watch_ctx, int_member(kv, "mod_revision", 0));
		if (rc)
			return rc;
	}
	return 0;
}

static size_t on_watch_data(char *p, size_t size, size_t nmemb, void *ctx)
{
	struct etcd *e = ctx;
	size_t n = size * nmemb, off = 0;

	while (off < n) {
		json_object *o;
		enum json_tokener_error je;

		while (off < n && (p[off] == '\n' || p[off] == '\r' || p[off] == ' '))
			off++;
		if (off == n)
			break;
		o = json_tokener_parse_ex(e->tok, p + off, (int)(n - off));
		je = json_tokener_get_error(e->tok);
		if (je == json_tokener_continue)
			return n; /* the object goes on in the next piece */
		if (!o) {
			snprintf(e->error, sizeof(e->error), "watch stream from %s: %s", e->urls[e->cur],
				 json_tokener_error_desc(je));
			e->watch_rc = -EPROTO;
			return 0;
		}
		off += json_tokener_get_parse_end(e->tok);
		json_tokener_reset(e->tok);
		e->watch_rc = watch_message(e, o);
		json_object_put(o);
		if (e->watch_rc)
			return 0;
	}
	return n;
}

static int on_progress(void *ctx, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d)
{
	struct etcd *e = ctx;

	(void)a;
	(void)b;
	(void)c;
	(void)d;
	return e->stop && atomic_load(e->stop);
}

int etcd_watch_prefix(struct etcd *e, const char *prefix, int64_t start,
		      int (*fn)(void *ctx, bool put, const char *key, const char *val, size_t vlen,
				int64_t rev),
		      void *ctx, const atomic_bool *stop)
{
	json_object *q = json_object_new_object(), *cr = json_object_new_object();
	struct curl_slist *h;
	char url[URL_MAX + 32];
	const char *text;
	CURLcode cc;
	long status = 0;
	int rc;

	if (e->user && !e->token[0]) {
		rc = authenticate(e);
		if (rc) {
			json_object_put(q);
			json_object_put(cr);
			return rc;
		}
	}
	h = headers(e, "/v3/watch");
	if (!h) {
		json_object_put(q);
		json_object_put(cr);
		return -ENOMEM;
	}
	add_prefix(cr, prefix);
	json_object_object_add(cr, "start_revision", int_string(start));
	json_object_object_add(q, "create_request", cr);
	text = json_object_to_json_string_ext(q, JSON_C_TO_STRING_PLAIN);
	if (!e->tok && !(e->tok = json_tokener_new())) {
		json_object_put(q);
		curl_slist_free_all(h);
		return -ENOMEM;
	}
	json_tokener_reset(e->tok);
	e->watch_fn = fn;
	e->watch_ctx = ctx;
	e->stop = stop;
	e->watch_rc = 0;
	e->watch_created = false;
	setup(e, "/v3/watch", text, h, url);
	curl_easy_setopt(e->curl, CURLOPT_WRITEFUNCTION, on_watch_data);
	curl_easy_setopt(e->curl, CURLOPT_WRITEDATA, e);
	curl_easy_setopt(e->curl, CURLOPT_NOPROGRESS, 0L);
	curl_easy_setopt(e->curl, CURLOPT_XFERINFOFUNCTION, on_progress);
	curl_easy_setopt(e->curl, CURLOPT_XFERINFODATA, e);
	cc = curl_easy_perform(e->curl);
	curl_easy_getinfo(e->curl, CURLINFO_RESPONSE_CODE, &status);
	if (e->watch_rc)
		rc = e->watch_rc;
	else if (cc == CURLE_ABORTED_BY_CALLBACK)
		rc = -ECANCELED;
	else if (cc != CURLE_OK) {
		rc = transfer_error(e, cc);
		if (rc != -EPROTO)
			rc = -ECONNRESET;
		e->cur = (e->cur + 1) % e->n_urls;
	} else if (status != 200) {
		json_object *o = e->len ? json_tokener_parse(e->buf) : NULL;

		rc = gateway_error(e, o, status);
		json_object_put(o);
		if (rc == EKEYEXPIRED_ETCD) {
			e->token[0] = 0;
			rc = -EACCES;
		}
	} else {
		snprintf(e->error, sizeof(e->error), "watch stream from %s ended (HTTP %ld)",
			 e->urls[e->cur], status);
		rc = -ECONNRESET;
	}
	e->stop = NULL;
	json_object_put(q);
	curl_slist_free_all(h);
	return rc;
}
