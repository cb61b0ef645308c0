"""This backend's kernels as ahead-of-time compile jobs (``megablocks backends compile``).

:func:`compile_jobs` runs every op function of the backend on ``meta`` tensors of a layer shape
while :class:`~megablocks_triton.launch.record_launches` notes each launch instead of running it,
with the launch policy of the simulated device in force: the tile choices, launch options and
paths (TMA) are the launch path's own, so what is compiled is what would run there. A declared
variant beside an op's kernel (the Gluon weight gradient on Hopper, ``triton/gluon-hopper``) is
compiled for the layer's calls its predicates take.

:func:`specialize` turns a recorded launch into Triton's compile inputs; it is the one place that
relies on Triton internals.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from megablocks_core.plugin import (
    ArchLimits,
    CompileJob,
    CompileShape,
    DeviceInfo,
    TensorMeta,
    device_limits,
)

from .config import LaunchConfigs, arch_tuning, dtype_class, use_launch_configs
from .launch import RecordedLaunch, record_launches


def specialize(launch: RecordedLaunch, lim: ArchLimits) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) of ``launch`` compiled for ``lim``'s target: the
    argument types and specialisations (alignment, divisibility by 16, ints equal to 1) that
    ``kernel[grid](...)`` would compute on that target's driver.

    Relies on Triton 3.6 internals (``create_function_from_signature``, ``_pack_args``): the
    steps ``JITFunction.run`` takes before it compiles, without a driver.
    """
    from triton.compiler.compiler import make_backend  # type: ignore[import-untyped]
    from triton.runtime.jit import create_function_from_signature  # type: ignore[import-untyped]

    kernel = launch.kernel
    backend = make_backend(lim.triton_target())
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, dict(launch.kwargs), bound, specialization, options
    )
    return signature, constexprs, attrs, dict(options.__dict__)


