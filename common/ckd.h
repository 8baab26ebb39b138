/*
 * ckd — checked arithmetic for every size, offset and extent computed from a client's
 * numbers (request fields, landing layouts, frame sizes, file headers). The one set the
 * daemon, the fuse engine, the store and the codecs use; tests/lint_ckd.py finds `*` and
 * `+` on wire fields in the request handlers and the fuse engine that do not go through
 * it. Named and shaped after C23's <stdckdint.h>: each returns true when the exact
 * result does not fit in *r (which then holds the wrapped value: never use it). Any
 * integer types; the compiler's overflow builtins do the work. Header-only. Not installed.
 */
#ifndef KVBLEND_COMMON_CKD_H
#define KVBLEND_COMMON_CKD_H

#include <stdbool.h>
#include <stdint.h>

/* *r = a + b; true on overflow. */
#define ckd_add(r, a, b) __builtin_add_overflow((a), (b), (r))
/* *r = a - b; true on overflow (below zero for unsigned r). */
#define ckd_sub(r, a, b) __builtin_sub_overflow((a), (b), (r))
/* *r = a * b; true on overflow. */
#define ckd_mul(r, a, b) __builtin_mul_overflow((a), (b), (r))

/* *r = a * b + c in 64 bits; true on overflow (*r untouched then). */
static inline bool ckd_mul_add(uint64_t *r, uint64_t a, uint64_t b, uint64_t c)
{
	uint64_t p, s;

	if (__builtin_mul_overflow(a, b, &p) || __builtin_add_overflow(p, c, &s))
		return true;
	*r = s;
	return false;
}

/* *r = a * b * c in 64 bits; true on overflow (*r untouched then). */
static inline bool ckd_mul3(uint64_t *r, uint64_t a, uint64_t b, uint64_t c)
{
	uint64_t p, s;

	if (__builtin_mul_overflow(a, b, &p) || __builtin_mul_overflow(p, c, &s))
		return true;
	*r = s;
	return false;
}

/* *r = a + b + c in 64 bits; true on overflow (*r untouched then). */
static inline bool ckd_add3(uint64_t *r, uint64_t a, uint64_t b, uint64_t c)
{
	uint64_t p, s;

	if (__builtin_add_overflow(a, b, &p) || __builtin_add_overflow(p, c, &s))
		return true;
	*r = s;
	return false;
}

#endif
