// Device kernels of the megablocks-cuda routing ops.
//
// Torch-free on purpose: this header only needs CUDA and CUB, so it can be syntax-checked with a
// bare `nvcc -x cu -c` and reused outside the extension. routing.cu does the torch plumbing
// (allocation, dtype dispatch, the current stream) and calls the launchers below.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cub/cub.cuh>
#include <cuda_runtime.h>

namespace megablocks_cuda {

constexpr int kThreads = 256;
// Histograms with up to this many bins count in shared memory (16 KiB), then flush with one
// global atomic per non-empty bin; beyond it every key does a global atomic.
constexpr int kSharedHistogramBins = 4096;

inline int blocks_for(int64_t items, int64_t per_block = kThreads, int64_t cap = 65535) {
  int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

// Number of entries e in [0, n) with ends[e] <= position (ends is nondecreasing):
// the segment that holds `position`, as torch.searchsorted(ends, position, right=True).
template <typename IndexT>
__device__ __forceinline__ int64_t segment_of(const IndexT* ends, int64_t n, int64_t position) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    int64_t mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(ends[mid]) <= position) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// ------------------------------------------------------------------ sort

// Stable radix sort of (key, position) pairs over bits [0, end_bit) only: keys are known to lie
// in [0, 2**end_bit), so e.g. 8 experts need one 3-bit pass instead of a full-width sort.
// Two-phase like every CUB device call: temp == nullptr only sizes `temp_bytes`.
template <typename KeyT>
cudaError_t sort_pairs(void* temp, size_t& temp_bytes, const KeyT* keys_in, KeyT* keys_out,
                       const KeyT* values_in, KeyT* values_out, int n, int end_bit,
                       cudaStream_t stream) {
  return cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, values_in,
                                         values_out, n, 0, end_bit, stream);
}

template <typename T>
__global__ void iota_kernel(T* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = static_cast<T>(i);
  }
}

// ------------------------------------------------------------------ one-block sort and route

// Decode-sized calls (up to kOneBlockMaxKeys keys) sort inside one thread block: keys in
// registers, CUB's block radix sort through shared memory, one launch and no scratch memory. At
// these sizes a call's cost is its host work and launch, not the sort.

// route's histogram and scans run in shared memory over at most this many experts.
constexpr int kOneBlockMaxBins = 1024;
// The most keys one block takes (1024 threads x 4 keys), and the widest digit it sorts by.
constexpr int64_t kOneBlockMaxKeys = 1024 * 4;
constexpr int kOneBlockMaxBits = 16;

// Stable sort of one block's keys by a small digit, carrying each key's position.
//
// sort (ROUTE false): digit = key's bits [0, bits) (the contract keeps keys in [0, 2**bits); an
// out-of-range key sorts by its low bits: still a permutation). route (ROUTE true): digit = the
// expert id, or num_bins for an id outside [0, num_bins) (sorted after every valid id, in input
// order, and not counted); also writes the per-expert counts, their inclusive sum and the
// inclusive sum of the counts rounded up to block_size. Slots past n hold the largest digit, so
// the block radix sort, stable in the blocked arrangement, keeps them after every real key.
// Positions always lie in [0, n): no key, however bad, makes an access leave its tensor.
// route counts and sums BINS bins per thread: the launch picks BINS * THREADS >= num_bins (one
// bin per thread when the experts fit, so few-expert calls do not scan kOneBlockMaxBins).
template <typename KeyT, int THREADS, int ITEMS, int BINS, bool ROUTE>
__global__ void __launch_bounds__(THREADS)
    one_block_sort_kernel(const KeyT* keys, int n, int bits, uint32_t digit_mask, int num_bins,
                          int64_t block_size, KeyT* values_out, KeyT* positions_out,
                          int32_t* counts, int32_t* bins, int32_t* padded_bins) {
  using Sort = cub::BlockRadixSort<uint32_t, THREADS, ITEMS, int32_t>;
  using Scan = cub::BlockScan<int32_t, THREADS>;
  constexpr int kBinsPerThread = ROUTE ? BINS : 1;
  __shared__ union {
    typename Sort::TempStorage sort;
    typename Scan::TempStorage scan;
  } temp;
  __shared__ int32_t histogram[ROUTE ? BINS * THREADS : 1];

  if (ROUTE) {
    for (int b = threadIdx.x; b < BINS * THREADS; b += THREADS) histogram[b] = 0;
    __syncthreads();
  }
  const uint32_t last_digit = (1u << bits) - 1;
  uint32_t digit[ITEMS];
  int32_t position[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x * ITEMS + j;
    position[j] = i;
    digit[j] = last_digit;
    if (i < n) {
      const int64_t key = static_cast<int64_t>(keys[i]);
      if (ROUTE) {
        const bool valid = key >= 0 && key < num_bins;
        digit[j] = valid ? static_cast<uint32_t>(key) : static_cast<uint32_t>(num_bins);
        if (valid) atomicAdd(&histogram[key], 1);
      } else {
        digit[j] = static_cast<uint32_t>(key) & digit_mask;
      }
    }
  }
  Sort(temp.sort).Sort(digit, position, 0, bits);
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int rank = threadIdx.x * ITEMS + j;
    if (rank < n) {
      values_out[rank] = keys[position[j]];
      positions_out[rank] = static_cast<KeyT>(position[j]);
    }
  }
  if (!ROUTE) return;

  __syncthreads();  // the histogram is complete, and the sort's shared memory is free again
  int32_t count[kBinsPerThread], rounded[kBinsPerThread], total[kBinsPerThread];
