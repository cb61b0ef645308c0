// scatter of a few thousand rows in one launch (variant "scan" of the scatter op).
//
// The plain scatter needs, for every (token, k), the sorted row whose flat id is token*top_k + k:
// the inverse of `indices`. Computed by a kernel of its own, that is a second launch, which at
// small batch sizes costs more host time than both kernels' GPU time. Here each block scans all of
// `indices` (at most kScanScatterMaxRows ids, a few KiB read from L2), keeps the rows of its own
// tokens in shared memory, then sums them: one launch, no scratch tensor, no host sync.
#include <algorithm>
#include <cstdint>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "check.h"
#include "permutation.h"

namespace megablocks_cuda {
namespace {

constexpr int kScanScatterThreads = 256;
// Every block keeps (row, weight) for each of its tokens' copies in shared memory; a block's copies
// never outnumber the call's rows, so this many take at most 48 KiB with float64 weights (the
// default dynamic shared memory limit).
constexpr int64_t kScanScatterMaxRows = 4096;

template <typename T>
struct Accumulator {
  using type = float;
};
template <>
struct Accumulator<double> {
  using type = double;
};

// The weights' dtype is a runtime switch, read once per copy into shared memory (a template
// argument would multiply the instantiations by five for a handful of loads).
enum WeightsKind : int { kNoWeights, kHalf, kBFloat16, kFloat, kDouble };

template <typename AccT>
__device__ __forceinline__ AccT load_weight(const void* weights, int kind, int64_t i) {
  switch (kind) {
    case kHalf:
      return static_cast<AccT>(static_cast<const at::Half*>(weights)[i]);
    case kBFloat16:
      return static_cast<AccT>(static_cast<const at::BFloat16*>(weights)[i]);
    case kFloat:
      return static_cast<AccT>(static_cast<const float*>(weights)[i]);
    case kDouble:
      return static_cast<AccT>(static_cast<const double*>(weights)[i]);
    default:
      return AccT(1);
  }
}

// VEC elements of a row in one access (16 bytes when the row allows it, else one element).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Loads a block issues before it waits on any of them: the index scan's ids per thread, and the
// copies of a token summed per step (latency, not bandwidth, bounds these small calls).
constexpr int kIdsAtOnce = 8;
constexpr int kCopiesAtOnce = 8;

// Block b sums tokens [b * tokens_per_block, ...) over hidden columns split across gridDim.y.
template <typename ScalarT, typename IndexT, int VEC>
__global__ void __launch_bounds__(kScanScatterThreads)
    scan_scatter_kernel(const ScalarT* __restrict__ x, const IndexT* __restrict__ indices,
                        const void* __restrict__ weights, int weights_kind,
                        ScalarT* __restrict__ out, int64_t n, int64_t num_tokens, int top_k,
                        int64_t hidden, int tokens_per_block) {
  using AccT = typename Accumulator<ScalarT>::type;
  extern __shared__ __align__(16) unsigned char shared[];
  // weight first: AccT's alignment (8 for double) is the stricter of the two.
  AccT* weight = reinterpret_cast<AccT*>(shared);
  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * tokens_per_block;
  const int tokens =
      static_cast<int>(std::min<int64_t>(tokens_per_block, num_tokens - first_token));
  const int copies = tokens * top_k;
  int32_t* row_of = reinterpret_cast<int32_t*>(weight + tokens_per_block * top_k);
  const int64_t first_id = first_token * top_k;
  for (int c = threadIdx.x; c < copies; c += blockDim.x) {
    row_of[c] = -1;  // no row names this copy (bad data): it contributes 0
  }
  __syncthreads();
  // The weights' loads go out with the scan's (both wait on memory, neither on the other).
  for (int c = threadIdx.x; c < copies; c += blockDim.x) {
    weight[c] = load_weight<AccT>(weights, weights_kind, first_id + c);
  }
  // Ids outside this block's copies (other tokens', or out of [0, n) altogether) are skipped;
  // where several rows name one copy, whichever store lands last wins (unspecified, as allowed).
  for (int64_t base = threadIdx.x; base < n; base += int64_t(blockDim.x) * kIdsAtOnce) {
    int64_t id[kIdsAtOnce];
#pragma unroll
    for (int i = 0; i < kIdsAtOnce; ++i) {
      const int64_t p = base + int64_t(i) * blockDim.x;
      id[i] = p < n ? static_cast<int64_t>(indices[p]) - first_id : -1;
    }
#pragma unroll
    for (int i = 0; i < kIdsAtOnce; ++i) {
      if (id[i] >= 0 && id[i] < copies) {
        row_of[id[i]] = static_cast<int32_t>(base + int64_t(i) * blockDim.x);
      }
    }
  }
  __syncthreads();
  using PackT = Pack<ScalarT, VEC>;
  const int64_t packs = hidden / VEC;
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.y;
  for (int t = 0; t < tokens; ++t) {
    const int32_t* rows = row_of + t * top_k;
    const AccT* scale = weight + t * top_k;
    PackT* out_row = reinterpret_cast<PackT*>(out + (first_token + t) * hidden);
    for (int64_t j = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; j < packs; j += step) {
      AccT acc[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = AccT(0);
      for (int k0 = 0; k0 < top_k; k0 += kCopiesAtOnce) {
        PackT v[kCopiesAtOnce];
        AccT w[kCopiesAtOnce];
#pragma unroll
        for (int i = 0; i < kCopiesAtOnce; ++i) {
          const int k = k0 + i;
          const int32_t row = k < top_k ? rows[k] : -1;
          w[i] = row < 0 ? AccT(0) : scale[k];
          if (row >= 0) {
            v[i] = reinterpret_cast<const PackT*>(x + static_cast<int64_t>(row) * hidden)[j];
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) v[i].v[e] = ScalarT(0);
          }
        }
#pragma unroll
        for (int i = 0; i < kCopiesAtOnce; ++i) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[e] += w[i] * static_cast<AccT>(v[i].v[e]);
        }
      }
      PackT result;
#pragma unroll
      for (int e = 0; e < VEC; ++e) result.v[e] = static_cast<ScalarT>(acc[e]);
      out_row[j] = result;
    }
  }
}

int weights_kind_of(const std::optional<torch::Tensor>& weights) {
  if (!weights.has_value()) return kNoWeights;
  switch (weights->scalar_type()) {
    case at::kHalf:
      return kHalf;
    case at::kBFloat16:
      return kBFloat16;
    case at::kFloat:
      return kFloat;
    case at::kDouble:
      return kDouble;
    default:
      MB_CHECK(false, "megablocks_cuda.scan_scatter: weights must be a float tensor, not ",
               weights->scalar_type());
  }
}

// Launch shape: a block per token (on the H200 one token per block was the fastest up to 512
// tokens, the most the plugin sends here; more tokens share a block so that the index scans,
// which every block makes, stay a small part of the traffic), and the columns split across
// blocks when there are too few tokens to occupy every SM twice.
struct ScanScatterShape {
  int tokens_per_block;
  int column_blocks;
};

ScanScatterShape shape_for(int64_t num_tokens, int64_t packs, int tokens_per_block) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (tokens_per_block <= 0) {
    tokens_per_block = static_cast<int>(std::clamp<int64_t>(num_tokens / (4 * sms), 1, 8));
  }
  // Never more than the call's tokens: a block's copies then fit the shared memory sized for
  // kScanScatterMaxRows.
  tokens_per_block = static_cast<int>(std::min<int64_t>(tokens_per_block, num_tokens));
  const int64_t token_blocks = (num_tokens + tokens_per_block - 1) / tokens_per_block;
  const int64_t most_columns = (packs + kScanScatterThreads - 1) / kScanScatterThreads;
  const int64_t columns =
      std::clamp<int64_t>((2 * sms) / token_blocks, 1, std::max<int64_t>(most_columns, 1));
  return {tokens_per_block, static_cast<int>(columns)};
}

}  // namespace

