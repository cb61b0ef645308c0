// Declarations shared by routing.cu and bindings.cpp (the binding unit is compiled by the host
// compiler, so it never sees CUDA or CUB headers).
#pragma once

#include <tuple>
#include <vector>

#include <torch/extension.h>

namespace megablocks_cuda {

std::vector<torch::Tensor> sort(const torch::Tensor& x, int64_t end_bit);
std::tuple<torch::Tensor, torch::Tensor> sort_one_block(const torch::Tensor& x, int64_t end_bit);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
route_one_block(const torch::Tensor& top_experts, int64_t num_experts, int64_t block_size);
std::tuple<int64_t, int64_t, int64_t> one_block_limits();
torch::Tensor histogram(const torch::Tensor& x, int64_t num_bins);
torch::Tensor cumsum(const torch::Tensor& x, bool inclusive);
torch::Tensor topology(const torch::Tensor& padded_bins, int64_t block_size, int64_t block_rows,
                       int64_t block_columns);
torch::Tensor replicate(const torch::Tensor& x, const torch::Tensor& bins, int64_t num_outputs);
torch::Tensor replicate_backward(const torch::Tensor& grad, const torch::Tensor& bins);
void zero_empty_groups(torch::Tensor& out, const torch::Tensor& counts);
void zero_uncovered_rows(torch::Tensor& out, const torch::Tensor& ends);
bool has_kernel_image(int64_t device_index);

}  // namespace megablocks_cuda
