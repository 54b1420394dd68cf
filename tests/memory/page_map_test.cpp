// The pages of an expandable segment (memory/detail/page_map.hpp): which pages a block's bytes touch or hold
// wholly, at page boundaries and inside a page; the mapped-byte count through maps, repeated maps and unmaps; runs
// of mapped pages; and the bytes of a block that lie on mapped pages.
#include <doctest/doctest.h>

#include <gpukit/memory/detail/page_map.hpp>

#include <cstddef>
#include <utility>
#include <vector>

namespace {

using gpukit::detail::page_map;
constexpr std::size_t page = 4096;

std::vector<std::pair<std::size_t, std::size_t>> runs(const page_map& m) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  m.for_each_mapped_run([&](std::size_t offset, std::size_t bytes) { out.emplace_back(offset, bytes); });
  return out;
}

}  // namespace

TEST_CASE("page_map: an ordinary segment's map has no pages and no mapped bytes") {
  const page_map none;
  CHECK(none.page_count() == 0);
  CHECK(none.page_size() == 0);
  CHECK(none.mapped_bytes() == 0);
  CHECK(none.mapped_bytes_in(0, 1 << 20) == 0);  // no division by the page size of no pages
  CHECK(runs(none).empty());
}

TEST_CASE("page_map: the pages bytes touch, and the pages they hold wholly") {
  const page_map m(8, page);
  CHECK(m.page_count() == 8);
  CHECK(m.page_size() == page);
  CHECK(m.mapped_bytes() == 0);

  auto touched = m.touched_by(0, 1);
  CHECK(touched.first == 0);
  CHECK(touched.end == 1);
  touched = m.touched_by(page - 1, 2);  // one byte on each side of a boundary
  CHECK(touched.first == 0);
  CHECK(touched.end == 2);
  touched = m.touched_by(page, page);  // exactly page 1
  CHECK(touched.first == 1);
  CHECK(touched.end == 2);
  touched = m.touched_by(0, 8 * page);  // the whole range
  CHECK(touched.first == 0);
  CHECK(touched.end == 8);

  auto inside = m.inside(page, 2 * page);  // pages 1 and 2 exactly
  CHECK(inside.first == 1);
  CHECK(inside.end == 3);
  inside = m.inside(1, 2 * page);  // starts inside page 0: only page 1 is whole
  CHECK(inside.first == 1);
  CHECK(inside.end == 2);
  inside = m.inside(100, 200);  // within one page: none
  CHECK(inside.first == inside.end);
  inside = m.inside(page - 10, 20);  // across a boundary, no whole page: none, and never first > end
  CHECK(inside.first == inside.end);
}

TEST_CASE("page_map: maps and unmaps keep the mapped bytes, whatever the order and repetition") {
  page_map m(8, page);
  CHECK(m.any_unmapped(m.touched_by(0, 8 * page)));
  m.set_mapped(2);
  m.set_mapped(3);
  m.set_mapped(3);  // mapped already: counted once
  m.set_mapped(6);
  CHECK(m.mapped_bytes() == 3 * page);
  CHECK(m.is_mapped(2));
  CHECK_FALSE(m.is_mapped(4));
  CHECK_FALSE(m.any_unmapped(m.touched_by(2 * page, 2 * page)));
  CHECK(m.any_unmapped(m.touched_by(2 * page, 2 * page + 1)));

  CHECK(m.mapped_run(2, 8) == 2);
  CHECK(m.mapped_run(2, 3) == 1);  // stops at `end`
  CHECK(m.mapped_run(4, 8) == 0);
  CHECK(runs(m) == std::vector<std::pair<std::size_t, std::size_t>>{{2 * page, 2 * page}, {6 * page, page}});

  m.set_unmapped({3, 7});  // pages 4 and 5 were not mapped: only 3 and 6 count
  CHECK(m.mapped_bytes() == page);
  CHECK(runs(m) == std::vector<std::pair<std::size_t, std::size_t>>{{2 * page, page}});
  m.set_unmapped({0, 8});
  CHECK(m.mapped_bytes() == 0);
  CHECK(runs(m).empty());
}

TEST_CASE("page_map: the bytes of a block that lie on mapped pages") {
  page_map m(4, page);
  m.set_mapped(1);
  m.set_mapped(3);
  CHECK(m.mapped_bytes_in(0, 4 * page) == 2 * page);
  CHECK(m.mapped_bytes_in(0, page) == 0);
  CHECK(m.mapped_bytes_in(page + 100, 200) == 200);                // inside a mapped page
  CHECK(m.mapped_bytes_in(page - 100, 300) == 200);                // the part on page 1
  CHECK(m.mapped_bytes_in(2 * page - 50, page + 100) == 50 + 50);  // the tail of 1 and the head of 3
  CHECK(m.mapped_bytes_in(3 * page, page) == page);                // the last page, to the range's end
  CHECK(m.mapped_bytes_in(0, 0) == 0);
}
