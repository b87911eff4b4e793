// Multi-tensor apply (the scheme of apex/csrc/multi_tensor_apply.cuh): the addresses of many tensors
// travel in the kernel's argument block, and every thread block works on one fixed-size chunk of one
// tensor, so a whole parameter group is updated in a handful of launches instead of one per tensor.
#pragma once
#include <ATen/ATen.h>
// c10 rather than ATen/cuda/CUDAContext.h: the latter pulls in cuBLAS/cuSPARSE headers that a
// minimal CUDA toolkit lacks, and only the current stream is needed here
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include <vector>

namespace lightning_zero {
namespace cuda {

constexpr int kThreads = 512;
constexpr int64_t kChunk = 65536;  // elements per block: long enough to amortise the block start
constexpr int kMaxBlocks = 320;
// Tensors per launch for each list depth, sized so the metadata stays under the classic 4 KiB
// kernel-parameter limit (apex's numbers).
constexpr int kMaxTensors[6] = {0, 110, 64, 48, 36, 30};

template <int DEPTH>
struct TensorListMeta {
  void* addr[DEPTH][kMaxTensors[DEPTH]];
  int64_t sizes[kMaxTensors[DEPTH]];
  int index[kMaxTensors[DEPTH]];  // position of the tensor in the caller's list (for LAMB norms)
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
};

// Calls `launch(n_blocks, meta)` as often as needed to cover every chunk of every tensor.
// lists[d][t]: tensor t of list d; all lists have the same length and sizes (checked by callers).
template <int DEPTH, typename Launch>
void multi_tensor_apply(const std::vector<std::vector<at::Tensor>>& lists, Launch launch) {
  TensorListMeta<DEPTH> meta;
  int nt = 0, nb = 0;
  const size_t count = lists[0].size();
  for (size_t t = 0; t < count; ++t) {
    const int64_t numel = lists[0][t].numel();
    if (numel == 0) continue;
    for (int d = 0; d < DEPTH; ++d) meta.addr[d][nt] = lists[d][t].data_ptr();
    meta.sizes[nt] = numel;
    meta.index[nt] = int(t);
    ++nt;
    const int64_t chunks = (numel + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[nb] = static_cast<unsigned char>(nt - 1);
      meta.block_to_chunk[nb] = int(c);
      ++nb;
      const bool last_chunk = c == chunks - 1;
      const bool full = nb == kMaxBlocks || (nt == kMaxTensors[DEPTH] && last_chunk);
      if (full) {
        launch(nb, meta);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        nb = 0;
        if (last_chunk) {
          nt = 0;
        } else {  // the current tensor continues in the next launch: keep it as slot 0
          for (int d = 0; d < DEPTH; ++d) meta.addr[d][0] = meta.addr[d][nt - 1];
          meta.sizes[0] = meta.sizes[nt - 1];
          meta.index[0] = meta.index[nt - 1];
          nt = 1;
        }
      }
    }
  }
  if (nb > 0) {
    launch(nb, meta);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace lightning_zero
