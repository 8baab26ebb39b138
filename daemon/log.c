/* log — leveled logging to stderr; see log.h. */
#include "daemon/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Atomic: a reload changes it while workers read it. */
static atomic_int current = LOG_LVL_INFO;
static int journal;

static const char *const names[] = { "error", "warn", "info", "debug" };
static const int priorities[] = { 3, 4, 6, 7 };

void log_init(enum log_level level)
{
	log_set_level(level);
	journal = getenv("JOURNAL_STREAM") != NULL;
}

enum log_level log_get_level(void)
{
	return (enum log_level)atomic_load_explicit(&current, memory_order_relaxed);
}

void log_set_level(enum log_level level)
{
	atomic_store_explicit(&current, (int)level, memory_order_relaxed);
}

int log_level_parse(const char *s)
{
	for (int i = 0; i <= LOG_LVL_DEBUG; i++)
		if (!strcmp(s, names[i]))
			return i;
	return -1;
}

const char *log_level_name(enum log_level level)
{
	return level <= LOG_LVL_DEBUG ? names[level] : "?";
}

void log_msg(enum log_level level, const char *fmt, ...)
{
	char line[1024];
	int n = 0;
	va_list ap;

	if (level > log_get_level())
		return;
	if (journal) {
		n = snprintf(line, sizeof(line), "<%d>", priorities[level]);
	} else {
		struct timespec ts;
		struct tm tm;

		clock_gettime(CLOCK_REALTIME, &ts);
		gmtime_r(&ts.tv_sec, &tm);
		n = (int)strftime(line, sizeof(line), "%Y-%m-%dT%H:%M:%S", &tm);
		n += snprintf(line + n, sizeof(line) - (size_t)n, ".%03ldZ %-5s ",
			      ts.tv_nsec / 1000000, names[level]);
	}
	va_start(ap, fmt);
	vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
	va_end(ap);
	/* One write per line so lines from several threads never interleave. */
	fprintf(stderr, "%s\n", line);
}
