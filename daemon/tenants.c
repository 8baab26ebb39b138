/* tenants — namespaces bound to client identities; see tenants.h. */
#include "daemon/tenants.h"

#include <ctype.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum match_kind { MATCH_UID, MATCH_GID, MATCH_KEY, MATCH_CAPACITY };

struct match {
	enum match_kind kind;
	unsigned long id;
	char key[41];
	size_t tenant; /* index into names */
};

struct tenants {
	char (*names)[TENANT_NAME_MAX + 1];
	uint64_t *capacity; /* per name; 0: none */
	size_t n_names;
	struct match *m;
	size_t n;
};

static bool name_ok(const char *s)
{
	size_t n = strlen(s);

	if (!n || n > TENANT_NAME_MAX)
		return false;
	for (; *s; s++)
		if (!isalnum((unsigned char)*s) && !strchr("._-", *s))
			return false;
	return true;
}

/* One MATCH word of a line into *m. */
static int parse_match(const char *w, struct match *m)
{
	char *end;

	if (!strncmp(w, "uid=", 4) || !strncmp(w, "gid=", 4)) {
		m->kind = w[0] == 'u' ? MATCH_UID : MATCH_GID;
		errno = 0;
		m->id = strtoul(w + 4, &end, 10);
		return w[4] && !*end && !errno && m->id <= 0xffffffffUL ? 0 : -EINVAL;
	}
	if (!strncmp(w, "key=", 4) && strlen(w + 4) == 40) {
		m->kind = MATCH_KEY;
		memcpy(m->key, w + 4, 41);
		return 0;
	}
	if (!strncmp(w, "capacity=", 9)) {
		/* a size: digits with an optional K, M, G or T (powers of 1024) */
		unsigned shift = 0;

		errno = 0;
		m->id = strtoul(w + 9, &end, 10);
		if (end == w + 9 || errno)
			return -EINVAL;
		if (*end) {
			const char *u = strchr("KMGT", toupper((unsigned char)*end));

			if (!u || end[1])
				return -EINVAL;
			shift = 10 * (unsigned)(u - "KMGT" + 1);
		}
		if (!m->id || m->id > (~0UL >> shift))
			return -EINVAL;
		m->id <<= shift;
		m->kind = MATCH_CAPACITY;
		return 0;
	}
	return -EINVAL;
}

static int add_line(struct tenants *t, char *line, char *err, size_t errlen, const char *path,
		    unsigned lineno)
{
	char *save = NULL, *w = strtok_r(line, " \t\r\n", &save);
	bool matched = false;
	size_t idx;

	if (!w || *w == '#')
		return 0;
	if (!name_ok(w)) {
		snprintf(err, errlen, "tenants_file %s:%u: tenant name '%s' must be 1..%d letters, "
			 "digits, '.', '_' or '-'", path, lineno, w, TENANT_NAME_MAX);
		return -EINVAL;
	}
	for (idx = 0; idx < t->n_names && strcmp(t->names[idx], w); idx++)
		;
	if (idx == t->n_names) {
		void *nn = realloc(t->names, (t->n_names + 1) * sizeof(*t->names));
		void *nc;

		if (!nn)
			return -ENOMEM;
		t->names = nn;
		nc = realloc(t->capacity, (t->n_names + 1) * sizeof(*t->capacity));
		if (!nc)
			return -ENOMEM;
		t->capacity = nc;
		t->capacity[t->n_names] = 0;
		snprintf(t->names[t->n_names++], TENANT_NAME_MAX + 1, "%s", w);
	}
	for (w = strtok_r(NULL, " \t\r\n", &save); w && *w != '#';
	     w = strtok_r(NULL, " \t\r\n", &save)) {
		struct match m = { .tenant = idx };
		void *nm;

		if (parse_match(w, &m)) {
			snprintf(err, errlen, "tenants_file %s:%u: '%s' is not uid=N, gid=N, "
				 "key=KEY (a 40-character Z85 CURVE public key) or capacity=SIZE",
				 path, lineno, w);
			return -EINVAL;
		}
		if (m.kind == MATCH_CAPACITY) {
			t->capacity[idx] = m.id;
			continue;
		}
		matched = true;
		nm = realloc(t->m, (t->n + 1) * sizeof(*t->m));
		if (!nm)
			return -ENOMEM;
		t->m = nm;
		t->m[t->n++] = m;
	}
	if (!matched) {
		snprintf(err, errlen, "tenants_file %s:%u: tenant '%s' has no uid=, gid= or key=",
			 path, lineno, t->names[idx]);
		return -EINVAL;
	}
	return 0;
}

int tenants_load(const char *path, struct tenants **out, char *err, size_t errlen)
{
	struct tenants *t = calloc(1, sizeof(*t));
	char line[1024];
	unsigned lineno = 0;
	FILE *f;
	int rc = 0;

	if (!t)
		return -ENOMEM;
	if (!path || !path[0]) {
		*out = t;
		return 0;
	}
	f = fopen(path, "r");
	if (!f) {
		rc = -errno;
		snprintf(err, errlen, "tenants_file %s: %s", path, strerror(-rc));
		tenants_free(&t);
		return rc;
	}
	while (!rc && fgets(line, sizeof(line), f))
		rc = add_line(t, line, err, errlen, path, ++lineno);
	fclose(f);
	if (rc) {
		if (rc == -ENOMEM)
			snprintf(err, errlen, "tenants_file %s: out of memory", path);
		tenants_free(&t);
		return rc;
	}
	*out = t;
	return 0;
}

void tenants_free(struct tenants **tp)
{
	struct tenants *t = tp ? *tp : NULL;

	if (!t)
		return;
	free(t->names);
	free(t->capacity);
	free(t->m);
	free(t);
	*tp = NULL;
}

const char *tenants_of(const struct tenants *t, const char *principal)
{
	unsigned long uid = 0, gid = 0;
	bool ipc = false, key = false;

	if (!t || !t->n)
		return "";
	if (!strncmp(principal, "ipc:", 4))
		ipc = sscanf(principal + 4, "%lu:%lu:", &uid, &gid) == 2;
	else
		key = !strncmp(principal, "key:", 4) && strlen(principal + 4) == 40;
	for (size_t i = 0; i < t->n; i++) {
		const struct match *m = &t->m[i];

		if ((ipc && m->kind == MATCH_UID && m->id == uid) ||
		    (ipc && m->kind == MATCH_GID && m->id == gid) ||
		    (key && m->kind == MATCH_KEY && !strcmp(m->key, principal + 4)))
			return t->names[m->tenant];
	}
	return "";
}

uint64_t tenants_capacity(const struct tenants *t, const char *ns)
{
	for (size_t i = 0; t && ns[0] && i < t->n_names; i++)
		if (!strcmp(t->names[i], ns))
			return t->capacity[i];
	return 0;
}

bool tenants_quota_any(const struct tenants *t)
{
	for (size_t i = 0; t && i < t->n_names; i++)
		if (t->capacity[i])
			return true;
	return false;
}

size_t tenants_count(const struct tenants *t)
{
	return t ? t->n_names : 0;
}
