/*
 * fdsock — the asking side of the daemon's descriptor socket (docs/protocol.md#shared-memory):
 * a shared-memory segment's descriptor, fetched by its id. Shared by libkvblend and the
 * tests that check whom the daemon hands descriptors to. Does its own I/O, nothing else.
 */
#ifndef KVBLEND_PROTO_FDSOCK_H
#define KVBLEND_PROTO_FDSOCK_H

#include <stdint.h>

/*
 * The descriptor of segment id from the descriptor socket at path (the SHM_ATTACH or
 * FUSE_OPEN reply names it): sends the 8-byte id (little-endian), receives a status
 * byte with the descriptor attached (SCM_RIGHTS, close-on-exec). The daemon hands it
 * only to the process that owns the segment. Returns the descriptor, the caller's to
 * close, or -1: path too long or unreachable, no answer within 2 s, a refusal (status
 * not 0), or no descriptor attached.
 */
int kvbp_segment_fd(const char *path, uint64_t id);

#endif
