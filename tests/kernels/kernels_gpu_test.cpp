// The optimizer kernels (streamsafe_kernels) against host references: SignSGD and AdamW, per
// parameter and foreach, fp32 and bf16 parameters, odd tensor sizes (1 element, sizes around the
// 65536-element foreach chunk, a tensor longer than one launch's chunks, more tensors than one
// launch holds), aligned and unaligned views; and the helper kernels (spin, fill, read_sum).
// Plain C++: only the host API and the CUDA runtime API.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "streamsafe/kernels/optimizers.hpp"
#include "support/gpu.hpp"

namespace sk = streamsafe::kernels;

namespace {

#define CUDA_OK(expr) REQUIRE((expr) == cudaSuccess)

// ---- bf16 on the host, by bit manipulation ----------------------------------------------------

float bf16_to_float(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest, ties to even (NaN kept quiet).
std::uint16_t float_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  const std::uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<std::uint16_t>(u >> 16);
}

// ---- host references --------------------------------------------------------------------------

float sign0(float g) { return g > 0.f ? 1.f : (g < 0.f ? -1.f : 0.f); }

float signsgd_ref(float p, float g, float lr, float wd) {
  const float decay = 1.0f - lr * wd;
  return p * decay - lr * sign0(g);
}

struct adam_state {
  float p;
  float m;
  float v;
};

void adamw_ref(adam_state& s, float g, const sk::adamw_hparams& hp, std::int64_t t) {
  const float decay = 1.0f - hp.lr * hp.weight_decay;
  const float bc1 = static_cast<float>(
      1.0 - std::pow(static_cast<double>(hp.beta1), static_cast<double>(t)));
  const float bc2 = static_cast<float>(
      1.0 - std::pow(static_cast<double>(hp.beta2), static_cast<double>(t)));
  s.p = s.p * decay;
  s.m = hp.beta1 * s.m + (1.0f - hp.beta1) * g;
  s.v = hp.beta2 * s.v + (1.0f - hp.beta2) * g * g;
  const float mhat = s.m / bc1;
  const float vhat = s.v / bc2;
  s.p = s.p - hp.lr * mhat / (std::sqrt(vhat) + hp.eps);
}

// ---- device buffers ---------------------------------------------------------------------------

class device_buffer {
 public:
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) {
    REQUIRE(cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes) == cudaSuccess);
  }
  ~device_buffer() { (void)cudaFree(ptr_); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  unsigned char* bytes() const { return static_cast<unsigned char*>(ptr_); }
  std::size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_;
};

class stream_guard {
 public:
  stream_guard() { REQUIRE(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking) == cudaSuccess); }
  ~stream_guard() { (void)cudaStreamDestroy(s_); }
  stream_guard(const stream_guard&) = delete;
  stream_guard& operator=(const stream_guard&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// Tensors of the given sizes laid out in device arrays. Each tensor starts at an element offset
// that is a multiple of 4 when `aligned` (so 16-byte aligned for fp32, 8-byte for bf16) and is
// shifted by one element otherwise, so both the vectorised and the scalar paths run.
struct layout {
  std::vector<std::size_t> sizes;
  std::vector<std::size_t> offsets;
  std::size_t total = 0;
};

layout make_layout(const std::vector<std::size_t>& sizes, bool aligned) {
  layout l;
  l.sizes = sizes;
  std::size_t at = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    at = (at + 3) / 4 * 4 + 4;  // a gap of at least one group between tensors
    if (!aligned && i % 2 == 0) at += 1;
    l.offsets.push_back(at);
    at += sizes[i];
  }
  l.total = at + 8;
  return l;
}

std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float scale, bool zeros) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = (zeros && i % 7 == 3) ? 0.0f : dist(rng);
  return v;
}

// Parameters on the host as floats (bf16 values already rounded) and their device bytes.
struct host_params {
  sk::dtype type;
  std::vector<float> values;

