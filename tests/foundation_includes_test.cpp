// The foundation that every gpukit header includes (error.hpp, device/device.hpp) stays light (issue 10): it pulls in
// neither std::function, nor the mutexes, nor shared_ptr. The checks read the standard libraries' include guards
// (libstdc++'s and libc++'s), before anything else is included.
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>

#if defined(_GLIBCXX_FUNCTIONAL) || defined(_LIBCPP_FUNCTIONAL)
#error "gpukit's foundation headers include <functional>"
#endif
#if defined(_GLIBCXX_MUTEX) || defined(_LIBCPP_MUTEX) || defined(_GLIBCXX_CONDITION_VARIABLE) || \
    defined(_LIBCPP_CONDITION_VARIABLE)
#error "gpukit's foundation headers include <mutex> or <condition_variable>"
#endif
#if defined(_GLIBCXX_MEMORY) || defined(_LIBCPP_MEMORY)
#error "gpukit's foundation headers include <memory>"
#endif

#include <doctest/doctest.h>

#include <string>
#include <type_traits>

static_assert(std::is_nothrow_copy_constructible_v<gpukit::error>, "copying an exception must not throw");
static_assert(std::is_nothrow_copy_assignable_v<gpukit::error>, "assigning an exception must not throw");

TEST_CASE("an error keeps its call and numbers in copies, without shared_ptr") {
  const std::string call = "cudaMemcpyAsync(dst, src, " + std::string(300, '9') + ")";  // beyond any small buffer
  gpukit::error copy(gpukit::errc::invalid_argument, "other", cudaErrorMemoryAllocation);
  {
    const gpukit::cuda_error original("message", cudaErrorInvalidValue, call, 3, "file.cpp", 42);
    copy = original;
  }
  CHECK(copy.call() == call);
  CHECK(copy.code() == gpukit::errc::cuda);
  CHECK(copy.cuda_result() == cudaErrorInvalidValue);
  CHECK(copy.device() == 3);
  CHECK(std::string(copy.file()) == "file.cpp");
  CHECK(copy.line() == 42);
  CHECK(std::string(copy.what()) == "message");
  const gpukit::error empty(gpukit::errc::no_device, "none");
  CHECK(empty.call().empty());
  CHECK(empty.file() == nullptr);
}
