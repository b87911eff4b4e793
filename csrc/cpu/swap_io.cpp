// The disk tier's thread-pool I/O engine (lightning_zero/offload/nvme.py, aio_engine "threads",
// and the fallback of swap_uring.cpp's io_uring engine): one tensor <-> one file, split into
// block_size requests served by `threads` threads with pread/pwrite, through O_DIRECT when asked
// and the file system allows it. O_DIRECT needs block-aligned addresses, lengths and offsets:
// a whole block at a 4096-aligned address (the swap store allocates its tensors so) goes straight
// to and from the tensor; otherwise (torch's allocator only promises 64-byte alignment, and the
// last block of a tensor is partial) each thread copies through its own aligned bounce block. The
// last block of a file is written padded with zeros to block_size, so files are block multiples
// and reads of the last block never run short. Called from the I/O threads of the Python store;
// the dispatcher releases the GIL, so the step's compute runs meanwhile. Readable reference:
// os.pwrite/os.preadv in SwapStore (the fallback when this op is not compiled).
#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace lightning_zero {
namespace cpu {

// Opens a swap file for reading or (creating it) writing, with O_DIRECT when `direct` and the file
// system takes it; *used_direct says which. Returns the fd, or -1 with errno set.
int swap_open(const std::string& path, bool write, bool direct, bool* used_direct) {
  int flags = write ? (O_RDWR | O_CREAT) : O_RDONLY;
  if (direct) {
    int fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
    if (fd >= 0) {
      *used_direct = true;
      return fd;
    }
    // tmpfs and some network file systems refuse O_DIRECT (EINVAL): the page cache then
  }
  *used_direct = false;
  return ::open(path.c_str(), flags, 0600);
}

// Returns the number of bytes of `buffer` moved (its nbytes), or raises with errno's message.
int64_t swap_io(const at::Tensor& buffer, const std::string& path, bool write, int64_t block_size,
                int64_t threads, bool direct) {
  TORCH_CHECK_VALUE(buffer.device().is_cpu() && buffer.is_contiguous(),
                    "swap_io: the tensor must be contiguous host memory");
  TORCH_CHECK_VALUE(block_size >= 4096 && (block_size & (block_size - 1)) == 0,
                    "swap_io: block_size must be a power of two of at least 4096, got ", block_size);
  const int64_t nbytes = buffer.numel() * buffer.element_size();
  char* data = static_cast<char*>(buffer.data_ptr());
  bool used_direct = false;
  const int fd = swap_open(path, write, direct, &used_direct);
  TORCH_CHECK(fd >= 0, "swap_io: cannot open ", path, ": ", std::strerror(errno));
  const int64_t blocks = (nbytes + block_size - 1) / block_size;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, blocks));
  std::atomic<int64_t> next{0};
  std::atomic<int> error{0};
  // page-cache I/O takes any address, O_DIRECT a 4096-aligned one
  const bool straight = !used_direct || reinterpret_cast<uintptr_t>(data) % 4096 == 0;
  auto work = [&]() {
    void* bounce = nullptr;
    if (posix_memalign(&bounce, 4096, block_size) != 0) {
      error = ENOMEM;
      return;
    }
    char* aligned = static_cast<char*>(bounce);
    for (int64_t b = next++; b < blocks && error == 0; b = next++) {
      const int64_t offset = b * block_size;
      const int64_t valid = std::min(block_size, nbytes - offset);
      ssize_t done;
      if (straight && valid == block_size) {
        done = write ? ::pwrite(fd, data + offset, block_size, offset) : ::pread(fd, data + offset, block_size, offset);
      } else if (write) {
        std::memcpy(aligned, data + offset, valid);
        if (valid < block_size) std::memset(aligned + valid, 0, block_size - valid);
        done = ::pwrite(fd, aligned, block_size, offset);
      } else {
        done = ::pread(fd, aligned, block_size, offset);
        if (done >= valid) std::memcpy(data + offset, aligned, valid);
      }
      if (done < valid) error = done < 0 ? errno : EIO;  // EIO: a short read or write
    }
    std::free(bounce);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < workers; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  ::close(fd);
  TORCH_CHECK(error == 0, "swap_io: ", write ? "writing " : "reading ", path, " failed: ",
              std::strerror(error.load()), used_direct ? " (O_DIRECT)" : "");
  return nbytes;
}

}  // namespace cpu
}  // namespace lightning_zero
