// streamsafe PyTorch extension: PyTorch's allocator settings (PYTORCH_CUDA_ALLOC_CONF /
// PYTORCH_ALLOC_CONF at install, torch.cuda.memory._set_allocator_settings afterwards).
// Each key is applied where streamsafe has the option, accepted and ignored where it only
// concerns host memory or PyTorch's own locking, and refused by name otherwise (docs/pytorch.md
// has the table). After install, max_split_size_mb, garbage_collection_threshold and
// roundup_power2_divisions and graph_capture_record_stream_reuse change at once on every device's
// allocator and every MemPool's own (caching_allocator::set_runtime_options), for the allocations
// that follow; as in PyTorch, a call sets all four, those it does not name going back to their
// values at install.
// expandable_segments that differs from the running backend is accepted with one warning: the
// backend is a placement choice fixed when the allocator is made, and streamsafe keeps it.
#include "extension_allocator.hpp"

#include <cctype>

namespace streamsafe::torch_ext {

namespace {

std::string trimmed(const std::string& text) {
  std::size_t b = 0, e = text.size();
  while (b < e && std::isspace(static_cast<unsigned char>(text[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(text[e - 1]))) --e;
  return text.substr(b, e - b);
}

// "k:v,k:[a:b,c:d],..." into (key, value) pairs; a value in brackets keeps its commas.
std::vector<std::pair<std::string, std::string>> split_settings(const std::string& conf) {
  std::vector<std::pair<std::string, std::string>> out;
  std::string item;
  int depth = 0;
  auto flush = [&] {
    const std::string t = trimmed(item);
    item.clear();
    if (t.empty()) return;
    const std::size_t colon = t.find(':');
    TORCH_CHECK(colon != std::string::npos, "streamsafe: PyTorch allocator setting '", t,
                "' has no value (expected key:value)");
    out.emplace_back(trimmed(t.substr(0, colon)), trimmed(t.substr(colon + 1)));
  };
  for (char c : conf) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) {
      flush();
    } else {
      item += c;
    }
  }
  flush();
  return out;
}

bool is_true(const std::string& key, const std::string& value) {
  if (value == "True" || value == "true" || value == "1") return true;
  if (value == "False" || value == "false" || value == "0") return false;
  TORCH_CHECK(false, "streamsafe: PyTorch allocator setting ", key, ":", value,
              ": expected True or False");
  return false;
}

// Keys that concern pinned host memory or PyTorch's own lock around cudaMalloc: nothing of
// streamsafe's device allocator to change. Only keys PyTorch 2.11's parser knows (it refuses
// pinned_use_host_register, for one, and so does streamsafe).
bool host_only(const std::string& key) {
  return key == "release_lock_on_cudamalloc" || key == "pinned_use_cuda_host_register" ||
         key == "pinned_num_register_threads" || key == "pinned_use_background_threads" ||
         key == "pinned_reserve_segment_size_mb";
}

}  // namespace

std::string torch_settings_to_options(const std::string& torch_conf) {
  std::string out;
  auto add = [&](const std::string& kv) { out += (out.empty() ? "" : ",") + kv; };
  for (const auto& [key, value] : split_settings(torch_conf)) {
    if (key == "max_split_size_mb" || key == "garbage_collection_threshold") {
      add(key + ":" + value);
    } else if (key == "roundup_power2_divisions") {
      add(key + ":" + value);  // one number, or PyTorch's list "[64:8,128:2,>:1]"
    } else if (key == "graph_capture_record_stream_reuse") {
      add(key + ":" + (is_true(key, value) ? "True" : "False"));
    } else if (key == "expandable_segments") {
      add(std::string("backend:") + (is_true(key, value) ? "expandable" : "cuda_malloc"));
    } else if (key == "backend") {
      TORCH_CHECK(value == "native", "streamsafe: PyTorch allocator setting backend:", value,
                  " is not supported with streamsafe installed (streamsafe is the allocator; "
                  "only backend:native is accepted)");
    } else if (host_only(key)) {
      continue;  // accepted, ignored: host memory or PyTorch's own locking
    } else {
      TORCH_CHECK(false, "streamsafe: PyTorch allocator setting '", key,
                  "' is not supported by the streamsafe allocator (docs/pytorch.md lists the "
                  "settings it applies)");
    }
  }
  return out;
}

void torch_allocator::set_torch_settings_text(std::string torch_conf) {
  std::lock_guard<std::mutex> lock(torch_settings_mu_);
  torch_settings_ = std::move(torch_conf);
}
std::string torch_allocator::torch_settings_text() {
  std::lock_guard<std::mutex> lock(torch_settings_mu_);
  return torch_settings_;
}

void torch_allocator::apply_torch_settings(const std::string& torch_conf) {
  // PyTorch's parser took the string before this call (streamsafe.torch routes it there first):
  // PyTorch reports it as its last settings, whatever streamsafe makes of it.
  set_torch_settings_text(torch_conf);
  const std::string mapped = torch_settings_to_options(torch_conf);  // refuses by name
  std::lock_guard<std::mutex> settings(settings_mu_);
  // The options at install with this call's keys over them: a key it does not name goes back
  // to its value at install (PyTorch resets the keys a call leaves out to its defaults).
  streamsafe::options wanted = options_;
  try {
    wanted = streamsafe::options::parse(options_.to_string() +
                                        (mapped.empty() ? "" : "," + mapped));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "streamsafe: PyTorch allocator settings '", torch_conf, "': ", e.what());
  }
  if (wanted.backend != options_.backend && !backend_warned_.exchange(true)) {
    TORCH_WARN("streamsafe: PyTorch allocator setting expandable_segments:",
               wanted.backend == streamsafe::backend_kind::expandable ? "True" : "False",
               " after install is accepted, but streamsafe keeps its ",
               streamsafe::to_string(options_.backend),
               " backend (fixed at install: give expandable_segments in PYTORCH_CUDA_ALLOC_CONF "
               "or backend in STREAMSAFE_ALLOC_CONF before streamsafe.torch.install()); the "
               "other settings apply. This warning is shown once.");
  }
  const streamsafe::runtime_options r = streamsafe::runtime_options::of(wanted);
  ss_->set_runtime_options(r);                  // every device's allocator, and those made later
  std::lock_guard<std::mutex> lock(pools_mu_);  // MemPools with their own allocator
  for (const std::shared_ptr<pool_instance>& inst : instances_) inst->alloc->set_runtime_options(r);
}

}  // namespace streamsafe::torch_ext
