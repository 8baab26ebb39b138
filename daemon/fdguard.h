/*
 * fdguard — keep the daemon alive when it runs out of file descriptors.
 *
 * libzmq's IPC listener aborts the process when accept() fails with EMFILE
 * (libzmq 4.3: an assertion that lists ENFILE but not EMFILE). kvblendd defines
 * accept() and accept4() itself, so that every accept in the process, libzmq's
 * included, goes through here: when the process is out of descriptors, the
 * pending connection is taken with a spare descriptor kept for that and closed
 * at once (the client sees its connection end, and no listener spins on a
 * backlog it cannot drain), and the caller sees ECONNABORTED, which every
 * listener treats as a connection that went away.
 */
#ifndef KVBLEND_DAEMON_FDGUARD_H
#define KVBLEND_DAEMON_FDGUARD_H

#include <stdint.h>

/* Open the spare descriptor. Call once at start, before any listener runs. */
int fdguard_init(void);
/* Connections dropped because the process was out of descriptors. */
uint64_t fdguard_dropped(void);

#endif
