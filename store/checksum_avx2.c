/* checksum_avx2 — the AVX2 build of checksum_impl.h; compiled with -mavx2. */
#include <stdint.h>

#define CHECKSUM_SUFFIX avx2
#include "store/checksum_impl.h"