def _float_dtypes(launch: RecordedLaunch) -> list[torch.dtype]:
    """The float dtypes of a launch's tensor arguments, in order (a TMA descriptor's tensor
    too: an FP8 GEMM's operands may come as descriptors)."""
    tensors = [getattr(a, "base", a) for a in launch.args]
    return [t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _describe(launch: RecordedLaunch) -> str:
    """A short name for a launch variant: the first tensor's dtype, the tile and warp counts."""
    kw = launch.kwargs
    floats = _float_dtypes(launch)
    dtype = str(floats[0]).removeprefix("torch.") if floats else ""
    tiles = "x".join(str(kw[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in kw)
    parts = [dtype, tiles, f"w{kw.get('num_warps', 4)}"]
    if "num_stages" in kw:
        parts.append(f"s{kw['num_stages']}")
    for flag in (
        "USE_TMA", "B_TMA", "TMA", "ACCUMULATE", "REDUCE", "TRANS_B", "GATHER", "FLATTEN",
        "BLOCKWISE", "HARDWARE",
    ):  # fmt: skip
        if kw.get(flag):
            parts.append(flag.lower())
    return " ".join(p for p in parts if p)


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _op_calls(shape: CompileShape, dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(op, call) for every op of the backend at ``shape`` with ``dtype`` activations."""
    from . import activation, gmm, moe_permute, permutation, routing

    t, h, f, e, k = shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k
    rows = t * k
    i32 = torch.int32
    ids, counts = _meta(rows, dtype=i32), _meta(e, dtype=i32)
    x, sorted_rows = _meta(t, h, dtype=dtype), _meta(rows, h, dtype=dtype)
    weights = _meta(rows, dtype=dtype)
    w1, w2 = _meta(e, h, f, dtype=dtype), _meta(e, f, h, dtype=dtype)
    hidden_rows, out_dtype = _meta(rows, f, dtype=dtype), torch.float32
    block = 128
    padded = min(rows + e * (block - 1), rows * 2)  # the padded row count a router could give
    # padded_gather reads padded_bins on the host: a CPU tensor beside meta operands, a device
    # tensor beside real ones (gate_vs_gpu runs these calls on a GPU).
    padded_bins = torch.full((e,), padded, dtype=i32, device="cpu" if x.is_meta else x.device)
    if dtype != torch.float32:  # routing and permutation: once, with the 16-bit activations
        yield "route", lambda: routing.route(ids, e, block)
        yield "sort", lambda: routing.sort(ids, max((e - 1).bit_length(), 1))
        yield "histogram", lambda: routing.histogram(ids, e)
        yield "inclusive_cumsum", lambda: routing.inclusive_cumsum(counts, 0)
        yield "exclusive_cumsum", lambda: routing.exclusive_cumsum(counts, 0)
        blocks = -(-padded // block)
        yield "topology", lambda: routing.topology(counts, block, blocks, -(-f // block))
        yield "replicate", lambda: routing.replicate(_meta(1, e, dtype=dtype), counts, rows)
        yield (
            "replicate_backward",
            lambda: routing.replicate_backward(_meta(1, rows, dtype=dtype), counts),
        )
        yield "router_topk", lambda: routing.router_topk(_meta(t, e, dtype=dtype), k, True)
        yield "gather", lambda: permutation.gather(x, ids, ids, None, counts, k)
        yield "scatter", lambda: permutation.scatter(sorted_rows, ids, ids, weights, counts, k)
        yield (
            "scatter_wgrad",
            lambda: permutation.scatter_wgrad(sorted_rows, x, ids, ids, counts, k),
        )
        yield (
            "padded_gather",
            lambda: permutation.padded_gather(x, ids, ids, None, counts, padded_bins, k),
        )
        yield (
            "padded_scatter",
            lambda: permutation.padded_scatter(
                _meta(padded, h, dtype=dtype),
                ids,
                ids,
                weights,
                counts,
                padded_bins.to(x.device),
                k,
            ),
        )
        # Megatron-Core / Transformer Engine permutation: mask and top-k id maps, FP8 padding.
        mask, top = _meta(t, e, dtype=torch.bool), _meta(t, k, dtype=i32)
        row_map, probs = _meta(t, k, dtype=i32), _meta(t, k, dtype=torch.float32)
        yield "moe_permute_map", lambda: moe_permute.moe_permute_map(mask, e, rows, 1)
        yield "moe_permute_map", lambda: moe_permute.moe_permute_map(top, e, rows, 16)
        # The map's other paths: a map one program takes whole (a few tokens; an index map of
        # that tile's full size walks it in several chunks), and the per-expert scans past
        # MAX_MAP_EXPERTS.
        few, many = (
            max(moe_permute.SINGLE_MAP_TILE // max(k, e), 1),
            moe_permute.MAX_MAP_EXPERTS + 1,
        )
        for routing_map, experts in (
            (_meta(few, e, dtype=torch.bool), e),
            (_meta(few, k, dtype=i32), e),
            (_meta(max(moe_permute.SINGLE_MAP_TILE // k, 1), k, dtype=i32), e),
            (_meta(t, many, dtype=torch.bool), many),
            (_meta(t, k, dtype=i32), many),
        ):
            yield (
                "moe_permute_map",
                functools.partial(moe_permute.moe_permute_map, routing_map, experts, rows, 16),
            )
        yield "moe_permute", lambda: moe_permute.moe_permute(x, row_map, None, rows)
        yield "moe_permute", lambda: moe_permute.moe_permute(x, row_map, probs, rows)
        yield "moe_permute_probs", lambda: moe_permute.moe_permute_probs(probs, row_map, rows)
        yield "moe_unpermute", lambda: moe_permute.moe_unpermute(sorted_rows, row_map, probs)
        yield (
            "moe_unpermute_wgrad",
            lambda: moe_permute.moe_unpermute_wgrad(sorted_rows, x, row_map),
        )
        # The mask form's row map (one slot per expert) takes the compaction pre-pass.
        mask_map, mask_probs = _meta(t, e, dtype=i32), _meta(t, e, dtype=torch.float32)
        yield "moe_permute", lambda: moe_permute.moe_permute(x, mask_map, mask_probs, rows)
        yield "moe_unpermute", lambda: moe_permute.moe_unpermute(sorted_rows, mask_map, mask_probs)
        yield (
            "moe_unpermute_wgrad",
            lambda: moe_permute.moe_unpermute_wgrad(sorted_rows, x, mask_map),
        )
        yield (
            "moe_sort_chunks",
            lambda: moe_permute.moe_sort_chunks(sorted_rows, counts, _meta(e, dtype=i32)),
        )
        yield "glu", lambda: activation.glu(_meta(rows, 2 * f, dtype=dtype), "silu")
        yield (
            "glu_backward",
            lambda: activation.glu_backward(hidden_rows, _meta(rows, 2 * f, dtype=dtype), "silu"),
        )
        yield (
            "activation_backward",
            lambda: activation.activation_backward(
                hidden_rows, _meta(rows, f, dtype=dtype), _meta(rows, dtype=dtype), "gelu"
            ),
        )
        # GPT-OSS's experts (interleaved clamped SwiGLU) and the exact GELU: other code paths.
        gpt_oss = "silu_oai_interleaved"
        yield "glu", lambda: activation.glu(_meta(rows, 2 * f, dtype=dtype), gpt_oss)
        yield (
            "activation_backward",
            lambda: activation.activation_backward(
                hidden_rows,
                _meta(rows, 2 * f, dtype=dtype),
                _meta(rows, dtype=dtype),
                "swiglu_oai_interleaved",
            ),
        )
        yield (
            "activation_backward",
            lambda: activation.activation_backward(
                hidden_rows, _meta(rows, f, dtype=dtype), _meta(rows, dtype=dtype), "gelu_erf"
            ),
        )
    # The layer's grouped GEMMs: forward, x's gradient (trans_b), both weight gradients.
    yield "gmm", lambda: gmm.gmm(sorted_rows, w1, counts)
    yield "gmm", lambda: gmm.gmm(hidden_rows, w1, counts, trans_b=True)
    yield "gather_gmm", lambda: gmm.gather_gmm(x, w1, ids, ids, counts, k)
    yield "gmm_scatter", lambda: gmm.gmm_scatter(hidden_rows, w2, ids, ids, weights, counts, k)
    # With per-expert biases (GPT-OSS's experts): the epilogue's bias load, its own variant.
    b1, b2 = _meta(e, f, dtype=dtype), _meta(e, h, dtype=dtype)
    yield "gather_gmm", lambda: gmm.gather_gmm(x, w1, ids, ids, counts, k, False, None, b1)
    yield (
        "gmm_scatter",
        lambda: gmm.gmm_scatter(
            hidden_rows, w2, ids, ids, weights, counts, k, False, None, None, b2
        ),
    )
    if k <= e:  # one token (decode): gmm_scatter's one-launch path, both gated layouts
        pair_ids, pair_weights = _meta(k, dtype=i32), _meta(k, dtype=dtype)
        gated_rows, w2_t = _meta(k, 2 * f, dtype=dtype), _meta(e, h, f, dtype=dtype)
        yield (
            "gmm_scatter",
            lambda: gmm.gmm_scatter(
                gated_rows, w2_t, pair_ids, pair_ids, pair_weights, counts, k, True, "swiglu"
            ),
        )
        # Top-2 too (Mixtral's): fewer warps, longer steps (the same launch as above at k = 2).
        two, two_rows, two_weights = (
            _meta(2, dtype=i32),
            _meta(2, 2 * f, dtype=dtype),
            _meta(2, dtype=dtype),
        )
        yield (
            "gmm_scatter",
            lambda: gmm.gmm_scatter(
                two_rows, w2_t, two, two, two_weights, counts, 2, True, "swiglu"
            ),
        )
        yield (
            "gmm_scatter",
            lambda: gmm.gmm_scatter(
                gated_rows,
                w2_t,
                pair_ids,
                pair_ids,
                pair_weights,
                counts,
                k,
                True,
                "swiglu_oai_interleaved",
                None,
                b2,
            ),
        )
    yield "gmm_weight_grad", lambda: gmm.gmm_weight_grad(sorted_rows, hidden_rows, counts)
    yield "gmm_weight_grad", lambda: gmm.gmm_weight_grad(hidden_rows, sorted_rows, counts)
    for grad_dtype in dict.fromkeys((dtype, out_dtype)):  # into .grad, or a float32 main_grad
        yield (
            "gmm_weight_grad_accumulate",
            functools.partial(
                gmm.gmm_weight_grad_accumulate,
                sorted_rows,
                hidden_rows,
                counts,
                _meta(e, h, f, dtype=grad_dtype),
            ),
        )


def _alternatives(
    op: str, device: DeviceInfo, shape: CompileShape, dtype: torch.dtype
) -> Iterator[Callable[[], Any]]:
    """The declared variants beside an op's plain kernel, for the layer's calls their predicates
    take: the Gluon weight gradients (``triton/gluon-hopper``,
    :func:`megablocks_triton.gmm.warp_specialized_problem`) beside the Triton ones."""
    from . import gmm

    if op not in ("gmm_weight_grad", "gmm_weight_grad_accumulate"):
        return
    if gmm.warp_specialized_capability(device) is not None:
        return
    t, h, f, e, k = shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k
    rows, counts = _meta(t * k, h, dtype=dtype), _meta(e, dtype=torch.int32)
    hidden_rows = _meta(t * k, f, dtype=dtype)
    for a, grad in ((rows, hidden_rows), (hidden_rows, rows)):
        call: dict[str, Any] = {"a": _info(a), "grad": _info(grad), "batch_sizes": _info(counts)}
        if op == "gmm_weight_grad":
            if gmm.warp_specialized_problem(op, device, call) is None:
                yield functools.partial(gmm.gmm_weight_grad_warp_specialized, a, grad, counts)
            continue
        for grad_dtype in dict.fromkeys((dtype, torch.float32)):  # .grad, or a float32 main_grad
            out = _meta(e, a.shape[1], grad.shape[1], dtype=grad_dtype)
            if gmm.warp_specialized_problem(op, device, {**call, "out": _info(out)}) is None:
                yield functools.partial(
                    gmm.gmm_weight_grad_accumulate_warp_specialized, a, grad, counts, out
                )


def _info(t: torch.Tensor) -> TensorMeta:
    """A meta tensor as a shape predicate sees it on the simulated (CUDA) device."""
    return TensorMeta(tuple(t.shape), t.dtype, "cuda")


def compile_jobs(
    device: DeviceInfo, shape: CompileShape, configs: LaunchConfigs | None = None
) -> list[CompileJob]:
    """Every distinct kernel launch of this backend's ops at ``shape`` on ``device`` (under the
    launch policy ``configs``, default the triton backend's own), as compile jobs for the
    device's compiler target. Empty for a device without one in the core's limits table."""
    lim = device_limits(device)
    if lim is None:
        return []
    jobs: list[CompileJob] = []
    seen: set[Any] = set()
    accepted = arch_tuning(device).spills_accepted if configs is None else {}
    from .scaled import compile_calls

    with use_launch_configs(configs or LaunchConfigs()):
        for dtype in shape.dtypes:
            for op, call in _op_calls(shape, dtype):
                launches = _record(device, [call, *_alternatives(op, device, shape, dtype)])
                for launch in launches:
                    reason = accepted.get(_spill_key(launch))
                    jobs.extend(_jobs(op, launch, lim, seen, reason))
        for op, call in compile_calls(shape, device):  # FP8, where the device has it
            for launch in _record(device, [call]):
                jobs.extend(_jobs(op, launch, lim, seen, accepted.get(_spill_key(launch))))
    return jobs


#: Kernel function name -> its class in :attr:`~megablocks_triton.config.ArchTuning.spills_accepted`.
_SPILL_CLASSES = {
    "_gmm_kernel": "gmm",
    "_scaled_gmm_kernel": "gmm",
    "_gmm_wgrad_kernel": "wgrad",
    "_scatter_kernel": "scatter",
}


def _spill_key(launch: RecordedLaunch) -> tuple[str, str]:
    kind = _SPILL_CLASSES.get(launch.kernel.fn.__name__, "")
    floats = _float_dtypes(launch)
    dtype = dtype_class(floats[0]) if floats else ""
    return kind, dtype


def _record(device: DeviceInfo, calls: Sequence[Callable[[], Any]]) -> list[RecordedLaunch]:
    launches: list[RecordedLaunch] = []
    for call in calls:
        with record_launches(device) as recorder:
            call()
        launches += recorder.launches
    return launches


def _jobs(
    op: str, launch: RecordedLaunch, lim: ArchLimits, seen: set[Any], spill_reason: str | None
) -> Iterator[CompileJob]:
    signature, constexprs, attrs, options = specialize(launch, lim)
    key = (
        launch.kernel,
        tuple(signature.items()),
        repr(sorted(constexprs.items())),
        repr(sorted(attrs.items())),
        repr(sorted((k, v) for k, v in options.items() if k != "debug")),
    )
    if key in seen:
        return
    seen.add(key)
    fn = launch.kernel
    options = {k: v for k, v in options.items() if v is not None}
    yield CompileJob(
        kernel=kernel_name(fn),
        op=op,
        variant=_describe(launch),
        fn=fn,
        signature=signature,
        constexprs=constexprs,
        attrs=attrs,
        options=_user_options(launch, options),
        spill_reason=spill_reason,
    )


def kernel_name(fn: Any) -> str:
    """A jit function's name in the gate's reports: ``module.function`` (``gmm._gmm_kernel``)."""
    return f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.fn.__name__}"


def _user_options(launch: RecordedLaunch, parsed: dict[str, Any]) -> dict[str, Any]:
    """The launch's own compile options (``num_warps``, ``waves_per_eu``, …): what
    ``triton.compile`` takes; the backend fills in the rest as it would at launch. A Gluon
    kernel's ``num_warps`` is both a parameter and an option."""
    return {k: v for k, v in launch.kwargs.items() if k in parsed}
