"""The core's autograd, written once for every backend: backward rules and the glue that runs them.

Each rule receives ``call(op, *args)``, which runs another op through the
registry (kernel-order arguments), and the forward's arguments by name (those
not kept are None; ``"<name>.shape"`` gives each tensor argument's shape). So a
backend that supplies only forward kernels is autograd-correct. The same rules serve eager autograd
(:func:`apply`, called by the entry functions of :mod:`megablocks_core.entries`) and
``torch.compile`` (:mod:`megablocks_core.library`); :func:`pack_for_backward` and
:func:`unpack_for_backward` decide what both keep for the backward.

Gradient-accumulation fusion (opt-in per parameter, :func:`fuse_grad_accumulation`): when a
training step accumulates gradients over micro-batches, an expert weight's gradient already
exists, and autograd would add each new (experts, k, n) weight gradient into it with a separate
elementwise pass. For an opted-in weight the backward rules of ``gmm``, ``gather_gmm`` and
``gmm_scatter`` instead add it into the existing buffer with ``gmm_weight_grad_accumulate`` (one
fused GEMM where the backend has the kernel) and return None for that weight, so autograd's
AccumulateGrad does nothing for it. The buffer is the weight's ``main_grad`` when it has one
(Megatron-LM's convention, often float32; ``grad_added_to_main_grad`` is then set), else its
``.grad`` when that is a dense, contiguous tensor of the weight's shape and dtype. Otherwise (the
first micro-batch, before ``.grad`` exists; ``torch.autograd.grad`` or ``backward(inputs=...)``
without the weight, which must not touch ``.grad``; ``create_graph=True``; eager-only: never
while compiling) the gradient is returned as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from . import bias as bias_ops
from .activations import activate_backward, activate_with, glu_backward
from .policy import Policy, policy_scope
from .schema import OpContract, RowsOption, TensorArg
from .validation import ContractError, ContractTypeError

Call = Callable[..., torch.Tensor]
Grads = dict[str, "torch.Tensor | None"]


@dataclass(frozen=True)
class BackwardRule:
    fn: Callable[[Call, Mapping[str, Any], torch.Tensor, Mapping[str, bool]], Grads]
    saves: tuple[str, ...]
    """Tensor arguments the backward reads (others are not kept alive)."""
    saves_if: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    """Argument → the input(s) whose gradient needs it (``x`` only if ``weights`` needs grad)."""
    saves_if_set: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """Argument → (an option, an input): also kept when that option is given (not None) and
    that input needs a gradient (gmm_scatter's x when an activation is to be differentiated)."""
    fusable: tuple[str, ...] = ()
    """Weight arguments whose gradient the rule can add into the parameter's existing gradient
    (gradient-accumulation fusion); the rule finds an opted-in one as ``"<name>.fused"``."""


# ---------------------------------------------------------------------------
# Gradient-accumulation fusion: the opt-in and the buffer a weight's gradient is added into

#: Set (True) on a parameter opted in to gradient-accumulation fusion.
FUSION_ATTRIBUTE = "megablocks_grad_accumulation_fusion"


def fuse_grad_accumulation(*params: torch.Tensor, enabled: bool = True) -> None:
    """Opt expert weights in to (or, ``enabled=False``, out of) gradient-accumulation fusion.

    For a weight opted in, the backward of ``gmm``, ``gather_gmm`` and ``gmm_scatter`` (where it
    is the expert matrices ``b``) adds its gradient straight into the weight's ``main_grad`` (if
    it has one) or its existing ``.grad`` with ``gmm_weight_grad_accumulate``, and autograd's own
    accumulation does nothing for it (see the module docstring for when it applies).

    Opt-in because it bypasses autograd's AccumulateGrad for those micro-batches: hooks on the
    weight's gradient (``Tensor.register_hook``) are called with None instead of the gradient
    (and may not replace it), ``register_post_accumulate_grad_hook`` hooks run after the fused
    kernel has already accumulated, and reducers that hook into the accumulation (DDP, FSDP)
    never see the micro-batch's gradient on its own; they are not supported with it. Only leaf
    tensors (parameters) can be opted in; the mark is an attribute of the tensor
    (``copy.deepcopy`` of a ``Parameter`` drops it).
    """
    if not isinstance(enabled, bool):  # "no" or 0.5 would be truthy
        raise TypeError(
            "megablocks_core.fuse_grad_accumulation: enabled must be True or False; got "
            f"{enabled!r} ({type(enabled).__name__})"
        )
    for index, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise TypeError(
                f"megablocks_core.fuse_grad_accumulation: argument {index} must be a tensor "
                f"(a parameter); got {type(param).__name__}"
            )
        if not param.is_leaf:
            raise ValueError(
                f"megablocks_core.fuse_grad_accumulation: argument {index} must be a leaf tensor "
                "(a parameter): the gradient of a computed tensor flows on to its inputs"
            )
        setattr(param, FUSION_ATTRIBUTE, enabled)


def is_grad_accumulation_fused(param: torch.Tensor) -> bool:
    """Whether ``param`` is opted in to gradient-accumulation fusion."""
    return bool(getattr(param, FUSION_ATTRIBUTE, False))


def _fusion_targets(
    rule: BackwardRule, contract: OpContract, args: tuple[Any, ...], needs: Mapping[str, bool]
) -> dict[str, torch.Tensor]:
    """``"<name>.fused"`` → the opted-in weight, for the forward to keep (eager autograd only)."""
    found = {}
    for name in rule.fusable:
        if needs.get(name):
            weight = args[contract.arg_names.index(name)]
            if getattr(weight, FUSION_ATTRIBUTE, False):
                found[f"{name}.fused"] = weight
    return found


def _runs_accumulate_grad(param: torch.Tensor) -> bool:
    """Whether this backward pass runs ``param``'s AccumulateGrad: ``backward()`` without
    ``inputs``, or with param among them; not ``torch.autograd.grad``, which returns gradients
    and leaves ``.grad`` alone."""
    try:
        node = torch.autograd.graph.get_gradient_edge(param).node
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError):  # torch.autograd.grad raises here; a torch without it
        return False


