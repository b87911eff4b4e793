// CRC-32 of checkpoint files (lightning_zero/checkpoint): the zlib / PNG / gzip CRC (reflected
// polynomial 0xEDB88320), so the value is exactly zlib.crc32's and checkpoints written with either
// check with the other. zlib's byte-wise ("braided") code runs at ~3 GB/s on the machines we use,
// which made the check of a resumed rank file as long as reading it. On x86-64 with PCLMULQDQ the
// bulk is folded 64 bytes at a time with carry-less multiplications (Gopal, Ozturk et al., "Fast
// CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction", Intel 2009; the constants
// are the paper's bit-reflected ones for this polynomial, as in Chromium's zlib crc32_simd.c), then
// reduced with Barrett's method; the tail (< 16 bytes) and CPUs without PCLMULQDQ use the table.
// Readable reference: zlib.crc32 (lightning_zero/ops/checksum.py falls back to it when this op is
// not compiled); tests/unit/test_checksum.py compares the two on odd sizes and offsets.
#include <ATen/ATen.h>

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define LZ_CRC_X86 1
#endif

namespace lightning_zero {
namespace cpu {

namespace {

struct Table {
  uint32_t entry[256];
  Table() {
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      entry[n] = c;
    }
  }
};

// `state` is the running register (the CRC's complement), as the folding code below uses it.
uint32_t crc_bytes(uint32_t state, const uint8_t* data, int64_t len) {
  static const Table table;
  for (int64_t i = 0; i < len; ++i) state = table.entry[(state ^ data[i]) & 0xFF] ^ (state >> 8);
  return state;
}

#ifdef LZ_CRC_X86
bool has_pclmul() {
  unsigned int a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  return (c & (1u << 1)) && (c & (1u << 19));  // PCLMULQDQ and SSE4.1 (_mm_extract_epi32)
}

// Folds `len` bytes (a multiple of 16, at least 64) into the register `state`.
__attribute__((target("pclmul,sse4.1"))) uint32_t crc_folded(uint32_t state, const uint8_t* buf, int64_t len) {
  alignas(16) static const uint64_t k1k2[] = {0x0154442bd4, 0x01c6e41596};
  alignas(16) static const uint64_t k3k4[] = {0x01751997d0, 0x00ccaa009e};
  alignas(16) static const uint64_t k5k0[] = {0x0163cd6124, 0x0000000000};
  alignas(16) static const uint64_t poly[] = {0x01db710641, 0x01f7011641};
  __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;

  x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x00));
  x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x10));
  x3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x20));
  x4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x30));
  x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128(static_cast<int>(state)));
  x0 = _mm_load_si128(reinterpret_cast<const __m128i*>(k1k2));
  buf += 64;
  len -= 64;

  // four independent 128-bit lanes, each folded 64 bytes forward per iteration
  while (len >= 64) {
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
    x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
    x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
    x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
    y5 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x00));
    y6 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x10));
    y7 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x20));
    y8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x30));
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
    x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
    x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
    x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
    buf += 64;
    len -= 64;
  }

  // the four lanes into one
  x0 = _mm_load_si128(reinterpret_cast<const __m128i*>(k3k4));
  x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
  x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
  x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);

  while (len >= 16) {
    x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    buf += 16;
    len -= 16;
  }

  // 128 -> 64 bits
  x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
  x3 = _mm_setr_epi32(~0, 0, ~0, 0);
  x1 = _mm_srli_si128(x1, 8);
  x1 = _mm_xor_si128(x1, x2);
  x0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k5k0));
  x2 = _mm_srli_si128(x1, 4);
  x1 = _mm_and_si128(x1, x3);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_xor_si128(x1, x2);

  // Barrett reduction to 32 bits
  x0 = _mm_load_si128(reinterpret_cast<const __m128i*>(poly));
  x2 = _mm_and_si128(x1, x3);
  x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
  x2 = _mm_and_si128(x2, x3);
  x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
  x1 = _mm_xor_si128(x1, x2);
  return static_cast<uint32_t>(_mm_extract_epi32(x1, 1));
}
#endif

}  // namespace

// zlib.crc32(data, value): the CRC-32 of the bytes of the contiguous CPU tensor `data`, continuing
// from `value` (0 to start). The dispatcher releases the GIL, so another thread's Python runs meanwhile.
int64_t crc32(const at::Tensor& data, int64_t value) {
  TORCH_CHECK_VALUE(data.device().is_cpu() && data.is_contiguous(), "crc32: the tensor must be contiguous host memory");
  TORCH_CHECK_VALUE(value >= 0 && value <= 0xFFFFFFFFLL, "crc32: value must be a CRC-32 (0 <= value < 2**32), got ",
                    value);
  const auto* bytes = static_cast<const uint8_t*>(data.data_ptr());
  int64_t len = data.numel() * data.element_size();
  uint32_t state = ~static_cast<uint32_t>(value);
#ifdef LZ_CRC_X86
  static const bool pclmul = has_pclmul();
  if (pclmul && len >= 64) {
    const int64_t bulk = len & ~int64_t(15);
    state = crc_folded(state, bytes, bulk);
    bytes += bulk;
    len -= bulk;
  }
#endif
  return static_cast<int64_t>(~crc_bytes(state, bytes, len));
}

}  // namespace cpu
}  // namespace lightning_zero