#pragma unroll
  for (int q = 0; q < kBinsPerThread; ++q) {
    const int b = threadIdx.x * kBinsPerThread + q;
    count[q] = b < num_bins ? histogram[b] : 0;
    // int64 first: block_size may exceed int32; the stored sums wrap like an int32 cumsum would.
    rounded[q] = static_cast<int32_t>((count[q] + block_size - 1) / block_size * block_size);
  }
  Scan(temp.scan).InclusiveSum(count, total);
#pragma unroll
  for (int q = 0; q < kBinsPerThread; ++q) {
    const int b = threadIdx.x * kBinsPerThread + q;
    if (b < num_bins) {
      counts[b] = count[q];
      bins[b] = total[q];
    }
  }
  __syncthreads();  // before the scan's shared memory is used again
  Scan(temp.scan).InclusiveSum(rounded, total);
#pragma unroll
  for (int q = 0; q < kBinsPerThread; ++q) {
    const int b = threadIdx.x * kBinsPerThread + q;
    if (b < num_bins) padded_bins[b] = total[q];
  }
}

// Lanes of this warp whose value equals v (every lane of the warp takes part).
__device__ __forceinline__ unsigned lanes_equal(unsigned v) {
#if __CUDA_ARCH__ >= 700
  return __match_any_sync(0xffffffffu, v);
#else
  unsigned lanes = 0;
  for (int lane = 0; lane < 32; ++lane) {
    if (__shfl_sync(0xffffffffu, v, lane) == v) lanes |= 1u << lane;
  }
  return lanes;
#endif
}

// The most ids the small route takes: one per thread of one block.
constexpr int kSmallRouteThreads = 128;

// route of at most kSmallRouteThreads ids (a few decoded tokens) as a counting sort in one pass,
// where the block radix sort takes a pass per 4-bit digit. Each warp finds the lanes holding the
// same expert; an id's sorted position is its expert's start (the exclusive sum of the counts),
// plus the equal ids of earlier warps, plus those of earlier lanes: stable, as the contract
// requires. Digits as in one_block_sort_kernel (num_bins: an id out of range, sorted last in
// input order, not counted); BINS bins per thread in the scans (BINS * 128 >= num_bins).
template <typename KeyT, int BINS>
__global__ void __launch_bounds__(kSmallRouteThreads)
    small_route_kernel(const KeyT* keys, int n, int num_bins, int64_t block_size,
                       KeyT* values_out, KeyT* positions_out, int32_t* counts, int32_t* bins,
                       int32_t* padded_bins) {
  constexpr int kWarps = kSmallRouteThreads / 32;
  constexpr int kDigits = kOneBlockMaxBins + 1;  // the experts and the out-of-range digit
  using Scan = cub::BlockScan<int32_t, kSmallRouteThreads>;
  __shared__ typename Scan::TempStorage scan;
  // Per warp and digit: its ids' count, then the count of the warps before it.
  __shared__ int32_t warp_counts[kWarps][kDigits];
  // Per digit: its count, then its first sorted position.
  __shared__ int32_t start[kDigits];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int d = tid; d <= num_bins; d += kSmallRouteThreads) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) warp_counts[w][d] = 0;
  }
  __syncthreads();
  KeyT key = 0;
  unsigned digit = 0xffffffffu;  // no id: never equal to a digit
  if (tid < n) {
    key = keys[tid];
    const int64_t id = static_cast<int64_t>(key);
    digit = id >= 0 && id < num_bins ? static_cast<unsigned>(id) : static_cast<unsigned>(num_bins);
  }
  const unsigned equal = lanes_equal(digit);
  const int earlier_lanes = __popc(equal & ((1u << lane) - 1));
  if (tid < n && earlier_lanes == 0) warp_counts[warp][digit] = __popc(equal);
  __syncthreads();
  for (int d = tid; d <= num_bins; d += kSmallRouteThreads) {
    int32_t run = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int32_t c = warp_counts[w][d];
      warp_counts[w][d] = run;
      run += c;
    }
    start[d] = run;
  }
  __syncthreads();
  int32_t count[BINS], rounded[BINS], total[BINS];