def _main_grad(param: torch.Tensor, main_grad: Any) -> torch.Tensor:
    ok = (
        isinstance(main_grad, torch.Tensor)
        and main_grad.shape == param.shape
        and main_grad.dtype in (param.dtype, torch.float32)
        and main_grad.device == param.device
        and main_grad.is_contiguous()
    )
    if not ok:
        got = (
            f"a tensor of shape {tuple(main_grad.shape)}, {main_grad.dtype} on "
            f"{main_grad.device}, contiguous={main_grad.is_contiguous()}"
            if isinstance(main_grad, torch.Tensor)
            else type(main_grad).__name__
        )
        raise ValueError(
            "megablocks_core: an expert weight opted in to gradient-accumulation fusion has a "
            f"main_grad, which must be a contiguous tensor of the weight's shape "
            f"{tuple(param.shape)} in {param.dtype} or float32 on {param.device}; got {got}"
        )
    return main_grad


def _accumulation_buffer(param: torch.Tensor | None) -> torch.Tensor | None:
    """Where an opted-in weight's gradient is added (see the module docstring), or None: return
    the gradient to autograd as usual."""
    if param is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None  # create_graph needs the gradient as a value; compiled autograd traces
    if not param.is_leaf or not _runs_accumulate_grad(param):
        return None
    main_grad = getattr(param, "main_grad", None)
    if main_grad is not None:
        return _main_grad(param, main_grad)
    grad = param.grad
    if (
        grad is not None
        and grad.layout == torch.strided
        and grad.shape == param.shape
        and grad.dtype == param.dtype
        and grad.device == param.device
        and grad.is_contiguous()
        and not grad.requires_grad
    ):
        return grad
    return None  # the first micro-batch (no .grad yet), or a .grad AccumulateGrad must handle


