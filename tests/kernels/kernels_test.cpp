// The optimizer kernels' host side, without a GPU: the launchers' argument checks (made before
// any CUDA call) and the foreach launch counts of the multi-tensor chunking. The kernels on the
// GPU: kernels_gpu_test.cpp.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <vector>

#include "streamsafe/kernels/optimizers.hpp"

namespace sk = streamsafe::kernels;

TEST_CASE("Optimizer launchers reject invalid arguments and accept empty work without a GPU",
          "[kernels]") {
  // Argument checks happen before any CUDA call, so this runs on machines without a GPU.
  const sk::adamw_hparams hp{};
  float f = 0.0f;
  CHECK(sk::signsgd_step(nullptr, sk::dtype::f32, &f, 4, 0.1f, 0.0f, nullptr) ==
        cudaErrorInvalidValue);
  CHECK(sk::signsgd_step(&f, sk::dtype::f32, nullptr, 4, 0.1f, 0.0f, nullptr) ==
        cudaErrorInvalidValue);
  CHECK(sk::signsgd_step(&f, static_cast<sk::dtype>(7), &f, 4, 0.1f, 0.0f, nullptr) ==
        cudaErrorInvalidValue);
  CHECK(sk::signsgd_step(nullptr, sk::dtype::bf16, nullptr, 0, 0.1f, 0.0f, nullptr) == cudaSuccess);
  CHECK(sk::adamw_step(&f, sk::dtype::f32, &f, &f, &f, 4, hp, 0, nullptr) == cudaErrorInvalidValue);
  CHECK(sk::adamw_step(&f, sk::dtype::f32, &f, nullptr, &f, 4, hp, 1, nullptr) ==
        cudaErrorInvalidValue);
  sk::adamw_hparams bad_beta = hp;
  bad_beta.beta2 = 1.0f;
  CHECK(sk::adamw_step(&f, sk::dtype::f32, &f, &f, &f, 4, bad_beta, 1, nullptr) ==
        cudaErrorInvalidValue);
  CHECK(sk::adamw_step(nullptr, sk::dtype::f32, nullptr, nullptr, nullptr, 0, hp, 1, nullptr) ==
        cudaSuccess);

  sk::tensor_list empty;
  CHECK(sk::signsgd_foreach(empty, 0.1f, 0.0f, nullptr) == cudaSuccess);
  CHECK(sk::adamw_foreach(empty, hp, 1, nullptr) == cudaSuccess);
  sk::tensor_list zero_sized;
  zero_sized.add(nullptr, nullptr, 0);
  CHECK(sk::signsgd_foreach(zero_sized, 0.1f, 0.0f, nullptr) == cudaSuccess);
  sk::tensor_list no_moments;
  no_moments.add(&f, &f, 1);  // fine for SignSGD, not for AdamW
  CHECK(sk::adamw_foreach(no_moments, hp, 1, nullptr) == cudaErrorInvalidValue);
  sk::tensor_list null_grad;
  null_grad.add(&f, nullptr, 1);
  CHECK(sk::signsgd_foreach(null_grad, 0.1f, 0.0f, nullptr) == cudaErrorInvalidValue);

  CHECK(sk::launch_spin(nullptr, -1.0) == cudaErrorInvalidValue);
  CHECK(sk::launch_spin(nullptr, std::nan("")) == cudaErrorInvalidValue);
  CHECK(sk::launch_fill(nullptr, 0, 1, nullptr) == cudaSuccess);
  CHECK(sk::launch_fill(nullptr, 8, 1, nullptr) == cudaErrorInvalidValue);
  CHECK(sk::launch_read_sum(&f, 4, nullptr, nullptr) == cudaErrorInvalidValue);
}

TEST_CASE("Foreach launch counts follow the multi-tensor chunking", "[kernels]") {
  const std::size_t chunk = sk::foreach_chunk_elements;
  const std::size_t max_chunks = sk::foreach_max_chunks_per_launch;
  float f = 0.0f;
  auto list_of = [&](const std::vector<std::size_t>& sizes) {
    sk::tensor_list l;
    for (std::size_t n : sizes) l.add(&f, &f, &f, &f, n);
    return l;
  };
  CHECK(sk::signsgd_foreach_launch_count(list_of({})) == 0);
  CHECK(sk::signsgd_foreach_launch_count(list_of({0, 0})) == 0);
  CHECK(sk::signsgd_foreach_launch_count(list_of({1})) == 1);
  // Tensor slots: 64 small tensors fit one SignSGD launch, 65 need two; AdamW holds 36.
  CHECK(sk::signsgd_foreach_launch_count(list_of(std::vector<std::size_t>(64, 5))) == 1);
  CHECK(sk::signsgd_foreach_launch_count(list_of(std::vector<std::size_t>(65, 5))) == 2);
  CHECK(sk::adamw_foreach_launch_count(list_of(std::vector<std::size_t>(36, 5))) == 1);
  CHECK(sk::adamw_foreach_launch_count(list_of(std::vector<std::size_t>(37, 5))) == 2);
  CHECK(sk::adamw_foreach_launch_count(list_of(std::vector<std::size_t>(150, 5))) == 5);
  // Block slots: one launch carries max_chunks (tensor, chunk) pairs.
  CHECK(sk::signsgd_foreach_launch_count(list_of({max_chunks * chunk})) == 1);
  CHECK(sk::signsgd_foreach_launch_count(list_of({max_chunks * chunk + 1})) == 2);
  CHECK(sk::signsgd_foreach_launch_count(list_of({chunk + 1, max_chunks * chunk})) == 2);
  // 1536 shards of 4 M floats (64 chunks each): 5 shards per launch.
  CHECK(sk::signsgd_foreach_launch_count(list_of(std::vector<std::size_t>(1536, 64 * chunk))) ==
        (1536 * 64 + max_chunks - 1) / max_chunks);
}