#pragma unroll
  for (int q = 0; q < BINS; ++q) {
    const int b = tid * BINS + q;
    count[q] = b < num_bins ? start[b] : 0;
    // int64 first: block_size may exceed int32; the stored sums wrap like an int32 cumsum would.
    rounded[q] = static_cast<int32_t>((count[q] + block_size - 1) / block_size * block_size);
  }
  int32_t routed;
  Scan(scan).InclusiveSum(count, total, routed);
  __syncthreads();  // every count is read before the starts replace them, and the scan is done
#pragma unroll
  for (int q = 0; q < BINS; ++q) {
    const int b = tid * BINS + q;
    if (b < num_bins) {
      counts[b] = count[q];
      bins[b] = total[q];
      start[b] = total[q] - count[q];
    }
  }
  if (tid == 0) start[num_bins] = routed;  // out-of-range ids follow every routed one
  Scan(scan).InclusiveSum(rounded, total);
#pragma unroll
  for (int q = 0; q < BINS; ++q) {
    const int b = tid * BINS + q;
    if (b < num_bins) padded_bins[b] = total[q];
  }
  __syncthreads();
  if (tid < n) {
    const int position = start[digit] + warp_counts[warp][digit] + earlier_lanes;
    values_out[position] = key;
    positions_out[position] = static_cast<KeyT>(tid);
  }
}

// ------------------------------------------------------------------ histogram

// grid: (blocks per row, rows; rows past 65535 loop). Keys are range-checked before any narrowing
// cast, so a large int64 key can never wrap into [0, num_bins).
template <typename KeyT>
__global__ void histogram_kernel(const KeyT* keys, int64_t rows, int64_t n, int32_t* counts,
                                 int num_bins) {
  extern __shared__ int32_t local[];
  const bool shared = num_bins <= kSharedHistogramBins;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const KeyT* row = keys + r * n;
    int32_t* row_counts = counts + r * num_bins;
    if (shared) {
      for (int b = threadIdx.x; b < num_bins; b += blockDim.x) local[b] = 0;
      __syncthreads();
    }
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
      const int64_t key = static_cast<int64_t>(row[i]);
      if (key < 0 || key >= num_bins) continue;
      if (shared) atomicAdd(&local[key], 1); else atomicAdd(&row_counts[key], 1);
    }
    if (shared) {
      __syncthreads();
      for (int b = threadIdx.x; b < num_bins; b += blockDim.x) {
        if (local[b]) atomicAdd(&row_counts[b], local[b]);
      }
      __syncthreads();  // local is cleared again for the next row
    }
  }
}

// ------------------------------------------------------------------ cumsum

// One row: CUB's single-pass decoupled look-back scan.
template <typename T>
cudaError_t scan_row(void* temp, size_t& temp_bytes, const T* in, T* out, int n, bool inclusive,
                     cudaStream_t stream) {
  return inclusive ? cub::DeviceScan::InclusiveSum(temp, temp_bytes, in, out, n, stream)
                   : cub::DeviceScan::ExclusiveSum(temp, temp_bytes, in, out, n, stream);
}

// Carries the running total of the chunks already scanned into the next BlockScan.
template <typename T>
struct RunningPrefix {
  T total;
  __device__ T operator()(T chunk_sum) {
    T before = total;
    total += chunk_sum;
    return before;
  }
};

