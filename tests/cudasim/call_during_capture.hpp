// A call made on another thread while this thread captures a stream with gpukit::capture: for work on the legacy
// default stream, which must be refused rather than join a blocking stream's capture and invalidate it.
#pragma once

#include <gpukit/error.hpp>
#include <gpukit/graph/graph.hpp>
#include <gpukit/stream/stream.hpp>

#include "support.hpp"

#include <exception>
#include <string>

namespace gpukit_test {

/// What a call made during a gpukit::capture did.
struct call_in_capture {
  bool returned = false;      ///< it returned in time (one that waited for the capture to end would not)
  std::string refusal;        ///< the message of the invalid_argument_error it threw, empty if none
  std::string capture_error;  ///< the capture's own error, empty if it ended well
};

/// Runs `call` on another thread while this thread captures `captured`, and waits a bounded time for it: a call that
/// waited for the capture to end would wait for this thread, and fails `returned` instead of hanging.
template <class Call>
call_in_capture call_during_capture(gpukit::stream_view captured, Call call) {
  call_in_capture result;
  bounded_calls calls;
  try {
    gpukit::graph g = gpukit::capture(captured, [&] {
      result.returned = calls.returned_within([&] {
        try {
          call();
        } catch (const gpukit::invalid_argument_error& e) {
          result.refusal = e.what();
        }
      });
    });
  } catch (const std::exception& e) {
    result.capture_error = e.what();
  }
  return result;
}

}  // namespace gpukit_test
