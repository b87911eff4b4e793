// The disk tier's asynchronous I/O engine (lightning_zero/offload/nvme.py, aio_engine "io_uring"):
// one tensor <-> one file, split into block_size requests of which up to queue_depth are in flight
// at once, all submitted and reaped by the calling thread through an io_uring. Raw system calls
// (io_uring_setup / io_uring_enter via syscall(2) and mmap of the rings), no liburing: this file is
// the whole engine. Same file format as swap_io.cpp (its thread-pool pread/pwrite engine, the
// fallback): files are block multiples, the last block padded with zeros.
//
// No bounce copy in the common case: a block whose memory address is 4096-aligned and which is a
// whole block_size goes straight between the tensor and the disk, also under O_DIRECT. The swap
// store gives its tensors 4096-aligned memory (host_alloc_aligned, csrc/cpu/host_pool.cpp), so only the last,
// partial block of a tensor, and every block of a tensor torch allocated (64-byte aligned), go
// through an aligned bounce block of their slot.
//
// The ring is kept per calling thread (thread_local) and re-made when queue_depth changes. The
// caller is one of the store's Python I/O threads; the dispatcher releases the GIL, so the step's
// compute runs meanwhile.
//
// Memory ordering (io_uring(7)): the kernel reads the SQ tail and we read the CQ tail it writes,
// so our store of the SQ tail is a release (the SQE is filled before the kernel can see it) and
// our load of the CQ tail an acquire (the CQE is read after the kernel wrote it); our store of the
// CQ head is a release (the CQE slot is free for the kernel only after we read it).
#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

// Headers of Linux 5.6 or later (IORING_OP_READ/WRITE came with IORING_FEAT_RW_CUR_POS); built
// elsewhere, the probe says so and the disk tier uses the thread engine.
#if defined(__linux__) && defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#endif
#endif
#if defined(IORING_FEAT_RW_CUR_POS)
#define LIGHTNING_ZERO_IO_URING 1
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#endif

namespace lightning_zero {
namespace cpu {

namespace {
constexpr int64_t kAlign = 4096;  // O_DIRECT's address/length/offset unit on the file systems we target
}  // namespace

#if defined(LIGHTNING_ZERO_IO_URING)

int swap_open(const std::string& path, bool write, bool direct, bool* used_direct);  // swap_io.cpp

namespace {

template <typename T>
T* at_offset(void* base, uint32_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// One io_uring: its fd, the three mappings (SQ ring, CQ ring, SQE array) and pointers into them.
class Ring {
 public:
  explicit Ring(unsigned depth) : depth_(depth) {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    fd_ = static_cast<int>(syscall(__NR_io_uring_setup, depth, &p));
    if (fd_ < 0) {
      error_ = std::string("io_uring_setup: ") + std::strerror(errno);
      return;
    }
    sq_bytes_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = p.features & IORING_FEAT_SINGLE_MMAP;  // one mapping serves both rings
    if (single) sq_bytes_ = cq_bytes_ = std::max(sq_bytes_, cq_bytes_);
    sq_ = map(sq_bytes_, IORING_OFF_SQ_RING);
    cq_ = single ? sq_ : map(cq_bytes_, IORING_OFF_CQ_RING);
    sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(map(sqes_bytes_, IORING_OFF_SQES));
    if (sq_ == nullptr || cq_ == nullptr || sqes_ == nullptr) {
      error_ = std::string("io_uring mmap: ") + std::strerror(errno);
      return;
    }
    sq_tail_ = at_offset<unsigned>(sq_, p.sq_off.tail);
    sq_mask_ = *at_offset<unsigned>(sq_, p.sq_off.ring_mask);
    sq_array_ = at_offset<unsigned>(sq_, p.sq_off.array);
    cq_head_ = at_offset<unsigned>(cq_, p.cq_off.head);
    cq_tail_ = at_offset<unsigned>(cq_, p.cq_off.tail);
    cq_mask_ = *at_offset<unsigned>(cq_, p.cq_off.ring_mask);
    cqes_ = at_offset<io_uring_cqe>(cq_, p.cq_off.cqes);
  }

  ~Ring() {
    if (sqes_ != nullptr) munmap(sqes_, sqes_bytes_);
    if (cq_ != nullptr && cq_ != sq_) munmap(cq_, cq_bytes_);
    if (sq_ != nullptr) munmap(sq_, sq_bytes_);
    if (fd_ >= 0) ::close(fd_);
  }

  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  const std::string& error() const { return error_; }  // empty when the ring works
  unsigned depth() const { return depth_; }

  // Queue one request (not yet submitted). We are the only producer: the tail is ours to read plainly.
  void push(uint8_t opcode, int fd, void* addr, uint32_t len, uint64_t offset, uint64_t tag) {
    const unsigned tail = *sq_tail_;
    const unsigned index = tail & sq_mask_;
    io_uring_sqe* sqe = &sqes_[index];
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = opcode;
    sqe->fd = fd;
    sqe->addr = reinterpret_cast<uint64_t>(addr);
    sqe->len = len;
    sqe->off = offset;
    sqe->user_data = tag;
    sq_array_[index] = index;
    __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
    ++queued_;
  }

  // Submit what push() queued and wait until at least `wait_for` completions are posted.
  int enter(unsigned wait_for) {
    for (;;) {
      const long done = syscall(__NR_io_uring_enter, fd_, queued_, wait_for,
                                wait_for > 0 ? IORING_ENTER_GETEVENTS : 0, nullptr, 0);
      if (done >= 0) {
        queued_ -= static_cast<unsigned>(done);
        return 0;
      }
      if (errno != EINTR) return errno;
    }
  }

  // Take one completion if one is posted: its tag and result (bytes, or -errno).
  bool pop(uint64_t* tag, int32_t* result) {
    const unsigned head = *cq_head_;
    if (head == __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE)) return false;
    const io_uring_cqe& cqe = cqes_[head & cq_mask_];
    *tag = cqe.user_data;
    *result = cqe.res;
    __atomic_store_n(cq_head_, head + 1, __ATOMIC_RELEASE);
    return true;
  }

 private:
  void* map(size_t bytes, off_t what) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, what);
    return p == MAP_FAILED ? nullptr : p;
  }