// Several rows (batched counts): one block per row, chunk by chunk. Rows are short in practice
// (experts), so a block per row beats one device-wide scan launch per row.
template <typename T>
__global__ void scan_rows_kernel(const T* in, T* out, int64_t n, bool inclusive) {
  using BlockScan = cub::BlockScan<T, kThreads>;
  __shared__ typename BlockScan::TempStorage storage;
  const T* row_in = in + int64_t(blockIdx.x) * n;
  T* row_out = out + int64_t(blockIdx.x) * n;
  RunningPrefix<T> prefix{T(0)};
  for (int64_t base = 0; base < n; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    T value = i < n ? row_in[i] : T(0);
    T result;
    if (inclusive) BlockScan(storage).InclusiveSum(value, result, prefix);
    else BlockScan(storage).ExclusiveSum(value, result, prefix);
    __syncthreads();  // storage is reused by the next chunk
    if (i < n) row_out[i] = result;
  }
}

// ------------------------------------------------------------------ topology

// Block-row r belongs to the expert e with padded_bins[e-1] // bs <= r < padded_bins[e] // bs and
// gets columns e * columns + [0, columns).
template <typename IndexT>
__global__ void topology_kernel(const IndexT* padded_bins, int64_t experts, int64_t block_size,
                                int64_t block_rows, int64_t columns, int16_t* out) {
  const int64_t total = block_rows * columns;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / columns;
    // #{e : padded_bins[e] // bs <= r} == #{e : padded_bins[e] < (r + 1) * bs} (non-negative bins)
    const int64_t expert = segment_of(padded_bins, experts, (r + 1) * block_size - 1);
    out[i] = static_cast<int16_t>(expert * columns + i % columns);
  }
}

// ------------------------------------------------------------------ replicate

// out[b, j] = x[b, e] for the bin e holding column j; columns past bins[-1] get 0.
template <typename T, typename IndexT>
__global__ void replicate_kernel(const T* x, const IndexT* bins, int64_t num_bins, int64_t batch,
                                 int64_t num_outputs, T* out) {
  const int64_t total = batch * num_outputs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / num_outputs;
    const int64_t e = segment_of(bins, num_bins, i % num_outputs);
    out[i] = e < num_bins ? x[b * num_bins + e] : T(0);
  }
}

// One block per (row, bin): a deterministic block reduction of the bin's columns in AccT.
template <typename T, typename AccT, typename IndexT>
__global__ void replicate_backward_kernel(const T* grad, const IndexT* bins, int64_t num_bins,
                                          int64_t batch, int64_t rows, T* out) {
  using BlockReduce = cub::BlockReduce<AccT, kThreads>;
  __shared__ typename BlockReduce::TempStorage storage;
  for (int64_t task = blockIdx.x; task < batch * num_bins; task += gridDim.x) {
    const int64_t b = task / num_bins, e = task % num_bins;
    int64_t start = e == 0 ? 0 : static_cast<int64_t>(bins[e - 1]);
    int64_t end = static_cast<int64_t>(bins[e]);
    start = start < 0 ? 0 : start;
    end = end > rows ? rows : end;
    AccT sum = AccT(0);
    for (int64_t j = start + threadIdx.x; j < end; j += blockDim.x) {
      sum += static_cast<AccT>(grad[b * rows + j]);
    }
    sum = BlockReduce(storage).Sum(sum);
    if (threadIdx.x == 0) out[task] = static_cast<T>(sum);
    __syncthreads();  // storage is reused by the next task
  }
}

// ------------------------------------------------------------------ grouped GEMM helper

// Zero out[e] (each `slice` elements) for every group with counts[e] == 0. Blocks of non-empty
// groups return at once, so this costs a launch, not a pass over the whole output.
template <typename T, typename CountT>
__global__ void zero_empty_groups_kernel(T* out, const CountT* counts, int64_t groups,
                                         int64_t slice) {
  for (int64_t e = blockIdx.y; e < groups; e += gridDim.y) {
    if (counts[e] != 0) continue;
    T* base = out + e * slice;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < slice;
         i += int64_t(gridDim.x) * blockDim.x) {
      base[i] = T(0);
    }
  }
}

// Zero rows [ends[groups - 1], rows) of a row-major (rows, cols) output: the rows no group covers
// when device-side group sizes (unchecked outside checked mode) add up to fewer than `rows`.
// The end is clamped to [0, rows]; on valid sizes it equals `rows` and no thread writes anything.
template <typename T, typename EndT>
__global__ void zero_uncovered_rows_kernel(T* out, const EndT* ends, int64_t groups, int64_t rows,
                                           int64_t cols) {
  int64_t covered = static_cast<int64_t>(ends[groups - 1]);
  covered = covered < 0 ? 0 : (covered > rows ? rows : covered);
  const int64_t total = rows * cols;
  for (int64_t i = covered * cols + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = T(0);
  }
}

}  // namespace megablocks_cuda
