/*
 * notify — the systemd notification protocol (READY, RELOADING, STATUS,
 * WATCHDOG, STOPPING), through libsystemd's sd_notify. Built without libsystemd, every
 * call is a no-op. Does nothing when NOTIFY_SOCKET is unset.
 */
#ifndef KVBLEND_DAEMON_NOTIFY_H
#define KVBLEND_DAEMON_NOTIFY_H

#include <stdint.h>

void notify_ready(void);
/* A reload (SIGHUP) begins: RELOADING=1 with MONOTONIC_USEC=, as systemd wants for
 * Type=notify-reload; notify_ready() ends it. */
void notify_reloading(void);
void notify_stopping(void);
void notify_status(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Ping the watchdog if one is configured and half its interval has passed. */
void notify_watchdog(void);

#endif
