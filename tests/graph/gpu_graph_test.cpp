// CUDA graphs with graph-private pools (issue 9): capture, instantiate, replay; allocations inside the capture come
// from the pool with no cudaMalloc; frees inside the capture are reused by the same capture; outputs keep the pool
// alive; the reserve goes back once graphs and outputs are gone; misuse is a clear error and leaves the capture and
// the allocators usable. GPU tests: skipped with GPUKIT_TEST_SKIPPED without a GPU, run on the simulator as
// test_gpu_graph_sim.
#include "support.hpp"

#ifdef GPUKIT_TEST_ON_CUDASIM
#include "cudasim/cudasim.hpp"
#endif

#include <gpukit/graph/graph.hpp>
#include <gpukit/memory/async_allocator.hpp>
#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/graph_pool.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace gpukit_test;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::vector<int> read(const gpukit::device_buffer<int>& b, gpukit::stream& s) {
  std::vector<int> host(b.size());
  GPUKIT_CUDA_TRY(cudaMemcpyAsync(host.data(), b.data(), b.size_bytes(), cudaMemcpyDeviceToHost, s.cuda_handle()));
  s.synchronize();
  return host;
}

/// Captures, with `pool`, a graph whose output (`bytes` from `allocator` on `s`, kept past the capture) is filled
/// with 0x02 bytes; sets `*out` to it.
template <class Allocator>
gpukit::graph capture_producer(gpukit::stream& s, Allocator& allocator, std::size_t bytes,
                               const std::shared_ptr<gpukit::graph_pool>& pool, void** out) {
  return gpukit::capture(
      s,
      [&] {
        *out = allocator.allocate(bytes, s);
        GPUKIT_CUDA_TRY(cudaMemsetAsync(*out, 2, bytes, s.cuda_handle()));
      },
      pool);
}

}  // namespace

TEST_CASE("gpu: a captured step with temporaries from a graph pool replays, with no cudaMalloc in the capture") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::device_buffer<int> out(1024, s);
  GPUKIT_CUDA_TRY(cudaMemsetAsync(out.data(), 0, out.size_bytes(), s.cuda_handle()));
  auto pool = gpukit::graph_pool::create(d, 4 * MiB);
  const auto device_allocs = gpukit::memory_stats(d).num_device_alloc;
  void* first_tmp = nullptr;
  gpukit::graph step = gpukit::capture(
      s,
      [&] {
        {
          gpukit::device_buffer<int> tmp(1024, s);  // the default allocator, served by the pool during the capture
          first_tmp = tmp.data();
          CHECK(pool->owns(tmp.data()));
          GPUKIT_CUDA_TRY(cudaMemsetAsync(tmp.data(), 1, tmp.size_bytes(), s.cuda_handle()));
          GPUKIT_CUDA_TRY(
              cudaMemcpyAsync(out.data(), tmp.data(), tmp.size_bytes(), cudaMemcpyDeviceToDevice, s.cuda_handle()));
        }  // tmp is freed inside the capture: the next allocation of the same capture reuses it
        gpukit::device_buffer<int> again(1024, s);
        CHECK(static_cast<void*>(again.data()) == first_tmp);
      },
      pool);
  CHECK(gpukit::memory_stats(d).num_device_alloc == device_allocs);  // nothing allocated from the device meanwhile
  CHECK(pool->memory_allocated() == 0);
  CHECK(step.pool().get() == pool.get());
  CHECK(read(out, s) == std::vector<int>(1024, 0));  // captured, not run
  step.launch(s);
  CHECK(read(out, s) == std::vector<int>(1024, 0x01010101));
  GPUKIT_CUDA_TRY(cudaMemsetAsync(out.data(), 0, out.size_bytes(), s.cuda_handle()));
  step.launch(s);
  step.launch(s);
  CHECK(read(out, s) == std::vector<int>(1024, 0x01010101));
}

TEST_CASE("gpu: an output allocated in the capture stays in the pool, which lives until graphs and outputs are gone") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  const std::size_t reserved_before = gpukit::memory_allocated(d);
  std::unique_ptr<gpukit::device_buffer<int>> output;
  {
    auto pool = gpukit::graph_pool::create(d, 2 * MiB);
    CHECK(gpukit::memory_allocated(d) == reserved_before + 2 * MiB);  // the reserve, from the default allocator
    gpukit::graph g = gpukit::capture(
        s,
        [&] {
          output = std::make_unique<gpukit::device_buffer<int>>(256, s);
          GPUKIT_CUDA_TRY(cudaMemsetAsync(output->data(), 2, output->size_bytes(), s.cuda_handle()));
          // Memory the allocator routed to the pool is the allocator's to free, so it owns it (not only the block at
          // the reserve's start, which is also the engine's).
          void* scratch = gpukit::default_allocator(d).allocate(512, s);
          CHECK(pool->owns(scratch));
          CHECK(gpukit::default_allocator(d).owns(scratch));
          gpukit::default_allocator(d).deallocate(scratch);
        },
        pool);
    g.launch(s);
    CHECK(read(*output, s) == std::vector<int>(256, 0x02020202));
    CHECK(pool->memory_allocated() == 256 * sizeof(int));
    // graph and pool handle go here; the output keeps the pool (and its reserve) alive
  }
  CHECK(gpukit::memory_allocated(d) == reserved_before + 2 * MiB);
  CHECK(read(*output, s) == std::vector<int>(256, 0x02020202));
  output.reset();  // the pool's last allocation: the reserve goes back to the default allocator
  CHECK(gpukit::memory_allocated(d) == reserved_before);
  s.synchronize();
}

