/* cpu_baseline — the baseline build of the CPU blend kernels (kernels_impl.h). */
#define KERNEL_SUFFIX baseline
#include "blend/kernels_impl.h"
