// streamsafe core: segregated free lists with bitmaps (internal), in the style of TLSF
// (Masmano et al., "TLSF: a New Dynamic Memory Allocator for Real-Time Systems", ECRTS 2004).
//
// Sizes (multiples of 512 bytes) map to classes: the power of two of the size, subdivided into
// 8 linear steps. Each class is an intrusive doubly linked list (LIFO); a 64-bit bitmap of
// powers and an 8-bit bitmap per power find the next non-empty class in O(1). find() is a good
// fit close to best fit: it scans a bounded number of blocks of the request's own class for the
// smallest that fits, then takes the smallest of a bounded scan of the next non-empty class (any
// block there fits). Insert and erase are O(1); no allocation. Not thread-safe: the owning
// stream's lock guards it.
#pragma once

#include "core/blocks/block.hpp"

#include <cstddef>
#include <cstdint>

namespace streamsafe::detail {

class free_lists {
 public:
  static constexpr int k_sub_bits = 3;
  static constexpr int k_subs = 1 << k_sub_bits;
  static constexpr int k_min_power = 9;  // 512 B
  static constexpr int k_powers = 64 - k_min_power;
  static constexpr int k_classes = k_powers * k_subs;
  static constexpr int k_scan = 16;

  static int class_of(std::size_t size) noexcept {
    const int power = 63 - __builtin_clzll(static_cast<unsigned long long>(size));
    const int sub = static_cast<int>((size >> (power - k_sub_bits)) & (k_subs - 1));
    return (power - k_min_power) * k_subs + sub;
  }

  void insert(block* b) noexcept {
    const int c = class_of(b->size);
    b->free_class = static_cast<std::int16_t>(c);
    b->free_prev = nullptr;
    b->free_next = heads_[c];
    if (heads_[c]) heads_[c]->free_prev = b;
    heads_[c] = b;
    power_bits_ |= std::uint64_t{1} << (c / k_subs);
    sub_bits_[c / k_subs] = static_cast<std::uint8_t>(sub_bits_[c / k_subs] | (1u << (c % k_subs)));
    ++count_;
  }

  void erase(block* b) noexcept {
    const int c = b->free_class;
    if (b->free_prev) b->free_prev->free_next = b->free_next;
    else heads_[c] = b->free_next;
    if (b->free_next) b->free_next->free_prev = b->free_prev;
    b->free_prev = b->free_next = nullptr;
    b->free_class = -1;
    if (!heads_[c]) {
      sub_bits_[c / k_subs] = static_cast<std::uint8_t>(sub_bits_[c / k_subs] &
                                                        ~(1u << (c % k_subs)));
      if (!sub_bits_[c / k_subs]) power_bits_ &= ~(std::uint64_t{1} << (c / k_subs));
    }
    --count_;
  }

  static bool contains(const block* b) noexcept { return b->free_class >= 0; }

  // A free block of at least `size` bytes, or nullptr.
  block* find(std::size_t size) const noexcept {
    const int c = class_of(size);
    block* best = nullptr;
    int scanned = 0;
    for (block* b = heads_[c]; b && scanned < k_scan; b = b->free_next, ++scanned) {
      if (b->size >= size &&
          (!best || b->size < best->size || (b->size == best->size && b->addr < best->addr))) {
        best = b;
        if (b->size == size) break;
      }
    }
    if (best) return best;
    const int next = next_class(c + 1);
    if (next < 0) return nullptr;
    scanned = 0;
    for (block* b = heads_[next]; b && scanned < k_scan; b = b->free_next, ++scanned) {
      if (!best || b->size < best->size || (b->size == best->size && b->addr < best->addr))
        best = b;
    }
    return best;
  }

  // As find(), but only blocks for which ok(block) holds: the smallest such block among a
  // bounded scan of each class, from the request's class up to the first class that has one.
  template <class Pred>
  block* find_if(std::size_t size, Pred&& ok) const {
    for (int c = class_of(size); c >= 0; c = next_class(c + 1)) {
      block* best = nullptr;
      int scanned = 0;
      for (block* b = heads_[c]; b && scanned < k_scan; b = b->free_next, ++scanned) {
        if (b->size >= size &&
            (!best || b->size < best->size || (b->size == best->size && b->addr < best->addr)) &&
            ok(b)) {
          best = b;
        }
      }
      if (best) return best;
    }
    return nullptr;
  }

  // The largest free block (bounded scan of the highest non-empty class), or nullptr.
  block* largest() const noexcept {
    if (!power_bits_) return nullptr;
    const int power = 63 - __builtin_clzll(power_bits_);
    const int sub = 31 - __builtin_clz(sub_bits_[power]);
    block* best = nullptr;
    for (block* b = heads_[power * k_subs + sub]; b; b = b->free_next) {
      if (!best || b->size > best->size) best = b;
    }
    return best;
  }

  std::size_t size() const noexcept { return count_; }
  bool empty() const noexcept { return count_ == 0; }

  // Every block, by ascending class; the power groups with no block are skipped (a pool's lists
  // are mostly empty: 440 classes).
  template <class F>
  void for_each(F&& f) const {
    for (int power = 0; power < k_powers; ++power) {
      if (!sub_bits_[power]) continue;
      for (int c = power * k_subs; c < (power + 1) * k_subs; ++c) {
        for (block* b = heads_[c]; b; b = b->free_next) f(b);
      }
    }
  }

 private:
  int next_class(int c) const noexcept {
    if (c >= k_classes) return -1;
    int power = c / k_subs;
    const unsigned subs = sub_bits_[power] & (~0u << (c % k_subs)) & 0xffu;
    if (subs) return power * k_subs + __builtin_ctz(subs);
    const std::uint64_t powers = power + 1 >= 64 ? 0
                                                 : power_bits_ & (~std::uint64_t{0} << (power + 1));
    if (!powers) return -1;
    power = __builtin_ctzll(powers);
    return power * k_subs + __builtin_ctz(sub_bits_[power]);
  }

  block* heads_[k_classes] = {};
  std::uint64_t power_bits_ = 0;
  std::uint8_t sub_bits_[k_powers] = {};
  std::size_t count_ = 0;
};

}  // namespace streamsafe::detail
