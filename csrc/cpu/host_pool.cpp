// Host memory of the disk tier (lightning_zero/offload/nvme.py): the tensors the swap store brings
// back into memory (a sub-group's master and moments, gradient slices, parameter shards) get
// 4096-aligned blocks, so O_DIRECT moves their whole blocks without a bounce copy, and the blocks
// come from a pool, so a step that frees and re-takes the same sizes touches no fresh pages.
//
// Why a pool: the store frees every buffer once it is written behind and takes it again for the
// next read, tens of GB per step on a billion-parameter model. Fresh memory is page-faulted (and
// zeroed by the kernel) on first touch and unmapped on free: measured 0.39 s of system time per GB
// on a 2-core VM even with transparent huge pages, against nothing for memory touched before, i.e.
// more CPU than the I/O itself. The pool keeps freed blocks and hands them out again.
//
// What it holds: about the most the store had in use at once. A freed block is kept (the bytes in
// use plus the bytes kept free stay what they were); a request no free block fits (the smallest
// free block of at least the size and at most a quarter larger) allocates a new one and, when the bytes in
// use plus kept then pass that peak, gives free blocks back to the allocator until they do not
// (first those too small for the request, largest first, then the smallest of the others). A size
// given back and then asked for again raises that bound by its capacity for good, so a step that
// alternates between sizes settles instead of giving back and re-allocating every time (the
// steady state allocates nothing).
// host_pool_trim() gives every free block back, starts the bound again from the bytes in use, and
// until the next take frees blocks as they come back (the store calls it when it closes: tensors
// that outlive it, e.g. states brought back into memory, free their blocks to the allocator); host_pool_stats() reports [in use, free, peak, allocations]
// in bytes and calls to the allocator since the process started (tests and benchmarks read it).
//
// Blocks from 8 MiB are 2 MiB aligned and advised for transparent huge pages (fewer faults and TLB
// misses the first time); smaller ones 4096-aligned. A block returns to the pool through its
// DataPtr's deleter, from whichever thread frees the storage last, hence the mutex.
#include <ATen/ATen.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#endif

namespace lightning_zero {
namespace cpu {

namespace {
constexpr size_t kAlign = 4096;               // O_DIRECT's address/length unit
constexpr size_t kHuge = size_t(2) << 20;     // an x86-64 transparent huge page
constexpr size_t kHugeMin = size_t(8) << 20;  // blocks from this size are huge-page aligned

struct Block {
  void* address;
  size_t capacity;
};

struct Pool {
  std::mutex mutex;
  std::multimap<size_t, void*> free;  // capacity -> address
  std::set<size_t> given_back;        // capacities shed since the last trim
  size_t in_use = 0, kept = 0, peak = 0, extra = 0;
  int64_t allocations = 0;
  bool retain = false;  // keep freed blocks: from the first take after a trim until the next trim

  // Gives free blocks back to the allocator until in_use + kept <= peak + extra: those below
  // `wanted` (largest first), then the smallest of the rest. Called with the mutex held.
  void shed(size_t wanted) {
    while (in_use + kept > peak + extra && !free.empty()) {
      auto it = free.lower_bound(wanted);
      if (it != free.begin()) --it;  // the largest block below the request
      kept -= it->first;
      given_back.insert(it->first);
      std::free(it->second);
      free.erase(it);
    }
  }

  void release_all() {
    for (auto& entry : free) std::free(entry.second);
    free.clear();
    kept = 0;
  }
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: blocks may be freed during interpreter shutdown
  return *p;
}

void give_back(void* context) {
  Block* block = static_cast<Block*>(context);
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    p.in_use -= block->capacity;
    if (p.retain) {
      p.kept += block->capacity;
      p.free.emplace(block->capacity, block->address);
    } else {
      std::free(block->address);  // the store closed: a tensor outliving it frees its block
    }
  }
  delete block;
}

Block* take(size_t nbytes) {
  const size_t align = nbytes >= kHugeMin ? kHuge : kAlign;
  const size_t capacity = std::max<size_t>(align, (nbytes + align - 1) / align * align);
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.retain = true;
  auto it = p.free.lower_bound(capacity);
  if (it != p.free.end() && it->first <= capacity + capacity / 4) {
    Block* block = new Block{it->second, it->first};
    p.kept -= it->first;
    p.in_use += it->first;
    p.free.erase(it);
    return block;
  }
  void* address = nullptr;
  if (posix_memalign(&address, align, capacity) != 0) {
    p.release_all();  // out of memory: give every free block back and try once more
    TORCH_CHECK(posix_memalign(&address, align, capacity) == 0, "host_alloc_aligned: out of memory for ", nbytes,
                " bytes");
  }
#if defined(MADV_HUGEPAGE)
  if (align == kHuge) madvise(address, capacity, MADV_HUGEPAGE);  // a hint: without THP it does nothing
#endif
  ++p.allocations;
  if (p.given_back.erase(capacity)) p.extra += capacity;  // needed again after it was given back
  p.in_use += capacity;
  p.peak = std::max(p.peak, p.in_use);
  p.shed(capacity);
  return new Block{address, capacity};
}
}  // namespace

// Give `tensor`'s storage (a swapped-out tensor of the store: storage offset 0, resized to zero
// bytes) a block of the pool for its numel() elements. The storage keeps its allocator: a later
// resize_(0) returns the block to the pool through the DataPtr's deleter. Values are uninitialised,
// as after resize_ (a block from the pool holds what its last user left).
void host_alloc_aligned(const at::Tensor& tensor) {
  TORCH_CHECK_VALUE(tensor.device().is_cpu() && tensor.is_contiguous() && tensor.storage_offset() == 0,
                    "host_alloc_aligned: the tensor must be contiguous host memory at storage offset 0");
  const auto& storage = tensor.storage();
  TORCH_CHECK_VALUE(storage.resizable(), "host_alloc_aligned: the tensor's storage is not resizable");
  const size_t nbytes = static_cast<size_t>(tensor.numel() * tensor.element_size());
  Block* block = take(nbytes);
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(
      at::DataPtr(block->address, block, &give_back, at::Device(at::kCPU)));
  storage.unsafeGetStorageImpl()->set_nbytes(nbytes);
}

void host_pool_trim() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.release_all();
  p.given_back.clear();
  p.extra = 0;
  p.peak = p.in_use;
  p.retain = false;
}

std::vector<int64_t> host_pool_stats() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  return {int64_t(p.in_use), int64_t(p.kept), int64_t(p.peak), p.allocations};
}

}  // namespace cpu
}  // namespace lightning_zero