TEST_CASE("gpu: several graphs share a pool, and a graph is updated in place from a recapture") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::device_buffer<int> out(64, s);
  auto pool = gpukit::graph_pool::create(d, MiB);
  auto fill = [&](int byte, const std::shared_ptr<gpukit::graph_pool>& from) {
    return gpukit::capture(
        s,
        [&] {
          gpukit::device_buffer<int> tmp(64, s);
          GPUKIT_CUDA_TRY(cudaMemsetAsync(tmp.data(), byte, tmp.size_bytes(), s.cuda_handle()));
          GPUKIT_CUDA_TRY(
              cudaMemcpyAsync(out.data(), tmp.data(), tmp.size_bytes(), cudaMemcpyDeviceToDevice, s.cuda_handle()));
        },
        from);
  };
  gpukit::graph a = fill(3, pool);
  gpukit::graph b = fill(4, pool);
  a.launch(s);
  CHECK(read(out, s) == std::vector<int>(64, 0x03030303));
  b.launch(s);
  CHECK(read(out, s) == std::vector<int>(64, 0x04040404));
  gpukit::graph recaptured = fill(5, pool);
  CHECK(a.update(recaptured));  // same topology: updated in place
  CHECK_FALSE(recaptured);
  a.launch(s);
  CHECK(read(out, s) == std::vector<int>(64, 0x05050505));
  // Recaptured from another pool: the graph now uses that pool's memory, so it keeps that pool.
  auto other_pool = gpukit::graph_pool::create(d, MiB);
  gpukit::graph from_other_pool = fill(7, other_pool);
  CHECK(a.update(from_other_pool));
  CHECK((a.pool() == other_pool));
  a.launch(s);
  CHECK(read(out, s) == std::vector<int>(64, 0x07070707));
  gpukit::graph different =
      gpukit::capture(s, [&] { GPUKIT_CUDA_TRY(cudaMemsetAsync(out.data(), 6, out.size_bytes(), s.cuda_handle())); });
  cudaGraphExecUpdateResult why_not = cudaGraphExecUpdateSuccess;
  CHECK_FALSE(a.update(different, &why_not));  // another topology: refused, nothing changed
  CHECK(why_not == cudaGraphExecUpdateErrorTopologyChanged);
  CHECK(different);
  a.launch(s);
  CHECK(read(out, s) == std::vector<int>(64, 0x07070707));
}

TEST_CASE("gpu: graph misuse is a clear error and leaves the capture, the pool and the allocators usable") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  auto pool = gpukit::graph_pool::create(d, MiB);

  // A request the reserve cannot hold: out of memory, naming the remedy; the capture ends cleanly.
  try {
    (void)gpukit::capture(
        s, [&] { gpukit::device_buffer<char> big(2 * MiB, s); }, pool);
    FAIL("a request beyond the reserve was served");
  } catch (const gpukit::out_of_memory_error& e) {
    CHECK(contains(e.what(), "reserve more before it (graph_pool::reserve)"));
  }
  CHECK(gpukit::detail::capture_status(s) == cudaStreamCaptureStatusNone);

  // Reserving during the capture is refused (it would allocate device memory inside it).
  CHECK_THROWS_AS(gpukit::capture(
                      s, [&] { pool->reserve(MiB); }, pool),
                  gpukit::invalid_argument_error);
  // Without a pool, gpukit allocations in a capture are refused, as before.
  CHECK_THROWS_AS(gpukit::capture(s, [&] { gpukit::device_buffer<int> x(16, s); }), gpukit::invalid_argument_error);
  // An exception from the work ends the capture and passes through.
  CHECK_THROWS_AS(gpukit::capture(
                      s, [] { throw std::runtime_error("user code failed"); }, pool),
                  std::runtime_error);
  CHECK(gpukit::detail::capture_status(s) == cudaStreamCaptureStatusNone);

  // Streams that cannot be captured, a pool of another device, empty graphs.
  CHECK_THROWS_AS(gpukit::capture(gpukit::stream_view::default_stream(d), [] {}), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::capture(gpukit::stream_view::default_stream(gpukit::device::cpu()), [] {}),
                  gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::graph_pool::create(gpukit::device::cpu(), MiB), gpukit::invalid_argument_error);
  gpukit::graph empty;
  CHECK_THROWS_AS(empty.launch(s), gpukit::invalid_argument_error);
  if (gpukit::device_count() > 1) {
    gpukit::stream other(gpukit::device::cuda(1));
    CHECK_THROWS_AS(gpukit::capture(
                        other, [] {}, pool),
                    gpukit::invalid_argument_error);
  }
  int local = 0;
  CHECK_THROWS_AS(pool->deallocate(&local), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(pool->set_reserved_limit(MiB), gpukit::invalid_argument_error);

  // Everything still works: the pool serves a capture, the default allocator serves the stream.
  gpukit::graph g = gpukit::capture(
      s, [&] { gpukit::device_buffer<int> x(16, s); }, pool);
  g.launch(s);
  gpukit::device_buffer<int> y(16, s);
  CHECK_FALSE(pool->owns(y.data()));
  s.synchronize();
}

