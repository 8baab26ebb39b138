/*
 * wire_fuzz — the private header of fuzz_wire_daemon, the structured wire fuzzer (the
 * whole story is at the top of wire_fuzz.c). One program in six files, by concern:
 *
 *   wire_fuzz.c           main, options, the run loop, checking replies, liveness, report
 *   wire_fuzz_msg.c       messages and frames: build, send, receive, the log of the last
 *                         messages sent, .kvbw save and replay
 *   wire_fuzz_state.c     what the fuzzer knows of the daemon (models, chunks, segments,
 *                         sessions): setup, and what each reply teaches
 *   wire_fuzz_gen.c       random choices and the generators of requests: gen_op, gen_put,
 *                         gen_fuse, gen_mutated, gen_frames, generate
 *   wire_fuzz_handmade.c  hand-encoded protobuf headers (gen_handmade)
 *   wire_fuzz_peer.c      what members send each other (gen_peer) and its templates
 *
 * Not a library: the state below is global to the program, single-threaded, and every
 * failure to allocate aborts.
 */
#ifndef KVBLEND_TESTS_FUZZ_WIRE_FUZZ_H
#define KVBLEND_TESTS_FUZZ_WIRE_FUZZ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/wire.h"

#define LOG_MSGS 256
#define MAX_MODELS 8
#define MAX_CHUNKS 64
#define MAX_SHMS 8
#define MAX_SESSIONS 6 /* below the wrapper's fuse_max_sessions (8): room for strays */
#define SHM_MAP_MAX (16u << 20)
#define WF_KINDS 7 /* generators named in kind_names, counted in wf_st.by_kind */

struct frame {
	uint8_t *data;
	size_t len;
};

/* What a message teaches us once answered. */
enum learn {
	LEARN_NONE,
	LEARN_PUT,
	LEARN_SHM_ATTACH,
	LEARN_FUSE_OPEN,
	LEARN_FUSE_LAYER,
	LEARN_FUSE_CLOSE,
	LEARN_CHUNK,	/* a request naming a chunk: a not_found reply (or a DELETE) drops it */
	LEARN_SHM_DETACH, /* an ok reply: the segment (learn_session) is gone */
};

struct msg {
	struct frame *f;
	size_t n, cap;
	bool delim;	    /* an empty delimiter frame goes first */
	bool know_id;	    /* the header is ours, unmutated: the reply must echo id */
	bool expect_reply;  /* false for a frame above the daemon's hard cap */
	bool abandon;	    /* the client goes away without waiting for the reply */
	uint64_t id;
	const char *kind;   /* generator, for the report */
	enum learn learn;
	int learn_idx;	    /* session or chunk slot */
	uint32_t learn_tokens;
	uint8_t learn_hash[KVBP_HASH_LEN];
	int learn_model;
	bool learn_delete;
	uint64_t learn_session;
	bool landing; /* a FUSE_OPEN with a landing layout (gen_layout) */
	uint64_t land_shm; /* the segment it names */
};

struct model_info {
	struct kvbp_model m;
	size_t row; /* bytes of one token row: heads x head_dim x elem */
};

struct chunk_info {
	int model;
	uint8_t hash[KVBP_HASH_LEN];
	uint32_t tokens;
};

struct shm_info {
	uint64_t id;
	uint64_t size;
	uint8_t *map; /* our mapping, NULL if we could not map it */
};

struct session_info {
	bool open;
	uint64_t id;
	int model;
	uint32_t tokens, next_layer, rows_next;
};

struct opts {
	const char *endpoint;
	long pid;
	uint64_t seed;
	uint64_t count;
	double seconds;
	unsigned every;
	int reply_ms, ping_ms;
	uint64_t max_message;
	const char *save;
	bool verbose;
	char **replay;
	int n_replay;
};

struct wf_stats {
	uint64_t sent, answered, unanswered, retired, ok, errors, strict_checked, pings, internal;
	double slowest;
	uint64_t by_kind[16];
	uint64_t codes[KVBP_CODE_COUNT + 1];
	uint64_t ok_by_op[KVBP_OP_COUNT], sent_by_op[KVBP_OP_COUNT];
	uint64_t land_opens, land_ok, land_shape; /* landing layouts: sent, opened, bad_shape */
};

/* ---- wire_fuzz.c ---- */

extern struct opts wf_opt;	/* the command line */
extern struct wf_stats wf_st;	/* counts for the report */
extern void *wf_ctrl;		/* the control socket: liveness pings and setup */
extern bool wf_failed;		/* a defect was found (save_log sets it) */

/* A line on stderr, prefixed with the program's name. */
__attribute__((format(printf, 1, 2))) void say(const char *fmt, ...);
/* The monotonic clock in seconds. */
double now_s(void);
/* False when --pid names a process that is gone or a zombie; true without --pid. */
bool process_alive(void);
/* Send HELLO or STATS on wf_ctrl; true when its own reply is ok, decoded into *rep. */
bool ping_one(uint32_t op, struct kvbp_request *q, struct kvbp_reply *rep);
/* HELLO, STATS and a burst of HELLOs answered within --ping-ms; false (logged, saved) if not. */
bool liveness(const char *when);
/* Send m on socket si, check and learn from its reply: 0, or -1 on a defect or a lost socket. */
int fuzz_one(const struct msg *m, int si);

