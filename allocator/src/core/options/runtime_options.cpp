// streamsafe core: the options a program may change while the allocator runs
// (runtime_settings.hpp holds them; PyTorch's _set_allocator_settings reaches here).
#include "core/allocator_impl.hpp"

namespace streamsafe {

void caching_allocator::set_runtime_options(const runtime_options& r) {
  r.validate();                                       // throws config_error: nothing changed
  detail::lock_guard<detail::mutex> dlk(impl_->mu_);  // one writer at a time
  impl_->runtime_.store(r);
}

}  // namespace streamsafe
