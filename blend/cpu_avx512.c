/* cpu_avx512 — the avx512 build of the CPU blend kernels (kernels_impl.h). */
#define KERNEL_SUFFIX avx512
#include "blend/kernels_impl.h"
