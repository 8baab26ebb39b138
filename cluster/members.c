/*
 * members — who is in the cluster (see cluster.h): the static cluster_peers list,
 * or etcd, where this daemon keeps its record under a lease and watches the
 * others' records, applied to the peers and the view as they change.
 */
#include "cluster/cluster_impl.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cluster/record.h"

/* ---- the members: a static list, or etcd's records ---- */

bool id_ok(const char *s, size_t n)
{
	if (!n || n > STORE_OWED_PEER_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)s[i]) && !strchr("._-", s[i]))
			return false;
	return true;
}

/* A new peer (the view lock held for writing, or before any thread runs). */
static struct peer *peer_add(struct cluster *c, const char *id, size_t id_len)
{
	struct peer *p;

	if (c->n_peers == MEMBERS_MAX - 1)
		return NULL;
	p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	memcpy(p->id, id, id_len);
	p->weight = 1.0;
	pthread_mutex_init(&p->lock, NULL);
	c->peers[c->n_peers++] = p;
	return p;
}

static struct peer *peer_find(struct cluster *c, const char *id)
{
	for (size_t i = 0; i < c->n_peers; i++)
		if (!strcmp(c->peers[i]->id, id))
			return c->peers[i];
	return NULL;
}

/* Close p's idle sockets (its endpoint or key changed); p->lock held. */
void peer_drop_idle(struct peer *p)
{
	while (p->n_idle)
		psock_free(p->idle[--p->n_idle]);
}

/* One "id=tcp://host:port[=key]" of cluster_peers. */
static int parse_peer(struct cluster *c, const char *s, size_t n, char *err, size_t errlen)
{
	const char *eq = memchr(s, '=', n), *ep, *eq2;
	size_t id_len, ep_len;
	struct peer *p;

	if (!eq) {
		snprintf(err, errlen, "cluster_peers: '%.*s' is not ID=tcp://HOST:PORT[=KEY]", (int)n,
			 s);
		return -EINVAL;
	}
	id_len = (size_t)(eq - s);
	if (!id_ok(s, id_len)) {
		snprintf(err, errlen, "cluster_peers: member id '%.*s' must be 1..%d letters, digits "
			 "or ._-", (int)id_len, s, STORE_OWED_PEER_MAX);
		return -EINVAL;
	}
	ep = eq + 1;
	eq2 = memchr(ep, '=', n - id_len - 1);
	ep_len = eq2 ? (size_t)(eq2 - ep) : n - id_len - 1;
	if (!record_endpoint_ok(ep, ep_len)) {
		snprintf(err, errlen, "cluster_peers: member '%.*s': endpoint '%.*s' must be "
			 "tcp://HOST:PORT", (int)id_len, s, (int)ep_len, ep);
		return -EINVAL;
	}
	if (eq2 && n - id_len - 1 - ep_len - 1 != 40) {
		snprintf(err, errlen, "cluster_peers: member '%.*s': a CURVE key is 40 Z85 "
			 "characters; got %zu", (int)id_len, s, n - id_len - 1 - ep_len - 1);
		return -EINVAL;
	}
	if (id_len == strlen(c->self) && !memcmp(s, c->self, id_len)) {
		if (!c->advertise[0]) /* this daemon, listed like the others */
			memcpy(c->advertise, ep, ep_len < sizeof(c->advertise) ? ep_len : 0);
		return 0;
	}
	for (size_t i = 0; i < c->n_peers; i++)
		if (strlen(c->peers[i]->id) == id_len && !memcmp(c->peers[i]->id, s, id_len)) {
			snprintf(err, errlen, "cluster_peers: member '%.*s' listed twice", (int)id_len,
				 s);
			return -EINVAL;
		}
	p = peer_add(c, s, id_len);
	if (!p) {
		snprintf(err, errlen, "cluster_peers: more than %d members", MEMBERS_MAX);
		return -EINVAL;
	}
	memcpy(p->endpoint, ep, ep_len);
	if (eq2)
		memcpy(p->key, eq2 + 1, 40);
	p->live = true;
	return 0;
}

