/* notify — sd_notify wrapper; see notify.h. */
#include "daemon/notify.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#ifdef HAVE_LIBSYSTEMD
#include <systemd/sd-daemon.h>

void notify_ready(void)
{
	sd_notify(0, "READY=1\nSTATUS=serving");
}

void notify_reloading(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	sd_notifyf(0, "RELOADING=1\nSTATUS=reloading configuration\nMONOTONIC_USEC=%llu",
		   (unsigned long long)ts.tv_sec * 1000000ull +
			   (unsigned long long)ts.tv_nsec / 1000ull);
}

void notify_stopping(void)
{
	sd_notify(0, "STOPPING=1\nSTATUS=stopping");
}

void notify_status(const char *fmt, ...)
{
	char buf[256];
	va_list ap;
	int n = snprintf(buf, sizeof(buf), "STATUS=");

	va_start(ap, fmt);
	vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
	va_end(ap);
	sd_notify(0, buf);
}

void notify_watchdog(void)
{
	static uint64_t interval_us, last_us;
	static int probed, enabled;
	struct timespec ts;
	uint64_t now;

	if (!probed) {
		enabled = sd_watchdog_enabled(0, &interval_us) > 0;
		probed = 1;
	}
	if (!enabled)
		return;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	now = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
	if (now - last_us >= interval_us / 2) {
		sd_notify(0, "WATCHDOG=1");
		last_us = now;
	}
}
#else
void notify_ready(void)
{
}

void notify_reloading(void)
{
}

void notify_stopping(void)
{
}

void notify_status(const char *fmt, ...)
{
	(void)fmt;
}

void notify_watchdog(void)
{
}
#endif