  std::size_t elem_bytes() const { return type == sk::dtype::f32 ? 4 : 2; }
  std::vector<unsigned char> encode() const {
    std::vector<unsigned char> out(values.size() * elem_bytes());
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (type == sk::dtype::f32) {
        std::memcpy(&out[i * 4], &values[i], 4);
      } else {
        const std::uint16_t b = float_to_bf16(values[i]);
        std::memcpy(&out[i * 2], &b, 2);
      }
    }
    return out;
  }
  std::vector<float> decode(const std::vector<unsigned char>& in) const {
    std::vector<float> out(in.size() / elem_bytes());
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (type == sk::dtype::f32) {
        std::memcpy(&out[i], &in[i * 4], 4);
      } else {
        std::uint16_t b;
        std::memcpy(&b, &in[i * 2], 2);
        out[i] = bf16_to_float(b);
      }
    }
    return out;
  }
  // What the kernel stores: fp32 as is, bf16 rounded to nearest even.
  float store(float x) const {
    return type == sk::dtype::f32 ? x : bf16_to_float(float_to_bf16(x));
  }
};

host_params make_params(sk::dtype type, std::size_t n, std::mt19937& rng) {
  host_params hp{type, random_floats(n, rng, 1.0f, false)};
  for (float& x : hp.values) x = hp.store(x);
  return hp;
}

struct tolerance {
  float abs;
  float rel;
};

tolerance param_tolerance(sk::dtype type) {
  // fp32: a few ulps (FMA contraction may differ between nvcc and the host compiler).
  // bf16: a rounding flip near a tie gives one bf16 ulp (at most 2^-7 relative), which later
  // steps carry but do not grow; 1e-3 absolute covers values that shrank from |p| < 0.25.
  return type == sk::dtype::f32 ? tolerance{1e-6f, 1e-5f} : tolerance{1e-3f, 1e-2f};
}

constexpr tolerance moment_tolerance{1e-7f, 1e-5f};

// Compares got to want element by element over the given tensors' ranges; reports the first
// mismatch and how many there were.
void check_close(const std::vector<float>& got, const std::vector<float>& want, const layout& l,
                 tolerance tol, const std::string& what) {
  std::size_t bad = 0;
  std::ostringstream first;
  double worst = 0.0;
  for (std::size_t t = 0; t < l.sizes.size(); ++t) {
    for (std::size_t j = 0; j < l.sizes[t]; ++j) {
      const std::size_t i = l.offsets[t] + j;
      const float a = got[i];
      const float b = want[i];
      const float diff = std::fabs(a - b);
      const float allowed = tol.abs + tol.rel * std::max(std::fabs(a), std::fabs(b));
      worst = std::max(worst, static_cast<double>(diff));
      if (!(diff <= allowed)) {
        if (bad == 0) {
          first << what << ": tensor " << t << " (size " << l.sizes[t] << ") element " << j
                << ": got " << a << ", want " << b;
        }
        ++bad;
      }
    }
  }
  INFO(first.str());
  INFO(what << ": " << bad << " mismatches, largest difference " << worst);
  CHECK(bad == 0);
}

// Gaps between tensors must stay untouched.
void check_gaps(const std::vector<float>& got, const std::vector<float>& before, const layout& l,
                const std::string& what) {
  std::vector<char> inside(got.size(), 0);
  for (std::size_t t = 0; t < l.sizes.size(); ++t) {
    std::fill(inside.begin() + static_cast<std::ptrdiff_t>(l.offsets[t]),
              inside.begin() + static_cast<std::ptrdiff_t>(l.offsets[t] + l.sizes[t]), 1);
  }
  std::size_t touched = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!inside[i] && std::memcmp(&got[i], &before[i], sizeof(float)) != 0) ++touched;
  }
  INFO(what << ": " << touched << " elements outside the tensors changed");
  CHECK(touched == 0);
}