/* ---- wire_fuzz_msg.c ---- */

extern struct msg logbuf[LOG_MSGS]; /* the last LOG_MSGS messages sent, a ring */

/* An empty message of a generator `kind` (a string that outlives it), with a delimiter. */
void msg_init(struct msg *m, const char *kind);
/* Free the frames of m; m stays usable, empty. */
void msg_free(struct msg *m);
/* Append a frame of len bytes (a copy of data, or tensor-like bytes when data is NULL). */
uint8_t *msg_add(struct msg *m, const void *data, size_t len);
/* Append q encoded as a header frame. */
void msg_add_header(struct msg *m, const struct kvbp_request *q);
/* Keep a copy of m in logbuf. */
void log_msg(const struct msg *m);
/* Send m on sock: 0, or a negative errno. */
int send_msg(void *sock, const struct msg *m);
/* Receive one whole message into *out within ms milliseconds: 1, 0 on timeout, <0 on error. */
int recv_msg(void *sock, int ms, struct msg *out);
/* Report a failure: sets wf_failed, names the last messages, saves them under --save. */
void save_log(const char *why);
/* Send the --replay files and directories: 0 ok, 1 a defect, 2 a file unreadable. */
int replay_all(void);

/* ---- wire_fuzz_state.c ---- */

extern uint64_t next_id; /* the next request id of ours */
extern struct model_info models[MAX_MODELS];
extern int n_models;
extern struct chunk_info chunks[MAX_CHUNKS];
extern int n_chunks;
extern struct shm_info shms[MAX_SHMS];
extern int n_shms;
extern struct session_info sessions[MAX_SESSIONS];
extern bool sessions_full; /* an open hit fuse_max_sessions: close one of ours next */
/* Sessions opened by messages that did not mean to (mutated ones): closed at once. */
extern uint64_t orphans[16];
extern unsigned n_orphans;

/* A segment no request names, its bytes CANARY_BYTE (setup); map NULL if unmapped. */
#define CANARY_BYTE 0xc5
extern struct shm_info canary;
/* Device-landing handles (setup): ours, handed in; another process's, handed in by a
 * child whose memfd we map (foreign_map, DEV_BYTES of CANARY_BYTE: checked with the
 * canary). Empty when the daemon has no descriptor socket. */
#define DEV_BYTES (1u << 20)
struct dev_handles {
	uint8_t own[64], foreign[64];
	int own_fd, foreign_fd;
	uint8_t *foreign_map;
	int child;
};
extern struct dev_handles devh;
/* A segment of setup's that landing layouts name most often (kept alive as the canary). */
extern struct shm_info landseg;
/* Name the canary in a request that only reads it (a PUT from it), so that shm_idle never
 * releases it. */
void canary_keep(void);
/* 0 while every canary byte is intact; else 1 + the offset of the first changed one. */
size_t canary_changed(void);
/* Segments of shms[] mapped here (their descriptors fetched from the daemon). */
int shms_mapped(void);
/* Map the segment of an SHM_ATTACH reply here: 0 and *out, or -1. */
int shm_map_reply(const struct kvbp_reply *rep, struct shm_info *out);
/* Forget segment i (unmapping it); the last one takes its place. */
void shm_forget(int i);
/* Update the state from the reply rep to m. */
void learn(const struct msg *m, const struct kvbp_reply *rep);
/* Wait for the daemon, register models, attach a segment, store chunks: 0, or -1 (said). */
int setup(void);

/* ---- wire_fuzz_gen.c ---- */

extern uint64_t rng_state; /* the seed, then the state of rnd() */
extern uint8_t hash_buf[1024][KVBP_HASH_LEN]; /* scratch for a request's repeated hashes */
extern const char *const kind_names[WF_KINDS]; /* msg.kind of each generator */

uint64_t rnd(void);
/* A number below n (0 when n is 0). */
uint32_t below(uint32_t n);
/* True with this probability. */
bool chance(unsigned percent);
void fill_random(void *p, size_t n);
/* Tensor-like bytes: mostly small finite f16 values, sometimes raw bits. */
void fill_tensor(void *p, size_t n);
/* A small, random or boundary value. */
uint64_t pick_u64(void);
uint32_t pick_u32(void);
double pick_double(void);
/* A known model, or -1 when none is. */
int pick_model(void);
/* A known chunk of model mi (any with -1), or NULL. */
const struct chunk_info *pick_chunk(int mi);
/* A known chunk's hash of model mi, or a zero or random one. */
void set_hash(uint8_t *hash, int mi);
/* A correct PUT of a fresh chunk of `tokens` tokens of model mi. */
void gen_put(struct msg *m, int mi, uint32_t tokens);
/* A message from one of the generators, chosen at random, into m (msg_init'ed here). */
void generate(struct msg *m);

/* ---- wire_fuzz_handmade.c ---- */

/* A header encoded by hand, with wrong wire types, lengths and repeated fields. */
void gen_handmade(struct msg *m);

/* ---- wire_fuzz_peer.c ---- */

extern int n_tmpls; /* stored chunks fetched for gen_peer */

/* FETCH, LOOKUP and REPLICATE as members send them, and mutated REPLICATEs. */
void gen_peer(struct msg *m);
/* After setup: fetch one stored chunk of each model, the templates of gen_peer. */
void setup_templates(void);

#endif