def _weight_grad(
    call: Call,
    bound: Mapping[str, Any],
    name: str,
    a: torch.Tensor,
    grad: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor | None:
    """The gradient of weight argument ``name``: ``gmm_weight_grad(a, grad, counts)``, or None
    once it has been added into an opted-in weight's gradient buffer."""
    param = bound.get(f"{name}.fused")
    buffer = _accumulation_buffer(param)
    if param is None or buffer is None:
        return call("gmm_weight_grad", a, grad, counts)
    call("gmm_weight_grad_accumulate", a, grad, counts, buffer)
    if buffer is getattr(param, "main_grad", None):
        param.grad_added_to_main_grad = True  # Megatron-LM's flag: its reducers skip .grad
    return None


def _cast(t: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or like is None else t.to(like.dtype)


def _gather(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # A kernel-level weighted gather (a backward's) is the adjoint of the weighted scatter (which
    # takes every sorted row: those past rows, which the gather did not produce, add nothing).
    out: Grads = {}
    routing = (a["indices"], a["bin_ids"])
    grad = RowsOption.pad(grad, a["indices"].shape[0])
    if needs["x"]:
        out["x"] = call("scatter", grad, *routing, a["weights"], a["bins"], a["top_k"])
    if needs["weights"]:  # recorded only in double backward (the weights are kernel level)
        wgrad = call("scatter_wgrad", grad, a["x"], *routing, a["bins"], a["top_k"])
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _weighted_rows(
    call: Call,
    grad: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
    rows: int | None,
) -> torch.Tensor:
    """grad[indices[i] // top_k] * weights[indices[i]] for each sorted row (the first ``rows``):
    the weighted gather kernel, or, when this backward is itself recorded (double backward), the
    plain gather times the weights through torch, so that the weights' second-order terms are
    recorded too (the gather kernel's weights carry no gradient)."""
    if weights is None or not torch.is_grad_enabled():
        return call("gather", grad, *routing, weights, bins, top_k, rows)
    gathered = call("gather", grad, *routing, None, bins, top_k, rows)
    first = _first_rows(routing, rows)
    return _scale_rows(call, gathered, _row_scales(weights, first[0]), first, bins)


def _first_rows(
    routing: tuple[torch.Tensor, torch.Tensor], rows: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing (indices, bin_ids) of the first ``rows`` sorted rows (all when None)."""
    return routing if rows is None else (routing[0][:rows], routing[1][:rows])


def _scatter(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    if needs["x"]:
        routing = (a["indices"], a["bin_ids"])
        out["x"] = _weighted_rows(call, grad, routing, a["weights"], a["bins"], a["top_k"], None)
    if needs["weights"]:
        wgrad = call(
            "scatter_wgrad", a["x"], grad, a["indices"], a["bin_ids"], a["bins"], a["top_k"]
        )
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _padded_gather(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    layout = (a["indices"], a["bin_ids"])
    bins, padded_bins, top_k = a["bins"], a["padded_bins"], a["top_k"]
    if needs["x"]:
        out["x"] = call("padded_scatter", grad, *layout, a["weights"], bins, padded_bins, top_k)
    if needs["weights"]:  # recorded only in double backward (the weights are kernel level)
        wgrad = call("padded_scatter_wgrad", grad, a["x"], *layout, bins, padded_bins, top_k)
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _padded_scatter(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    if needs["x"]:
        out["x"] = call(
            "padded_gather",
            grad,
            a["indices"],
            a["bin_ids"],
            a["weights"],
            a["bins"],
            a["padded_bins"],
            a["top_k"],
        )
    if needs["weights"]:
        wgrad = call(
            "padded_scatter_wgrad",
            a["x"],
            grad,
            a["indices"],
            a["bin_ids"],
            a["bins"],
            a["padded_bins"],
            a["top_k"],
        )
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _binned_gather(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    indices, bins, top_k = a["indices"], a["bins"], a["top_k"]
    if needs["x"]:
        out["x"] = call("binned_scatter", grad, indices, a["weights"], bins, top_k)
    if needs["weights"]:  # recorded only in double backward (the weights are kernel level)
        wgrad = call("binned_scatter_wgrad", grad, a["x"], indices, bins, top_k)
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _binned_scatter(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    if needs["x"]:
        bin_size = a["x.shape"][1]  # x itself is kept only when weights need a gradient
        out["x"] = call(
            "binned_gather", grad, a["indices"], a["weights"], a["bins"], bin_size, a["top_k"]
        )
    if needs["weights"]:
        wgrad = call("binned_scatter_wgrad", a["x"], grad, a["indices"], a["bins"], a["top_k"])
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _replicate(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    return {"x": call("replicate_backward", grad, a["bins"])}


def _gmm(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    out: Grads = {}
    trans_b = a["trans_b"]
    if needs["a"]:
        out["a"] = call("gmm", grad, a["b"], a["batch_sizes"], not trans_b)
    if needs["b"]:
        if trans_b:  # b[e] is (n, k): its gradient is grad_e^T a_e
            out["b"] = _weight_grad(call, a, "b", grad, a["a"], a["batch_sizes"])
        else:
            out["b"] = _weight_grad(call, a, "b", a["a"], grad, a["batch_sizes"])
    if needs["bias"]:
        out["bias"] = bias_ops.group_sums(call, grad, a["batch_sizes"])
    return out


def _weight_grad_by_bins(
    call: Call, bound: Mapping[str, Any], x: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor | None:
    """b's gradient over the groups that cumulative bins give (sorted rows of x and grad).

    The counts stay on bins' device (no host sync). They are the groups as the fused forward read
    them, also for bins that are not a cumulative sum (unchecked data the forward accepted): a
    negative group counts as 0 and the groups are cut at the last row of x. So the weight
    gradient sees valid counts wherever they live, and the backward neither raises about an
    argument the caller never passed nor behaves differently for CPU and device-side bins."""
    return _weight_grad(call, bound, "b", x, grad, _counts_from_bins(bound["bins"], x.shape[0]))


def _counts_from_bins(bins: torch.Tensor, rows: int) -> torch.Tensor:
    """Group sizes (int32, each <= rows) from cumulative bins as the fused ops read them."""
    ends = bias_ops.group_ends(bins, rows)  # int64: sums of int32 bins cannot wrap
    return torch.diff(ends, prepend=ends.new_zeros(1)).int()


def _gather_gmm(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    routing = (a["indices"], a["bin_ids"])
    trans_b, top_k, bins, first = a["trans_b"], a["top_k"], a["bins"], a["rows"]
    if needs["x"]:  # every (token, k) row's gradient, summed back into its token
        out["x"] = call(
            "gmm_scatter", grad, a["b"], *routing, None, bins, top_k, not trans_b, None, first
        )
    if needs["b"]:
        # The gathered rows were not kept: gather them again, a transient copy (a gather kernel
        # and the best weight-gradient GEMM beat a GEMM reading rows through the indices).
        rows = call("gather", a["x"], *routing, None, bins, top_k, first)
        if trans_b:  # b[e] is (n, k): grad_e^T @ rows_e
            out["b"] = _weight_grad_by_bins(call, a, grad, rows)
        else:
            out["b"] = _weight_grad_by_bins(call, a, rows, grad)
    if needs["bias"]:
        out["bias"] = bias_ops.group_sums(call, grad, _counts_from_bins(bins, grad.shape[0]))
    return out


def _row_scales(weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """weights[indices[i]] for each sorted row i; 0 for an id out of range (bad data stays inside
    weights)."""
    flat = indices.long()
    valid = (flat >= 0) & (flat < weights.shape[0])
    return torch.where(valid, weights.index_select(0, torch.where(valid, flat, 0)), 0)


def _identity(indices: torch.Tensor) -> torch.Tensor:
    """Sorted row i named by flat id i: the routing's own layout (bins, bin_ids) over rows that
    are already sorted, for the ops that take one row per token with top_k 1. Shares the
    indices' dtype (and its row limit)."""
    return torch.arange(indices.shape[0], device=indices.device, dtype=indices.dtype)


def _row_dots(
    call: Call,
    x: torch.Tensor,
    y: torch.Tensor,
    identity: torch.Tensor,
    routing: tuple[torch.Tensor, ...],
    bins: torch.Tensor,
) -> torch.Tensor:
    """dot(x[i], y[i]) for each row, accumulated in float32: scatter_wgrad with identity indices
    and top_k 1 (its one-row-per-token form), a bandwidth-bound kernel where a batched GEMV of
    1x1 products runs several times slower."""
    return call("scatter_wgrad", x, y, identity, routing[1], bins, 1)


def _scale_rows(
    call: Call,
    rows: torch.Tensor,
    scale: torch.Tensor,
    routing: tuple[torch.Tensor, ...],
    bins: torch.Tensor,
    identity: torch.Tensor | None = None,
) -> torch.Tensor:
    """rows[i] * scale[i]: a weighted gather with identity indices and top_k 1 (a row-broadcast
    multiply runs on torch's unvectorised strided path at about half the bandwidth). When this
    backward is itself recorded (double backward), torch's multiply instead, so that the scale's
    gradient is recorded too (the gather kernel's weights carry none)."""
    if torch.is_grad_enabled():
        return rows * scale.to(rows.dtype).unsqueeze(1)
    if identity is None:
        identity = _identity(routing[0])
    return call("gather", rows, identity, routing[1], scale, bins, 1)


def _by_flat_id(values: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """out[indices[i]] = values[i] for ids in [0, n) (``indices`` may name the first sorted rows
    only); ids no row names get 0, ids out of range are dropped."""
    flat = indices.long()
    slot = torch.where((flat >= 0) & (flat < n), flat, n)  # out-of-range ids land in a cut-off slot
    return values.new_zeros(n + 1).index_copy_(0, slot, values)[:n]


def _gmm_scatter(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    routing = (a["indices"], a["bin_ids"])
    trans_b, top_k, weights, bins = a["trans_b"], a["top_k"], a["weights"], a["bins"]
    activation, first = a["activation"], a["rows"]
    # x holds the first `first` sorted rows (all when None): so do the per-row tensors below.
    row_routing = _first_rows(routing, first)
    # With an activation whose input needs a gradient, one activation_backward pass gives that
    # gradient, act(x) and the weights' dots together (when this backward is itself recorded,
    # the differentiable composition below runs instead).
    one_pass = activation is not None and needs["x"] and not torch.is_grad_enabled()
    # The GEMM's input rows: x, or act(x) recomputed (transient) from the kept pre-activation.
    x_in = a["x"]
    if activation is not None and not one_pass and (needs["weights"] or needs["b"]):
        x_in = activate_with(call, x_in, activation)
    if needs["x"] or needs["weights"]:
        # grad[t] @ b[e].T for each sorted row: act(x)'s gradient before weighting, and (dotted
        # with act(x)) the weights' gradient, so the forward's (rows, n) product need not be kept.
        rows_grad = call("gather_gmm", grad, a["b"], *routing, bins, top_k, not trans_b, first)
        if one_pass:
            scale = None if weights is None else _row_scales(weights, row_routing[0])
            # act(x), the weight gradient's operand, is written over rows_grad (its last use).
            out["x"], dots = call("activation_backward", rows_grad, a["x"], scale, activation)
            x_in = rows_grad
        else:
            identity = _identity(row_routing[0])
            if needs["weights"]:
                dots = _row_dots(call, x_in, rows_grad, identity, row_routing, bins)
            if needs["x"]:
                if weights is not None:
                    scale = _row_scales(weights, row_routing[0])
                    rows_grad = _scale_rows(call, rows_grad, scale, row_routing, bins, identity)
                if activation is not None:
                    rows_grad = activate_backward(rows_grad, a["x"], activation)
                out["x"] = rows_grad
        if needs["weights"]:
            n = a["indices"].shape[0]
            out["weights"] = _by_flat_id(dots, row_routing[0], n).to(weights.dtype)
    # bias is kept only for the weights' gradient (its own needs none of its values).
    bias_in_weights = needs["weights"] and a["bias"] is not None
    if needs["bias"] or bias_in_weights:
        grad_bias, bias_dots = bias_ops.scatter_bias_grads(a, grad, needs["bias"], bias_in_weights)
        if grad_bias is not None:
            out["bias"] = grad_bias
        weights_grad = out.get("weights")
        if bias_dots is not None and weights_grad is not None:
            out["weights"] = (weights_grad + bias_dots).to(weights.dtype)
    if needs["b"]:  # the weighted rows of grad, gathered again (transient), then the GEMM
        rows = _weighted_rows(call, grad, routing, weights, bins, top_k, first)
        if trans_b:  # b[e] is (n, k): rows_e^T @ act(x)_e
            out["b"] = _weight_grad_by_bins(call, a, rows, x_in)
        else:
            out["b"] = _weight_grad_by_bins(call, a, x_in, rows)
    return out


def _glu(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    if torch.is_grad_enabled():  # recorded (double backward): the differentiable definition
        return {"x": glu_backward(grad, a["x"], a["activation"])}
    return {"x": call("glu_backward", grad, a["x"], a["activation"])}


# The kernel-level ops a backward calls are differentiable too, so that a backward recorded for
# double backward (create_graph=True) carries every second-order term on every backend. Each is
# linear in each of its float inputs; its rule is the adjoint. ``out_grad`` is the cotangent (the
# ops' own "grad" argument is one of their inputs).


def _scatter_wgrad(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # out[indices[i]] = <x[i], grad[indices[i] // top_k]>
    out: Grads = {}
    routing, bins, top_k = (a["indices"], a["bin_ids"]), a["bins"], a["top_k"]
    if needs["x"]:
        out["x"] = _weighted_rows(call, a["grad"], routing, out_grad, bins, top_k, None)
    if needs["grad"]:
        out["grad"] = call("scatter", a["x"], *routing, out_grad, bins, top_k)
    return out


def _padded_scatter_wgrad(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    layout = (a["indices"], a["bin_ids"], out_grad, a["bins"], a["padded_bins"], a["top_k"])
    if needs["x"]:
        out["x"] = call("padded_gather", a["grad"], *layout)
    if needs["grad"]:
        out["grad"] = call("padded_scatter", a["x"], *layout)
    return out


def _binned_scatter_wgrad(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    indices, bins, top_k = a["indices"], a["bins"], a["top_k"]
    if needs["x"]:
        bin_size = a["x.shape"][1]
        out["x"] = call("binned_gather", a["grad"], indices, out_grad, bins, bin_size, top_k)
    if needs["grad"]:
        out["grad"] = call("binned_scatter", a["x"], indices, out_grad, bins, top_k)
    return out


def _replicate_backward(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    return {"grad": call("replicate", out_grad, a["bins"], a["grad.shape"][1])}


def _gmm_weight_grad(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # out[e] = a_e^T grad_e: a_e's gradient is grad_e out_grad[e]^T, grad_e's is a_e out_grad[e].
    out: Grads = {}
    sizes = a["batch_sizes"]
    if needs["a"]:
        out["a"] = call("gmm", a["grad"], out_grad.to(a["grad"].dtype), sizes, True)
    if needs["grad"]:
        out["grad"] = call("gmm", a["a"], out_grad.to(a["a"].dtype), sizes, False)
    return out


ROUTING_SAVES = ("indices", "bin_ids", "bins")

#: Op name → its backward rule. Every differentiable contract has one (a test checks).
RULES: dict[str, BackwardRule] = {
    "gather": BackwardRule(_gather, (*ROUTING_SAVES, "weights"), {"x": "weights"}),
    "scatter": BackwardRule(_scatter, (*ROUTING_SAVES, "weights"), {"x": "weights"}),
    "scatter_wgrad": BackwardRule(_scatter_wgrad, ROUTING_SAVES, {"x": "grad", "grad": "x"}),
    "padded_gather": BackwardRule(
        _padded_gather, (*ROUTING_SAVES, "weights", "padded_bins"), {"x": "weights"}
    ),
    "padded_scatter": BackwardRule(
        _padded_scatter, (*ROUTING_SAVES, "weights", "padded_bins"), {"x": "weights"}
    ),
    "padded_scatter_wgrad": BackwardRule(
        _padded_scatter_wgrad, (*ROUTING_SAVES, "padded_bins"), {"x": "grad", "grad": "x"}
    ),
    "binned_gather": BackwardRule(_binned_gather, ("indices", "weights", "bins"), {"x": "weights"}),
    "binned_scatter": BackwardRule(
        _binned_scatter, ("indices", "weights", "bins"), {"x": "weights"}
    ),
    "binned_scatter_wgrad": BackwardRule(
        _binned_scatter_wgrad, ("indices", "bins"), {"x": "grad", "grad": "x"}
    ),
    "replicate": BackwardRule(_replicate, ("bins",)),
    "replicate_backward": BackwardRule(_replicate_backward, ("bins",)),
    "gmm_weight_grad": BackwardRule(_gmm_weight_grad, ("batch_sizes",), {"a": "grad", "grad": "a"}),
    "gmm": BackwardRule(_gmm, ("batch_sizes",), {"a": "b", "b": "a"}, fusable=("b",)),
    "gather_gmm": BackwardRule(_gather_gmm, ROUTING_SAVES, {"x": "b", "b": "x"}, fusable=("b",)),
    # x is needed for b's gradient and for the weights' (<x[i], grad[t] @ b[e].T>).
    # With an activation, x (the pre-activation rows) is also needed for its own gradient.
    "gmm_scatter": BackwardRule(
        _gmm_scatter,
        (*ROUTING_SAVES, "weights"),
        {"x": ("b", "weights"), "b": ("x", "weights"), "bias": "weights"},
        saves_if_set={"x": ("activation", "x")},
        fusable=("b",),
    ),
    "glu": BackwardRule(_glu, ("x",)),
}


def kept(rule: BackwardRule, name: str, needs: Mapping[str, bool]) -> bool:
    """Whether the forward must keep argument ``name`` for this backward."""
    if name in rule.saves:
        return True
    dependants = rule.saves_if.get(name, ())
    if isinstance(dependants, str):
        dependants = (dependants,)
    return any(needs.get(d, False) for d in dependants)


def _kept_if_set(
    rule: BackwardRule, contract: OpContract, name: str, needs: Mapping[str, bool]
) -> int:
    """Position of the option that, when given, also keeps argument ``name``; -1 if none does
    for these needs."""
    option, dependant = rule.saves_if_set.get(name, ("", ""))
    if not option or not needs.get(dependant, False):
        return -1
    return contract.arg_names.index(option)


# ---------------------------------------------------------------------------
# The glue: what a forward keeps, and the autograd node of an eager call


#: How an op's forward packs its arguments for one combination of inputs needing a gradient:
#: those needs by name; per tensor argument (position, "<name>.shape", kept for backward, the
#: position of an option that also keeps it when given or -1); per other argument (position,
#: name).
_Packing = tuple[
    Mapping[str, bool], tuple[tuple[int, str, bool, int], ...], tuple[tuple[int, str], ...]
]
#: (op, each argument's needs-gradient flag) → its packing, worked out once (a training step
#: calls each op with the same flags every time).
_PACKINGS: dict[tuple[str, tuple[bool, ...]], _Packing] = {}


def _packing(contract: OpContract, flags: tuple[bool, ...]) -> _Packing:
    found = _PACKINGS.get((contract.name, flags))
    if found is None:
        rule = RULES[contract.name]
        needs = MappingProxyType(
            {a.name: bool(f) for a, f in zip(contract.args, flags, strict=True)}
        )
        tensor_slots = tuple(
            (
                i,
                f"{a.name}.shape",
                kept(rule, a.name, needs),
                _kept_if_set(rule, contract, a.name, needs),
            )
            for i, a in enumerate(contract.args)
            if isinstance(a, TensorArg)
        )
        other_slots = tuple(
            (i, a.name) for i, a in enumerate(contract.args) if not isinstance(a, TensorArg)
        )
        found = _PACKINGS[(contract.name, flags)] = (needs, tensor_slots, other_slots)
    return found


def _pack(
    packing: _Packing, args: tuple[Any, ...]
) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    _, tensor_slots, other_slots = packing
    tensors: list[torch.Tensor | None] = []
    consts: dict[str, Any] = {}
    for i, shape_name, keep, option in tensor_slots:
        value = args[i]
        if value is None:  # an optional tensor not given
            tensors.append(None)
        else:
            keep = keep or (option >= 0 and args[option] is not None)
            tensors.append(value if keep else None)
            consts[shape_name] = tuple(value.shape)
    for i, name in other_slots:
        consts[name] = args[i]
    return tensors, consts


def pack_for_backward(
    contract: OpContract, args: tuple[Any, ...], needs: Mapping[str, bool]
) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    """Split the forward's arguments into tensors to save and constants to keep."""
    flags = tuple(bool(needs.get(a.name, False)) for a in contract.args)
    return _pack(_packing(contract, flags), args)


def unpack_for_backward(
    contract: OpContract, saved: tuple[torch.Tensor | None, ...], consts: Mapping[str, Any]
) -> dict[str, Any]:
    """The forward's arguments by name, for a backward rule (see :func:`pack_for_backward`)."""
    bound = dict(consts)
    bound.update(zip((a.name for a in contract.tensor_args), saved, strict=True))
    return bound


#: Leading arguments of :class:`_OpFunction` that are not the op's.
_NODE_ARGS = 4


def run_rule(
    contract: OpContract,
    call: Call,
    bound: Mapping[str, Any],
    grad: torch.Tensor,
    needs: Mapping[str, bool],
) -> Grads:
    """The op's backward rule; a contract error raised by an op it calls is re-raised naming the
    op whose backward this is (the caller never called the inner op)."""
    try:
        return RULES[contract.name].fn(call, bound, grad, needs)
    except (ContractError, ContractTypeError) as exc:
        if str(exc).startswith(f"megablocks_core.ops.{contract.name}:"):
            raise
        raise type(exc)(
            f"megablocks_core.ops.{contract.name}: its backward could not run: {exc}"
        ) from exc


class _OpFunction(torch.autograd.Function):
    """One autograd node for any differentiable op; the backward comes from :data:`RULES`."""

    @staticmethod
    def forward(
        ctx: Any,
        contract: OpContract,
        run: Callable[..., Any],
        policy: Policy,
        call: Call,
        *args: Any,
    ) -> Any:
        packing = _packing(contract, ctx.needs_input_grad[_NODE_ARGS:])
        needs = packing[0]
        tensors, consts = _pack(packing, args)
        rule = RULES[contract.name]
        if rule.fusable:  # eager only: torch.compile's autograd (library.py) never fuses
            consts.update(_fusion_targets(rule, contract, args, needs))
        ctx.save_for_backward(*tensors)
        ctx.meta = (contract, policy, call, consts, needs)
        return run(*args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        contract, policy, call, consts, needs = ctx.meta
        bound = unpack_for_backward(contract, ctx.saved_tensors, consts)
        with policy_scope(policy):  # backward runs on the backends the forward was ranked with
            grads = run_rule(contract, call, bound, grad, needs)
        return (
            *(None,) * _NODE_ARGS,
            *(grads.get(a.name) if needs[a.name] else None for a in contract.args),
        )


def apply(
    contract: OpContract, run: Callable[..., Any], policy: Policy, call: Call, args: tuple[Any, ...]
) -> Any:
    """``run(*args)`` recorded as one autograd node; its backward runs the op's rule, calling other
    ops through ``call`` under ``policy`` (the policy the forward was ranked with)."""
    return _OpFunction.apply(contract, run, policy, call, *args)


# ---------------------------------------------------------------------------
# Megatron-Core / Transformer Engine permutation (moe_permute and its family). The row map is
# integer data: only the rows and the probabilities get gradients.


def _moe_permute(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    row_map, probs = a["row_map"], a["probs"]
    if needs["x"]:  # each token's rows summed back, weighted as they were written
        out["x"] = call("moe_unpermute", grad, row_map, probs)
    if needs["probs"]:  # recorded only in double backward (the probs are kernel level)
        out["probs"] = _cast(call("moe_unpermute_wgrad", grad, a["x"], row_map), probs)
    return out


def _slot_values(values: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    """values[row_map[t, j]] per slot, 0 for a slot that goes nowhere (values is 1-D)."""
    dest = row_map.long()
    valid = (dest >= 0) & (dest < values.shape[0])
    if values.shape[0] == 0:
        return values.new_zeros(row_map.shape)
    return torch.where(valid, values[torch.where(valid, dest, 0)], 0)


def _moe_permute_probs(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # A (tokens, slots) gather of the output gradient: torch, so double backward records it too.
    return {"probs": _slot_values(grad, a["row_map"])}


def _moe_unpermute(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    row_map, probs = a["row_map"], a["probs"]
    if needs["x"]:  # the token's gradient at each of its rows, scaled by its merging prob
        out["x"] = call("moe_permute", grad, row_map, probs, a["x.shape"][0])
    if needs["probs"]:
        out["probs"] = _cast(call("moe_unpermute_wgrad", a["x"], grad, row_map), probs)
    return out


def _moe_unpermute_wgrad(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # out[t, j] = <x[row_map[t, j]], grad[t]>: linear in x and in grad.
    out: Grads = {}
    row_map = a["row_map"]
    if needs["x"]:
        out["x"] = call("moe_permute", a["grad"], row_map, out_grad, a["x.shape"][0])
    if needs["grad"]:
        out["grad"] = call("moe_unpermute", a["x"], row_map, out_grad)
    return out


def _moe_sort_chunks(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # The inverse reordering: the output's chunks (sizes split_sizes[sorted_index]) put back in
    # source order. Computed on the sizes' device without reading them (no host sync).
    sizes, index = a["split_sizes"], a["sorted_index"]
    index = index.to(sizes.device).long()
    chunks = index.shape[0]
    valid = (index >= 0) & (index < chunks)
    safe = torch.where(valid, index, 0)
    out_sizes = torch.where(valid, sizes.long()[safe], 0) if chunks else sizes.long()
    slot = torch.where(valid, index, chunks)  # an out-of-range index lands in a cut-off slot
    positions = torch.arange(chunks, device=sizes.device)
    inverse = torch.full((chunks + 1,), chunks, dtype=torch.int64, device=sizes.device)
    inverse = inverse.scatter_reduce_(0, slot, positions, reduce="amin")[:chunks]
    return {"x": call("moe_sort_chunks", grad, out_sizes, inverse)}


RULES.update(
    {
        "moe_permute": BackwardRule(_moe_permute, ("row_map", "probs"), {"x": "probs"}),
        "moe_permute_probs": BackwardRule(_moe_permute_probs, ("row_map",)),
        "moe_unpermute": BackwardRule(_moe_unpermute, ("row_map", "probs"), {"x": "probs"}),
        "moe_unpermute_wgrad": BackwardRule(
            _moe_unpermute_wgrad, ("row_map",), {"x": "grad", "grad": "x"}
        ),
        "moe_sort_chunks": BackwardRule(_moe_sort_chunks, ("split_sizes", "sorted_index")),
    }
)
