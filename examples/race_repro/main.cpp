// race_repro: reproduces the empty_cache-after-optimizer.step() crash of FSDP2 training and
// shows streamsafe's release avoiding it. Runs the matrix
//   optimizer {signsgd_per_parameter, signsgd_foreach, adamw_foreach}
//   x release {pytorch (allocation_stream fence), pytorch + device synchronize, streamsafe (wait),
//              streamsafe (defer)}
// on the GPU when there is one (each configuration in its own child process, since a fault
// poisons the CUDA context), on the simulated device otherwise, and prints a table.
//
//   race_repro [--sim] [--steps N] [--params N] [--shard-floats N] [--unrelated-ms MS]
//              [--optimizers a,b] [--variants a,b]
// Exit status: 0 when every streamsafe configuration ran clean, 1 otherwise, 2 on bad usage.
#include "ops.hpp"
#include "scenario.hpp"

#include <streamsafe/backends/gpu.hpp>

#include <cuda_runtime_api.h>

#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

using namespace race_repro;

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string self_path() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "race_repro";
  buf[n] = 0;
  return buf;
}

std::string problem_args(const problem& p) {
  std::ostringstream os;
  os << " --steps " << p.steps << " --params " << p.params << " --shard-floats " << p.shard_floats
     << " --unrelated-ms " << p.unrelated_ms;
  return os.str();
}

run_result run_child(optimizer_kind k, release_variant v, const problem& p) {
  const std::string cmd = "'" + self_path() + "' --child " + to_string(k) + " " + to_string(v) +
                          problem_args(p) + " 2>&1";
  run_result r;
  r.clean = false;
  r.outcome = "child process gave no result";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) {
    r.outcome = "could not start the child process";
    return r;
  }
  std::string last;
  char line[4096];
  bool got = false;
  while (std::fgets(line, sizeof line, pipe)) {
    std::string s(line);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    if (decode(s, r)) {
      got = true;
    } else if (!s.empty()) {
      last = s;
      std::cerr << "  [" << to_string(k) << "/" << to_string(v) << "] " << s << "\n";
    }
  }
  const int status = pclose(pipe);
  if (!got) {
    r.outcome = "child exited with status " + std::to_string(status) +
                (last.empty() ? "" : ": " + last);
  }
  return r;
}

std::string gib_text(std::uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1 << 30));
  return buf;
}

const char* variant_title(release_variant v) {
  switch (v) {
    case release_variant::pytorch: return "allocation_stream (PyTorch)";
    case release_variant::pytorch_synchronize: return "allocation_stream + synchronize";
    case release_variant::streamsafe_wait: return "streamsafe (all_streams, wait)";
    case release_variant::streamsafe_defer: return "streamsafe (all_streams, defer)";
  }
  return "?";
}

void usage() {
  std::cerr
      << "usage: race_repro [--sim] [--steps N] [--params N] [--shard-floats N] [--unrelated-ms "
         "MS]\n"
         "                  [--optimizers signsgd_per_parameter,signsgd_foreach,adamw_foreach]\n"
         "                  [--variants pytorch,pytorch_synchronize,streamsafe,streamsafe_defer]\n";
}

}  // namespace

