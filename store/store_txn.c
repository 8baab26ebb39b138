/*
 * store_txn — transactions and walks: the one translation of LMDB codes, write
 * commits (each notes the data file's time; one that wrote data renews the disk
 * reserve), the pool of read transactions, and walks over a database's records.
 * Calls no other module of the store; see store_impl.h.
 */
#include "store/store_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <lmdb.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

const MDB_val st_format_key = { 6, "format" };

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
void st_disk_reserve(struct store *s)
{
	MDB_envinfo ei;
	MDB_stat st;
	int fd;

	if (mdb_env_info(s->env, &ei) || mdb_env_stat(s->env, &st) || mdb_env_get_fd(s->env, &fd))
		return;
	(void)fallocate(fd, FALLOC_FL_KEEP_SIZE, (off_t)(ei.me_last_pgno + 1) * st.ms_psize,
			DISK_RESERVE);
}

int64_t st_file_mtime(const struct store *s)
{
	struct stat st;

	if (s->data_fd < 0 || fstat(s->data_fd, &st))
		return -1;
	return (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
}

void st_mtime_note(struct store *s)
{
	atomic_store(&s->own_mtime, st_file_mtime(s));
}

int st_commit(struct store *s, MDB_txn *txn, uint64_t need)
{
	int rc = st_err_write(s, mdb_txn_commit(txn), need);

	if (!rc && need)
		st_disk_reserve(s); /* the file grew into the reserve: renew it */
	if (!rc)
		st_mtime_note(s);
	return rc;
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
	rc = st_err_from_mdb(mdb_put(txn, s->meta, (MDB_val *)&st_format_key, &v, 0));
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