/* The endpoint other members reach this daemon at (etcd mode). */
static int advertise_endpoint(struct cluster *c, const struct cluster_opts *o, char *err,
			      size_t errlen)
{
	const char *tcp = o->listen_tcp && o->listen_tcp[0] ? o->listen_tcp : NULL;

	if (o->advertise && o->advertise[0]) {
		if (!record_endpoint_ok(o->advertise, strlen(o->advertise))) {
			snprintf(err, errlen, "cluster_advertise: '%.200s' is not tcp://HOST:PORT",
				 o->advertise);
			return -EINVAL;
		}
		memcpy(c->advertise, o->advertise, strlen(o->advertise) + 1);
		return 0;
	}
	if (!tcp) {
		snprintf(err, errlen, "cluster_etcd needs a tcp:// endpoint in listen (other members "
			 "reach this daemon there), or cluster_advertise");
		return -EINVAL;
	}
	{
		const char *host = tcp + 6, *colon = strrchr(host, ':');
		size_t hl = colon ? (size_t)(colon - host) : strlen(host);

		if (!colon) {
			snprintf(err, errlen, "listen '%.200s' has no port", tcp);
			return -EINVAL;
		}
		if ((hl == 1 && host[0] == '*') || (hl == 7 && !memcmp(host, "0.0.0.0", 7)) ||
		    (hl == 4 && !memcmp(host, "[::]", 4))) {
			char name[256];

			if (gethostname(name, sizeof(name) - 1)) {
				snprintf(err, errlen, "listen '%.200s' binds every address: set "
					 "cluster_advertise", tcp);
				return -EINVAL;
			}
			name[sizeof(name) - 1] = 0;
			snprintf(c->advertise, sizeof(c->advertise), "tcp://%.100s%.20s", name, colon);
		} else {
			snprintf(c->advertise, sizeof(c->advertise), "%s", tcp);
		}
	}
	return 0;
}

int members_parse_list(struct cluster *c, const char *s, char *err, size_t errlen)
{
	while (*s) {
		size_t n = strcspn(s, ", \t\n");
		int rc;

		if (!n) {
			s++;
			continue;
		}
		rc = parse_peer(c, s, n, err, errlen);
		if (rc < 0)
			return rc;
		s += n;
	}
	return 0;
}

/* A file setting (NULL or "": unset) copied into dst; -EINVAL when it does not fit. */
static int copy_setting(char *dst, size_t cap, const char *key, const char *val, char *err,
			size_t errlen)
{
	size_t n = val ? strlen(val) : 0;

	if (n >= cap) {
		snprintf(err, errlen, "%s: longer than %zu characters", key, cap - 1);
		return -EINVAL;
	}
	memcpy(dst, n ? val : "", n + 1);
	return 0;
}

/* The password of cluster_etcd_user: the first line of path, without its newline. */
static int read_password(struct cluster *c, const char *path, char *err, size_t errlen)
{
	FILE *f = fopen(path, "r");
	size_t n;

	if (!f) {
		snprintf(err, errlen, "cluster_etcd_password_file: cannot read '%.200s': %s", path,
			 strerror(errno));
		return -EINVAL;
	}
	if (!fgets(c->etcd_password, sizeof(c->etcd_password), f))
		c->etcd_password[0] = 0;
	n = strcspn(c->etcd_password, "\r\n");
	if (n == sizeof(c->etcd_password) - 1 && !feof(f) && fgetc(f) != '\n' && !feof(f)) {
		fclose(f);
		explicit_bzero(c->etcd_password, sizeof(c->etcd_password));
		snprintf(err, errlen, "cluster_etcd_password_file '%.200s': the password is longer "
			 "than %zu bytes", path, sizeof(c->etcd_password) - 2);
		return -EINVAL;
	}
	fclose(f);
	c->etcd_password[n] = 0;
	if (!n) {
		snprintf(err, errlen, "cluster_etcd_password_file '%.200s' is empty (the password "
			 "is its first line)", path);
		return -EINVAL;
	}
	return 0;
}