int main(int argc, char** argv) {
  problem p;
  bool force_sim = false;
  std::vector<optimizer_kind> optimizers = {optimizer_kind::signsgd_per_parameter,
                                            optimizer_kind::signsgd_foreach,
                                            optimizer_kind::adamw_foreach};
  std::vector<release_variant> variants = {
      release_variant::pytorch, release_variant::pytorch_synchronize,
      release_variant::streamsafe_wait, release_variant::streamsafe_defer};
  bool child = false;
  bool sized = false;  // --params or --shard-floats given: no sizing to the device
  optimizer_kind child_kind{};
  release_variant child_variant{};
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      auto next = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument("missing value after " + a);
        return argv[++i];
      };
      if (a == "--sim") force_sim = true;
      else if (a == "--steps") p.steps = std::stoi(next());
      else if (a == "--params") p.params = std::stoi(next()), sized = true;
      else if (a == "--shard-floats") p.shard_floats = std::stoull(next()), sized = true;
      else if (a == "--unrelated-ms") p.unrelated_ms = std::stod(next());
      else if (a == "--optimizers" || a == "--variants") {
        auto items = split(next());
        if (a == "--optimizers") optimizers.clear();
        else variants.clear();
        for (auto& item : items) {
          optimizer_kind k;
          release_variant v;
          if (a == "--optimizers" && parse(item, k)) optimizers.push_back(k);
          else if (a == "--variants" && parse(item, v)) variants.push_back(v);
          else throw std::invalid_argument("unknown value '" + item + "' for " + a);
        }
      } else if (a == "--child") {
        child = true;
        if (!parse(next(), child_kind) || !parse(next(), child_variant))
          throw std::invalid_argument("bad --child");
      } else if (a == "--help" || a == "-h") {
        usage();
        return 0;
      } else {
        throw std::invalid_argument("unknown option " + a);
      }
    }
    if (p.steps < 1 || p.params < 1 || p.shard_floats < 1)
      throw std::invalid_argument("sizes must be positive");
  } catch (const std::exception& e) {
    std::cerr << "race_repro: " << e.what() << "\n";
    usage();
    return 2;
  }

  if (child) {
    run_result r;
    try {
      auto ops = make_gpu_ops(0);
      r = run(*ops, child_kind, child_variant, p);
    } catch (const std::exception& e) {
      r.clean = false;
      r.outcome = std::string("exception: ") + e.what();
    }
    std::cout << encode(r) << std::endl;
    std::_Exit(0);  // skip destructors: the context may be poisoned
  }

  const int gpus = force_sim ? 0 : streamsafe::cuda::device_count();
  std::string where;
  if (gpus > 0) {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    where = std::string("GPU: ") + prop.name +
            " (device 0); each configuration runs in its own process";
    // AdamW holds a parameter, two moments and a gradient per tensor, and the last step's
    // gradients may still be on their way back: five times the gradients must fit, with 15%
    // for the driver and the kernels. The defaults were chosen on a 141 GB H200; a smaller card
    // gets fewer parameter tensors (said below), unless --params / --shard-floats say otherwise.
    const double gradients = static_cast<double>(p.params) * static_cast<double>(p.shard_floats) *
                             4;
    const double fits = 0.85 * static_cast<double>(prop.totalGlobalMem) / 5;
    if (!sized && gradients > fits) {
      p.params = std::max(1, static_cast<int>(p.params * fits / gradients));
      where += "; sized to its " + gib_text(prop.totalGlobalMem) + " (--params " +
               std::to_string(p.params) + ")";
    }
  } else {
    where = force_sim ? "simulated device (--sim)"
                      : "simulated device: no GPU found here (cudaGetDeviceCount reported none); "
                        "faults are the simulator's, not CUDA errors";
  }
  std::cout << "streamsafe race reproduction on the " << where << "\n"
            << "problem: " << p.params << " parameters x " << p.shard_floats << " floats ("
            << gib_text(static_cast<std::uint64_t>(p.params) * p.shard_floats * 4)
            << " of gradients per step), " << p.steps << " steps, unrelated kernel: "
            << (p.unrelated_ms > 0
                    ? std::to_string(p.unrelated_ms) + " ms per step on a third stream"
                    : "none")
            << "\n\n";
  std::printf("%-22s %-33s %5s %9s %15s %10s %8s  %s\n", "optimizer", "release", "steps", "step ms",
              "empty_cache ms", "released", "deferred", "outcome");
  bool streamsafe_clean = true;
  for (auto k : optimizers) {
    for (auto v : variants) {
      run_result r;
      if (gpus > 0) {
        r = run_child(k, v, p);
      } else {
        try {
          auto ops = make_sim_ops();
          r = run(*ops, k, v, p);
        } catch (const std::exception& e) {
          r.clean = false;
          r.outcome = std::string("exception: ") + e.what();
        }
      }
      std::printf("%-22s %-33s %5d %9.2f %15.3f %10s %8llu  %s\n", to_string(k), variant_title(v),
                  r.steps_completed, r.median_step_ms, r.median_empty_cache_ms,
                  gib_text(r.bytes_released).c_str(),
                  static_cast<unsigned long long>(r.releases_deferred),
                  r.clean ? "clean" : ("FAULT: " + r.outcome).c_str());
      if (r.clean && p.steps >= 4) {
        std::printf(
            "%-22s   peak reserved per step: %.1f MiB (steps 2-%d), %.1f MiB (steps %d-%d); "
            "allocated drift %lld bytes\n",
            "", static_cast<double>(r.peak_reserved_first_half) / 1048576.0, p.steps / 2,
            static_cast<double>(r.peak_reserved_second_half) / 1048576.0, p.steps / 2 + 1, p.steps,
            static_cast<long long>(r.allocated_drift));
      }
      std::fflush(stdout);
      if (!r.clean &&
          (v == release_variant::streamsafe_wait || v == release_variant::streamsafe_defer)) {
        streamsafe_clean = false;
      }
    }
  }
  std::cout << "\n"
            << (streamsafe_clean ? "every streamsafe configuration ran clean"
                                 : "A STREAMSAFE CONFIGURATION FAULTED")
            << "\n";
  return streamsafe_clean ? 0 : 1;
}
