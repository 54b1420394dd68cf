// cuda::stream_ref interop (CCCL from the toolkit). Conversions need no GPU: they only move handles.
#include <gpukit/stream/stream_ref.hpp>

#include "support.hpp"

TEST_CASE("stream_view converts to and from cuda::stream_ref") {
  auto raw = reinterpret_cast<cudaStream_t>(0x1234);
  const gpukit::stream_view view(gpukit::device::cuda(0), raw);
  const cuda::stream_ref ref = view;
  CHECK(ref.get() == raw);
  const gpukit::stream_view back = ref;
  CHECK(back.native_handle() == raw);
  CHECK(gpukit::to_stream_ref(view).get() == raw);
}

TEST_CASE("a CPU stream has no cuda::stream_ref") {
  gpukit::stream s(gpukit::device::cpu());
  CHECK_THROWS_AS(gpukit::to_stream_ref(s), gpukit::invalid_argument_error);
  CHECK_THROWS_AS((void)static_cast<cuda::stream_ref>(s.view()), gpukit::invalid_argument_error);
}

TEST_CASE("an owning stream converts to cuda::stream_ref too (a CUDA one: test_memory_resource_sim)") {
  gpukit::stream cpu_stream(gpukit::device::cpu());
  CHECK_THROWS_AS((void)static_cast<cuda::stream_ref>(cpu_stream), gpukit::invalid_argument_error);
  const auto takes_ref = [](cuda::stream_ref ref) { return ref.get(); };
  const gpukit::stream_view view(gpukit::device::cuda(0), reinterpret_cast<cudaStream_t>(0x5678));
  CHECK(takes_ref(view) == reinterpret_cast<cudaStream_t>(0x5678));
}
