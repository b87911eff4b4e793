// Which of the compiled kernel tables this CPU can run, decided once from cpuid/XGETBV.
#pragma once
#include "kernels.h"

namespace lightning_zero {
namespace cpu {

// Kernel tables this CPU and OS can run, best first, always ending with "scalar". Returns the count.
int supported_tables(KernelTable* out, int capacity);

}  // namespace cpu
}  // namespace lightning_zero