int64_t scan_scatter_max_rows() { return kScanScatterMaxRows; }

torch::Tensor scan_scatter(const torch::Tensor& rows, const torch::Tensor& ids,
                           const std::optional<torch::Tensor>& weights_in, int64_t top_k,
                           int64_t tokens_per_block) {
  // Contiguous here rather than in Python: free when it already is (the usual case).
  const torch::Tensor x = rows.contiguous();
  const torch::Tensor indices = ids.contiguous();
  MB_CHECK(x.is_cuda() && indices.is_cuda() && x.device() == indices.device(),
           "megablocks_cuda.scan_scatter: x and indices must be on one CUDA device");
  MB_CHECK(x.dim() == 2 && indices.dim() == 1 && x.size(0) == indices.size(0),
           "megablocks_cuda.scan_scatter: expected x (rows, hidden) and one index per row");
  const int64_t n = indices.numel();
  MB_CHECK(n <= kScanScatterMaxRows, "megablocks_cuda.scan_scatter: at most ",
           kScanScatterMaxRows, " rows, not ", n);
  MB_CHECK(top_k >= 1 && n % top_k == 0,
           "megablocks_cuda.scan_scatter: the rows must be whole tokens of top_k >= 1 copies");
  std::optional<torch::Tensor> weights;
  if (weights_in.has_value()) {
    weights = weights_in->contiguous();
    MB_CHECK(weights->is_cuda() && weights->device() == x.device() && weights->dim() == 1 &&
                 weights->numel() == n,
             "megablocks_cuda.scan_scatter: weights must hold one value per row, on x's device");
  }
  const at::ScalarType index_type = indices.scalar_type();
  MB_CHECK(index_type == at::kShort || index_type == at::kInt || index_type == at::kLong,
           "megablocks_cuda.scan_scatter: indices must be int16, int32 or int64, not ",
           index_type);
  const int kind = weights_kind_of(weights);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t num_tokens = n / top_k;
  const int64_t hidden = x.size(1);
  auto out = torch::Tensor(at::detail::empty_cuda({num_tokens, hidden}, x.scalar_type(),
                                                  x.device(), std::nullopt));
  if (num_tokens == 0 || hidden == 0) return out;
  const void* weights_ptr = weights.has_value() ? weights->data_ptr() : nullptr;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  check_dispatched(x.scalar_type(), "megablocks_cuda.scan_scatter");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "megablocks_cuda.scan_scatter", [&] {
    using ScalarT = scalar_t;
    using AccT = typename Accumulator<ScalarT>::type;
    constexpr int kWide = 16 / sizeof(ScalarT);
    // 16-byte accesses when every row starts on a 16-byte boundary (torch's allocations do).
    const bool wide = hidden % kWide == 0 &&
                      reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
    const ScanScatterShape shape =
        shape_for(num_tokens, wide ? hidden / kWide : hidden, static_cast<int>(tokens_per_block));
    const dim3 grid(static_cast<unsigned>((num_tokens + shape.tokens_per_block - 1) /
                                          shape.tokens_per_block),
                    static_cast<unsigned>(shape.column_blocks));
    const size_t shared =
        static_cast<size_t>(shape.tokens_per_block) * top_k * (sizeof(AccT) + sizeof(int32_t));
    const auto launch = [&](auto index_type, auto vec) {
      using IndexT = decltype(index_type);
      scan_scatter_kernel<ScalarT, IndexT, decltype(vec)::value>
          <<<grid, kScanScatterThreads, shared, stream>>>(
              x.data_ptr<ScalarT>(), indices.data_ptr<IndexT>(), weights_ptr, kind,
              out.data_ptr<ScalarT>(), n, num_tokens, static_cast<int>(top_k), hidden,
              shape.tokens_per_block);
    };
    const auto with_vec = [&](auto index_type) {
      if (wide) {
        launch(index_type, std::integral_constant<int, kWide>{});
      } else {
        launch(index_type, std::integral_constant<int, 1>{});
      }
    };
    switch (index_type) {
      case at::kShort:
        with_vec(int16_t{});
        break;
      case at::kInt:
        with_vec(int32_t{});
        break;
      default:
        with_vec(int64_t{});
        break;
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace megablocks_cuda