/* The TLS and authentication settings of o into c->etcd_opts. */
static int etcd_security(struct cluster *c, const struct cluster_opts *o, char *err,
			 size_t errlen)
{
	const char *pw = o->etcd_password_file;
	int rc;

	rc = copy_setting(c->etcd_ca, sizeof(c->etcd_ca), "cluster_etcd_ca_file", o->etcd_ca_file,
			  err, errlen);
	if (!rc)
		rc = copy_setting(c->etcd_cert, sizeof(c->etcd_cert), "cluster_etcd_cert_file",
				  o->etcd_cert_file, err, errlen);
	if (!rc)
		rc = copy_setting(c->etcd_key, sizeof(c->etcd_key), "cluster_etcd_key_file",
				  o->etcd_key_file, err, errlen);
	if (!rc)
		rc = copy_setting(c->etcd_user, sizeof(c->etcd_user), "cluster_etcd_user",
				  o->etcd_user, err, errlen);
	if (!rc && pw && pw[0] && !c->etcd_user[0]) {
		snprintf(err, errlen, "cluster_etcd_password_file is set without cluster_etcd_user");
		rc = -EINVAL;
	}
	if (!rc && c->etcd_user[0] && !(pw && pw[0])) {
		snprintf(err, errlen, "cluster_etcd_user '%.64s' needs cluster_etcd_password_file "
			 "(the password is never given on the command line)", c->etcd_user);
		rc = -EINVAL;
	}
	if (!rc && c->etcd_user[0])
		rc = read_password(c, pw, err, errlen);
	if (!rc && c->etcd_user[0] && strstr(c->etcd_urls, "http://"))
		cl_warn(c, "cluster: cluster_etcd_user '%s' over an http:// endpoint: its password "
			"and token cross the network unencrypted (use https://)", c->etcd_user);
	c->etcd_opts = (struct etcd_opts){
		.timeout_ms = c->timeout_ms,
		.ca_file = c->etcd_ca,
		.cert_file = c->etcd_cert,
		.key_file = c->etcd_key,
		.user = c->etcd_user,
		.password = c->etcd_password,
	};
	return rc;
}

/*
 * One call to etcd at start, so that settings etcd refuses (a CA that does not
 * sign its certificate, a client certificate missing or refused, a wrong
 * password, no permission on the prefix) stop the start with etcd's reason;
 * an etcd that cannot be reached does not: the registrar retries.
 */
static int etcd_start_probe(struct cluster *c, struct etcd *e, char *err, size_t errlen)
{
	int rc = etcd_probe(e, c->prefix);

	if (!rc)
		return 0;
	if (rc == -EACCES && c->etcd_user[0]) {
		snprintf(err, errlen, "cluster_etcd: etcd refused etcd user '%.64s': %.400s",
			 c->etcd_user, etcd_error(e));
		return -EACCES;
	}
	if (rc == -EACCES) {
		snprintf(err, errlen, "cluster_etcd: etcd refused this daemon (%.300s): has etcd "
			 "authentication on? Then set cluster_etcd_user and "
			 "cluster_etcd_password_file", etcd_error(e));
		return -EACCES;
	}
	if (rc == -EPROTO) {
		snprintf(err, errlen, "cluster_etcd: %s: %.400s", etcd_endpoint(e), etcd_error(e));
		return -EPROTO;
	}
	cl_warn(c, "cluster: etcd not reachable at start (%s); retrying", etcd_error(e));
	return 0;
}