template <typename T>
void upload(unsigned char* dst, const std::vector<T>& src) {
  CUDA_OK(cudaMemcpy(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <typename T>
std::vector<T> download(const unsigned char* src, std::size_t count) {
  std::vector<T> out(count);
  CUDA_OK(cudaMemcpy(out.data(), src, count * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

std::vector<float> download_params(const host_params& hp, const unsigned char* src) {
  std::vector<unsigned char> bytes(hp.values.size() * hp.elem_bytes());
  CUDA_OK(cudaMemcpy(bytes.data(), src, bytes.size(), cudaMemcpyDeviceToHost));
  return hp.decode(bytes);
}

const char* name(sk::dtype t) { return t == sk::dtype::f32 ? "fp32" : "bf16"; }

// Sizes: 1-element tensors, tiny odd sizes, sizes around the foreach chunk, a few larger ones.
const std::vector<std::size_t> odd_sizes = {1,      2,      3,    4,     5,      7,     1,
                                            17,     1023,   4097, 65535, 65536,  65537, 131071,
                                            131073, 200003, 1,    9,     300007, 33};

// ---- SignSGD ----------------------------------------------------------------------------------

void run_signsgd(sk::dtype type, const std::vector<std::size_t>& sizes, bool aligned, bool foreach,
                 int steps) {
  INFO((foreach ? "foreach " : "per-parameter ")
       << name(type) << (aligned ? " aligned" : " unaligned"));
  std::mt19937 rng(1234u + static_cast<unsigned>(type) * 7u + (aligned ? 1u : 0u));
  const layout l = make_layout(sizes, aligned);
  host_params params = make_params(type, l.total, rng);
  const std::vector<float> initial = params.values;

  device_buffer d_param(l.total * params.elem_bytes());
  device_buffer d_grad(l.total * sizeof(float));
  upload(d_param.bytes(), params.encode());

  stream_guard stream;
  const float lr = 0.03f;
  const float wd = 0.1f;
  for (int step = 0; step < steps; ++step) {
    const std::vector<float> grad = random_floats(l.total, rng, 2.0f, true);
    upload(d_grad.bytes(), grad);
    const float* g = reinterpret_cast<const float*>(d_grad.bytes());
    if (foreach) {
      sk::tensor_list list(type);
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        list.add(d_param.bytes() + l.offsets[t] * params.elem_bytes(), g + l.offsets[t], sizes[t]);
      }
      CUDA_OK(sk::signsgd_foreach(list, lr, wd, stream.get()));
    } else {
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        CUDA_OK(sk::signsgd_step(d_param.bytes() + l.offsets[t] * params.elem_bytes(), type,
                                 g + l.offsets[t], sizes[t], lr, wd, stream.get()));
      }
    }
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      for (std::size_t j = 0; j < sizes[t]; ++j) {
        const std::size_t i = l.offsets[t] + j;
        params.values[i] = params.store(signsgd_ref(params.values[i], grad[i], lr, wd));
      }
    }
    CUDA_OK(cudaStreamSynchronize(stream.get()));
  }
  const std::vector<float> got = download_params(params, d_param.bytes());
  check_close(got, params.values, l, param_tolerance(type), "param");
  check_gaps(got, initial, l, "param");
}

// ---- AdamW ------------------------------------------------------------------------------------

void run_adamw(sk::dtype type, const std::vector<std::size_t>& sizes, bool aligned, bool foreach,
               int steps) {
  INFO((foreach ? "foreach " : "per-parameter ")
       << name(type) << (aligned ? " aligned" : " unaligned"));
  std::mt19937 rng(99u + static_cast<unsigned>(type) * 7u + (aligned ? 1u : 0u));
  const layout l = make_layout(sizes, aligned);
  host_params params = make_params(type, l.total, rng);
  const std::vector<float> initial = params.values;
  std::vector<float> m(l.total, 0.0f);
  std::vector<float> v(l.total, 0.0f);

  device_buffer d_param(l.total * params.elem_bytes());
  device_buffer d_grad(l.total * sizeof(float));
  device_buffer d_m(l.total * sizeof(float));
  device_buffer d_v(l.total * sizeof(float));
  upload(d_param.bytes(), params.encode());
  upload(d_m.bytes(), m);
  upload(d_v.bytes(), v);

  sk::adamw_hparams hp;
  hp.lr = 1e-2f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.999f;
  hp.eps = 1e-8f;
  hp.weight_decay = 0.1f;

  stream_guard stream;
  float* dm = reinterpret_cast<float*>(d_m.bytes());
  float* dv = reinterpret_cast<float*>(d_v.bytes());
  for (std::int64_t t = 1; t <= steps; ++t) {
    const std::vector<float> grad = random_floats(l.total, rng, 0.5f, true);
    upload(d_grad.bytes(), grad);
    const float* g = reinterpret_cast<const float*>(d_grad.bytes());
    if (foreach) {
      sk::tensor_list list(type);
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const std::size_t o = l.offsets[k];
        list.add(d_param.bytes() + o * params.elem_bytes(), g + o, dm + o, dv + o, sizes[k]);
      }
      CUDA_OK(sk::adamw_foreach(list, hp, t, stream.get()));
    } else {
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const std::size_t o = l.offsets[k];
        CUDA_OK(sk::adamw_step(d_param.bytes() + o * params.elem_bytes(), type, g + o, dm + o,
                               dv + o, sizes[k], hp, t, stream.get()));
      }
    }
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      for (std::size_t j = 0; j < sizes[k]; ++j) {
        const std::size_t i = l.offsets[k] + j;
        adam_state s{params.values[i], m[i], v[i]};
        adamw_ref(s, grad[i], hp, t);
        params.values[i] = params.store(s.p);
        m[i] = s.m;
        v[i] = s.v;
      }
    }
    CUDA_OK(cudaStreamSynchronize(stream.get()));
  }
  const std::vector<float> got = download_params(params, d_param.bytes());
  check_close(got, params.values, l, param_tolerance(type), "param");
  check_gaps(got, initial, l, "param");
  check_close(download<float>(d_m.bytes(), l.total), m, l, moment_tolerance, "exp_avg");
  check_close(download<float>(d_v.bytes(), l.total), v, l, moment_tolerance, "exp_avg_sq");
}

