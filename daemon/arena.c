/* arena — first-fit ranges of a region the caller holds; see arena.h. */
#include "daemon/arena.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A range handed out: [off, off + len) of the region. */
struct range {
	size_t off, len;
};

struct arena {
	uint8_t *base;
	size_t bytes, align, used;
	struct range *r; /* handed out, sorted by off */
	size_t n, cap;
};

int arena_new(void *base, size_t bytes, size_t align, struct arena **out)
{
	struct arena *a;

	if (!bytes || !align || (align & (align - 1)))
		return -EINVAL;
	a = calloc(1, sizeof(*a));
	if (!a)
		return -ENOMEM;
	a->base = base;
	a->bytes = bytes;
	a->align = align;
	*out = a;
	return 0;
}

void arena_free(struct arena **ap)
{
	struct arena *a = ap ? *ap : NULL;

	if (!a)
		return;
	free(a->r);
	free(a);
	*ap = NULL;
}

int arena_take(struct arena *a, size_t bytes, void **out, size_t *got)
{
	size_t len, at = 0, i;

	if (!bytes)
		return -EINVAL;
	if (bytes > a->bytes)
		return -ENOMEM;
	len = (bytes + a->align - 1) & ~(a->align - 1);
	/* The first gap (before range i, or after the last) that holds len. */
	for (i = 0; i <= a->n; i++) {
		size_t end = i < a->n ? a->r[i].off : a->bytes;

		if (end >= at && end - at >= len)
			break;
		if (i < a->n)
			at = (a->r[i].off + a->r[i].len + a->align - 1) & ~(a->align - 1);
	}
	if (i > a->n)
		return -ENOMEM;
	if (a->n == a->cap) {
		size_t cap = a->cap ? 2 * a->cap : 16;
		struct range *r = realloc(a->r, cap * sizeof(*r));

		if (!r)
			return -ENOMEM;
		a->r = r;
		a->cap = cap;
	}
	memmove(&a->r[i + 1], &a->r[i], (a->n - i) * sizeof(*a->r));
	a->r[i] = (struct range){ at, len };
	a->n++;
	a->used += len;
	*out = a->base + at;
	*got = len;
	return 0;
}

int arena_give(struct arena *a, void *p)
{
	size_t lo = 0, hi = a->n;

	if (!arena_owns(a, p))
		return -EINVAL;
	/* binary search by offset */
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;

		if (a->r[mid].off < (size_t)((uint8_t *)p - a->base))
			lo = mid + 1;
		else
			hi = mid;
	}
	if (lo == a->n || a->base + a->r[lo].off != (uint8_t *)p)
		return -EINVAL;
	a->used -= a->r[lo].len;
	memmove(&a->r[lo], &a->r[lo + 1], (a->n - lo - 1) * sizeof(*a->r));
	a->n--;
	return 0;
}

bool arena_owns(const struct arena *a, const void *p)
{
	uintptr_t x = (uintptr_t)p, b = (uintptr_t)a->base;

	return x >= b && x - b < a->bytes;
}

void arena_usage(const struct arena *a, size_t *used, size_t *bytes)
{
	*used = a->used;
	*bytes = a->bytes;
}
