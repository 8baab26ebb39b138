/*
 * store — the environment's life: store_open() (the environment, its databases, the
 * format and its upgrade, the data file's checks) and store_close(); see store.h.
 */
#include "store/store_impl.h"

#include <errno.h>
#include <limits.h>
#include <lmdb.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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
	rc = mdb_get(txn, s->meta, (MDB_val *)&st_format_key, &v);
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
		rc = mdb_put(txn, s->meta, (MDB_val *)&st_format_key, &v, 0);
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
	st_disk_reserve(s);
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
