// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

// A stream that another thread destroys in the middle of a gpukit call, its handle going to the next stream created
// (CUDA reuses handles; the simulator last-in first-out), made deterministic with cudasim::before_call.

#include "cudasim.hpp"

#include <gpukit/device/device.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace gpukit_test {

/// Before the `nth` next call of `function`: destroys `doomed`, creates a stream of its device, which gets its handle,
/// then runs `then` (to fail the call itself, say). Must outlive that call.
class handle_reuse_at {
 public:
  handle_reuse_at(const std::string& function, int nth, std::unique_ptr<gpukit::stream>& doomed,
                  std::function<void()> then = {})
      : handle_(doomed->cuda_handle()), device_(doomed->device()) {
    cudasim::before_call(function, nth, [this, &doomed, then = std::move(then)] {
      doomed.reset();
      successor_.emplace(device_);
      if (then) then();
    });
  }
  handle_reuse_at(const handle_reuse_at&) = delete;
  handle_reuse_at& operator=(const handle_reuse_at&) = delete;

  /// The new stream; requires that the hook ran and that the new stream got the destroyed one's handle.
  gpukit::stream& successor() {
    REQUIRE(successor_.has_value());
    REQUIRE(successor_->cuda_handle() == handle_);
    return *successor_;
  }

 private:
  cudaStream_t handle_;
  gpukit::device device_;
  std::optional<gpukit::stream> successor_;
};

}  // namespace gpukit_test