  unsigned depth_;
  int fd_ = -1;
  std::string error_;
  void* sq_ = nullptr;
  void* cq_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  size_t sq_bytes_ = 0, cq_bytes_ = 0, sqes_bytes_ = 0;
  unsigned *sq_tail_ = nullptr, *sq_array_ = nullptr, *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0, queued_ = 0;
  io_uring_cqe* cqes_ = nullptr;
};

// This thread's ring (made on first use, re-made for another depth or after a failed enter).
std::unique_ptr<Ring>& thread_ring_slot() {
  thread_local std::unique_ptr<Ring> ring;
  return ring;
}

Ring& thread_ring(unsigned depth) {
  std::unique_ptr<Ring>& ring = thread_ring_slot();
  if (!ring || ring->depth() != depth) ring = std::make_unique<Ring>(depth);
  return *ring;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// One in-flight request: the block it moves and, when it cannot go straight, its bounce block.
struct Slot {
  int64_t block = -1;
  char* target = nullptr;  // where the request reads into / writes from
  std::unique_ptr<char, FreeDeleter> bounce;
};

}  // namespace

// "" when an io_uring of `depth` entries can be set up and completes a NOP here, else why not
// (seccomp in containers, kernel.io_uring_disabled, an old kernel: the caller falls back).
std::string swap_uring_probe(int64_t depth) {
  if (depth < 1 || depth > 4096) return "queue_depth must be 1..4096";
  // a ring of its own, closed on return: the caller's thread (often the main one, which a forked
  // DataLoader worker copies) keeps no ring
  Ring ring(static_cast<unsigned>(depth));
  if (!ring.error().empty()) return ring.error();
  ring.push(IORING_OP_NOP, -1, nullptr, 0, 0, 7);
  if (int err = ring.enter(1)) return std::string("io_uring_enter: ") + std::strerror(err);
  uint64_t tag = 0;
  int32_t result = -1;
  if (!ring.pop(&tag, &result)) return "io_uring: the NOP did not complete";
  if (tag != 7 || result != 0) return "io_uring: the NOP completed with " + std::to_string(result);
  return "";
}

// Returns the number of bytes of `buffer` moved (its nbytes), or raises with the file and errno's text.
int64_t swap_uring(const at::Tensor& buffer, const std::string& path, bool write, int64_t block_size,
                   int64_t queue_depth, bool direct) {
  TORCH_CHECK_VALUE(buffer.device().is_cpu() && buffer.is_contiguous(),
                    "swap_uring: the tensor must be contiguous host memory");
  TORCH_CHECK_VALUE(block_size >= kAlign && (block_size & (block_size - 1)) == 0 && block_size <= (1 << 30),
                    "swap_uring: block_size must be a power of two from 4096 to 2^30, got ", block_size);
  TORCH_CHECK_VALUE(queue_depth >= 1 && queue_depth <= 4096, "swap_uring: queue_depth must be 1..4096, got ",
                    queue_depth);
  Ring& ring = thread_ring(static_cast<unsigned>(queue_depth));
  TORCH_CHECK(ring.error().empty(), "swap_uring: ", ring.error(), " (use aio_engine='threads')");
  const int64_t nbytes = buffer.numel() * buffer.element_size();
  char* data = static_cast<char*>(buffer.data_ptr());
  bool used_direct = false;
  const int fd = swap_open(path, write, direct, &used_direct);
  TORCH_CHECK(fd >= 0, "swap_uring: cannot open ", path, ": ", std::strerror(errno));
  const int64_t blocks = (nbytes + block_size - 1) / block_size;
  // Page-cache I/O takes any address; O_DIRECT an aligned one. The last, partial block always
  // goes through a bounce block: it is written padded with zeros and read without running past
  // the tensor's memory.
  const bool straight = !used_direct || reinterpret_cast<uintptr_t>(data) % kAlign == 0;
  std::vector<Slot> slots(static_cast<size_t>(std::min<int64_t>(queue_depth, std::max<int64_t>(blocks, 1))));
  std::vector<size_t> free_slots;
  for (size_t s = slots.size(); s-- > 0;) free_slots.push_back(s);
  int error = 0;
  bool broken = false;
  int64_t next = 0, in_flight = 0;
  auto issue = [&](size_t s) {
    Slot& slot = slots[s];
    slot.block = next++;
    const int64_t offset = slot.block * block_size;
    const int64_t valid = std::min(block_size, nbytes - offset);
    if (straight && valid == block_size) {
      slot.target = data + offset;
    } else {
      if (!slot.bounce) {
        void* p = nullptr;
        if (posix_memalign(&p, kAlign, block_size) != 0) return false;
        slot.bounce.reset(static_cast<char*>(p));
      }
      slot.target = slot.bounce.get();
      if (write) {
        std::memcpy(slot.target, data + offset, valid);
        std::memset(slot.target + valid, 0, block_size - valid);
      }
    }
    ring.push(write ? IORING_OP_WRITE : IORING_OP_READ, fd, slot.target, static_cast<uint32_t>(block_size),
              static_cast<uint64_t>(offset), s);
    ++in_flight;
    return true;
  };
  // Keep up to queue_depth requests in flight; on an error stop issuing but reap every request
  // already issued (the kernel still writes into their memory) before raising.
  while (in_flight > 0 || (next < blocks && error == 0)) {
    while (error == 0 && next < blocks && !free_slots.empty()) {
      const size_t s = free_slots.back();
      if (!issue(s)) {
        error = ENOMEM;
        break;
      }
      free_slots.pop_back();
    }
    if (in_flight == 0) break;
    const int err = ring.enter(1);
    if (err != 0 && err != EAGAIN && err != EBUSY) {  // EAGAIN/EBUSY: reap below, then enter again
      // The ring itself failed (not one request): what is still in flight cannot be reaped here.
      // Closing the ring makes the kernel cancel or finish those requests; the ring is re-made
      // at this thread's next call.
      error = err;
      broken = true;
      break;
    }
    uint64_t tag = 0;
    int32_t result = 0;
    while (ring.pop(&tag, &result)) {
      Slot& slot = slots[static_cast<size_t>(tag)];
      const int64_t offset = slot.block * block_size;
      const int64_t valid = std::min(block_size, nbytes - offset);
      if (result < 0) {
        if (error == 0) error = -result;
      } else if (result < valid) {
        if (error == 0) error = EIO;  // a short read or write
      } else if (!write && slot.target != data + offset) {
        std::memcpy(data + offset, slot.target, valid);
      }
      --in_flight;
      free_slots.push_back(static_cast<size_t>(tag));
    }
  }
  if (broken) {
    // requests may still land after the ring closes: their bounce blocks are leaked, not freed
    for (Slot& slot : slots) slot.bounce.release();
    thread_ring_slot().reset();
  }
  ::close(fd);
  TORCH_CHECK(error == 0, "swap_uring: ", write ? "writing " : "reading ", path, " failed: ", std::strerror(error),
              used_direct ? " (O_DIRECT)" : "");
  return nbytes;
}

#else  // no io_uring headers at build time

std::string swap_uring_probe(int64_t) { return "lightning_zero._C was built without <linux/io_uring.h> (5.6+)"; }

int64_t swap_uring(const at::Tensor&, const std::string& path, bool, int64_t, int64_t, bool) {
  TORCH_CHECK(false, "swap_uring: lightning_zero._C was built without io_uring (", path, "); use aio_engine='threads'");
  return 0;
}

#endif  // LIGHTNING_ZERO_IO_URING

}  // namespace cpu
}  // namespace lightning_zero