// More tensors than one foreach launch holds, with sizes cycling through odd_sizes.
std::vector<std::size_t> many_sizes(std::size_t count) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < count; ++i) out.push_back(odd_sizes[(i * 7) % odd_sizes.size()]);
  return out;
}

}  // namespace

TEST_CASE("SignSGD per-parameter steps match the host reference for fp32 and bf16 parameters",
          "[gpu][kernels]") {
  STREAMSAFE_REQUIRE_GPU();
  const sk::dtype type = GENERATE(sk::dtype::f32, sk::dtype::bf16);
  const bool aligned = GENERATE(true, false);
  run_signsgd(type, odd_sizes, aligned, /*foreach=*/false, /*steps=*/3);
}

TEST_CASE("SignSGD foreach steps match the host reference across many odd-sized tensors",
          "[gpu][kernels]") {
  STREAMSAFE_REQUIRE_GPU();
  const sk::dtype type = GENERATE(sk::dtype::f32, sk::dtype::bf16);
  const bool aligned = GENERATE(true, false);
  std::vector<std::size_t> sizes = many_sizes(150);  // over 64 tensors: several launches
  sizes.insert(sizes.end(), odd_sizes.begin(), odd_sizes.end());
  run_signsgd(type, sizes, aligned, /*foreach=*/true, /*steps=*/3);
}

TEST_CASE("SignSGD foreach handles a tensor with more chunks than one launch carries",
          "[gpu][kernels]") {
  STREAMSAFE_REQUIRE_GPU();
  const sk::dtype type = GENERATE(sk::dtype::f32, sk::dtype::bf16);
  const std::size_t big = sk::foreach_max_chunks_per_launch * sk::foreach_chunk_elements + 12345;
  run_signsgd(type, {3, big, 1, 65537}, /*aligned=*/true, /*foreach=*/true, /*steps=*/2);
}

TEST_CASE("AdamW per-parameter steps match the bias-corrected host reference over several steps",
          "[gpu][kernels]") {
  STREAMSAFE_REQUIRE_GPU();
  const sk::dtype type = GENERATE(sk::dtype::f32, sk::dtype::bf16);
  const bool aligned = GENERATE(true, false);
  run_adamw(type, odd_sizes, aligned, /*foreach=*/false, /*steps=*/5);
}

TEST_CASE("AdamW foreach steps match the bias-corrected host reference over several steps",
          "[gpu][kernels]") {
  STREAMSAFE_REQUIRE_GPU();
  const sk::dtype type = GENERATE(sk::dtype::f32, sk::dtype::bf16);
  const bool aligned = GENERATE(true, false);
  std::vector<std::size_t> sizes = many_sizes(80);  // over 36 tensors: several launches
  sizes.insert(sizes.end(), odd_sizes.begin(), odd_sizes.end());
  run_adamw(type, sizes, aligned, /*foreach=*/true, /*steps=*/5);
}

TEST_CASE("AdamW foreach handles a tensor with more chunks than one launch carries",
          "[gpu][kernels]") {
  STREAMSAFE_REQUIRE_GPU();
  const std::size_t big = sk::foreach_max_chunks_per_launch * sk::foreach_chunk_elements + 777;
  run_adamw(sk::dtype::f32, {5, big, 1}, /*aligned=*/true, /*foreach=*/true, /*steps=*/2);
}

