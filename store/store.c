/* store — the environment: errors, transactions, totals, open; see store.h. */
#include "store/store_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <lmdb.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "store/checksum.h"
#include "store/codec.h"

static const MDB_val format_key = { 6, "format" };

/* The one place LMDB codes become errno values. */
int st_err_from_mdb(int rc)
{
	switch (rc) {
	case MDB_SUCCESS:
		return 0;
	case MDB_NOTFOUND:
		return -ENOENT;
	case MDB_MAP_FULL:
	case MDB_TXN_FULL:
	case EDQUOT: /* a quota is a full disk for us */
		return -ENOSPC;
	case MDB_READERS_FULL:
	case MDB_MAP_RESIZED:
		return -EAGAIN;
	case MDB_CORRUPTED:
	case MDB_PAGE_NOTFOUND:
	case MDB_INVALID:
	case MDB_VERSION_MISMATCH:
		return -EBADMSG;
	default:
		return rc > 0 ? -rc : -EIO;
	}
}

/*
 * The error of a failed write (a put that spilled pages, a commit). LMDB
 * reports a short write as EIO, and a file system that fills up in the middle
 * of a write gives exactly that: when the data file's file system has less room
 * left than the write needed, the EIO was a full disk. The failed transaction
 * is aborted by the caller: nothing it wrote is reachable, the pages written
 * past the end are reused by the next transaction, the environment stays usable.
 */
int st_err_write(struct store *s, int mdb_rc, uint64_t need)
{
	int rc = st_err_from_mdb(mdb_rc);
	struct statvfs sv;
	int fd;

	if (rc != -EIO || mdb_env_get_fd(s->env, &fd) || fstatvfs(fd, &sv))
		return rc;
	if ((uint64_t)sv.f_bavail * sv.f_frsize < need + WRITE_SLACK)
		return -ENOSPC;
	return rc;
}

/*
 * Keep DISK_RESERVE bytes of the file system allocated to the data file past
 * its last page (without changing its size). A delete writes a few fresh pages
 * (LMDB never overwrites the last snapshot): when something else fills the
 * disk, they come from here, so eviction can still make room. Best effort: a
 * file system without fallocate() or without room simply keeps less.
 */
static void disk_reserve(struct store *s)
{
	MDB_envinfo ei;
	MDB_stat st;
	int fd;

	if (mdb_env_info(s->env, &ei) || mdb_env_stat(s->env, &st) || mdb_env_get_fd(s->env, &fd))
		return;
	(void)fallocate(fd, FALLOC_FL_KEEP_SIZE, (off_t)(ei.me_last_pgno + 1) * st.ms_psize,
			DISK_RESERVE);
}

int st_commit(struct store *s, MDB_txn *txn, uint64_t need)
{
	int rc = st_err_write(s, mdb_txn_commit(txn), need);

	if (!rc && need)
		disk_reserve(s); /* the file grew into the reserve: renew it */
	if (!rc)
		st_mtime_note(s);
	return rc;
}

/*
 * XXH3-64 of a record's key and body: a flipped bit anywhere in the record, or
 * a record that ended up under another key, fails the check.
 */
uint64_t st_rec_sum(const MDB_val *k, const void *body, size_t body_len)
{
	uint8_t buf[REC_SUM_MAX];

	memcpy(buf, k->mv_data, k->mv_size);
	memcpy(buf + k->mv_size, body, body_len);
	return checksum(buf, k->mv_size + body_len);
}

bool st_rec_sum_ok(const MDB_val *k, const MDB_val *v, size_t body_len)
{
	const uint8_t *p = v->mv_data;

	return k->mv_size + body_len <= REC_SUM_MAX && v->mv_size == body_len + 8 &&
	       le_get(p + body_len, 8) == st_rec_sum(k, p, body_len);
}

int st_rtxn_begin(struct store *s, MDB_txn **out)
{
	MDB_txn *t = NULL;
	int rc;

	pthread_mutex_lock(&s->pool_lock);
	if (s->pool_n)
		t = s->pool[--s->pool_n];
	pthread_mutex_unlock(&s->pool_lock);
	if (t) {
		rc = mdb_txn_renew(t);
		if (rc == MDB_SUCCESS) {
			*out = t;
			return 0;
		}
		mdb_txn_abort(t);
	}
	rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &t);
	if (rc)
		return st_err_from_mdb(rc);
	*out = t;
	return 0;
}

void st_rtxn_end(struct store *s, MDB_txn *t)
{
	mdb_txn_reset(t);
	pthread_mutex_lock(&s->pool_lock);
	if (s->pool_n < RTXN_POOL_MAX) {
		s->pool[s->pool_n++] = t;
		t = NULL;
	}
	pthread_mutex_unlock(&s->pool_lock);
	if (t)
		mdb_txn_abort(t);
}

