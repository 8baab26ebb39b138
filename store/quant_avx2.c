/* quant — the decode kernel built for AVX2 + F16C (chosen at run time by quant.c). */
#define QUANT_SUFFIX avx2
#include "store/quant_impl.h"