TEST_CASE("launch_spin keeps a stream busy for roughly the requested time", "[gpu][kernels]") {
  STREAMSAFE_REQUIRE_GPU();
  stream_guard stream;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  // Warm up (module load, first launch).
  CUDA_OK(sk::launch_spin(stream.get(), 1.0));
  CUDA_OK(cudaStreamSynchronize(stream.get()));

  const double requested_ms = 100.0;
  const auto host_start = std::chrono::steady_clock::now();
  CUDA_OK(cudaEventRecord(start, stream.get()));
  CUDA_OK(sk::launch_spin(stream.get(), requested_ms));
  CUDA_OK(cudaEventRecord(stop, stream.get()));
  // The launch returns at once; the stream is still busy.
  CHECK(cudaStreamQuery(stream.get()) == cudaErrorNotReady);
  CUDA_OK(cudaEventSynchronize(stop));
  const double host_ms = std::chrono::duration<double, std::milli>(
                             std::chrono::steady_clock::now() - host_start)
                             .count();
  float gpu_ms = 0.0f;
  CUDA_OK(cudaEventElapsedTime(&gpu_ms, start, stop));
  INFO("gpu " << gpu_ms << " ms, host " << host_ms << " ms for " << requested_ms
              << " ms requested");
  CHECK(gpu_ms >= 0.9 * requested_ms);
  CHECK(gpu_ms <= 5.0 * requested_ms);
  CHECK(host_ms >= 0.9 * requested_ms);
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
}

TEST_CASE("launch_fill writes the byte value to exactly the requested range", "[gpu][kernels]") {
  STREAMSAFE_REQUIRE_GPU();
  stream_guard stream;
  const std::size_t total = (1u << 20) + 123;
  device_buffer buf(total);
  struct range {
    std::size_t offset;
    std::size_t bytes;
  };
  const range ranges[] = {{0, total},   {3, 1},      {5, 10},     {1, 31},
                          {17, 100000}, {16, 65536}, {7, 1 << 20}};
  for (const range& r : ranges) {
    INFO("offset " << r.offset << ", " << r.bytes << " bytes");
    CUDA_OK(cudaMemset(buf.bytes(), 0, total));
    const unsigned char value = static_cast<unsigned char>(0xA5 ^ (r.offset & 0xff));
    CUDA_OK(sk::launch_fill(buf.bytes() + r.offset, r.bytes, value, stream.get()));
    CUDA_OK(cudaStreamSynchronize(stream.get()));
    const std::vector<unsigned char> got = download<unsigned char>(buf.bytes(), total);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < total; ++i) {
      const bool inside = i >= r.offset && i < r.offset + r.bytes;
      if (got[i] != (inside ? value : 0)) ++wrong;
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("launch_read_sum adds up the bytes a kernel reads", "[gpu][kernels]") {
  STREAMSAFE_REQUIRE_GPU();
  stream_guard stream;
  const std::size_t total = (3u << 20) + 77;
  std::vector<unsigned char> host(total);
  std::mt19937 rng(7u);
  for (unsigned char& b : host) b = static_cast<unsigned char>(rng() & 0xff);
  device_buffer buf(total);
  device_buffer sum(sizeof(unsigned long long));
  upload(buf.bytes(), host);
  auto* d_sum = reinterpret_cast<unsigned long long*>(sum.bytes());
  const std::pair<std::size_t, std::size_t> ranges[] = {{0, total}, {1, 1}, {3, 29}, {9, 2000003}};
  for (const auto& [offset, bytes] : ranges) {
    INFO("offset " << offset << ", " << bytes << " bytes");
    CUDA_OK(cudaMemsetAsync(d_sum, 0, sizeof(unsigned long long), stream.get()));
    CUDA_OK(sk::launch_read_sum(buf.bytes() + offset, bytes, d_sum, stream.get()));
    CUDA_OK(cudaStreamSynchronize(stream.get()));
    unsigned long long want = 0;
    for (std::size_t i = offset; i < offset + bytes; ++i) want += host[i];
    CHECK(download<unsigned long long>(sum.bytes(), 1)[0] == want);
  }
  // A fill followed by a read on the same stream sees the filled bytes.
  CUDA_OK(cudaMemsetAsync(d_sum, 0, sizeof(unsigned long long), stream.get()));
  CUDA_OK(sk::launch_fill(buf.bytes(), total, 3, stream.get()));
  CUDA_OK(sk::launch_read_sum(buf.bytes(), total, d_sum, stream.get()));
  CUDA_OK(cudaStreamSynchronize(stream.get()));
  CHECK(download<unsigned long long>(sum.bytes(), 1)[0] == 3ull * total);
}
