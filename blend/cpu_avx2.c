/* cpu_avx2 — the avx2 build of the CPU blend kernels (kernels_impl.h). */
#define KERNEL_SUFFIX avx2
#include "blend/kernels_impl.h"