int members_etcd_setup(struct cluster *c, const struct cluster_opts *o, char *err,
		       size_t errlen)
{
	const char *name = o->name ? o->name : "";
	struct etcd *probe;
	int rc;

	if (!id_ok(name, strlen(name))) {
		snprintf(err, errlen, "cluster_name '%.64s' must be 1..%d letters, digits or ._-",
			 name, STORE_OWED_PEER_MAX);
		return -EINVAL;
	}
	if (strlen(o->etcd) >= sizeof(c->etcd_urls)) {
		snprintf(err, errlen, "cluster_etcd: longer than %zu characters",
			 sizeof(c->etcd_urls) - 1);
		return -EINVAL;
	}
	memcpy(c->etcd_urls, o->etcd, strlen(o->etcd) + 1);
	rc = etcd_security(c, o, err, errlen);
	if (rc)
		return rc;
	rc = etcd_new(c->etcd_urls, &c->etcd_opts, &probe, err, errlen); /* checks the list */
	if (rc)
		return rc;
	rc = advertise_endpoint(c, o, err, errlen);
	snprintf(c->prefix, sizeof(c->prefix), "/kvblend/%.64s/members/", name);
	if (!rc)
		rc = etcd_start_probe(c, probe, err, errlen);
	etcd_free(&probe);
	if (rc)
		return rc;
	c->lease_ttl = o->lease_ttl_s;
	c->capacity = o->capacity;
	/* weight: capacity in GiB, the same formula every member applies to every record */
	c->self_weight = fmax((double)c->capacity / (double)(1ull << 30), 1.0 / 1024);
	return 0;
}

/* ---- etcd: this daemon's registration, and the others' ---- */

/* Sleep ms in steps, returning early when the daemon stops. */
static void etcd_sleep(struct cluster *c, int64_t ms)
{
	int64_t end = now_ms() + ms;

	while (!atomic_load(&c->etcd_stop) && now_ms() < end) {
		struct timespec ts = { 0, 50 * 1000000 };

		nanosleep(&ts, NULL);
	}
}

static void etcd_state(struct cluster *c, bool ok, struct etcd *e, const char *what)
{
	if (ok) {
		atomic_store(&c->etcd_last_ok, (uint64_t)wall_ms());
		if (!atomic_exchange(&c->etcd_ok, true))
			cl_info(c, "cluster: etcd %s answers again", etcd_endpoint(e));
		return;
	}
	atomic_fetch_add(&c->etcd_errors, 1);
	if (atomic_exchange(&c->etcd_ok, false) || !atomic_load(&c->etcd_last_ok))
		cl_warn(c, "cluster: etcd unreachable (%s: %s); serving with the last membership "
			"known, retrying", what, etcd_error(e));
}

void *registrar_main(void *arg)
{
	struct cluster *c = arg;
	struct etcd *e = NULL;
	char err[256], key[sizeof(c->prefix) + STORE_OWED_PEER_MAX + 1];
	struct member_record self = { .capacity = c->capacity };
	char val[1024];
	int64_t lease = 0, backoff = 250;

	snprintf(self.endpoint, sizeof(self.endpoint), "%s", c->advertise);
	snprintf(self.key, sizeof(self.key), "%s", c->public_key);
	snprintf(self.version, sizeof(self.version), "%s", KVBLEND_VERSION);
	if (record_format(c->self, &self, val, sizeof(val)) < 0 ||
	    etcd_new(c->etcd_urls, &c->etcd_opts, &e, err, sizeof(err))) {
		cl_err(c, "cluster: cannot start talking to etcd");
		return NULL;
	}
	snprintf(key, sizeof(key), "%s%s", c->prefix, c->self);
	while (!atomic_load(&c->etcd_stop)) {
		int64_t ttl;
		int rc;

		if (!lease) {
			rc = etcd_lease_grant(e, c->lease_ttl, &lease);
			if (!rc) {
				rc = etcd_put(e, key, val, strlen(val), lease);
				if (rc) {
					etcd_lease_revoke(e, lease);
					lease = 0;
				}
			}
			etcd_state(c, rc == 0, e, "registering");
			if (rc) {
				etcd_sleep(c, backoff);
				backoff = backoff * 2 > 4000 ? 4000 : backoff * 2;
				continue;
			}
			cl_info(c, "cluster: registered in etcd as %s (lease %d s)", key, c->lease_ttl);
			backoff = 250;
		}
		/* renew at a third of the TTL: two tries before it runs out */
		etcd_sleep(c, c->lease_ttl * 1000 / 3);
		if (atomic_load(&c->etcd_stop))
			break;
		rc = etcd_lease_keepalive(e, lease, &ttl);
		if (rc == -ENOENT) {
			cl_warn(c, "cluster: etcd lease expired (etcd unreachable longer than %d s?); "
				"registering again", c->lease_ttl);
			lease = 0;
			etcd_state(c, true, e, "renewing");
			continue;
		}
		etcd_state(c, rc == 0, e, "renewing the lease");
	}
	if (lease) /* a clean leave: the others drop this member now, not after the TTL */
		etcd_lease_revoke(e, lease);
	etcd_free(&e);
	return NULL;
}

