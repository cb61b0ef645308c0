"""Gradient-accumulation fusion: the opt-in, and the buffer a weight's gradient is added into.

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

from collections.abc import Mapping
from typing import Any

import torch

from ..schema import OpContract
from .base import BackwardRule, Call, GatheredRows

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
    a: torch.Tensor | GatheredRows,
    grad: torch.Tensor | GatheredRows,
    counts: torch.Tensor,
) -> torch.Tensor | None:
    """The gradient of weight argument ``name``: ``gmm_weight_grad(a, grad, counts)``, or None
    once it has been added into an opted-in weight's gradient buffer. An operand may be
    :class:`GatheredRows` only for a call that reads them (:func:`reads_gathered_rows`)."""
    param = bound.get(f"{name}.fused")
    buffer = _accumulation_buffer(param)
    if param is None or buffer is None:
        return call("gmm_weight_grad", a, grad, counts)
    call("gmm_weight_grad_accumulate", a, grad, counts, buffer)
    if buffer is getattr(param, "main_grad", None):
        param.grad_added_to_main_grad = True  # Megatron-LM's flag: its reducers skip .grad
    return None
