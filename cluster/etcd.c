/* etcd — etcd v3 through its JSON gateway; see etcd.h. */
#include "etcd.h"

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

struct etcd {
	CURL *curl;
	char urls[ENDPOINTS_MAX][URL_MAX];
	unsigned n_urls, cur;
	int timeout_ms;
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

int etcd_new(const char *endpoints, int timeout_ms, struct etcd **out, char *err, size_t errlen)
{
	struct etcd *e = calloc(1, sizeof(*e));
	const char *s = endpoints;

	*out = NULL;
	if (!e)
		return -ENOMEM;
	while (*s) {
		size_t n = strcspn(s, ", \t");

		if (!n) {
			s++;
			continue;
		}
		if (strncmp(s, "http://", 7) || n <= 7 || n >= URL_MAX - 16) {
			snprintf(err, errlen, "cluster_etcd: '%.*s' is not http://HOST:PORT", (int)n, s);
			free(e);
			return -EINVAL;
		}
		if (e->n_urls == ENDPOINTS_MAX) {
			snprintf(err, errlen, "cluster_etcd: more than %d endpoints", ENDPOINTS_MAX);
			free(e);
			return -EINVAL;
		}
		memcpy(e->urls[e->n_urls], s, n);
		/* no trailing slash: paths are appended as /v3/... */
		while (n > 7 && e->urls[e->n_urls][n - 1] == '/')
			e->urls[e->n_urls][--n] = 0;
		e->n_urls++;
		s += n;
		while (*s == '/')
			s++;
	}
	if (!e->n_urls) {
		snprintf(err, errlen, "cluster_etcd: no endpoint");
		free(e);
		return -EINVAL;
	}
	e->timeout_ms = timeout_ms;
	e->curl = curl_easy_init();
	if (!e->curl) {
		free(e);
		return -ENOMEM;
	}
	*out = e;
	return 0;
}

void etcd_free(struct etcd **ep)
{
	struct etcd *e = ep ? *ep : NULL;

	if (!e)
		return;
	curl_easy_cleanup(e->curl);
	if (e->tok)
		json_tokener_free(e->tok);
	free(e->buf);
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

static void setup(struct etcd *e, const char *path, const char *body,
		  struct curl_slist *headers, char *url)
{
	snprintf(url, URL_MAX + 32, "%s%s", e->urls[e->cur], path);
	curl_easy_reset(e->curl);
	curl_easy_setopt(e->curl, CURLOPT_URL, url);
	curl_easy_setopt(e->curl, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(e->curl, CURLOPT_PROTOCOLS_STR, "http");
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
	return strstr(msg, "lease not found") ? -ENOENT : -EPROTO;
}

/*
 * POST body (a JSON object, consumed) to path on the first endpoint that
 * answers; *out is the parsed answer (json_object_put it). Returns 0 or -errno.
 */
static int call(struct etcd *e, const char *path, json_object *body, json_object **out)
{
	const char *text = json_object_to_json_string_ext(body, JSON_C_TO_STRING_PLAIN);
	struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
	int rc = -ECONNREFUSED;

	*out = NULL;
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
			if (!e->error[0])
				snprintf(e->error, sizeof(e->error), "%s", curl_easy_strerror(cc));
			rc = cc == CURLE_OPERATION_TIMEDOUT ? -ETIMEDOUT
			     : e->overflow		    ? -EPROTO
							    : -ECONNREFUSED;
			if (e->overflow)
				snprintf(e->error, sizeof(e->error), "answer from %s over %u bytes",
					 e->urls[e->cur], REPLY_MAX);
			e->cur = (e->cur + 1) % e->n_urls; /* the next endpoint, next time too */
			continue;
		}
		curl_easy_getinfo(e->curl, CURLINFO_RESPONSE_CODE, &status);
		o = e->len ? json_tokener_parse(e->buf) : NULL;
		if (!o || !json_object_is_type(o, json_type_object)) {
			snprintf(e->error, sizeof(e->error), "HTTP %ld from %s: not the gateway's JSON",
				 status, e->urls[e->cur]);
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
	json_object_put(body);
	return rc;
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
		gateway_error(e, o, 200);
		return -EPROTO;
	}
	if (int_member(res, "compact_revision", 0) > 0) {
		snprintf(e->error, sizeof(e->error), "watch start compacted away (at %" PRId64 ")",
			 int_member(res, "compact_revision", 0));
		return -ESTALE;
	}
	if (json_object_object_get_ex(res, "created", &hdr))
		e->watch_created = true;
	if (json_object_object_get_ex(res, "canceled", &hdr) && json_object_get_boolean(hdr)) {
		snprintf(e->error, sizeof(e->error), "watch canceled by %s", e->urls[e->cur]);
		return -ECONNRESET;
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
	struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
	char url[URL_MAX + 32];
	const char *text;
	CURLcode cc;
	long status = 0;
	int rc;

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
		if (!e->error[0])
			snprintf(e->error, sizeof(e->error), "%s", curl_easy_strerror(cc));
		e->cur = (e->cur + 1) % e->n_urls;
		rc = -ECONNRESET;
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
