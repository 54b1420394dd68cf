// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The pages of an expandable segment (allocator_options::expandable_segments): a reserved virtual range of whole
/// pages, each mapped to memory when a block on it is taken and unmapped when the cache is trimmed, so that free
/// space never splits across segments. page_map records which pages are mapped and answers the engine's questions
/// about a block's bytes (which pages they touch, which lie wholly inside them, how many of them are backed). The
/// engine makes the upstream calls (map, unmap) and keeps the statistics.

#include <gpukit/detail/config.hpp>

#include <algorithm>
#include <cstddef>
#include <vector>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// Which pages of a virtual range are mapped. Offsets are bytes from the start of the range.
class page_map {
 public:
  /// Pages [first, end) of the range.
  struct page_range {
    std::size_t first = 0;
    std::size_t end = 0;
  };

  /// No pages (an ordinary segment).
  page_map() = default;
  /// A range of `page_count` pages of `page_size` bytes (> 0), none mapped. Throws std::bad_alloc.
  page_map(std::size_t page_count, std::size_t page_size) : mapped_(page_count, false), page_size_(page_size) {}

  [[nodiscard]] std::size_t page_size() const noexcept { return page_size_; }
  [[nodiscard]] std::size_t page_count() const noexcept { return mapped_.size(); }
  /// Bytes of the mapped pages.
  [[nodiscard]] std::size_t mapped_bytes() const noexcept { return mapped_pages_ * page_size_; }
  [[nodiscard]] bool is_mapped(std::size_t page) const noexcept { return mapped_[page]; }

  /// The pages that bytes [offset, offset + bytes) touch, wholly or in part (`bytes` > 0).
  [[nodiscard]] page_range touched_by(std::size_t offset, std::size_t bytes) const noexcept {
    return {offset / page_size_, (offset + bytes - 1) / page_size_ + 1};
  }
  /// The pages that lie wholly inside bytes [offset, offset + bytes): none when they hold no whole page.
  [[nodiscard]] page_range inside(std::size_t offset, std::size_t bytes) const noexcept {
    const std::size_t first = (offset + page_size_ - 1) / page_size_;
    return {first, std::max(first, (offset + bytes) / page_size_)};
  }
  /// Whether a page of `pages` is not mapped.
  [[nodiscard]] bool any_unmapped(page_range pages) const noexcept {
    for (std::size_t i = pages.first; i < pages.end; ++i) {
      if (!mapped_[i]) return true;
    }
    return false;
  }
  /// How many pages of `pages` are not mapped.
  [[nodiscard]] std::size_t unmapped_count(page_range pages) const noexcept {
    std::size_t n = 0;
    for (std::size_t i = pages.first; i < pages.end; ++i) n += mapped_[i] ? std::size_t{0} : std::size_t{1};
    return n;
  }
  /// Whether a page of `pages` is mapped.
  [[nodiscard]] bool any_mapped(page_range pages) const noexcept {
    for (std::size_t i = pages.first; i < pages.end; ++i) {
      if (mapped_[i]) return true;
    }
    return false;
  }
  /// How many pages from `first` on are mapped, up to the first one that is not or to `end`.
  [[nodiscard]] std::size_t mapped_run(std::size_t first, std::size_t end) const noexcept {
    std::size_t n = 0;
    while (first + n < end && mapped_[first + n]) ++n;
    return n;
  }
  /// The bytes of [offset, offset + bytes) that lie on mapped pages.
  [[nodiscard]] std::size_t mapped_bytes_in(std::size_t offset, std::size_t bytes) const noexcept {
    if (mapped_pages_ == 0) return 0;
    const std::size_t end = offset + bytes;
    std::size_t backed = 0;
    for (std::size_t i = offset / page_size_; i < mapped_.size() && i * page_size_ < end; ++i) {
      if (mapped_[i]) backed += std::min(end, (i + 1) * page_size_) - std::max(offset, i * page_size_);
    }
    return backed;
  }

  /// The bytes of [offset, offset + bytes) from `offset` on that lie on mapped pages, up to the first page that is not:
  /// what a block there can hand out without mapping (blocks are taken from their start).
  [[nodiscard]] std::size_t mapped_prefix(std::size_t offset, std::size_t bytes) const noexcept {
    if (mapped_pages_ == 0) return 0;
    const page_range pages = touched_by(offset, bytes);
    const std::size_t run = mapped_run(pages.first, pages.end);
    return run == 0 ? 0 : std::min(offset + bytes, (pages.first + run) * page_size_) - offset;
  }

  /// Records page `page` as mapped.
  void set_mapped(std::size_t page) noexcept {
    if (mapped_[page]) return;
    mapped_[page] = true;
    ++mapped_pages_;
  }
  /// Records the pages of `pages` as unmapped.
  void set_unmapped(page_range pages) noexcept {
    for (std::size_t i = pages.first; i < pages.end; ++i) {
      if (!mapped_[i]) continue;
      mapped_[i] = false;
      --mapped_pages_;
    }
  }

  /// Calls f(offset, bytes) for each run of consecutive mapped pages, in address order.
  template <class F>
  void for_each_mapped_run(F&& f) const {
    for (std::size_t i = 0; i < mapped_.size();) {
      const std::size_t n = mapped_run(i, mapped_.size());
      if (n != 0) f(i * page_size_, n * page_size_);
      i += n + 1;
    }
  }

 private:
  std::vector<bool> mapped_;
  std::size_t page_size_ = 0;
  std::size_t mapped_pages_ = 0;
};

}  // namespace detail
GPUKIT_END_NAMESPACE
