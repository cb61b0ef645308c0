// Declarations shared by permutation.cu and bindings.cpp (compiled by the host compiler).
#pragma once

#include <optional>

#include <torch/extension.h>

namespace megablocks_cuda {

torch::Tensor scan_scatter(const torch::Tensor& x, const torch::Tensor& indices,
                           const std::optional<torch::Tensor>& weights, int64_t top_k,
                           int64_t tokens_per_block);
int64_t scan_scatter_max_rows();

}  // namespace megablocks_cuda
