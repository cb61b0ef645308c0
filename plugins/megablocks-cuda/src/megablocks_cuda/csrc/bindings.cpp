// Python bindings of the megablocks-cuda extension (module megablocks_cuda._C, or the JIT build).
#include <torch/extension.h>

#include "permutation.h"
#include "routing.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megablocks-cuda kernels (CUB radix sort and scans, histogram, topology, replicate, scatter)";
  m.def("sort", &megablocks_cuda::sort, "stable radix sort of keys over bits [0, end_bit)");
  m.def("sort_one_block", &megablocks_cuda::sort_one_block,
        "sort of up to one_block_limits()[0] keys in one thread block (one launch)");
  m.def("route_one_block", &megablocks_cuda::route_one_block,
        "route (sort, counts and their sums) of up to one_block_limits()[0] ids in one block");
  m.def("one_block_limits", &megablocks_cuda::one_block_limits,
        "(most keys, most experts, widest end_bit) the one-block kernels take");
  m.def("scan_scatter", &megablocks_cuda::scan_scatter,
        "scatter of up to scan_scatter_max_rows() rows in one launch (each block scans indices)",
        pybind11::arg("x"), pybind11::arg("indices"), pybind11::arg("weights"),
        pybind11::arg("top_k"), pybind11::arg("tokens_per_block") = 0);
  m.def("scan_scatter_max_rows", &megablocks_cuda::scan_scatter_max_rows,
        "most rows scan_scatter takes");
  m.def("histogram", &megablocks_cuda::histogram, "int32 counts per row of (rows, n) keys");
  m.def("cumsum", &megablocks_cuda::cumsum, "inclusive or exclusive scan of each row, in x's dtype");
  m.def("topology", &megablocks_cuda::topology, "int16 column indices of the block-sparse weights");
  m.def("replicate", &megablocks_cuda::replicate, "expand one value per bin to the bin's columns");
  m.def("replicate_backward", &megablocks_cuda::replicate_backward, "per-bin sums of columns");
  m.def("zero_empty_groups", &megablocks_cuda::zero_empty_groups,
        "zero out[e] in place where counts[e] == 0");
  m.def("zero_uncovered_rows", &megablocks_cuda::zero_uncovered_rows,
        "zero rows [ends[-1], rows) of a (rows, cols) output in place");
  m.def("has_kernel_image", &megablocks_cuda::has_kernel_image,
        "whether this build has code for the device");
}