TEST_CASE("gpu: over-aligned allocations in a capture come from the pool, aligned, and go back through the pool") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::allocator_options options;
  options.rounding = 64;  // a backing allocator whose blocks are only 64-byte aligned
  gpukit::caching_allocator backing(d, options);
  auto pool = gpukit::graph_pool::create(d, 4 * MiB, &backing);
  CHECK(pool->natural_alignment() == 64);
  const auto aligned_to = [](const void* p, std::size_t alignment) {
    return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
  };
  // Directly from the pool, at the default alignment and over it.
  for (std::size_t alignment : {std::size_t{256}, std::size_t{512}, std::size_t{8192}}) {
    CAPTURE(alignment);
    void* p = pool->allocate(1000, alignment, s);
    CHECK(aligned_to(p, alignment));
    CHECK(pool->owns(p));
    pool->deallocate(p);
  }
  CHECK(pool->memory_allocated() == 0);
  // Through the default allocator, which routes a capture's allocations to the pool.
  void* inside = nullptr;
  gpukit::graph step = gpukit::capture(
      s,
      [&] {
        inside = gpukit::default_allocator(d).allocate(3000, 4096, s);
        CHECK(aligned_to(inside, 4096));
        CHECK(pool->owns(inside));
        GPUKIT_CUDA_TRY(cudaMemsetAsync(inside, 0, 3000, s.cuda_handle()));  // all of it lies in the pool block
        pool->deallocate(inside);  // freed through the pool that served it, not the allocator that asked
      },
      pool);
  CHECK(pool->memory_allocated() == 0);
  step.launch(s);
  s.synchronize();
}

