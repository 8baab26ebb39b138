/*
 * cli.h — what the kvblend CLI's files share (cli_common.c): parsing a command's options
 * and arguments, and printing the one error line. Every command is
 * `int cmd_NAME(kvb_client *c, struct args *a)`: it parses a->argv from a->i on, uses c
 * (NULL for commands that need no daemon) and returns the exit status: 0 success,
 * 1 an error (one line on stderr), 2 bad usage.
 */
#ifndef KVBLEND_CLI_H
#define KVBLEND_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "client/include/kvblend.h"

/* The command line; i is the next argument to read. */
struct args {
	int argc;
	char **argv;
	int i;
};

/* Options of one command: a flat list of "--name" -> value (or "1" for switches). */
struct opts {
	const char *names[16];
	const char *values[16];
	bool is_switch[16];
	int n;
	const char *positional[64];
	int npos;
};

/* The text of `kvblend --help`. */
extern const char usage_text[];

/* Print "kvblend: MESSAGE" on stderr; returns 1, the exit status of an error. */
__attribute__((format(printf, 1, 2))) int die(const char *fmt, ...);
/* die() with what failed, the code's text and the client's last error; returns 1. */
int client_err(kvb_client *c, int rc, const char *what);

/* Declare option name of the command (a switch takes no value), before opt_parse(). */
void opt_decl(struct opts *o, const char *name, bool is_switch);
/*
 * Read the rest of a's arguments into o: declared options and positionals. --help
 * prints the usage and exits 0. Returns 0, or 1 after die() on an unknown option,
 * a missing value or too many arguments.
 */
int opt_parse(struct opts *o, struct args *a);
/* The value of option name, "1" for a switch given, or NULL if it was not given. */
const char *opt(const struct opts *o, const char *name);
/* *out = the value of a required option: 0, or 1 after die() if it is missing. */
int need(const struct opts *o, const char *name, const char **out);
/* A whole number 0..UINT32_MAX: 0 and *out, or 1 after die() naming what. */
int parse_u32(const char *s, const char *what, uint32_t *out);
/* A chunk hash of 64 hex digits: 0 and h, or 1 after die(). */
int parse_hash(const char *s, uint8_t h[KVB_HASH_LEN]);
/*
 * Token ids from a .npy of integers or a text file of whitespace-separated ids:
 * 0 with *ids (malloc'd, the caller frees) and *n >= 1, or 1 after die().
 */
int read_tokens(const char *path, uint32_t **ids, size_t *n);
/* The .npy descr of a model dtype (bfloat16 as raw "<u2"). */
const char *npy_descr(enum kvb_dtype d);
/* Print s on stdout as a JSON string, quoted and escaped. */
void json_str(const char *s);

/* The commands, one file per concern: cli_admin.c, cli_chunk.c, cli_fuse.c. */
int cmd_keygen(kvb_client *c, struct args *a);
int cmd_ping(kvb_client *c, struct args *a);
int cmd_stats(kvb_client *c, struct args *a);
int cmd_cluster(kvb_client *c, struct args *a);
int cmd_model(kvb_client *c, struct args *a);
int cmd_hash(kvb_client *c, struct args *a);
int cmd_put(kvb_client *c, struct args *a);
int cmd_get(kvb_client *c, struct args *a);
int cmd_get_rerotated(kvb_client *c, struct args *a);
int cmd_ls(kvb_client *c, struct args *a);
int cmd_lookup(kvb_client *c, struct args *a);
int cmd_pin(kvb_client *c, struct args *a);
int cmd_unpin(kvb_client *c, struct args *a);
int cmd_rm(kvb_client *c, struct args *a);
int cmd_fuse(kvb_client *c, struct args *a);

#endif
