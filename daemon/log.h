/*
 * log — leveled logging to stderr for kvblendd.
 *
 * Under systemd (JOURNAL_STREAM set) lines carry <N> syslog priority prefixes so
 * the journal records levels; otherwise they carry a timestamp and level name.
 */
#ifndef KVBLEND_DAEMON_LOG_H
#define KVBLEND_DAEMON_LOG_H

enum log_level { LOG_LVL_ERROR = 0, LOG_LVL_WARN, LOG_LVL_INFO, LOG_LVL_DEBUG };

void log_init(enum log_level level);
enum log_level log_get_level(void);
/* Change the level while threads log (SIGHUP reload): safe from any thread. */
void log_set_level(enum log_level level);
/* Parse "error", "warn", "info", "debug". Returns the level or -1. */
int log_level_parse(const char *s);
const char *log_level_name(enum log_level level);

void log_msg(enum log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define log_err(...) log_msg(LOG_LVL_ERROR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_LVL_WARN, __VA_ARGS__)
#define log_info(...) log_msg(LOG_LVL_INFO, __VA_ARGS__)
#define log_debug(...)                                     \
	do {                                               \
		if (log_get_level() >= LOG_LVL_DEBUG)      \
			log_msg(LOG_LVL_DEBUG, __VA_ARGS__); \
	} while (0)

#endif
