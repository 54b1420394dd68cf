// gpukit::span: the C++17 stand-in for std::span.
#include <gpukit/span.hpp>

#include <doctest/doctest.h>

#include <array>
#include <string>
#include <type_traits>
#include <vector>
#if __cplusplus >= 202002L && __has_include(<span>)
#include <span>
#endif

TEST_CASE("span views containers, arrays and pointer ranges") {
  std::vector<int> v{1, 2, 3, 4};
  gpukit::span<int> s = v;
  CHECK(s.size() == 4);
  CHECK(s.size_bytes() == 16);
  CHECK(s.data() == v.data());
  s[1] = 20;
  CHECK(v[1] == 20);
  gpukit::span<const int> c = s;
  CHECK(c.size() == 4);
  int raw[3] = {7, 8, 9};
  gpukit::span<int> a = raw;
  CHECK(a.size() == 3);
  CHECK(a.last(1)[0] == 9);
  CHECK(a.first(2).size() == 2);
  CHECK(a.subspan(1).size() == 2);
  CHECK(a.subspan(1, 1)[0] == 8);
  const std::array<double, 2> arr{1.0, 2.0};
  gpukit::span<const double> d = arr;
  CHECK(d.size() == 2);
  int sum = 0;
  for (int x : s) sum += x;
  CHECK(sum == 1 + 20 + 3 + 4);
  CHECK(gpukit::as_bytes(s).size() == 16);
  CHECK(gpukit::span<int>().empty());
  const std::string text = "abc";
  gpukit::span<const char> chars = text;
  CHECK(chars.size() == 3);
#if __cplusplus >= 202002L && __has_include(<span>)
  std::span<int> standard(s.begin(), s.end());
  CHECK(standard.size() == 4);
  gpukit::span<int> back = standard;
  CHECK(back.data() == v.data());
#endif
}

namespace {
struct span_base {
  int a;
};
struct span_derived : span_base {
  int b;
};
}  // namespace

TEST_CASE("span of a base class refuses containers and spans of a derived class, as std::span does") {
  // Derived* converts to Base*, but a span<Base> over Derived objects would stride by sizeof(Base).
  CHECK_FALSE(std::is_constructible<gpukit::span<span_base>, std::vector<span_derived>&>::value);
  CHECK_FALSE(std::is_constructible<gpukit::span<span_base>, gpukit::span<span_derived>&>::value);
  CHECK_FALSE(std::is_constructible<gpukit::span<const span_base>, const std::vector<span_derived>&>::value);
  CHECK(std::is_constructible<gpukit::span<const span_derived>, std::vector<span_derived>&>::value);
  CHECK(std::is_constructible<gpukit::span<const int>, gpukit::span<int>&>::value);
}
