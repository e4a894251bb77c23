// Work shared between torch's intra-op threads a chunk at a time: each thread takes the next
// chunk from a shared counter until none is left (llama.cpp's matrix products do the same).
// With a static split, a thread that the OS preempts (on a 2-core machine the gateway and the
// clients run beside the worker) holds back the whole call at its end; here the other threads
// take its share. Which thread computes a chunk never changes what the chunk computes, so
// results stay the same whatever the threads do.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

// fn(chunk) for every chunk in [0, num_chunks), shared between the intra-op threads; on the
// calling thread alone where there is one thread or one chunk.
template <typename F>
inline void for_each_chunk(int64_t num_chunks, const F& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t chunk = 0; chunk < num_chunks; ++chunk) fn(chunk);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t chunk = next.fetch_add(1, std::memory_order_relaxed); chunk < num_chunks;
         chunk = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(chunk);
    }
  });
}

}  // namespace
