// Run-time ISA detection. The CPU must report the instructions (cpuid) *and* the OS must save the
// wider registers on context switch (XCR0 via XGETBV); a hypervisor can hide the latter, and then
// AVX-512 code faults even though cpuid lists it.
#include "isa.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>

namespace {

struct X86Features {
  bool avx2_fma_f16c = false;
  bool avx512 = false;  // F + BW + VL + DQ, with ZMM state enabled by the OS
};

unsigned long long xgetbv0() {
  unsigned int eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

X86Features detect() {
  X86Features f;
  unsigned int a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12),
             f16c = c & (1u << 29);
  if (!(osxsave && avx)) return f;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;     // SSE + AVX registers saved by the OS
  const bool zmm_state = (xcr0 & 0xE6) == 0xE6;   // + opmask, ZMM_Hi256, Hi16_ZMM
  if (!ymm_state || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512dq = b & (1u << 17),
             avx512bw = b & (1u << 30), avx512vl = b & (1u << 31);
  f.avx2_fma_f16c = avx2 && fma && f16c;
  f.avx512 = f.avx2_fma_f16c && zmm_state && avx512f && avx512dq && avx512bw && avx512vl;
  return f;
}

}  // namespace
#endif

namespace lightning_zero {
namespace cpu {

int supported_tables(KernelTable* out, int capacity) {
  int n = 0;
#if defined(__x86_64__) || defined(_M_X64)
  static const X86Features features = detect();
  if (features.avx512 && n < capacity) out[n++] = avx512_kernels();
  if (features.avx2_fma_f16c && n < capacity) out[n++] = avx2_kernels();
#endif
  if (n < capacity) out[n++] = scalar_kernels();
  return n;
}

}  // namespace cpu
}  // namespace lightning_zero