TEST_CASE("gpu: in a capture, a freed pool block is reused only on the stream that freed it") {
  // A capture orders each stream's work, not the work of a stream forked into it: a block freed on `s` and handed to
  // `forked` would be written by two graph nodes at once. Blocks another stream used wait for the capture's end.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::stream forked(d);
  auto pool = gpukit::graph_pool::create(d, 4 * MiB);
  auto& allocator = gpukit::default_allocator(d);
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  GPUKIT_CUDA_TRY(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  GPUKIT_CUDA_TRY(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  void* freed_on_s = nullptr;
  void* shared = nullptr;
  gpukit::graph g = gpukit::capture(
      s,
      [&] {
        GPUKIT_CUDA_TRY(cudaEventRecord(fork, s.cuda_handle()));
        GPUKIT_CUDA_TRY(cudaStreamWaitEvent(forked.cuda_handle(), fork, 0));  // `forked` joins the capture
        freed_on_s = allocator.allocate(4096, s);
        GPUKIT_CUDA_TRY(cudaMemsetAsync(freed_on_s, 1, 4096, s.cuda_handle()));
        allocator.deallocate(freed_on_s, s);
        void* on_forked = allocator.allocate(4096, forked);
        CHECK(on_forked != freed_on_s);  // the memset on `s` may still run beside `forked`'s work
        void* on_s = allocator.allocate(4096, s);
        CHECK(on_s == freed_on_s);  // `s` itself orders its reuse
        // Used by `forked` too (record_stream): reused by neither stream until the capture ends.
        allocator.record_stream(on_s, forked);
        allocator.deallocate(on_s, s);
        shared = on_s;
        void* again = allocator.allocate(4096, s);
        CHECK(again != shared);
        allocator.deallocate(again, s);
        // Freed on another stream than its own: the same.
        allocator.deallocate(on_forked, s);
        void* after_cross_free = allocator.allocate(4096, forked);
        CHECK(after_cross_free != on_forked);
        allocator.deallocate(after_cross_free, forked);
        GPUKIT_CUDA_TRY(cudaEventRecord(join, forked.cuda_handle()));
        GPUKIT_CUDA_TRY(cudaStreamWaitEvent(s.cuda_handle(), join, 0));  // joined back before the capture ends
      },
      pool);
  CHECK(pool->memory_allocated() == 0);
  // After the capture, the blocks it used serve any stream of a later capture, merged again; the rest stays apart
  // for direct allocations too, and a later capture takes both as one.
  CHECK(pool->free_space().free_blocks == 2);
  CHECK(pool->free_space().free_bytes == 4 * MiB);
  g.launch(s);
  s.synchronize();
  GPUKIT_CUDA_TRY(cudaEventDestroy(fork));
  GPUKIT_CUDA_TRY(cudaEventDestroy(join));
}

TEST_CASE("gpu: a double free of a pool block is refused, and the reserve stays the pool's") {
  // The pool's first block starts where its reserve, an allocation of the default allocator, does: a second free
  // of it must reach the pool (which refuses it), not hand the whole reserve back to the default allocator.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  auto& allocator = gpukit::default_allocator(d);
  auto pool = gpukit::graph_pool::create(d, MiB);
  void* output = nullptr;
  gpukit::graph g = gpukit::capture(
      s, [&] { output = allocator.allocate(4096, s); }, pool);
  REQUIRE(output != nullptr);
  CHECK(pool->owns(output));
  const std::size_t allocated = allocator.memory_allocated();
  allocator.deallocate(output);
  CHECK_FALSE(allocator.owns(output));
  CHECK_FALSE(pool->owns(output));
  CHECK_THROWS_WITH_AS(allocator.deallocate(output), doctest::Contains("double free"), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(allocator.record_stream(output, s), gpukit::invalid_argument_error);
  CHECK(allocator.memory_allocated() == allocated);  // the reserve is still allocated, to the pool
  CHECK(pool->memory_reserved() == MiB);
  void* next = allocator.allocate(MiB, s);
  CHECK_FALSE(pool->owns(next));
  CHECK((reinterpret_cast<std::uintptr_t>(next) + MiB <= reinterpret_cast<std::uintptr_t>(output) ||
         reinterpret_cast<std::uintptr_t>(next) >= reinterpret_cast<std::uintptr_t>(output) + MiB));
  allocator.deallocate(next);
}

TEST_CASE("gpu: a graph updated from a capture_for_update is not instantiated twice, and one refused is instantiated") {
  // cudaGraphExecUpdate needs only the recaptured cudaGraph_t: an instantiation would be made only to be destroyed.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::device_buffer<int> out(64, s);
  const auto fill = [&](int byte) {
    GPUKIT_CUDA_TRY(cudaMemsetAsync(out.data(), byte, out.size_bytes(), s.cuda_handle()));
  };
  gpukit::graph g = gpukit::capture(s, [&] { fill(1); });
#ifdef GPUKIT_TEST_ON_CUDASIM
  const std::size_t instantiations = cudasim::calls("cudaGraphInstantiate");
#endif
  gpukit::graph recaptured = gpukit::capture_for_update(s, [&] { fill(2); });
  CHECK(recaptured.native_graph() != nullptr);
  CHECK(recaptured.native_exec() == nullptr);
  CHECK_FALSE(recaptured);
  CHECK_THROWS_WITH_AS(recaptured.launch(s), doctest::Contains("not instantiated"), gpukit::invalid_argument_error);
  CHECK_THROWS_WITH_AS(recaptured.update(g), doctest::Contains("not instantiated"), gpukit::invalid_argument_error);
  CHECK(g.update(recaptured));
  CHECK(recaptured.native_graph() == nullptr);
  g.launch(s);
  CHECK(read(out, s) == std::vector<int>(64, 0x02020202));
#ifdef GPUKIT_TEST_ON_CUDASIM
  CHECK(cudasim::calls("cudaGraphInstantiate") == instantiations);  // none for the update
#endif
  // Another topology: refused, and instantiated to replace the graph.
  gpukit::graph different = gpukit::capture_for_update(s, [&] {
    fill(3);
    fill(4);
  });
  cudaGraphExecUpdateResult why_not = cudaGraphExecUpdateSuccess;
  CHECK_FALSE(g.update(different, &why_not));
  CHECK(why_not == cudaGraphExecUpdateErrorTopologyChanged);
  different.instantiate();
  REQUIRE(static_cast<bool>(different));
  different.instantiate();  // once is enough: nothing more
#ifdef GPUKIT_TEST_ON_CUDASIM
  CHECK(cudasim::calls("cudaGraphInstantiate") == instantiations + 1);
#endif
  g = std::move(different);
  g.launch(s);
  CHECK(read(out, s) == std::vector<int>(64, 0x04040404));
  CHECK_THROWS_WITH_AS(different.instantiate(), doctest::Contains("empty"), gpukit::invalid_argument_error);
}

TEST_CASE("gpu: a graph updated from itself is refused and still launches") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::device_buffer<int> out(16, s);
  gpukit::graph g =
      gpukit::capture(s, [&] { GPUKIT_CUDA_TRY(cudaMemsetAsync(out.data(), 0, out.size_bytes(), s.cuda_handle())); });
  CHECK_THROWS_WITH_AS(g.update(g), doctest::Contains("from itself"), gpukit::invalid_argument_error);
  REQUIRE(static_cast<bool>(g));
  g.launch(s);
  s.synchronize();
}

TEST_CASE("gpu: a graph pool's release orders its reserve after its launches on the device, without a host wait") {
  // A launch held back by a host function that the releasing thread would let go later must not deadlock the
  // release; the reserve still goes back only after the launch's work.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gate held;
  gpukit::allocator_options options;
  options.release_before_grow = false;  // no cudaFree (a device-wide wait) while the gate holds work back
  gpukit::caching_allocator backing(d, options);
  gpukit::stream s(d);
  gpukit::device_buffer<int> out(16, s);
  auto pool = gpukit::graph_pool::create(d, MiB, &backing);
  void* reserve = nullptr;
  gpukit::graph g = gpukit::capture(
      s,
      [&] {
        gpukit::device_buffer<int> tmp(16, s);
        reserve = tmp.data();  // the first block of an empty pool: the reserve's start
        GPUKIT_CUDA_TRY(cudaMemsetAsync(tmp.data(), 7, tmp.size_bytes(), s.cuda_handle()));
        GPUKIT_CUDA_TRY(
            cudaMemcpyAsync(out.data(), tmp.data(), tmp.size_bytes(), cudaMemcpyDeviceToDevice, s.cuda_handle()));
      },
      pool);
  held.hold(s);
  g.launch(s);  // held back until the gate opens
  const captured_warnings warnings;
  const bool had_to_open = held.opened_to_return([&] {
    g = gpukit::graph();  // the last owners: the reserve goes back now
    pool.reset();
  });
  CHECK_FALSE(had_to_open);  // the release did not wait for the held launch
  CHECK(warnings.messages().empty());
  CHECK(backing.memory_allocated() == 0);  // freed into the backing allocator...
  const auto reserve_at = reinterpret_cast<std::uintptr_t>(reserve);
  void* other = backing.allocate(MiB, gpukit::stream_view::default_stream(d));
  const auto other_at = reinterpret_cast<std::uintptr_t>(other);
  CHECK((other_at + MiB <= reserve_at || other_at >= reserve_at + MiB));  // ...but not reusable before the launch ran
  held.open();
  CHECK(read(out, s) == std::vector<int>(16, 0x07070707));
  {
    const gpukit::device_guard guard(d);
    GPUKIT_CUDA_TRY(cudaDeviceSynchronize());  // the release's own stream too
  }
  void* again = backing.allocate(MiB, gpukit::stream_view::default_stream(d));
  CHECK(again == reserve);  // reusable once the launch's work is done
  backing.deallocate(again);
  backing.deallocate(other);
}

TEST_CASE("gpu: a graph pool backed by async_allocator releases its reserve without a host wait") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gate held;
  gpukit::async_allocator backing(d);
  gpukit::stream s(d);
  gpukit::device_buffer<int> out(16, s);
  auto pool = gpukit::graph_pool::create(d, MiB, &backing);
  gpukit::graph g = gpukit::capture(
      s,
      [&] {
        gpukit::device_buffer<int> tmp(16, s);
        GPUKIT_CUDA_TRY(cudaMemsetAsync(tmp.data(), 9, tmp.size_bytes(), s.cuda_handle()));
        GPUKIT_CUDA_TRY(
            cudaMemcpyAsync(out.data(), tmp.data(), tmp.size_bytes(), cudaMemcpyDeviceToDevice, s.cuda_handle()));
      },
      pool);
  held.hold(s);
  g.launch(s);
  const captured_warnings warnings;
  const bool had_to_open = held.opened_to_return([&] {
    g = gpukit::graph();
    pool.reset();  // cudaFreeAsync on the pool's private stream, after the held launch
  });
  CHECK_FALSE(had_to_open);
  CHECK(backing.memory_allocated() == 0);
  held.open();
  CHECK(read(out, s) == std::vector<int>(16, 0x09090909));
  CHECK(warnings.messages().empty());
}

TEST_CASE("gpu: a graph with a pool launched into a stream being captured is refused, and the capture goes on") {
  // Its launch would become part of the outer graph, which could run after the pool's memory went back.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::stream outer(d);
  auto pool = gpukit::graph_pool::create(d, MiB);
  gpukit::graph inner = gpukit::capture(
      s,
      [&] {
        gpukit::device_buffer<int> tmp(16, s);
        GPUKIT_CUDA_TRY(cudaMemsetAsync(tmp.data(), 1, tmp.size_bytes(), s.cuda_handle()));
      },
      pool);
  bool refused = false;
  gpukit::graph wrapper = gpukit::capture(outer, [&] {
    try {
      inner.launch(outer);
    } catch (const gpukit::invalid_argument_error& e) {
      refused = contains(e.what(), "being captured") && contains(e.what(), "graph pool");
    }
  });
  CHECK(refused);
  wrapper.launch(outer);  // the outer capture was not invalidated
  inner.launch(s);        // and the inner graph still launches where it may
  outer.synchronize();
  s.synchronize();
}

TEST_CASE("gpu: a graph pool released while another thread captures a blocking stream leaves that capture intact") {
  // The release waits for the graphs' launches. A wait on the legacy default stream (where the reserve came from) is
  // refused while a blocking stream of the device is captured, and invalidates that capture: the host waits instead.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::device_buffer<int> out(16, s);
  auto pool = gpukit::graph_pool::create(d, MiB);
  gpukit::graph g = gpukit::capture(
      s,
      [&] {
        gpukit::device_buffer<int> tmp(16, s);
        GPUKIT_CUDA_TRY(cudaMemsetAsync(tmp.data(), 0, tmp.size_bytes(), s.cuda_handle()));
      },
      pool);
  g.launch(s);  // the pool now waits for this launch at its release
  const gpukit::device_guard guard(d);
  cudaStream_t blocking = nullptr;
  GPUKIT_CUDA_TRY(cudaStreamCreate(&blocking));  // blocking: synchronizes with the legacy default stream
  GPUKIT_CUDA_TRY(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeGlobal));
  const captured_warnings warnings;
  std::thread([&] {
    g = gpukit::graph();  // the last owners: the pool's reserve goes back now
    pool.reset();
  }).join();
  for (const std::string& message : warnings.messages()) FAIL_CHECK(message);
  GPUKIT_CUDA_TRY(cudaMemsetAsync(out.data(), 0, out.size_bytes(), blocking));
  cudaGraph_t captured = nullptr;
  CHECK(cudaStreamEndCapture(blocking, &captured) == cudaSuccess);  // not invalidated
  if (captured != nullptr) GPUKIT_CUDA_TRY(cudaGraphDestroy(captured));
  GPUKIT_CUDA_TRY(cudaStreamDestroy(blocking));
  s.synchronize();
}

