// streamsafe core: a stream's pending list (internal): its pending_free blocks (freed by the host,
// waiting for events of other streams) in the order they were freed. An intrusive doubly linked
// list through block::pending_prev / pending_next: insertion and removal are O(1) and allocate
// nothing. Invariant: a block is linked (pending_linked) exactly while it is in one list.
// It also keeps bounds on its blocks' sizes (widened by each insertion, reset once it is
// empty), so that an allocation can tell in O(1) whether a pending block might fit it better.
// Not thread-safe: the owning stream's lock guards it.
#pragma once

#include "core/blocks/block.hpp"

#include <cstddef>

namespace streamsafe::detail {

class pending_list {
 public:
  class iterator {
   public:
    explicit iterator(block* b) noexcept : b_(b) {}
    block* operator*() const noexcept { return b_; }
    iterator& operator++() noexcept {
      b_ = b_->pending_next;
      return *this;
    }
    bool operator!=(const iterator& o) const noexcept { return b_ != o.b_; }

   private:
    block* b_;
  };

  bool empty() const noexcept { return head_ == nullptr; }
  std::size_t size() const noexcept { return size_; }
  block* front() const noexcept { return head_; }  // the oldest
  block* back() const noexcept { return tail_; }   // the newest; older ones via pending_prev
  iterator begin() const noexcept { return iterator(head_); }
  iterator end() const noexcept { return iterator(nullptr); }

  // False when no block of the list can have a size in [at_least, below) (the bounds may be
  // loose: true says only that one might).
  bool may_hold_size(std::size_t at_least, std::size_t below) const noexcept {
    return head_ != nullptr && max_size_ >= at_least && min_size_ < below;
  }

  void push_back(block* b) noexcept {
    b->pending_prev = tail_;
    b->pending_next = nullptr;
    if (tail_) tail_->pending_next = b;
    else head_ = b;
    tail_ = b;
    b->pending_linked = true;
    if (size_++ == 0) min_size_ = max_size_ = b->size;
    else if (b->size < min_size_) min_size_ = b->size;
    else if (b->size > max_size_) max_size_ = b->size;
  }

  void erase(block* b) noexcept {
    if (b->pending_prev) b->pending_prev->pending_next = b->pending_next;
    else head_ = b->pending_next;
    if (b->pending_next) b->pending_next->pending_prev = b->pending_prev;
    else tail_ = b->pending_prev;
    b->pending_prev = b->pending_next = nullptr;
    b->pending_linked = false;
    --size_;
  }

 private:
  block* head_ = nullptr;
  block* tail_ = nullptr;
  std::size_t size_ = 0;
  std::size_t min_size_ = 0;  // bounds on the sizes of the blocks in the list (while not empty)
  std::size_t max_size_ = 0;
};

}  // namespace streamsafe::detail