static int open_dbs(struct store *s)
{
	MDB_txn *txn;
	MDB_val v;
	uint8_t fmt[4];
	int rc = mdb_txn_begin(s->env, NULL, 0, &txn);

	if (rc)
		return st_err_from_mdb(rc);
	if ((rc = mdb_dbi_open(txn, "meta", MDB_CREATE, &s->meta)) ||
	    (rc = mdb_dbi_open(txn, "models", MDB_CREATE, &s->models)) ||
	    (rc = mdb_dbi_open(txn, "chunks", MDB_CREATE, &s->chunks)) ||
	    (rc = mdb_dbi_open(txn, "layers", MDB_CREATE, &s->layers)) ||
	    (rc = mdb_dbi_open(txn, "owed", MDB_CREATE, &s->owed))) {
		rc = st_err_from_mdb(rc);
		goto fail;
	}
	rc = mdb_get(txn, s->meta, (MDB_val *)&format_key, &v);
	if (rc == MDB_SUCCESS && v.mv_size == 4 && le_get(v.mv_data, 4) == STORE_FORMAT_V1) {
		rc = st_upgrade_v1(s, txn);
		if (rc)
			goto fail;
		rc = MDB_NOTFOUND; /* write the new format below */
	} else if (rc == MDB_SUCCESS && (v.mv_size != 4 || le_get(v.mv_data, 4) != STORE_FORMAT)) {
		rc = -EPROTO; /* a store written by another format version */
		goto fail;
	}
	if (rc == MDB_NOTFOUND) {
		le_put(fmt, STORE_FORMAT, 4);
		v.mv_size = 4;
		v.mv_data = fmt;
		rc = mdb_put(txn, s->meta, (MDB_val *)&format_key, &v, 0);
	}
	if (rc) {
		rc = st_err_from_mdb(rc);
		goto fail;
	}
	return st_commit(s, txn, 0);
fail:
	mdb_txn_abort(txn);
	return rc;
}

/*
 * LMDB never shortens its data file: one shorter than its last page was cut by
 * something else (a copy cut short, a tool, a full disk under a copy), and a read
 * of a page past its end would stop the process with SIGBUS. 0, or -EUCLEAN.
 */
static int file_whole(struct store *s)
{
	MDB_envinfo ei;
	MDB_stat st;
	struct stat fs;
	int fd;

	if (mdb_env_info(s->env, &ei) || mdb_env_stat(s->env, &st) || mdb_env_get_fd(s->env, &fd) ||
	    fstat(fd, &fs))
		return -EIO;
	/* ckd-ok: a page number and a page size, each far below 2^32 */
	return (uint64_t)fs.st_size < ((uint64_t)ei.me_last_pgno + 1) * st.ms_psize ? -EUCLEAN : 0;
}

/*
 * A data file LMDB cannot read as one (MDB_INVALID) and shorter than two pages: LMDB
 * writes both of its meta pages when it makes the file and never shortens it, so
 * this one was cut by something else, below what even the meta pages need. (A file
 * of 0 bytes is not: LMDB starts a new store in it.) The page is this system's, which
 * is LMDB's for every file made here; a file cut past two pages is file_whole()'s.
 */
static bool cut_below_metas(const char *dir)
{
	char path[PATH_MAX];
	struct stat st;
	long page = sysconf(_SC_PAGESIZE);

	if (snprintf(path, sizeof(path), "%s/data.mdb", dir) >= (int)sizeof(path) ||
	    stat(path, &st) || page <= 0)
		return false;
	return S_ISREG(st.st_mode) && st.st_size > 0 && st.st_size < 2 * (off_t)page;
}

int store_open(const struct store_opts *opts, struct store **out)
{
	struct store *s;
	/*
	 * Never MDB_WRITEMAP: writes then go through pwrite(), so a full file system
	 * fails a commit with an error (st_err_write()) instead of a SIGBUS on a store
	 * into the map.
	 */
	unsigned flags = MDB_NOTLS | MDB_NORDAHEAD | (opts->no_sync ? MDB_NOSYNC : 0);
	int rc;

	if (!opts->dir || !opts->map_size)
		return -EINVAL;
	if (mkdir(opts->dir, 0750) && errno != EEXIST)
		return -errno;
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	pthread_mutex_init(&s->pool_lock, NULL);
	atomic_init(&s->chunk_walks, 0);
	s->min_saving = opts->min_saving;
	rc = mdb_env_create(&s->env);
	if (rc) {
		rc = st_err_from_mdb(rc);
		s->env = NULL;
		goto fail;
	}
	if ((rc = mdb_env_set_mapsize(s->env, opts->map_size)) ||
	    (rc = mdb_env_set_maxreaders(s->env, opts->max_readers ? opts->max_readers : 126)) ||
	    (rc = mdb_env_set_maxdbs(s->env, 8)) ||
	    (rc = mdb_env_open(s->env, opts->dir, flags, 0640))) {
		rc = rc == MDB_INVALID && cut_below_metas(opts->dir) ? -EUCLEAN : st_err_from_mdb(rc);
		goto fail;
	}
	/* Reader slots of processes that died (a killed daemon) would pin old pages. */
	{
		int dead = 0;

		mdb_reader_check(s->env, &dead);
	}
	rc = file_whole(s);
	if (!rc)
		rc = open_dbs(s);
	if (rc)
		goto fail;
	st_totals_repair(s);
	disk_reserve(s);
	rc = st_verify_open(s, opts);
	if (rc)
		goto fail;
	*out = s;
	return 0;
fail:
	store_close(&s);
	return rc;
}