TEST_CASE("gpu: a graph with allocation nodes has one executable at a time, which gpukit::capture makes") {
  // CUDA refuses a second executable of a graph with memory nodes while the first lives (the simulator too, as a
  // violation); gpukit::capture instantiates each graph once, and the graph relaunches as often as asked.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::async_allocator a(d);
  gpukit::stream s(d);
  gpukit::device_buffer<int> out(16, s);
  gpukit::graph g = gpukit::capture(s, [&] {
    void* scratch = a.allocate(out.size_bytes(), s);  // an allocation node
    GPUKIT_CUDA_TRY(cudaMemsetAsync(scratch, 5, out.size_bytes(), s.cuda_handle()));
    GPUKIT_CUDA_TRY(cudaMemcpyAsync(out.data(), scratch, out.size_bytes(), cudaMemcpyDeviceToDevice, s.cuda_handle()));
    a.deallocate(scratch);  // a free node
  });
  const gpukit::device_guard guard(d);
  cudaGraphExec_t second = nullptr;
  const cudaError_t refused = cudaGraphInstantiate(&second, g.native_graph(), 0);
  (void)cudaGetLastError();
  std::printf("a second cudaGraphInstantiate of a graph with memory nodes returned %s\n", cudaGetErrorName(refused));
#ifdef GPUKIT_TEST_ON_CUDASIM
  CHECK(cudasim::take_violations().size() == 1);
#endif
  CHECK(refused != cudaSuccess);
  if (refused == cudaSuccess) GPUKIT_CUDA_TRY(cudaGraphExecDestroy(second));
  for (int launch = 0; launch < 3; ++launch) g.launch(s);  // the first is unharmed
  CHECK(read(out, s) == std::vector<int>(16, 0x05050505));
  CHECK(a.memory_allocated() == 0);  // the scratch memory is the graph's, freed in it
}

