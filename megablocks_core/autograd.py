"""The core's autograd, written once for every backend: backward rules and the glue that runs them.

Each rule receives ``call(op, *args)``, which runs another op through the
registry (kernel-order arguments), and the forward's arguments by name (those
not kept are None; ``"<name>.shape"`` gives each tensor argument's shape). So a
backend that supplies only forward kernels is autograd-correct. The same rules serve eager autograd
(:func:`apply`, called by the entry functions of :mod:`megablocks_core.entries`) and
``torch.compile`` (:mod:`megablocks_core.library`); :func:`pack_for_backward` and
:func:`unpack_for_backward` decide what both keep for the backward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from .policy import Policy, policy_scope
from .schema import OpContract, TensorArg

Call = Callable[..., torch.Tensor]
Grads = dict[str, "torch.Tensor | None"]


@dataclass(frozen=True)
class BackwardRule:
    fn: Callable[[Call, Mapping[str, Any], torch.Tensor, Mapping[str, bool]], Grads]
    saves: tuple[str, ...]
    """Tensor arguments the backward reads (others are not kept alive)."""
    saves_if: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    """Argument → the input(s) whose gradient needs it (``x`` only if ``weights`` needs grad)."""


def _cast(t: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or like is None else t.to(like.dtype)


def _gather(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    return {"x": call("scatter", grad, a["indices"], a["bin_ids"], None, a["bins"], a["top_k"])}


def _scatter(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    if needs["x"]:
        out["x"] = call(
            "gather", grad, a["indices"], a["bin_ids"], a["weights"], a["bins"], a["top_k"]
        )
    if needs["weights"]:
        wgrad = call(
            "scatter_wgrad", a["x"], grad, a["indices"], a["bin_ids"], a["bins"], a["top_k"]
        )
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _padded_gather(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    return {
        "x": call(
            "padded_scatter",
            grad,
            a["indices"],
            a["bin_ids"],
            None,
            a["bins"],
            a["padded_bins"],
            a["top_k"],
        )
    }


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
    return {"x": call("binned_scatter", grad, a["indices"], None, a["bins"], a["top_k"])}


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
            out["b"] = call("gmm_weight_grad", grad, a["a"], a["batch_sizes"])
        else:
            out["b"] = call("gmm_weight_grad", a["a"], grad, a["batch_sizes"])
    return out


def _weight_grad(call: Call, a: torch.Tensor, grad: torch.Tensor, bins: torch.Tensor) -> Any:
    """gmm_weight_grad over the groups that cumulative bins give (sorted rows of a and grad).

    The counts stay on bins' device (no host sync). Bad bins need no care here: device-side
    counts are made safe by every gmm_weight_grad kernel (a negative group counts as 0, groups
    are cut at the last row, as the fused kernels read bins), CPU counts are checked on the host."""
    counts = torch.diff(bins, prepend=bins.new_zeros(1))
    if counts.dtype == torch.int16:  # gmm's counts are int32 or int64
        counts = counts.int()
    return call("gmm_weight_grad", a, grad, counts)


def _gather_gmm(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    routing = (a["indices"], a["bin_ids"])
    trans_b, top_k, bins = a["trans_b"], a["top_k"], a["bins"]
    if needs["x"]:  # every (token, k) row's gradient, summed back into its token
        out["x"] = call("gmm_scatter", grad, a["b"], *routing, None, bins, top_k, not trans_b)
    if needs["b"]:
        # The gathered rows were not kept: gather them again, a transient copy (a gather kernel
        # and the best weight-gradient GEMM beat a GEMM reading rows through the indices).
        rows = call("gather", a["x"], *routing, None, bins, top_k)
        if trans_b:  # b[e] is (n, k): grad_e^T @ rows_e
            out["b"] = _weight_grad(call, grad, rows, bins)
        else:
            out["b"] = _weight_grad(call, rows, grad, bins)
    return out


def _row_scales(weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """weights[indices[i]] for each sorted row i; 0 for an id out of range (bad data stays inside
    weights)."""
    flat = indices.long()
    valid = (flat >= 0) & (flat < weights.shape[0])
    return torch.where(valid, weights.index_select(0, torch.where(valid, flat, 0)), 0)


def _by_flat_id(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """out[indices[i]] = values[i]; ids no row names get 0, ids out of range are dropped."""
    n = indices.shape[0]
    flat = indices.long()
    slot = torch.where((flat >= 0) & (flat < n), flat, n)  # out-of-range ids land in a cut-off slot
    return values.new_zeros(n + 1).index_copy_(0, slot, values)[:n]


def _gmm_scatter(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    routing = (a["indices"], a["bin_ids"])
    trans_b, top_k, weights, bins = a["trans_b"], a["top_k"], a["weights"], a["bins"]
    if needs["x"] or needs["weights"]:
        # grad[t] @ b[e].T for each sorted row: x's gradient before weighting, and (dotted with
        # x) the weights' gradient, so the forward's (rows, n) product need not be kept.
        rows_grad = call("gather_gmm", grad, a["b"], *routing, bins, top_k, not trans_b)
        if needs["weights"]:
            # One dot per row (a batched GEMV: float32 accumulation, no float32 copies).
            dots = torch.bmm(a["x"].unsqueeze(1), rows_grad.unsqueeze(2)).view(-1)
            out["weights"] = _by_flat_id(dots, a["indices"]).to(weights.dtype)
        if needs["x"]:
            if weights is not None:
                scale = _row_scales(weights, a["indices"]).to(rows_grad.dtype).unsqueeze(1)
                # In place unless this backward is itself recorded (double backward).
                rows_grad = rows_grad * scale if torch.is_grad_enabled() else rows_grad.mul_(scale)
            out["x"] = rows_grad
    if needs["b"]:  # the weighted rows of grad, gathered again (transient), then the GEMM
        rows = call("gather", grad, *routing, weights, bins, top_k)
        if trans_b:  # b[e] is (n, k): rows_e^T @ x_e
            out["b"] = _weight_grad(call, rows, a["x"], bins)
        else:
            out["b"] = _weight_grad(call, a["x"], rows, bins)
    return out


ROUTING_SAVES = ("indices", "bin_ids", "bins")

#: Op name → its backward rule. Every differentiable contract has one (a test checks).
RULES: dict[str, BackwardRule] = {
    "gather": BackwardRule(_gather, ROUTING_SAVES),
    "scatter": BackwardRule(_scatter, (*ROUTING_SAVES, "weights"), {"x": "weights"}),
    "padded_gather": BackwardRule(_padded_gather, (*ROUTING_SAVES, "padded_bins")),
    "padded_scatter": BackwardRule(
        _padded_scatter, (*ROUTING_SAVES, "weights", "padded_bins"), {"x": "weights"}
    ),
    "binned_gather": BackwardRule(_binned_gather, ("indices", "bins")),
    "binned_scatter": BackwardRule(
        _binned_scatter, ("indices", "weights", "bins"), {"x": "weights"}
    ),
    "replicate": BackwardRule(_replicate, ("bins",)),
    "gmm": BackwardRule(_gmm, ("batch_sizes",), {"a": "b", "b": "a"}),
    "gather_gmm": BackwardRule(_gather_gmm, ROUTING_SAVES, {"x": "b", "b": "x"}),
    # x is needed for b's gradient and for the weights' (<x[i], grad[t] @ b[e].T>).
    "gmm_scatter": BackwardRule(
        _gmm_scatter, (*ROUTING_SAVES, "weights"), {"x": ("b", "weights"), "b": ("x", "weights")}
    ),
}


def kept(rule: BackwardRule, name: str, needs: Mapping[str, bool]) -> bool:
    """Whether the forward must keep argument ``name`` for this backward."""
    if name in rule.saves:
        return True
    dependants = rule.saves_if.get(name, ())
    if isinstance(dependants, str):
        dependants = (dependants,)
    return any(needs.get(d, False) for d in dependants)


# ---------------------------------------------------------------------------
# The glue: what a forward keeps, and the autograd node of an eager call


#: How an op's forward packs its arguments for one combination of inputs needing a gradient:
#: those needs by name; per tensor argument (position, "<name>.shape", kept for backward); per
#: other argument (position, name).
_Packing = tuple[Mapping[str, bool], tuple[tuple[int, str, bool], ...], tuple[tuple[int, str], ...]]
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
            (i, f"{a.name}.shape", kept(rule, a.name, needs))
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
    for i, shape_name, keep in tensor_slots:
        value = args[i]
        if value is None:  # an optional tensor not given
            tensors.append(None)
        else:
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
        ctx.save_for_backward(*tensors)
        ctx.meta = (contract, policy, call, consts, needs)
        return run(*args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        contract, policy, call, consts, needs = ctx.meta
        bound = unpack_for_backward(contract, ctx.saved_tensors, consts)
        with policy_scope(policy):  # backward runs on the backends the forward was ranked with
            grads = RULES[contract.name].fn(call, bound, grad, needs)
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
