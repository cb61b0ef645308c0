"""The low-precision ops in plain PyTorch: quantization as the core defines it, and the scaled
grouped GEMMs as float32 GEMMs of the dequantized operands (each product exact, the sums in
float32, rounded once), independent of any other backend's kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from megablocks_core.plugin import (
    SCALED_FORMATS,
    dequantize_definition,
    encoding_of,
    out_dtype_of,
    quantize_definition,
    quantize_transposed_definition,
)

from .kernels import _gather_rows, _groups, _sizes_from_bins, _token_major, gmm


def quantize(
    x: Tensor, reduce_dim: int, format: str, encoding: str | None
) -> tuple[Tensor, Tensor]:
    fmt = SCALED_FORMATS[format]
    block = fmt.block(x.dim(), reduce_dim)
    return quantize_definition(x, block, encoding_of(encoding, x.device), fmt.power_of_two)


def quantize_both_ways(
    x: Tensor, format: str, encoding: str | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    data, scale = quantize(x, 2, format, encoding)
    data_t, scale_t = quantize(x.transpose(1, 2), 2, format, encoding)
    return data, scale, data_t, scale_t


def quantize_transposed(
    x: Tensor, batch_sizes: Tensor, format: str, encoding: str | None
) -> tuple[Tensor, Tensor]:
    sizes = [size for _, size in _groups(batch_sizes, x.shape[0])]
    code = encoding_of(encoding, x.device)
    return quantize_transposed_definition(x, sizes, code, SCALED_FORMATS[format].power_of_two)


def gather_quantize_transposed(
    x: Tensor,
    indices: Tensor,
    weights: Tensor | None,
    top_k: int,
    batch_sizes: Tensor,
    rows: int | None,
    format: str,
    encoding: str | None,
) -> tuple[Tensor, Tensor]:
    return quantize_transposed(
        _gather_rows(x, indices, weights, top_k, rows), batch_sizes, format, encoding
    )


def scaled_gmm_weight_grad(
    a: Tensor,
    a_scale: Tensor,
    grad: Tensor,
    grad_scale: Tensor,
    batch_sizes: Tensor,
    format: str,
    out_dtype: str | None,
) -> Tensor:
    out = torch.zeros(
        batch_sizes.shape[0], a.shape[0], grad.shape[0], dtype=torch.float32, device=a.device
    )
    for expert, (start, size) in enumerate(_groups(batch_sizes, a.shape[1])):
        if size:  # an empty expert keeps its exact zeros, whatever its scales
            rows = slice(start, start + size)
            x = a[:, rows].float() * a_scale[expert, :, None]
            dy = grad[:, rows].float() * grad_scale[expert, :, None]
            out[expert] = x @ dy.t()
    return _out(out, out_dtype)


def _dequantized(data: Tensor, scale: Tensor, format: str, reduce_dim: int) -> Tensor:
    return dequantize_definition(data, scale, SCALED_FORMATS[format].block(data.dim(), reduce_dim))


def _operands(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, trans_b: bool, format: str
) -> tuple[Tensor, Tensor]:
    return (
        _dequantized(a, a_scale, format, 1),
        _dequantized(b, b_scale, format, 2 if trans_b else 1),
    )


def _out(values: Tensor, out_dtype: str | None) -> Tensor:
    return values.to(out_dtype_of(out_dtype))


def scaled_gmm(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    batch_sizes: Tensor,
    trans_b: bool,
    format: str,
    out_dtype: str | None,
) -> Tensor:
    rows, matrices = _operands(a, a_scale, b, b_scale, trans_b, format)
    return _out(gmm(rows, matrices, batch_sizes, trans_b), out_dtype)


def scaled_gather_gmm(
    x: Tensor,
    x_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    top_k: int,
    trans_b: bool,
    rows: int | None,
    format: str,
    out_dtype: str | None,
) -> Tensor:
    tokens, matrices = _operands(x, x_scale, b, b_scale, trans_b, format)
    gathered = _gather_rows(tokens, indices, None, top_k, rows)
    sizes = _sizes_from_bins(bins, gathered.shape[0])
    return _out(gmm(gathered, matrices, sizes, trans_b), out_dtype)


def scaled_gmm_scatter(
    x: Tensor,
    x_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Tensor | None,
    bins: Tensor,
    top_k: int,
    trans_b: bool,
    rows: int | None,
    format: str,
    out_dtype: str | None,
) -> Tensor:
    sorted_rows, matrices = _operands(x, x_scale, b, b_scale, trans_b, format)
    product = gmm(sorted_rows, matrices, _sizes_from_bins(bins, sorted_rows.shape[0]), trans_b)
    product = _out(product, out_dtype)  # each product row rounded, as the contract says
    if rows is not None and rows < indices.shape[0]:  # the pairs past rows have no product
        product = torch.cat([product, product.new_zeros(indices.shape[0] - rows, product.shape[1])])
    by_token = _token_major(product, indices).float()
    if weights is not None:
        by_token = by_token * weights.float()[:, None]
    tokens = indices.shape[0] // top_k
    return _out(by_token.view(tokens, top_k, product.shape[1]).sum(1), out_dtype)