TEST_CASE("gpu: a graph relaunched while its previous launch's allocation is unfreed says why it fails") {
  // CUDA says only cudaErrorInvalidValue: the graph's async_allocator memory kept past the capture is allocated again
  // at each launch, and must be freed after each.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::async_allocator a(d);
  gpukit::stream s(d);
  void* out = nullptr;
  gpukit::graph g = gpukit::capture(s, [&] { out = a.allocate(256, s); });
  g.launch(s);
  try {
    g.launch(s);
    FAIL("a launch with the previous launch's allocation unfreed was accepted");
  } catch (const gpukit::error& e) {
    CHECK(e.cuda_result() == cudaErrorInvalidValue);
    CHECK(std::string(e.what()).find("an allocation of its previous launch is not freed yet") != std::string::npos);
  }
#ifdef GPUKIT_TEST_ON_CUDASIM
  (void)cudasim::take_violations();  // the refused launch
#endif
  a.deallocate(out, s);  // the first launch's output, freed after it
  s.synchronize();
}

TEST_CASE("gpu: a graph output freed in a later capture of the stream that read it is reused after that read") {
  // The output of a first graph is read on y outside any capture, then freed inside a capture of y (the capture's
  // temporary takes its block): y's read is not the second graph's work, so the second graph, launched on another
  // stream, must wait for it. Found by review: the free in a capture took the freeing stream's work as the graph's.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  constexpr std::size_t bytes = 4096;
  gpukit::stream s(d);
  gpukit::stream y(d);
  gpukit::device_buffer<int> seen(bytes / sizeof(int), s);
  auto pool = gpukit::graph_pool::create(d, bytes);
  auto& allocator = gpukit::default_allocator(d);
  void* out = nullptr;
  gpukit::graph producer = capture_producer(y, allocator, bytes, pool, &out);
  producer.launch(y);
  y.synchronize();
  s.synchronize();
  gate held;
  held.hold(y);
  GPUKIT_CUDA_TRY(cudaMemcpyAsync(seen.data(), out, bytes, cudaMemcpyDeviceToDevice, y.cuda_handle()));  // held
  void* const block = out;
  void* reused = nullptr;
  gpukit::graph second = gpukit::capture(
      y,
      [&] {
        SUBCASE("freed without a stream, on its allocation's (as device_buffer frees)") { allocator.deallocate(out); }
        SUBCASE("freed on the stream that read it") { allocator.deallocate(out, y); }
        gpukit::device_buffer<int> tmp(bytes / sizeof(int), y);
        reused = tmp.data();
        GPUKIT_CUDA_TRY(cudaMemsetAsync(tmp.data(), 3, bytes, y.cuda_handle()));
      },
      pool);
  CHECK(reused == block);
  second.launch(s);
  CHECK(cudaStreamQuery(s.cuda_handle()) == cudaErrorNotReady);  // waits for y's held read
  held.open();
  y.synchronize();
  CHECK(read(seen, s) == std::vector<int>(bytes / sizeof(int), 0x02020202));  // the first graph's data
}

TEST_CASE("gpu: a graph pool's reserve goes back after the read of a stream that freed an output in a capture") {
  // As above, with the graphs and the pool gone before the read ran: the reserve goes back to the backing allocator
  // ordered after y's read too, so the backing allocator does not hand it out while the read is held.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  constexpr std::size_t reserve_bytes = MiB;
  gpukit::stream y(d);
  gpukit::device_buffer<int> seen(1024, y);
  gpukit::allocator_options options;
  options.release_before_grow = false;  // no cudaFree (a device-wide wait) while the gate holds work back
  gpukit::caching_allocator backing(d, options);
  void* block = nullptr;
  gate held;
  {
    auto pool = gpukit::graph_pool::create(d, reserve_bytes, &backing);
    void* out = nullptr;
    gpukit::graph producer = capture_producer(y, backing, 4096, pool, &out);
    block = out;
    producer.launch(y);
    y.synchronize();
    held.hold(y);
    GPUKIT_CUDA_TRY(cudaMemcpyAsync(seen.data(), out, 4096, cudaMemcpyDeviceToDevice, y.cuda_handle()));
    gpukit::graph cleanup = gpukit::capture(
        y, [&] { backing.deallocate(out); }, pool);  // the read is not its work
  }                                                  // graphs and pool gone, no allocation left: the reserve goes back
  const auto reserve_at = reinterpret_cast<std::uintptr_t>(block);
  void* other = backing.allocate(reserve_bytes, gpukit::stream_view::default_stream(d));
  const auto other_at = reinterpret_cast<std::uintptr_t>(other);
  CHECK((other_at + reserve_bytes <= reserve_at || other_at >= reserve_at + reserve_bytes));  // y's read is held
  held.open();
  y.synchronize();
  CHECK(read(seen, y) == std::vector<int>(1024, 0x02020202));
  backing.deallocate(other);
}

