/*
 * admin — the daemon's counters (STATS) and the cluster members it reports.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "client/client_impl.h"

/* The counters of a STATS reply into a malloc'd array (0 or -ENOMEM). */
static int stats_out(kvb_client *c, const struct kvbp_reply *rep, struct kvb_stat **out,
		     size_t *n)
{
	struct kvb_stat *s = calloc(rep->n_stats ? rep->n_stats : 1, sizeof(*s));

	if (!s)
		return kvbc_set_err(c, -ENOMEM, "out of memory");
	for (size_t i = 0; i < rep->n_stats; i++) {
		snprintf(s[i].name, sizeof(s[i].name), "%s", rep->stats[i].name);
		s[i].value = rep->stats[i].value;
	}
	*out = s;
	*n = rep->n_stats;
	return 0;
}

int kvb_cluster_members(kvb_client *c, struct kvb_member **out, size_t *n,
			struct kvb_stat **stats, size_t *n_stats)
{
	struct call k = { .req = { .op = KVBP_OP_STATS } };
	struct kvb_member *m = NULL;
	int rc = kvbc_call(c, &k);

	if (!rc) {
		m = calloc(k.rep.n_members ? k.rep.n_members : 1, sizeof(*m));
		if (!m)
			rc = kvbc_set_err(c, -ENOMEM, "out of memory");
	}
	for (size_t i = 0; !rc && i < k.rep.n_members; i++) {
		const struct kvbp_member *w = &k.rep.members[i];

		snprintf(m[i].id, sizeof(m[i].id), "%s", w->id);
		snprintf(m[i].endpoint, sizeof(m[i].endpoint), "%s", w->endpoint);
		m[i].state = w->state;
		m[i].pushes_owed = w->pushes_owed;
		m[i].last_reply_age_ms = w->last_reply_age_ms;
		m[i].chunks = w->chunks;
		m[i].stored_bytes = w->stored_bytes;
	}
	if (!rc && stats)
		rc = stats_out(c, &k.rep, stats, n_stats);
	if (rc) {
		free(m);
	} else {
		*out = m;
		*n = k.rep.n_members;
	}
	kvbc_call_done(&k);
	return rc;
}

int kvb_cluster_check(kvb_client *c, struct kvb_stat **out, size_t *n)
{
	struct call k = { .req = { .op = KVBP_OP_STATS, .cluster_check = true } };
	int rc = kvbc_call(c, &k);

	if (!rc)
		rc = stats_out(c, &k.rep, out, n);
	kvbc_call_done(&k);
	return rc;
}

int kvb_stats(kvb_client *c, struct kvb_stat **out, size_t *n)
{
	struct call k = { .req = { .op = KVBP_OP_STATS } };
	int rc = kvbc_call(c, &k);

	if (!rc)
		rc = stats_out(c, &k.rep, out, n);
	kvbc_call_done(&k);
	return rc;
}
