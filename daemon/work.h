/*
 * work — requests on their way from the main thread to the workers: one FIFO that
 * idle workers take from. A request waits only while every worker is busy, never
 * behind one worker's long request while another is idle (as round-robin over the
 * workers' sockets had it: a payload read or written at a slow client's pace held up
 * every request dealt to that worker meanwhile).
 */
#ifndef KVBLEND_DAEMON_WORK_H
#define KVBLEND_DAEMON_WORK_H

#include <stdbool.h>
#include <stddef.h>
#include <zmq.h>

struct work;

/* A queue of at most cap requests: 0 and *out, or -ENOMEM. */
int work_new(size_t cap, struct work **out);
/* Close the frames of requests still queued and free it. Accepts NULL; sets *w to NULL. */
void work_free(struct work **w);
/* Whether it holds cap requests (the main thread then stops reading its sockets). */
bool work_full(struct work *w);
/*
 * Queue the request tag[0..tag_len) + frames[0..n): its frames are moved (left empty,
 * initialised). 0, or -ENOSPC (full) / -ENOMEM: frames untouched.
 */
int work_push(struct work *w, const void *tag, size_t tag_len, zmq_msg_t *frames, size_t n);
/*
 * Take the oldest request into frames[0..cap) (initialised here; the tag first),
 * waiting up to timeout_ms for one: its frame count, or 0 (none came). A request of
 * more than cap frames has the rest closed (cap is the most a request has).
 */
size_t work_pop(struct work *w, zmq_msg_t *frames, size_t cap, int timeout_ms);
/* Requests queued now. */
size_t work_len(struct work *w);

#endif
