"""The tests' one independent reference for every dispatched op of ``megablocks_core.contracts``.

Written from MegaBlocks' op semantics and the contracts' prose in numpy and plain Python loops,
and never calling megablocks_core or a backend, so it can judge all of them. Functions take
numpy arrays (or anything ``np.asarray`` accepts) in the op's kernel argument order, with None
for an absent optional tensor, and return float64 arrays for float data (every sum accumulated in
float64) and int64 arrays for integers; the caller rounds or casts where it compares.

Also here: the numpy side of building realistic routing inputs (:func:`make_routing`) and of
making float values a dtype stores exactly (:func:`representable`), shared by the test files.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray

# --------------------------------------------------------------------------------------------
# helpers


def _f64(a: Any) -> Array:
    return np.asarray(a, dtype=np.float64)


def _i64(a: Any) -> Array:
    return np.asarray(a, dtype=np.int64)


def start_of(cum: Any, e: int) -> int:
    """Where bin ``e`` starts, given the inclusive cumulative ends ``cum``."""
    return 0 if e == 0 else int(cum[e - 1])


def _weight(weights: Array | None, flat: int) -> float:
    return 1.0 if weights is None else float(weights[flat])


# --------------------------------------------------------------------------------------------
# routing


def sort(x: Any, end_bit: int | None = None) -> tuple[Array, Array]:
    """(values, indices): stable ascending order of the keys (end_bit only bounds the keys)."""
    keys = _i64(x)
    # An insertion sort by hand would be as good; a stable argsort is the definition itself.
    order = np.argsort(keys, kind="stable").astype(np.int64)
    return keys[order], order


def histogram(x: Any, num_bins: int) -> Array:
    """Counts of each value in [0, num_bins) per row (1-D input is one row); others are dropped."""
    keys = _i64(x)
    rows = keys if keys.ndim == 2 else keys.reshape(1, keys.shape[0])
    out = np.zeros((rows.shape[0], num_bins), dtype=np.int64)
    for b, row in enumerate(rows):
        for v in row:
            if 0 <= v < num_bins:
                out[b, v] += 1
    return out.reshape((*keys.shape[:-1], num_bins))


def _cumsum(x: Any, dim: int, exclusive: bool) -> Array:
    values = _i64(x)
    out = np.zeros_like(values)
    moved = np.moveaxis(values, dim, -1)
    res = np.moveaxis(out, dim, -1)  # a view: writing it fills out
    for idx in np.ndindex(moved.shape[:-1]):
        acc = 0
        for j in range(moved.shape[-1]):
            if exclusive:
                res[(*idx, j)] = acc
                acc += int(moved[(*idx, j)])
            else:
                acc += int(moved[(*idx, j)])
                res[(*idx, j)] = acc
    return out


def inclusive_cumsum(x: Any, dim: int) -> Array:
    """out[i] = x[0] + … + x[i] along ``dim``, same shape (a one-element input stays (1,))."""
    return _cumsum(x, dim, exclusive=False)


def exclusive_cumsum(x: Any, dim: int) -> Array:
    """out[0] = 0, out[i] = x[0] + … + x[i - 1] along ``dim``."""
    return _cumsum(x, dim, exclusive=True)


def topology(
    padded_bins: Any, block_size: int, output_block_rows: int, output_block_columns: int
) -> Array:
    """Block-row r of expert e gets column indices e * columns + [0, columns)."""
    padded_bins = _i64(padded_bins)
    cols = output_block_columns
    out = np.zeros(output_block_rows * cols, dtype=np.int64)
    for r in range(output_block_rows):
        owner = None
        for e in range(len(padded_bins)):
            if start_of(padded_bins, e) <= r * block_size < int(padded_bins[e]):
                owner = e
                break
        assert owner is not None, f"block-row {r} lies past padded_bins"
        for j in range(cols):
            out[r * cols + j] = owner * cols + j
    return out


def replicate(x: Any, bins: Any, num_outputs: int) -> Array:
    """out[b, j] = x[b, e] for bins[e-1] <= j < bins[e]; columns past bins[-1] are 0."""
    values = np.asarray(x)
    values = _i64(values) if values.dtype.kind in "iub" else _f64(values)
    out = np.zeros((values.shape[0], num_outputs), dtype=values.dtype)
    for e in range(values.shape[1]):
        for j in range(start_of(bins, e), int(bins[e])):
            out[:, j] = values[:, e]
    return out


def replicate_backward(grad: Any, bins: Any) -> Array:
    """out[b, e] = sum of grad[b, bins[e-1]:bins[e]]; an empty bin is exactly 0."""
    grad = _f64(grad)
    out = np.zeros((grad.shape[0], len(bins)))
    for e in range(len(bins)):
        for j in range(start_of(bins, e), int(bins[e])):
            out[:, e] += grad[:, j]
    return out


def route(
    top_experts: Any, num_experts: int, block_size: int
) -> tuple[Array, Array, Array, Array, Array]:
    """(indices, bin_ids, tokens_per_expert, bins, padded_bins) of a dropless layer."""
    bin_ids, indices = sort(top_experts)
    counts = histogram(top_experts, num_experts)
    padded = np.array([-(-int(c) // block_size) * block_size for c in counts], dtype=np.int64)
    return indices, bin_ids, counts, inclusive_cumsum(counts, 0), inclusive_cumsum(padded, 0)


def router_topk(scores: Any, top_k: int, softmax: bool) -> tuple[Array, Array]:
    """(weights, experts): each row's top_k ids by descending score, NaN above every number and
    equal scores by lower id; weights are the scores or their softmax over the whole row."""
    s = _f64(scores)
    weights = np.zeros((s.shape[0], top_k))
    experts = np.zeros((s.shape[0], top_k), dtype=np.int64)
    for t, row in enumerate(s):
        ranked = sorted(
            range(len(row)),
            key=lambda e: (0, 0.0, e) if np.isnan(row[e]) else (1, -row[e], e),
        )
        if softmax:
            peak = np.max(row)  # NaN if any is NaN; -inf - -inf and inf - inf are NaN too
            with np.errstate(invalid="ignore"):  # those NaN are the definition
                ex = np.exp(row - peak)
                row = ex / ex.sum()
        experts[t] = ranked[:top_k]
        weights[t] = [row[e] for e in ranked[:top_k]]
    return weights, experts


# --------------------------------------------------------------------------------------------
# permutation: sorted row i holds flat id f = indices[i] = token * top_k + k


def gather(x: Any, indices: Any, bin_ids: Any, weights: Any | None, bins: Any, top_k: int) -> Array:
    """out[i] = x[indices[i] // top_k] (times weights[indices[i]])."""
    x = _f64(x)
    w = None if weights is None else _f64(weights)
    out = np.zeros((len(indices), x.shape[1]))
    for i, f in enumerate(_i64(indices)):
        out[i] = x[f // top_k] * _weight(w, f)
    return out


def scatter(
    x: Any, indices: Any, bin_ids: Any, weights: Any | None, bins: Any, top_k: int
) -> Array:
    """out[t] = sum over k of weights[t*top_k + k] * x[i], where indices[i] = t*top_k + k."""
    x = _f64(x)
    w = None if weights is None else _f64(weights)
    out = np.zeros((len(indices) // top_k, x.shape[1]))
    for i, f in enumerate(_i64(indices)):
        out[f // top_k] += x[i] * _weight(w, f)
    return out


def scatter_wgrad(x: Any, grad: Any, indices: Any, bin_ids: Any, bins: Any, top_k: int) -> Array:
    """out[indices[i]] = dot(x[i], grad[indices[i] // top_k])."""
    x, grad = _f64(x), _f64(grad)
    out = np.zeros(len(indices))
    for i, f in enumerate(_i64(indices)):
        out[f] = float(np.dot(x[i], grad[f // top_k]))
    return out


def padded_positions(bin_ids: Any, bins: Any, padded_bins: Any) -> Array:
    """Row of the padded layout that sorted row i of expert e lands on."""
    pos = np.zeros(len(bin_ids), dtype=np.int64)
    for i, e in enumerate(_i64(bin_ids)):
        pos[i] = start_of(padded_bins, e) + (i - start_of(bins, e))
    return pos


def padded_gather(
    x: Any, indices: Any, bin_ids: Any, weights: Any | None, bins: Any, padded_bins: Any, top_k: int
) -> Array:
    """gather into per-expert segments starting at padded_bins[e-1]; padding rows are 0."""
    x = _f64(x)
    w = None if weights is None else _f64(weights)
    rows = int(padded_bins[-1]) if len(padded_bins) else 0
    out = np.zeros((rows, x.shape[1]))
    for i, p in enumerate(padded_positions(bin_ids, bins, padded_bins)):
        f = int(indices[i])
        out[p] = x[f // top_k] * _weight(w, f)
    return out


def padded_scatter(
    x: Any, indices: Any, bin_ids: Any, weights: Any | None, bins: Any, padded_bins: Any, top_k: int
) -> Array:
    """scatter reading the padded row each (token, k) was gathered to; padding is never read."""
    x = _f64(x)
    w = None if weights is None else _f64(weights)
    out = np.zeros((len(indices) // top_k, x.shape[1]))
    for i, p in enumerate(padded_positions(bin_ids, bins, padded_bins)):
        f = int(indices[i])
        out[f // top_k] += x[p] * _weight(w, f)
    return out


def padded_scatter_wgrad(
    x: Any, grad: Any, indices: Any, bin_ids: Any, bins: Any, padded_bins: Any, top_k: int
) -> Array:
    """scatter_wgrad reading padded rows."""
    x, grad = _f64(x), _f64(grad)
    out = np.zeros(len(indices))
    for i, p in enumerate(padded_positions(bin_ids, bins, padded_bins)):
        f = int(indices[i])
        out[f] = float(np.dot(x[p], grad[f // top_k]))
    return out


def binned_slots(bins: Any, bin_size: int) -> list[tuple[int, int, int]]:
    """(expert e, slot j, sorted row i) of every row kept within the capacity bin_size."""
    slots = []
    for e in range(len(bins)):
        start = start_of(bins, e)
        for j in range(min(bin_size, int(bins[e]) - start)):
            slots.append((e, j, start + j))
    return slots


def binned_gather(
    x: Any, indices: Any, weights: Any | None, bins: Any, bin_size: int, top_k: int
) -> Array:
    """(experts, bin_size, hidden), zero-filled; rows beyond bin_size are dropped."""
    x = _f64(x)
    w = None if weights is None else _f64(weights)
    out = np.zeros((len(bins), bin_size, x.shape[1]))
    for e, j, i in binned_slots(bins, bin_size):
        f = int(indices[i])
        out[e, j] = x[f // top_k] * _weight(w, f)
    return out


def binned_scatter(x: Any, indices: Any, weights: Any | None, bins: Any, top_k: int) -> Array:
    """out[t] = sum over the kept k of weights[t*top_k + k] * x[e, j]; dropped rows add 0."""
    x = _f64(x)
    w = None if weights is None else _f64(weights)
    out = np.zeros((len(indices) // top_k, x.shape[2]))
    for e, j, i in binned_slots(bins, x.shape[1]):
        f = int(indices[i])
        out[f // top_k] += x[e, j] * _weight(w, f)
    return out


def binned_scatter_wgrad(x: Any, grad: Any, indices: Any, bins: Any, top_k: int) -> Array:
    """scatter_wgrad for kept rows; dropped rows get exactly 0."""
    x, grad = _f64(x), _f64(grad)
    out = np.zeros(len(indices))
    for e, j, i in binned_slots(bins, x.shape[1]):
        f = int(indices[i])
        out[f] = float(np.dot(x[e, j], grad[f // top_k]))
    return out


# --------------------------------------------------------------------------------------------
# grouped GEMM


def _groups(batch_sizes: Any) -> list[tuple[int, int]]:
    """(start, end) rows of each expert's group."""
    out, start = [], 0
    for size in _i64(batch_sizes).reshape(-1):
        out.append((start, start + int(size)))
        start += int(size)
    return out


def gmm(a: Any, b: Any, batch_sizes: Any, trans_b: bool = False) -> Array:
    """Rows of expert e's group times b[e] (or b[e].T with trans_b)."""
    a, b = _f64(a), _f64(b)
    out = np.zeros((a.shape[0], b.shape[1] if trans_b else b.shape[2]))
    for e, (s, t) in enumerate(_groups(batch_sizes)):
        out[s:t] = a[s:t] @ (b[e].T if trans_b else b[e])
    return out


def gmm_weight_grad(a: Any, grad: Any, batch_sizes: Any) -> Array:
    """out[e] = a[rows of e].T @ grad[rows of e]; an empty expert gets exactly 0."""
    a, grad = _f64(a), _f64(grad)
    groups = _groups(batch_sizes)
    out = np.zeros((len(groups), a.shape[1], grad.shape[1]))
    for e, (s, t) in enumerate(groups):
        out[e] = a[s:t].T @ grad[s:t]
    return out


def gmm_weight_grad_accumulate(a: Any, grad: Any, batch_sizes: Any, out: Any) -> Array:
    """What out holds after ``out[e] += a[rows of e].T @ grad[rows of e]``: out plus one outer
    product per row of its expert's group; an empty expert's out[e] is unchanged."""
    a, grad = _f64(a), _f64(grad)
    result = _f64(out).copy()
    for e, (s, t) in enumerate(_groups(batch_sizes)):
        for row in range(s, t):
            result[e] += np.outer(a[row], grad[row])
    return result


def gmm_backward(
    a: Any, b: Any, grad: Any, batch_sizes: Any, trans_b: bool = False
) -> tuple[Array, Array]:
    """(grad of a, grad of b) of gmm for the output gradient ``grad``."""
    a, b, grad = _f64(a), _f64(b), _f64(grad)
    grad_a = np.zeros_like(a)
    grad_b = np.zeros_like(b)
    for e, (s, t) in enumerate(_groups(batch_sizes)):
        if trans_b:  # out_e = a_e @ b_e.T with b_e (n, k)
            grad_a[s:t] = grad[s:t] @ b[e]
            grad_b[e] = grad[s:t].T @ a[s:t]
        else:  # out_e = a_e @ b_e with b_e (k, n)
            grad_a[s:t] = grad[s:t] @ b[e].T
            grad_b[e] = a[s:t].T @ grad[s:t]
    return grad_a, grad_b


def _expert_of_rows(bins: Any) -> Array:
    """Expert of each sorted row up to bins[-1], from the cumulative bins; the sorted rows past
    bins[-1] (this array's length) belong to no expert and the fused ops skip them."""
    ends = _i64(bins)
    rows = int(ends[-1]) if len(ends) else 0
    return np.searchsorted(ends, np.arange(rows), side="right")


def _matrix(b: Array, e: int, trans_b: bool) -> Array:
    return b[e].T if trans_b else b[e]


def gather_gmm(x: Any, b: Any, indices: Any, bins: Any, top_k: int, trans_b: bool) -> Array:
    """Sorted row i: x[indices[i] // top_k] @ b[e] for the expert e holding row i."""
    x, b = _f64(x), _f64(b)
    experts = _expert_of_rows(bins)
    out = np.zeros((len(indices), b.shape[1] if trans_b else b.shape[2]))
    for i, f in enumerate(_i64(indices)):
        if i < len(experts):  # rows of no expert stay 0
            out[i] = x[f // top_k] @ _matrix(b, experts[i], trans_b)
    return out


def gather_gmm_backward(
    x: Any, b: Any, grad: Any, indices: Any, bins: Any, top_k: int, trans_b: bool
) -> tuple[Array, Array]:
    """(grad of x, grad of b) of gather_gmm, row by row."""
    x, b, grad = _f64(x), _f64(b), _f64(grad)
    experts = _expert_of_rows(bins)
    gx, gb = np.zeros_like(x), np.zeros_like(b)
    for i, f in enumerate(_i64(indices)):
        if i >= len(experts):  # a row of no expert: a constant 0, no gradient flows
            continue
        e, t = experts[i], f // top_k
        gx[t] += grad[i] @ _matrix(b, e, trans_b).T
        if trans_b:
            gb[e] += np.outer(grad[i], x[t])
        else:
            gb[e] += np.outer(x[t], grad[i])
    return gx, gb


def activation(x: Array, name: str | None) -> Array:
    """The expert activations from their textbook formulas (GELU: the tanh approximation)."""
    if name == "gelu":
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "relu":
        return np.maximum(x, 0.0)
    assert name is None, name
    return x


def activation_slope(x: Array, name: str | None) -> Array:
    """d activation(x) / dx, differentiated by hand."""
    if name == "gelu":
        c = np.sqrt(2.0 / np.pi)
        t = np.tanh(c * (x + 0.044715 * x**3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t**2) * c * (1.0 + 3 * 0.044715 * x**2)
    if name == "silu":
        s = 1.0 / (1.0 + np.exp(-x))
        return s * (1.0 + x * (1.0 - s))
    if name == "relu":
        return (x > 0).astype(np.float64)
    assert name is None, name
    return np.ones_like(x)


#: Gated activations: name → the gate's activation of act(gate) * up (glu).
GATED = {"geglu": "gelu", "swiglu": "silu", "reglu": "relu", "bilinear": None}


def activate_rows(x: Array, name: str | None) -> Array:
    """What gmm_scatter applies to its rows: an activation, or a gated one (glu of the halves)."""
    return glu(x, GATED[name]) if name in GATED else activation(x, name)


def activate_rows_backward(grad: Array, x: Array, name: str | None) -> Array:
    """The gradient of :func:`activate_rows` with respect to x, for its output gradient grad."""
    if name in GATED:
        return glu_backward(grad, x, GATED[name])
    return grad * activation_slope(x, name)


def gmm_scatter(
    x: Any,
    b: Any,
    indices: Any,
    weights: Any | None,
    bins: Any,
    top_k: int,
    trans_b: bool,
    act: str | None = None,
) -> Array:
    """out[t] = sum over k of weights[t*top_k + k] * (act(x[i]) @ b[e]), indices[i] = t*top_k + k."""
    x, b = _f64(x), _f64(b)
    x = activate_rows(x, act)
    w = None if weights is None else _f64(weights)
    experts = _expert_of_rows(bins)
    out = np.zeros((len(indices) // top_k, b.shape[1] if trans_b else b.shape[2]))
    for i, f in enumerate(_i64(indices)):
        if i < len(experts):  # a row of no expert adds nothing
            out[f // top_k] += _weight(w, f) * (x[i] @ _matrix(b, experts[i], trans_b))
    return out


def gmm_scatter_backward(
    x: Any,
    b: Any,
    weights: Any | None,
    grad: Any,
    indices: Any,
    bins: Any,
    top_k: int,
    trans_b: bool,
    act: str | None = None,
) -> tuple[Array, Array, Array | None]:
    """(grad of x, grad of b, grad of weights) of gmm_scatter, row by row."""
    pre, b, grad = _f64(x), _f64(b), _f64(grad)
    x = activate_rows(pre, act)
    w = None if weights is None else _f64(weights)
    experts = _expert_of_rows(bins)
    gx, gb = np.zeros_like(pre), np.zeros_like(b)
    gw = None if w is None else np.zeros_like(w)
    for i, f in enumerate(_i64(indices)):
        if i >= len(experts):  # skipped in forward: zero gradients (x's row and the weight)
            continue
        e, t = experts[i], f // top_k
        m = _matrix(b, e, trans_b)
        row_grad = _weight(w, f) * grad[t]  # gradient of row i's product x[i] @ m
        gx[i] = activate_rows_backward(row_grad @ m.T, pre[i], act)
        if trans_b:
            gb[e] += np.outer(row_grad, x[i])
        else:
            gb[e] += np.outer(x[i], row_grad)
        if gw is not None:
            gw[f] = float(np.dot(grad[t], x[i] @ m))
    return gx, gb, gw


# --------------------------------------------------------------------------------------------
# building inputs (numpy side)


def make_routing(
    rng: np.random.Generator,
    T: int,
    K: int,
    E: int,
    block: int = 4,
    empty: bool = False,
    unrouted: int = 0,
) -> dict[str, Any]:
    """Realistic MoE routing metadata, in numpy.

    top_experts (T*K,) -> indices/bin_ids by stable argsort -> tokens_per_expert by
    bincount -> bins (inclusive cumsum) and padded_bins (cumsum of counts rounded up
    to ``block``). ``empty`` leaves the first, the last and every other expert empty.
    ``unrouted`` (token, k) pairs, picked at random, get the sentinel expert E (routed to no
    expert, as expert parallelism routes other ranks' experts): they sort last, are not counted,
    and bins ends before the last sorted row.
    """
    allowed = np.arange(1, E - 1)[::2] if empty and E >= 3 else np.arange(E)
    top = np.zeros((T, K), dtype=np.int64)
    for t in range(T):
        top[t] = rng.choice(allowed, size=K, replace=len(allowed) < K)
    top = top.reshape(-1)
    if unrouted:
        top[rng.choice(T * K, size=unrouted, replace=False)] = E
    indices = np.argsort(top, kind="stable").astype(np.int64)
    bin_ids = top[indices]
    tpe = np.bincount(top, minlength=E + 1)[:E].astype(np.int64)
    bins = np.cumsum(tpe).astype(np.int64)
    padded_tpe = ((tpe + block - 1) // block) * block
    padded_bins = np.cumsum(padded_tpe).astype(np.int64)
    if empty and E >= 3 and T > 0:
        assert tpe[0] == 0 and tpe[-1] == 0
    return dict(
        T=T,
        K=K,
        E=E,
        top=top,
        indices=indices,
        bin_ids=bin_ids,
        tpe=tpe,
        bins=bins,
        padded_bins=padded_bins,
        block=block,
    )


def bf16_round(a: Any) -> Array:
    """Round float values to bfloat16 (nearest-even), in numpy; returns float64."""
    a32 = np.ascontiguousarray(a, dtype=np.float32)
    u = a32.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def representable(a: Any, dtype: Any) -> Array:
    """The float64 values that a float ``dtype`` (a torch dtype or its name) stores for ``a``."""
    a = _f64(a)
    dtype_name = str(dtype).rsplit(".", 1)[-1]
    if dtype_name == "float64":
        return a.copy()
    if dtype_name == "float32":
        return a.astype(np.float32).astype(np.float64)
    if dtype_name == "float16":
        return a.astype(np.float16).astype(np.float64)
    if dtype_name == "bfloat16":
        return bf16_round(a)
    raise ValueError(f"no float dtype named {dtype_name!r}")


def glu(x: Array, name: str | None) -> Array:
    """act(gate) * up for x = [gate | up] (halves of the last dimension)."""
    gate, up = np.split(x, 2, axis=-1)
    return activation(gate, name) * up


def activation_backward(
    grad: Array, x: Array, scale: Array | None, name: str | None, dtype: Any
) -> tuple[Array, Array, Array]:
    """(scale[i] * grad * act'(x), act(x) as ``dtype`` stores it, <that act(x)[i], grad[i]>);
    a gated name: x is [gate | up] and act glu's."""
    act = representable(activate_rows(x, name), dtype)
    factor = np.ones(x.shape[0]) if scale is None else scale
    grad_x = activate_rows_backward(factor[:, None] * grad, x, name)
    return grad_x, act, (act * grad).sum(axis=1)


def glu_backward(grad: Array, x: Array, name: str | None) -> Array:
    """d glu / d x for the output gradient grad: (gate half | up half)."""
    gate, up = np.split(x, 2, axis=-1)
    return np.concatenate(
        (grad * up * activation_slope(gate, name), grad * activation(gate, name)), axis=-1
    )
