// streamsafe core: the table of a stream's active blocks, address -> block (internal).
//
// It also holds the blocks parked in the stream's quick caches (state quick_cached, pool.hpp): a
// same-stream free followed by an allocation of the same size then costs one lookup and no
// insertion or removal. find_active() answers only for active blocks.
//
// Open addressing with linear probing and backward-shift deletion (no tombstones); load factor
// at most 1/2; keys are block addresses (never 0). Insert, find and erase are O(1) expected and
// allocate only when the table grows. Not thread-safe: the owning stream's lock guards it.
#pragma once

#include "core/blocks/block.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace streamsafe::detail {

class active_map {
 public:
  active_map() { slots_.resize(64); }

  void insert(block* b) {
    if ((count_ + 1) * 2 > slots_.size()) grow();
    place(b);
    ++count_;
  }

  block* find(std::uintptr_t addr) const noexcept {
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t i = hash(addr) & mask;; i = (i + 1) & mask) {
      block* b = slots_[i];
      if (!b) return nullptr;
      if (b->addr == addr) return b;
    }
  }

  // The active block at addr, or nullptr (also for a block parked in a quick cache).
  block* find_active(std::uintptr_t addr) const noexcept {
    block* b = find(addr);
    return b && b->state == block_state::active ? b : nullptr;
  }

  // Removes the block at addr and returns it (nullptr when absent).
  block* erase(std::uintptr_t addr) noexcept {
    const std::size_t mask = slots_.size() - 1;
    std::size_t i = hash(addr) & mask;
    for (;; i = (i + 1) & mask) {
      if (!slots_[i]) return nullptr;
      if (slots_[i]->addr == addr) break;
    }
    block* found = slots_[i];
    // Backward shift: pull later entries of the probe run into the hole.
    for (std::size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
      block* b = slots_[j];
      if (!b) break;
      const std::size_t home = hash(b->addr) & mask;
      const bool movable = (i <= j) ? (home <= i || home > j) : (home <= i && home > j);
      if (movable) {
        slots_[i] = b;
        i = j;
      }
    }
    slots_[i] = nullptr;
    --count_;
    return found;
  }

  std::size_t size() const noexcept { return count_; }

  template <class F>
  void for_each(F&& f) const {
    for (block* b : slots_) {
      if (b) f(b);
    }
  }

 private:
  static std::size_t hash(std::uintptr_t addr) noexcept {
    return static_cast<std::size_t>(((addr >> 9) * 0x9E3779B97F4A7C15ull) >> 16);
  }
  void place(block* b) noexcept {
    const std::size_t mask = slots_.size() - 1;
    std::size_t i = hash(b->addr) & mask;
    while (slots_[i]) i = (i + 1) & mask;
    slots_[i] = b;
  }
  void grow() {
    std::vector<block*> old(slots_.size() * 2, nullptr);
    old.swap(slots_);
    for (block* b : old) {
      if (b) place(b);
    }
  }

  std::vector<block*> slots_;
  std::size_t count_ = 0;
};

}  // namespace streamsafe::detail