TEST_CASE("gpu: a graph pool's out of memory in a capture says when free blocks are kept for other streams") {
  // In a capture a block freed on s serves only s: a forked stream's request of its size is refused, and the message
  // says the block is free but kept (it said: largest free block 4 KiB, reserve more).
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::stream forked(d);
  auto pool = gpukit::graph_pool::create(d, 4096);
  auto& allocator = gpukit::default_allocator(d);
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  GPUKIT_CUDA_TRY(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  GPUKIT_CUDA_TRY(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  std::string message;
  gpukit::graph g = gpukit::capture(
      s,
      [&] {
        GPUKIT_CUDA_TRY(cudaEventRecord(fork, s.cuda_handle()));  // forked joins the capture
        GPUKIT_CUDA_TRY(cudaStreamWaitEvent(forked.cuda_handle(), fork, 0));
        void* p = allocator.allocate(4096, s);
        allocator.deallocate(p, s);
        try {
          allocator.deallocate(allocator.allocate(4096, forked), forked);
        } catch (const gpukit::out_of_memory_error& e) {
          message = e.what();
        }
        GPUKIT_CUDA_TRY(cudaEventRecord(join, forked.cuda_handle()));
        GPUKIT_CUDA_TRY(cudaStreamWaitEvent(s.cuda_handle(), join, 0));
      },
      pool);
  GPUKIT_CUDA_TRY(cudaEventDestroy(fork));
  GPUKIT_CUDA_TRY(cudaEventDestroy(join));
  INFO(message);
  CHECK(contains(message,
                 "largest free block this stream may take 0 B; 4.00 KiB more is free (largest block "
                 "4.00 KiB) but kept for other streams until the pool's captures end"));
}

TEST_CASE("gpu: a launch that cannot wait for a captured stream that used a freed pool block says so, once") {
  // x read a graph's output (record_stream), then x is captured (a raw capture) when the output is freed and a graph
  // reusing its block is launched: x's read from before its capture cannot be waited for until that capture ends.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  constexpr std::size_t bytes = 4096;
  gpukit::stream s(d);
  gpukit::stream x(d);
  gpukit::stream other(d);
  gpukit::device_buffer<int> seen(bytes / sizeof(int), s);
  auto pool = gpukit::graph_pool::create(d, bytes);
  auto& allocator = gpukit::default_allocator(d);
  void* out = nullptr;
  gpukit::graph producer = capture_producer(s, allocator, bytes, pool, &out);
  producer.launch(s);
  s.synchronize();
  GPUKIT_CUDA_TRY(cudaMemcpyAsync(seen.data(), out, bytes, cudaMemcpyDeviceToDevice, x.cuda_handle()));
  allocator.record_stream(out, x);
  x.synchronize();  // the read is done: only what the launch can know is tested
  GPUKIT_CUDA_TRY(cudaStreamBeginCapture(x.cuda_handle(), cudaStreamCaptureModeThreadLocal));
  allocator.deallocate(out, s);  // x's use is deferred: x is captured
  gpukit::graph second = gpukit::capture(
      s,
      [&] {
        gpukit::device_buffer<int> tmp(bytes / sizeof(int), s);
        GPUKIT_CUDA_TRY(cudaMemsetAsync(tmp.data(), 3, bytes, s.cuda_handle()));
      },
      pool);
  const captured_warnings warnings;
  second.launch(other);
  second.launch(other);
  std::size_t said = 0;
  for (const std::string& m : warnings.messages()) said += contains(m, "cannot wait for that stream's work") ? 1 : 0;
  CHECK(said == 1);  // once per pool
  cudaGraph_t unused = nullptr;
  GPUKIT_CUDA_TRY(cudaStreamEndCapture(x.cuda_handle(), &unused));
  GPUKIT_CUDA_TRY(cudaGraphDestroy(unused));
  second.launch(other);  // x's use is recorded now
  other.synchronize();
}

TEST_CASE("gpu: a launch while another thread's capture of the pool frees an earlier graph's output says nothing") {
  // Thread t captures `second` on y and frees `first`'s output there: y's deferred use waits for that capture to end,
  // but until then the block serves only that capture, so a launch meanwhile is not unordered (review: it warned, and
  // the warning, said once per pool, was then lost for a real case).
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  constexpr std::size_t bytes = 4096;
  gpukit::stream y(d);
  gpukit::stream z(d);
  auto pool = gpukit::graph_pool::create(d, 4 * bytes);
  auto& allocator = gpukit::default_allocator(d);
  void* out = nullptr;
  gpukit::graph first = gpukit::capture(
      y,
      [&] {
        gpukit::device_buffer<int> tmp(bytes / sizeof(int), y);
        GPUKIT_CUDA_TRY(cudaMemsetAsync(tmp.data(), 1, bytes, y.cuda_handle()));
        out = allocator.allocate(bytes, y);
        GPUKIT_CUDA_TRY(cudaMemsetAsync(out, 2, bytes, y.cuda_handle()));
      },
      pool);
  first.launch(z);
  z.synchronize();
  std::mutex m;
  std::condition_variable cv;
  bool freed = false;
  bool launched = false;
  const captured_warnings warnings;
  std::thread t([&] {
    gpukit::graph second = gpukit::capture(
        y,
        [&] {
          allocator.deallocate(out, y);
          std::unique_lock<std::mutex> lock(m);
          freed = true;
          cv.notify_all();
          cv.wait(lock, [&] { return launched; });
        },
        pool);
  });
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return freed; });
  }
  gpukit::graph unrelated = gpukit::capture(
      z, [] {}, pool);  // of the pool: its launches order its uses
  unrelated.launch(z);  // while y's capture runs
  {
    std::lock_guard<std::mutex> lock(m);
    launched = true;
    cv.notify_all();
  }
  t.join();
  z.synchronize();
  CHECK(warnings.messages().empty());
}