void store_close(struct store **sp)
{
	struct store *s = sp ? *sp : NULL;

	if (!s)
		return;
	for (unsigned i = 0; i < s->pool_n; i++)
		mdb_txn_abort(s->pool[i]);
	if (s->env)
		mdb_env_close(s->env);
	st_verify_close(s);
	pthread_mutex_destroy(&s->pool_lock);
	free(s);
	*sp = NULL;
}

int st_cursor_walk(struct store *s, MDB_dbi dbi, const uint8_t *prefix, size_t prefix_len,
		   walk_fn fn, void *ctx)
{
	MDB_val k = { prefix_len, (void *)prefix }, v;
	MDB_cursor *cur = NULL;
	MDB_cursor_op op = prefix_len ? MDB_SET_RANGE : MDB_FIRST;
	MDB_txn *txn;
	int rc = st_rtxn_begin(s, &txn);

	if (rc)
		return rc;
	if (dbi == s->chunks)
		atomic_fetch_add_explicit(&s->chunk_walks, 1, memory_order_relaxed);
	rc = st_err_from_mdb(mdb_cursor_open(txn, dbi, &cur));
	while (rc == 0) {
		int mrc = mdb_cursor_get(cur, &k, &v, op);

		op = MDB_NEXT;
		if (mrc == MDB_NOTFOUND)
			break;
		if (mrc) {
			rc = st_err_from_mdb(mrc);
			break;
		}
		if (prefix_len && (k.mv_size < prefix_len || memcmp(k.mv_data, prefix, prefix_len)))
			break;
		rc = fn(ctx, &k, &v);
	}
	if (cur)
		mdb_cursor_close(cur);
	st_rtxn_end(s, txn);
	return rc;
}

/* Decode each walked record into a growing malloc'd array. */
struct collection {
	cursor_fn fn;
	size_t item_size, n, cap;
	uint8_t *items;
};

static int collect_one(void *ctx, const MDB_val *k, const MDB_val *v)
{
	struct collection *c = ctx;

	if (c->n == c->cap) {
		size_t ncap = c->cap ? c->cap * 2 : 16;
		void *p = realloc(c->items, ncap * c->item_size);

		if (!p)
			return -ENOMEM;
		c->items = p;
		c->cap = ncap;
	}
	return c->fn(k, v, c->items + c->n++ * c->item_size);
}

int st_collect(struct store *s, MDB_dbi dbi, const uint8_t *prefix, size_t prefix_len,
	       size_t item_size, cursor_fn fn, void **out, size_t *n_out)
{
	struct collection c = { fn, item_size, 0, 0, NULL };
	int rc = st_cursor_walk(s, dbi, prefix, prefix_len, collect_one, &c);

	if (rc) {
		free(c.items);
		return rc;
	}
	*out = c.items;
	*n_out = c.n;
	return 0;
}

/*
 * Commit a transaction that changes nothing but its id. LMDB reuses the pages
 * a transaction freed only from the transaction after the next one on (the
 * last snapshot stays intact), so right after a delete or an eviction the
 * space it freed is not yet usable; after this it is.
 */
int st_txn_advance(struct store *s)
{
	MDB_txn *txn;
	MDB_val v;
	uint8_t fmt[4];
	int rc = st_err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));

	if (rc)
		return rc;
	le_put(fmt, STORE_FORMAT, 4);
	v.mv_size = sizeof(fmt);
	v.mv_data = fmt;
	rc = st_err_from_mdb(mdb_put(txn, s->meta, (MDB_val *)&format_key, &v, 0));
	if (rc) {
		mdb_txn_abort(txn);
		return rc;
	}
	return st_commit(s, txn, 0);
}

uint64_t store_chunk_walks(struct store *s)
{
	return atomic_load_explicit(&s->chunk_walks, memory_order_relaxed);
}
