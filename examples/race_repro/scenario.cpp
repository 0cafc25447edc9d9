// race_repro: the training step (see scenario.hpp).
#include "scenario.hpp"

#include <algorithm>
#include <sstream>

namespace race_repro {

using streamsafe::stream_handle;

const char* to_string(optimizer_kind k) {
  switch (k) {
    case optimizer_kind::signsgd_per_parameter: return "signsgd_per_parameter";
    case optimizer_kind::signsgd_foreach: return "signsgd_foreach";
    case optimizer_kind::adamw_foreach: return "adamw_foreach";
  }
  return "?";
}

const char* to_string(release_variant v) {
  switch (v) {
    case release_variant::pytorch: return "pytorch";
    case release_variant::pytorch_synchronize: return "pytorch_synchronize";
    case release_variant::streamsafe_wait: return "streamsafe";
    case release_variant::streamsafe_defer: return "streamsafe_defer";
  }
  return "?";
}

bool parse(const std::string& s, optimizer_kind& out) {
  for (auto k : {optimizer_kind::signsgd_per_parameter, optimizer_kind::signsgd_foreach,
                 optimizer_kind::adamw_foreach}) {
    if (s == to_string(k)) {
      out = k;
      return true;
    }
  }
  return false;
}

bool parse(const std::string& s, release_variant& out) {
  for (auto v : {release_variant::pytorch, release_variant::pytorch_synchronize,
                 release_variant::streamsafe_wait, release_variant::streamsafe_defer}) {
    if (s == to_string(v)) {
      out = v;
      return true;
    }
  }
  return false;
}

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

streamsafe::options options_for(release_variant v) {
  streamsafe::options o;
  o.backend = streamsafe::backend_kind::expandable;  // the VMM release: unmap does not wait
  switch (v) {
    case release_variant::pytorch:
    case release_variant::pytorch_synchronize:
      o.release_fence = streamsafe::fence_scope::allocation_stream;
      break;
    case release_variant::streamsafe_wait: break;
    case release_variant::streamsafe_defer:
      o.empty_cache = streamsafe::empty_cache_mode::defer;
      break;
  }
  return o;
}

}  // namespace