/* A member record from etcd applied to the membership (the view lock held for writing). */
static bool member_put(struct cluster *c, const char *key, const char *val)
{
	const char *id = key + strlen(c->prefix);
	struct member_record r;
	char err[200];
	struct peer *p;
	double w;
	bool changed = false;

	if (strncmp(key, c->prefix, strlen(c->prefix)) || !id_ok(id, strlen(id))) {
		cl_warn(c, "cluster: etcd key %.200s: not a member record; ignored", key);
		return false;
	}
	if (record_parse(val, strlen(val), &r, err, sizeof(err))) {
		cl_warn(c, "cluster: member '%s' in etcd: bad record (%s); ignored", id, err);
		return false;
	}
	if (!strcmp(id, c->self)) {
		if (strcmp(r.endpoint, c->advertise))
			cl_err(c, "cluster: etcd says member '%s' is at %s, but this daemon is '%s' at "
			       "%s: two daemons with one node_id?", id, r.endpoint, c->self,
			       c->advertise);
		return false;
	}
	w = fmax((double)r.capacity / (double)(1ull << 30), 1.0 / 1024);
	p = peer_find(c, id);
	if (!p) {
		p = peer_add(c, id, strlen(id));
		if (!p) {
			cl_warn(c, "cluster: more than %d members; '%s' ignored", MEMBERS_MAX, id);
			return false;
		}
	}
	pthread_mutex_lock(&p->lock);
	if (strcmp(p->endpoint, r.endpoint) || strcmp(p->key, r.key)) {
		snprintf(p->endpoint, sizeof(p->endpoint), "%s", r.endpoint);
		snprintf(p->key, sizeof(p->key), "%s", r.key);
		peer_drop_idle(p);
		atomic_store(&p->suspect_until, 0);
		atomic_store(&p->stall_until, 0);
		changed = true;
	}
	pthread_mutex_unlock(&p->lock);
	if (!p->live || p->weight != w) {
		if (!p->live)
			cl_info(c, "cluster: member '%s' at %s joined", id, r.endpoint);
		p->live = true;
		p->weight = w;
		atomic_store(&p->gone_since, 0);
		atomic_store(&p->forgotten, false);
		changed = true;
	}
	return changed;
}

static bool member_gone(struct cluster *c, const char *id)
{
	struct peer *p = peer_find(c, id);

	if (!p || !p->live)
		return false;
	p->live = false;
	atomic_store(&p->gone_since, now_ms());
	if (c->grace_ms)
		cl_info(c, "cluster: member '%s' left (its etcd lease ended); it keeps its place "
			"for cluster_grace (%" PRId64 " s) before its chunks are copied elsewhere",
			id, c->grace_ms / 1000);
	else
		cl_info(c, "cluster: member '%s' left (its etcd lease ended)", id);
	return true;
}

/* The member records of one read of the prefix, copied out of the answer. */
struct sync_ctx {
	char **keys, **vals;
	size_t n, cap;
};

