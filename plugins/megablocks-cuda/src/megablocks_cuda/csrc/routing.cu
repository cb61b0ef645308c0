// Torch side of the routing ops: allocation, dtype dispatch and launches on the current stream.
//
// Rules that keep every op CUDA-graph capturable: no host reads of device data, temporary storage
// comes from torch's caching allocator (never cudaMalloc), nothing launches for empty inputs.
// Inputs arrive validated and contiguous (the megablocks core checks contracts and copies).
#include <algorithm>
#include <type_traits>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "check.h"
#include "kernels.cuh"
#include "routing.h"

namespace megablocks_cuda {
namespace {

void check_cuda(const torch::Tensor& t, const char* name) {
  MB_CHECK(t.is_cuda(), "megablocks_cuda: ", name, " must be a CUDA tensor");
  MB_CHECK(t.is_contiguous(), "megablocks_cuda: ", name, " must be contiguous");
}

// CUB's two-phase calls: size the scratch space, take it from torch's allocator, run.
template <typename Call>
void with_cub_temp(const torch::Tensor& like, Call call) {
  size_t bytes = 0;
  C10_CUDA_CHECK(call(nullptr, bytes));
  auto temp = torch::empty({static_cast<int64_t>(bytes)}, like.options().dtype(torch::kUInt8));
  C10_CUDA_CHECK(call(temp.data_ptr(), bytes));
}

}  // namespace

std::vector<torch::Tensor> sort(const torch::Tensor& x, int64_t end_bit) {
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  auto values = torch::empty_like(x);
  auto indices = torch::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return {values, indices};
  MB_CHECK(n <= INT32_MAX, "megablocks_cuda.sort: more than 2**31 - 1 keys");
  auto stream = at::cuda::getCurrentCUDAStream();
  MB_DISPATCH_INTS(x.scalar_type(), "megablocks_cuda.sort", [&] {
    // The positions to carry along: 0..n-1 in x's dtype (int16 keys are at most 32768 long).
    auto positions = torch::empty_like(x);
    iota_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(positions.data_ptr<scalar_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (end_bit == 0) {  // every key is 0: the stable order is the identity
      values.copy_(x);
      indices.copy_(positions);
      return;
    }
    with_cub_temp(x, [&](void* temp, size_t& bytes) {
      return sort_pairs<scalar_t>(temp, bytes, x.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                                  positions.data_ptr<scalar_t>(), indices.data_ptr<scalar_t>(),
                                  static_cast<int>(n), static_cast<int>(end_bit), stream);
    });
  });
  return {values, indices};
}

namespace {

// A 1-D output on like's device, allocated without going through the dispatcher: the one-block
// ops are all host cost, and they allocate up to five tensors a call.
torch::Tensor empty_1d(const torch::Tensor& like, int64_t n, at::ScalarType dtype) {
  return torch::Tensor(at::detail::empty_cuda({n}, dtype, like.device(), std::nullopt));
}

// What a one-block kernel reads and writes (sort: counts, bins and padded_bins are null).
template <typename KeyT>
struct OneBlockCall {
  const KeyT* keys;
  int n;
  int bits;             // the digits' width
  uint32_t digit_mask;  // sort: the bits of a key it sorts by
  int num_bins;         // route: the experts
  int64_t block_size;   // route: padded_bins rounds each count up to it
  KeyT* values_out;
  KeyT* positions_out;
  int32_t* counts;
  int32_t* bins;
  int32_t* padded_bins;
};

// route of up to 128 ids (a few decoded tokens): the one-pass counting sort, one bin per thread
// when the experts fit the block.
template <typename KeyT>
void launch_small_route(const OneBlockCall<KeyT>& c) {
  static_assert(kSmallRouteThreads == 128, "launch_one_block sends it up to 128 ids");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto launch = [&](auto bins_per_thread) {
    small_route_kernel<KeyT, decltype(bins_per_thread)::value>
        <<<1, kSmallRouteThreads, 0, stream>>>(c.keys, c.n, c.num_bins, c.block_size,
                                               c.values_out, c.positions_out, c.counts, c.bins,
                                               c.padded_bins);
  };
  if (c.num_bins <= kSmallRouteThreads) {
    launch(std::integral_constant<int, 1>{});
  } else {
    launch(std::integral_constant<int, kOneBlockMaxBins / kSmallRouteThreads>{});
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The one-block sort's shapes (threads x keys per thread): one key per thread up to 128 keys (a
// few decoded tokens: fewer slots to rank; one warp alone was slower, as route's histogram scan
// then runs 32 bins per thread; route takes the counting sort there), then 4 keys per thread on
// 128 to 1024 threads (on the H200 faster than 8 keys per thread on fewer: 2048 keys 5.1 against
// 7.4 µs, 4096 keys 8.9 against 10.6). route's counts and sums: one bin per thread when the
// experts fit the block, else enough for kOneBlockMaxBins; sort: none.
template <bool ROUTE, typename KeyT, int THREADS, int ITEMS>
void launch_one_block_as(const OneBlockCall<KeyT>& c) {
  static_assert(THREADS * ITEMS <= kOneBlockMaxKeys, "past the one-block limit");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto launch = [&](auto bins_per_thread) {
    one_block_sort_kernel<KeyT, THREADS, ITEMS, decltype(bins_per_thread)::value, ROUTE>
        <<<1, THREADS, 0, stream>>>(c.keys, c.n, c.bits, c.digit_mask, c.num_bins, c.block_size,
                                    c.values_out, c.positions_out, c.counts, c.bins,
                                    c.padded_bins);
  };
  if (!ROUTE || c.num_bins <= THREADS) {
    launch(std::integral_constant<int, 1>{});
  } else {
    launch(std::integral_constant<int, kOneBlockMaxBins / THREADS>{});
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool ROUTE, typename KeyT>
void launch_one_block(const OneBlockCall<KeyT>& c) {
  // Four keys per thread and as many threads as that takes (one thread block).
  const auto four_per_thread = [&](auto threads) {
    launch_one_block_as<ROUTE, KeyT, decltype(threads)::value, 4>(c);
  };
  if (c.n <= 128) {
    if constexpr (ROUTE) {
      launch_small_route<KeyT>(c);
    } else {
      launch_one_block_as<ROUTE, KeyT, 128, 1>(c);
    }
  } else if (c.n <= 512) {
    four_per_thread(std::integral_constant<int, 128>{});
  } else if (c.n <= 1024) {
    four_per_thread(std::integral_constant<int, 256>{});
  } else if (c.n <= 2048) {
    four_per_thread(std::integral_constant<int, 512>{});
  } else {
    four_per_thread(std::integral_constant<int, 1024>{});
  }
}

}  // namespace

std::tuple<int64_t, int64_t, int64_t> one_block_limits() {
  return {kOneBlockMaxKeys, kOneBlockMaxBins, kOneBlockMaxBits};
}

std::tuple<torch::Tensor, torch::Tensor> sort_one_block(const torch::Tensor& keys,
                                                        int64_t end_bit) {
  // Contiguous here rather than in Python: free when it already is (the usual case).
  const torch::Tensor x = keys.contiguous();
  check_cuda(x, "x");
  MB_CHECK(x.dim() == 1 && x.numel() <= kOneBlockMaxKeys,
           "megablocks_cuda.sort_one_block: expected at most ", kOneBlockMaxKeys, " 1-D keys");
  MB_CHECK(end_bit >= 0 && end_bit <= kOneBlockMaxBits,
           "megablocks_cuda.sort_one_block: end_bit must lie in [0, ", kOneBlockMaxBits, "]");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  auto values = empty_1d(x, n, x.scalar_type());
  auto indices = empty_1d(x, n, x.scalar_type());
  if (n == 0) return {values, indices};
  // end_bit 0: every digit is 0 (the identity order); the radix sort still needs one bit.
  const int bits = std::max<int>(static_cast<int>(end_bit), 1);
  const uint32_t mask = (1u << end_bit) - 1;
  MB_DISPATCH_INTS(x.scalar_type(), "megablocks_cuda.sort_one_block", [&] {
    launch_one_block<false, scalar_t>({x.data_ptr<scalar_t>(), static_cast<int>(n), bits, mask,
                                       /*num_bins=*/0, /*block_size=*/1,
                                       values.data_ptr<scalar_t>(), indices.data_ptr<scalar_t>(),
                                       nullptr, nullptr, nullptr});
  });
  return {values, indices};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
route_one_block(const torch::Tensor& ids, int64_t num_experts, int64_t block_size) {
  const torch::Tensor top_experts = ids.contiguous();
  check_cuda(top_experts, "top_experts");
  MB_CHECK(top_experts.dim() == 1 && top_experts.numel() <= kOneBlockMaxKeys,
           "megablocks_cuda.route_one_block: expected at most ", kOneBlockMaxKeys, " 1-D ids");
  MB_CHECK(num_experts >= 1 && num_experts <= kOneBlockMaxBins,
           "megablocks_cuda.route_one_block: num_experts must lie in [1, ", kOneBlockMaxBins, "]");
  MB_CHECK(block_size >= 1, "megablocks_cuda.route_one_block: block_size must be >= 1");
  const c10::cuda::CUDAGuard guard(top_experts.device());
  const int64_t n = top_experts.numel();
  auto indices = empty_1d(top_experts, n, top_experts.scalar_type());
  auto bin_ids = empty_1d(top_experts, n, top_experts.scalar_type());
  auto counts = empty_1d(top_experts, num_experts, at::kInt);
  auto bins = empty_1d(top_experts, num_experts, at::kInt);
  auto padded_bins = empty_1d(top_experts, num_experts, at::kInt);
  // Digits 0..num_experts (num_experts: an id out of range) need bit_length(num_experts) bits.
  const int bits = 64 - __builtin_clzll(static_cast<unsigned long long>(num_experts));
  // One launch even without ids: the kernel writes the all-zero counts and sums.
  MB_DISPATCH_INTS(top_experts.scalar_type(), "megablocks_cuda.route_one_block", [&] {
    launch_one_block<true, scalar_t>(
        {top_experts.data_ptr<scalar_t>(), static_cast<int>(n), bits, /*digit_mask=*/0,
         static_cast<int>(num_experts), block_size, bin_ids.data_ptr<scalar_t>(),
         indices.data_ptr<scalar_t>(), counts.data_ptr<int32_t>(), bins.data_ptr<int32_t>(),
         padded_bins.data_ptr<int32_t>()});
  });
  return {indices, bin_ids, counts, bins, padded_bins};
}

torch::Tensor histogram(const torch::Tensor& x, int64_t num_bins) {
  // x is (rows, n): the Python side views 1-D keys as one row.
  check_cuda(x, "x");
  MB_CHECK(x.dim() == 2, "megablocks_cuda.histogram: expected (rows, n) keys");
  MB_CHECK(num_bins <= INT32_MAX, "megablocks_cuda.histogram: too many bins");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), n = x.size(1);
  auto counts = torch::zeros({rows, num_bins}, x.options().dtype(torch::kInt32));
  if (rows == 0 || n == 0 || num_bins == 0) return counts;
  auto stream = at::cuda::getCurrentCUDAStream();
  const int bins = static_cast<int>(num_bins);
  const size_t shared = bins <= kSharedHistogramBins ? bins * sizeof(int32_t) : 0;
  // Enough blocks to fill the GPU, but not so many that the per-block flush dominates.
  const dim3 grid(blocks_for(n, kThreads * 8, 1024), static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  MB_DISPATCH_INTS(x.scalar_type(), "megablocks_cuda.histogram", [&] {
    histogram_kernel<scalar_t><<<grid, kThreads, shared, stream>>>(
        x.data_ptr<scalar_t>(), rows, n, counts.data_ptr<int32_t>(), bins);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return counts;
}

torch::Tensor cumsum(const torch::Tensor& x, bool inclusive) {
  // x is (rows, n), scanned along n: the Python side moves the summed dim last.
  check_cuda(x, "x");
  MB_CHECK(x.dim() == 2, "megablocks_cuda.cumsum: expected (rows, n)");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = torch::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  if (x.numel() == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  MB_DISPATCH_INTS(x.scalar_type(), "megablocks_cuda.cumsum", [&] {
    if (rows == 1 && n <= INT32_MAX) {
      with_cub_temp(x, [&](void* temp, size_t& bytes) {
        return scan_row<scalar_t>(temp, bytes, x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                  static_cast<int>(n), inclusive, stream);
      });
    } else {
      MB_CHECK(rows <= INT32_MAX, "megablocks_cuda.cumsum: too many rows");
      scan_rows_kernel<scalar_t><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, inclusive);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return out;
}

torch::Tensor topology(const torch::Tensor& padded_bins, int64_t block_size, int64_t block_rows,
                       int64_t block_columns) {
  check_cuda(padded_bins, "padded_bins");
  const c10::cuda::CUDAGuard guard(padded_bins.device());
  auto out = torch::empty({block_rows * block_columns}, padded_bins.options().dtype(torch::kInt16));
  if (out.numel() == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  MB_DISPATCH_INTS(padded_bins.scalar_type(), "megablocks_cuda.topology", [&] {
    topology_kernel<scalar_t><<<blocks_for(out.numel()), kThreads, 0, stream>>>(
        padded_bins.data_ptr<scalar_t>(), padded_bins.numel(), block_size, block_rows,
        block_columns, out.data_ptr<int16_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

torch::Tensor replicate(const torch::Tensor& x, const torch::Tensor& bins, int64_t num_outputs) {
  check_cuda(x, "x");
  check_cuda(bins, "bins");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), num_bins = x.size(1);
  auto out = torch::empty({batch, num_outputs}, x.options());
  if (out.numel() == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  check_dispatched(x.scalar_type(), "megablocks_cuda.replicate", /*integers=*/true);
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "megablocks_cuda.replicate", [&] {
    using value_t = scalar_t;
    MB_DISPATCH_INTS(bins.scalar_type(), "megablocks_cuda.replicate", [&] {
      replicate_kernel<value_t, scalar_t><<<blocks_for(out.numel()), kThreads, 0, stream>>>(
          x.data_ptr<value_t>(), bins.data_ptr<scalar_t>(), num_bins, batch, num_outputs,
          out.data_ptr<value_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

torch::Tensor replicate_backward(const torch::Tensor& grad, const torch::Tensor& bins) {
  check_cuda(grad, "grad");
  check_cuda(bins, "bins");
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t batch = grad.size(0), rows = grad.size(1), num_bins = bins.numel();
  if (rows == 0) return torch::zeros({batch, num_bins}, grad.options());  // every bin sums to 0
  auto out = torch::empty({batch, num_bins}, grad.options());
  if (out.numel() == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  const int blocks = static_cast<int>(std::min<int64_t>(batch * num_bins, 1 << 20));
  check_dispatched(grad.scalar_type(), "megablocks_cuda.replicate_backward");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(),
                                  "megablocks_cuda.replicate_backward", [&] {
    using value_t = scalar_t;
    // float32 accumulation, float64 for float64 data (the contract).
    using acc_t = std::conditional_t<std::is_same_v<value_t, double>, double, float>;
    MB_DISPATCH_INTS(bins.scalar_type(), "megablocks_cuda.replicate_backward", [&] {
      replicate_backward_kernel<value_t, acc_t, scalar_t><<<blocks, kThreads, 0, stream>>>(
          grad.data_ptr<value_t>(), bins.data_ptr<scalar_t>(), num_bins, batch, rows,
          out.data_ptr<value_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

void zero_empty_groups(torch::Tensor& out, const torch::Tensor& counts) {
  check_cuda(out, "out");
  check_cuda(counts, "counts");
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t groups = counts.numel();
  if (out.numel() == 0 || groups == 0) return;
  const int64_t slice = out.numel() / groups;
  auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(blocks_for(slice, kThreads * 4, 64), static_cast<unsigned>(std::min<int64_t>(groups, 65535)));
  check_dispatched(out.scalar_type(), "megablocks_cuda.zero_empty_groups");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(),
                                  "megablocks_cuda.zero_empty_groups", [&] {
    using value_t = scalar_t;
    MB_DISPATCH_INTS(counts.scalar_type(), "megablocks_cuda.zero_empty_groups", [&] {
      zero_empty_groups_kernel<value_t, scalar_t><<<grid, kThreads, 0, stream>>>(
          out.data_ptr<value_t>(), counts.data_ptr<scalar_t>(), groups, slice);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void zero_uncovered_rows(torch::Tensor& out, const torch::Tensor& ends) {
  check_cuda(out, "out");
  check_cuda(ends, "ends");
  MB_CHECK(out.dim() == 2, "megablocks_cuda.zero_uncovered_rows: expected a (rows, cols) output");
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t groups = ends.numel();
  if (out.numel() == 0 || groups == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  const int blocks = blocks_for(out.numel(), kThreads * 4, 1024);
  check_dispatched(out.scalar_type(), "megablocks_cuda.zero_uncovered_rows");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(),
                                  "megablocks_cuda.zero_uncovered_rows", [&] {
    using value_t = scalar_t;
    MB_DISPATCH_INTS(ends.scalar_type(), "megablocks_cuda.zero_uncovered_rows", [&] {
      zero_uncovered_rows_kernel<value_t, scalar_t><<<blocks, kThreads, 0, stream>>>(
          out.data_ptr<value_t>(), ends.data_ptr<scalar_t>(), groups, out.size(0), out.size(1));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

bool has_kernel_image(int64_t device_index) {
  // False when this build has no code for the device's architecture (e.g. an ahead-of-time
  // build for sm_90 on an sm_80 GPU): the capability check then rejects the routing kernels.
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, iota_kernel<int32_t>);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // clear the (non-sticky) error so later launches are unaffected
    return false;
  }
  return true;
}

}  // namespace megablocks_cuda