run_result run(device_ops& ops, optimizer_kind kind, release_variant variant, const problem& p) {
  run_result result;
  streamsafe::caching_allocator alloc(ops.backend(), options_for(variant));
  const stream_handle compute = ops.new_stream();
  const stream_handle reduce_scatter = ops.new_stream();
  const stream_handle unrelated = p.unrelated_ms > 0 ? ops.new_stream() : 0;
  const std::size_t bytes = p.shard_floats * sizeof(float);

  // Parameters (and AdamW moments) live on the compute stream for the whole run.
  std::vector<tensor> tensors(static_cast<std::size_t>(p.params));
  for (auto& t : tensors) {
    t.n = p.shard_floats;
    t.param = alloc.allocate(bytes, compute);
    ops.init_tensor(t.param, bytes, compute);
    if (kind == optimizer_kind::adamw_foreach) {
      t.exp_avg = static_cast<float*>(alloc.allocate(bytes, compute));
      t.exp_avg_sq = static_cast<float*>(alloc.allocate(bytes, compute));
      ops.init_tensor(t.exp_avg, bytes, compute);
      ops.init_tensor(t.exp_avg_sq, bytes, compute);
    }
  }
  std::string error = ops.finish_stream(compute);

  std::vector<double> step_ms, empty_cache_ms;
  std::int64_t allocated_after_first = 0;
  for (int step = 1; step <= p.steps && error.empty(); ++step) {
    const double t0 = ops.now_ms();
    alloc.reset_peak_stats();
    if (unrelated) ops.spin(unrelated, p.unrelated_ms);
    // Backward + reduce-scatter: gradients allocated and written on the reduce-scatter stream,
    // last layer first (backward order), so the optimizer's last reads hit the lowest addresses.
    for (auto it = tensors.rbegin(); it != tensors.rend(); ++it) {
      it->grad = static_cast<float*>(alloc.allocate(bytes, reduce_scatter));
      ops.write_gradient(it->grad, it->n, reduce_scatter);
    }
    ops.stream_wait(compute, reduce_scatter);
    // optimizer.step() on the compute stream reads the gradients; no record_stream.
    ops.optimizer_step(kind, tensors, step, compute);
    // zero_grad(set_to_none=True): the host drops the gradients.
    for (auto& t : tensors) {
      alloc.deallocate(t.grad);
      t.grad = nullptr;
    }
    // torch.cuda.empty_cache() right after the step.
    const double e0 = ops.now_ms();
    if (variant == release_variant::pytorch_synchronize) ops.synchronize_device();
    alloc.empty_cache();
    const double e1 = ops.now_ms();
    error = ops.finish_stream(compute);
    if (error.empty()) error = ops.finish_stream(reduce_scatter);
    if (!error.empty()) break;
    alloc.reclaim();
    step_ms.push_back(ops.now_ms() - t0);
    empty_cache_ms.push_back(e1 - e0);
    result.steps_completed = step;
    const auto step_stats = alloc.stats();
    const auto peak = static_cast<std::uint64_t>(step_stats.reserved_bytes.peak);
    if (step == 1) allocated_after_first = step_stats.allocated_bytes.current;
    if (step > 1 && 2 * step <= p.steps)
      result.peak_reserved_first_half = std::max(result.peak_reserved_first_half, peak);
    if (2 * step > p.steps)
      result.peak_reserved_second_half = std::max(result.peak_reserved_second_half, peak);
    result.allocated_drift = step_stats.allocated_bytes.current - allocated_after_first;
  }
  const auto stats = alloc.stats();
  result.bytes_released = stats.bytes_released;
  result.releases_deferred = stats.releases_deferred;
  result.fence_waits = stats.fence_waits;
  result.device_syncs = stats.num_sync_all_streams +
                        (variant == release_variant::pytorch_synchronize
                             ? static_cast<std::uint64_t>(result.steps_completed)
                             : 0);
  result.median_step_ms = median(step_ms);
  result.median_empty_cache_ms = median(empty_cache_ms);
  if (!error.empty()) {
    result.clean = false;
    result.outcome = error;
    return result;  // the context may be poisoned: leave the memory to process exit
  }
  if (unrelated) ops.synchronize_device();
  for (auto& t : tensors) {
    alloc.deallocate(t.param);
    if (t.exp_avg) alloc.deallocate(t.exp_avg);
    if (t.exp_avg_sq) alloc.deallocate(t.exp_avg_sq);
  }
  alloc.empty_cache(streamsafe::empty_cache_mode::wait);
  return result;
}

std::string encode(const run_result& r) {
  std::ostringstream os;
  os << "RESULT|" << (r.clean ? 1 : 0) << '|' << r.steps_completed << '|' << r.median_step_ms << '|'
     << r.median_empty_cache_ms << '|' << r.bytes_released << '|' << r.releases_deferred << '|'
     << r.fence_waits << '|' << r.device_syncs << '|' << r.peak_reserved_first_half << '|'
     << r.peak_reserved_second_half << '|' << r.allocated_drift << '|' << r.outcome;
  return os.str();
}

bool decode(const std::string& line, run_result& r) {
  if (line.rfind("RESULT|", 0) != 0) return false;
  std::istringstream is(line.substr(7));
  std::string field;
  std::vector<std::string> f;
  for (int i = 0; i < 11 && std::getline(is, field, '|'); ++i) f.push_back(field);
  if (f.size() != 11) return false;
  std::getline(is, r.outcome);
  r.clean = f[0] == "1";
  r.steps_completed = std::stoi(f[1]);
  r.median_step_ms = std::stod(f[2]);
  r.median_empty_cache_ms = std::stod(f[3]);
  r.bytes_released = std::stoull(f[4]);
  r.releases_deferred = std::stoull(f[5]);
  r.fence_waits = std::stoull(f[6]);
  r.device_syncs = std::stoull(f[7]);
  r.peak_reserved_first_half = std::stoull(f[8]);
  r.peak_reserved_second_half = std::stoull(f[9]);
  r.allocated_drift = std::stoll(f[10]);
  return true;
}

}  // namespace race_repro