static int sync_one(void *ctx, const char *key, const char *val, size_t vlen)
{
	struct sync_ctx *s = ctx;

	(void)vlen;
	if (s->n == s->cap) {
		size_t cap = s->cap ? 2 * s->cap : 16;
		char **k = realloc(s->keys, cap * sizeof(*k)), **v;

		if (!k)
			return -ENOMEM;
		s->keys = k;
		v = realloc(s->vals, cap * sizeof(*v));
		if (!v)
			return -ENOMEM;
		s->vals = v;
		s->cap = cap;
	}
	s->keys[s->n] = strdup(key);
	s->vals[s->n] = strdup(val);
	if (!s->keys[s->n] || !s->vals[s->n]) {
		free(s->keys[s->n]);
		free(s->vals[s->n]);
		return -ENOMEM;
	}
	s->n++;
	return 0;
}

static void sync_free(struct sync_ctx *s)
{
	for (size_t i = 0; i < s->n; i++) {
		free(s->keys[i]);
		free(s->vals[i]);
	}
	free(s->keys);
	free(s->vals);
}

/*
 * The membership is what the read found (the view lock held for writing): its
 * records applied, every other member gone. Returns whether anything changed.
 */
static bool sync_apply(struct cluster *c, const struct sync_ctx *s)
{
	size_t plen = strlen(c->prefix);
	bool changed = false;

	for (size_t i = 0; i < s->n; i++)
		changed |= member_put(c, s->keys[i], s->vals[i]);
	for (size_t p = 0; p < c->n_peers; p++) {
		bool listed = false;

		for (size_t i = 0; i < s->n && !listed; i++)
			listed = !strcmp(s->keys[i] + plen, c->peers[p]->id);
		if (!listed)
			changed |= member_gone(c, c->peers[p]->id);
	}
	return changed;
}

static int watch_one(void *ctx, bool put, const char *key, const char *val, size_t vlen,
		     int64_t rev)
{
	struct cluster *c = ctx;
	bool changed;

	(void)vlen;
	(void)rev;
	pthread_rwlock_wrlock(&c->view_lock);
	changed = put ? member_put(c, key, val) : member_gone(c, key + strlen(c->prefix));
	if (changed && !view_rebuild(c))
		atomic_fetch_add(&c->membership_changes, 1);
	pthread_rwlock_unlock(&c->view_lock);
	if (changed)
		rebalance_kick(c);
	return 0;
}

void *watcher_main(void *arg)
{
	struct cluster *c = arg;
	struct etcd *e = NULL;
	char err[256];
	int64_t backoff = 250;

	if (etcd_new(c->etcd_urls, &c->etcd_opts, &e, err, sizeof(err))) {
		cl_err(c, "cluster: cannot start talking to etcd");
		return NULL;
	}
	while (!atomic_load(&c->etcd_stop)) {
		struct sync_ctx s = { 0 };
		int64_t rev = 0;
		size_t others = 0;
		bool changed = false;
		int rc;

		/* The whole membership first (read without the view lock: etcd may be slow,
		 * requests must not wait on it), then every change after that revision. */
		rc = etcd_range_prefix(e, c->prefix, sync_one, &s, &rev);
		if (!rc) {
			pthread_rwlock_wrlock(&c->view_lock);
			changed = sync_apply(c, &s);
			if (changed && !view_rebuild(c))
				atomic_fetch_add(&c->membership_changes, 1);
			others = c->view.n - 1;
			pthread_rwlock_unlock(&c->view_lock);
		}
		sync_free(&s);
		etcd_state(c, rc == 0, e, "reading the members");
		if (rc) {
			etcd_sleep(c, backoff);
			backoff = backoff * 2 > 4000 ? 4000 : backoff * 2;
			continue;
		}
		if (!atomic_exchange(&c->etcd_synced, true))
			cl_info(c, "cluster: %zu other members in etcd", others);
		if (changed)
			rebalance_kick(c);
		backoff = 250;
		rc = etcd_watch_prefix(e, c->prefix, rev + 1, watch_one, c, &c->etcd_stop);
		if (rc == -ECANCELED)
			break;
		if (rc != -ESTALE)
			etcd_state(c, false, e, "watching the members");
		etcd_sleep(c, backoff);
	}
	etcd_free(&e);
	return NULL;
}