TEST_CASE("gpu: a direct allocation from a graph pool never gets a block its graph writes at each launch") {
  GPUKIT_REQUIRE_GPU();
  // The graph's scratch, freed inside its capture, is written again by every launch, which a direct allocation does
  // not wait for: direct allocations take only blocks no graph of the pool used (helper-189).
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  auto pool = gpukit::graph_pool::create(d, MiB);
  gpukit::device_buffer<int> out(256, s);
  void* scratch = nullptr;
  const gpukit::graph g = gpukit::capture(
      s,
      [&] {
        gpukit::device_buffer<int> tmp(256, s);
        scratch = tmp.data();
        GPUKIT_CUDA_TRY(cudaMemsetAsync(tmp.data(), 0x11, tmp.size_bytes(), s.cuda_handle()));
        GPUKIT_CUDA_TRY(
            cudaMemcpyAsync(out.data(), tmp.data(), tmp.size_bytes(), cudaMemcpyDeviceToDevice, s.cuda_handle()));
      },
      pool);
  g.launch(s);
  void* mine = pool->allocate(256 * sizeof(int), s);
  CHECK(mine != scratch);
  GPUKIT_CUDA_TRY(cudaMemsetAsync(mine, 0x22, 256 * sizeof(int), s.cuda_handle()));
  g.launch(s);
  std::vector<int> host(256);
  GPUKIT_CUDA_TRY(cudaMemcpyAsync(host.data(), mine, 256 * sizeof(int), cudaMemcpyDeviceToHost, s.cuda_handle()));
  s.synchronize();
  CHECK(host == std::vector<int>(256, 0x22222222));
  // Freed outside captures and never used by a graph: direct allocations may take it again.
  pool->deallocate(mine, s);
  void* again = pool->allocate(256 * sizeof(int), s);
  CHECK(again == mine);
  pool->deallocate(again, s);
  // Asking for all that is free outside the graph's block: out of memory names the block kept for the graph.
  std::string message;
  try {
    (void)pool->allocate(MiB, s);
  } catch (const gpukit::out_of_memory_error& e) {
    message = e.what();
  }
  CHECK(contains(message, "used by the pool's graphs"));
  s.synchronize();
}

TEST_CASE("gpu: a capture takes a block its pool's graphs used together with the untouched block beside it") {
  GPUKIT_REQUIRE_GPU();
  // Direct allocations keep to untouched blocks; a capture may take both kinds, merged when it needs the room.
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  auto pool = gpukit::graph_pool::create(d, MiB);
  const gpukit::graph first = gpukit::capture(
      s, [&] { gpukit::device_buffer<char> scratch(MiB / 2, s); }, pool);  // freed in the capture: the graph's
  void* big = nullptr;
  const gpukit::graph second = gpukit::capture(
      s, [&] { big = pool->allocate(3 * MiB / 4, s); }, pool);  // more than either half alone
  CHECK(big != nullptr);
  CHECK(pool->memory_allocated() >= 3 * MiB / 4);
  pool->deallocate(big, s);
  s.synchronize();
}

TEST_CASE("gpu: a graph pool refuses an allocation for a capture it does not serve, as it refuses the free") {
  GPUKIT_REQUIRE_GPU();
  // That graph would write the block at each launch with no reference to the pool, which would hand it out again
  // once freed (helper-189).
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  auto pool = gpukit::graph_pool::create(d, MiB);
  std::string message;
  const gpukit::graph g = gpukit::capture(s, [&] {  // no pool
    try {
      (void)pool->allocate(1024, s);
    } catch (const gpukit::invalid_argument_error& e) {
      message = e.what();
    }
  });
  CHECK(contains(message, "gpukit::graph_pool::allocate"));
  CHECK(contains(message, "a capture this graph pool does not serve"));
  CHECK(contains(message, "nothing was allocated"));
  CHECK(pool->memory_allocated() == 0);
}

TEST_CASE("gpu: a graph output freed on its launching stream during the next step's capture is refused, then freed") {
  // The training loop: step 1's output, launched on `t`, cannot be freed on `t` while step 2 is captured on `s` (the
  // free follows `s`, and would join that capture): refused, the memory still allocated; freed once the capture has
  // ended (helper-189, helper-191).
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::stream t(d);
  gpukit::async_allocator allocator(d);
  void* out = nullptr;
  const gpukit::graph first = gpukit::capture(s, [&] {
    out = allocator.allocate(1024, s);
    GPUKIT_CUDA_TRY(cudaMemsetAsync(out, 1, 1024, s.cuda_handle()));
  });
  first.launch(t);
  std::string refusal;
  const gpukit::graph second = gpukit::capture(s, [&] {
    GPUKIT_CUDA_TRY(cudaMemsetAsync(nullptr, 0, 0, s.cuda_handle()));
    try {
      allocator.deallocate(out, t);
    } catch (const gpukit::invalid_argument_error& e) {
      refusal = e.what();
    }
  });
  CHECK(contains(refusal, "free it after the capture ends"));
  CHECK(allocator.graph_allocations().count == 1);  // still allocated
  allocator.deallocate(out, t);
  t.synchronize();
  CHECK(allocator.graph_allocations().count == 0);
}

// An over-aligned block a graph pool served for the default allocator is owned and freed through that allocator (the
// process-wide table exists so that any allocator that could free the block can free the address; helper-204 found a
// first version of a stale-entry purge that broke it).
TEST_CASE("gpu: an over-aligned graph pool block is owned and freed through the allocator that asked for it") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  auto pool = gpukit::graph_pool::create(d, 4 * MiB);
  gpukit::device_allocator& alloc = gpukit::default_allocator(d);
  void* first = nullptr;
  void* inside = nullptr;
  bool owned = false;
  bool owned_by_pool_after = false;
  std::string error;
  gpukit::graph step = gpukit::capture(
      s,
      [&] {
        first = alloc.allocate(512, s);          // so that the next block does not start at a 4096 boundary
        inside = alloc.allocate(3000, 4096, s);  // from the pool, inside a larger block
        owned = alloc.owns(inside);
        owned_by_pool_after = pool->owns(inside);
        try {
          alloc.deallocate(inside);
        } catch (const std::exception& e) {
          error = e.what();
        }
        alloc.deallocate(first);
      },
      pool);
  INFO("deallocate: " << error);
  CHECK(reinterpret_cast<std::uintptr_t>(inside) % 4096 == 0);
  CHECK(owned);
  CHECK(owned_by_pool_after);
  CHECK(error.empty());
  CHECK(pool->memory_allocated() == 0);
#ifdef GPUKIT_TEST_ON_CUDASIM
  (void)cudasim::take_violations();
#endif
}
