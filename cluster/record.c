/* record — a cluster member's record in etcd; see record.h. */
#include "cluster/record.h"

#include <errno.h>
#include <json-c/json.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

__attribute__((format(printf, 3, 4))) static void say(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (!errlen)
		return;
	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
}

int record_endpoint_ok(const char *s, size_t n)
{
	if (n < 7 || n >= RECORD_ENDPOINT_MAX || strncmp(s, "tcp://", 6))
		return 0;
	for (size_t i = 6; i < n; i++) /* printable ASCII: host names, addresses, ports */
		if (s[i] <= ' ' || s[i] > '~' || s[i] == ',')
			return 0;
	return 1;
}

static bool z85_key(const char *s, size_t n)
{
	static const char alphabet[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTU"
				       "VWXYZ.-:+=^!/*?&<>()[]{}@%$#";

	if (n != RECORD_KEY_LEN)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!s[i] || !strchr(alphabet, s[i]))
			return false;
	return true;
}

/*
 * The string field name of o into out (cap bytes); absent leaves out as it is.
 * A field of another type, or a string that does not fit, is an error.
 */
static int string_field(json_object *o, const char *name, char *out, size_t cap, size_t *len,
			char *err, size_t errlen)
{
	json_object *f;
	size_t n;

	if (!json_object_object_get_ex(o, name, &f))
		return 1;
	if (!json_object_is_type(f, json_type_string)) {
		say(err, errlen, "\"%s\" is %s, not a string", name,
		    json_type_to_name(json_object_get_type(f)));
		return -EINVAL;
	}
	n = (size_t)json_object_get_string_len(f);
	if (n >= cap) {
		say(err, errlen, "\"%s\" has %zu characters; at most %zu", name, n, cap - 1);
		return -EINVAL;
	}
	memcpy(out, json_object_get_string(f), n);
	out[n] = 0;
	*len = n;
	return 0;
}

int record_parse(const char *json, size_t len, struct member_record *out, char *err,
		 size_t errlen)
{
	struct member_record r = { .endpoint = "" };
	struct json_tokener *tok;
	json_object *o = NULL, *f;
	char id[256] = "";
	size_t n = 0;
	int rc = -EINVAL;

	if (len > 64 * 1024 || len > INT32_MAX) {
		say(err, errlen, "record of %zu bytes; at most 65536", len);
		return -EINVAL;
	}
	tok = json_tokener_new();
	if (!tok) {
		say(err, errlen, "out of memory");
		return -ENOMEM;
	}
	o = json_tokener_parse_ex(tok, json, (int)len);
	if (!o && json_tokener_get_error(tok) == json_tokener_continue)
		o = json_tokener_parse_ex(tok, "", 1); /* the end: a bare number or null ends here */
	if (json_tokener_get_error(tok) != json_tokener_success) {
		say(err, errlen, "not JSON (%s)",
		    json_tokener_error_desc(json_tokener_get_error(tok)));
		goto out;
	}
	if (!o || !json_object_is_type(o, json_type_object)) { /* JSON null is a NULL o */
		say(err, errlen, "not a JSON object");
		goto out;
	}
	switch (string_field(o, "endpoint", r.endpoint, sizeof(r.endpoint), &n, err, errlen)) {
	case 1:
		say(err, errlen, "no \"endpoint\"");
		goto out;
	case 0:
		if (record_endpoint_ok(r.endpoint, n))
			break;
		for (size_t i = 0; i < n; i++) /* quoted in logs: no control or 8-bit bytes */
			if (r.endpoint[i] < ' ' || r.endpoint[i] > '~')
				r.endpoint[i] = '?';
		say(err, errlen, "\"endpoint\" '%.100s' is not tcp://HOST:PORT", r.endpoint);
		/* fall through */
	default:
		goto out;
	}
	switch (string_field(o, "curve_public_key", r.key, sizeof(r.key), &n, err, errlen)) {
	case 1:
		break;
	case 0:
		if (!n || z85_key(r.key, n))
			break;
		say(err, errlen, "\"curve_public_key\" is not empty nor %d Z85 characters",
		    RECORD_KEY_LEN);
		/* fall through */
	default:
		goto out;
	}
	if (string_field(o, "id", id, sizeof(id), &n, err, errlen) < 0 ||
	    string_field(o, "version", r.version, sizeof(r.version), &n, err, errlen) < 0)
		goto out;
	if (!json_object_object_get_ex(o, "capacity", &f)) {
		say(err, errlen, "no \"capacity\"");
		goto out;
	}
	if (!json_object_is_type(f, json_type_int) || json_object_get_int64(f) <= 0) {
		say(err, errlen, "\"capacity\" must be an integer above 0 (bytes)");
		goto out;
	}
	r.capacity = (uint64_t)json_object_get_int64(f);
	*out = r;
	rc = 0;
out:
	json_object_put(o);
	json_tokener_free(tok);
	return rc;
}

int record_format(const char *id, const struct member_record *r, char *buf, size_t size)
{
	json_object *rec = json_object_new_object();
	const char *s;
	size_t n;
	int rc;

	if (!rec)
		return -ENOMEM;
	json_object_object_add(rec, "id", json_object_new_string(id));
	json_object_object_add(rec, "endpoint", json_object_new_string(r->endpoint));
	json_object_object_add(rec, "curve_public_key", json_object_new_string(r->key));
	json_object_object_add(rec, "capacity", json_object_new_int64((int64_t)r->capacity));
	json_object_object_add(rec, "version", json_object_new_string(r->version));
	s = json_object_to_json_string_ext(rec, JSON_C_TO_STRING_PLAIN);
	n = s ? strlen(s) : 0;
	if (!s)
		rc = -ENOMEM;
	else if (n >= size)
		rc = -ENOSPC;
	else {
		memcpy(buf, s, n + 1);
		rc = (int)n;
	}
	json_object_put(rec);
	return rc;
}
