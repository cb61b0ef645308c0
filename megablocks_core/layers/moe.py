"""A dropless MoE layer (MegaBlocks' dMoE, grouped path) written only against :mod:`megablocks_core.ops`.

It is small on purpose: besides being a usable layer it is the reference for how the ops fit
together::

    logits = x @ router                              # (tokens, experts), float32 or wider
    weights, top_experts = ops.router_topk(logits, top_k, softmax=True)  # (tokens, top_k)
    indices, bin_ids, tokens_per_expert, bins, _ = ops.route(top_experts.flatten(), E, block)
    h = ops.gather_gmm(x, w1, indices, bin_ids, bins, top_k)       # (tokens * top_k, ffn), by expert
    out = ops.gmm_scatter(h, w2, indices, bin_ids, weights.flatten(), bins, top_k,
                          activation="gelu")             # (tokens, hidden)
    # GLU: w1 holds the gate and up projections side by side, (E, hidden, 2 * ffn): one
    # gather_gmm gives (tokens * top_k, 2 * ffn), and gmm_scatter(h, w2, ...,
    # activation="swiglu") applies act(gate) * up (SiLU: SwiGLU) on its way in

which is ``gmm`` between ``gather`` and ``scatter`` with the permutations fused into the GEMMs,
the second of which also applies the activation (and recomputes it in backward): no
(tokens * top_k, hidden) tensor is written in the forward or kept for the backward (MegaBlocks
keeps two: the gathered tokens and the expert outputs). What a step keeps for backward is the
routing metadata and the first GEMM's output h: with a named activation only h, (tokens *
top_k, ffn) for MLP experts and (tokens * top_k, 2 * ffn) for GLU experts (gmm_scatter
recomputes act(h) in backward); with a callable activation also act(h) (for GLU experts: act of
the gate, and the product).

Differences from MegaBlocks' ``dMoE`` (``megablocks/layers/dmoe.py``), all deliberate:

* ``forward`` returns ``(out, aux_loss)``; MegaBlocks returns ``(out, bias)`` and stashes the
  load-balancing inputs in a module-global list for ``batched_load_balancing_loss``. The loss here
  is the same formula for one layer (see :func:`load_balancing_loss`).
* The router's logits and softmax run in float32 (float64 for float64 inputs), as with
  MegaBlocks' ``moe_lbl_in_fp32``; MegaBlocks computes them in the input dtype. The top-k
  weights stay in that precision (MegaBlocks' are in the input dtype), and the top-k ranks the
  logits with equal ones taken in expert order (:func:`megablocks_core.ops.router_topk`;
  MegaBlocks' ``torch.topk`` of the probabilities breaks ties in an unspecified order).
* Expert weights are stored ``w1: (E, hidden, ffn)`` and ``w2: (E, ffn, hidden)`` so no
  ``trans_b`` is needed; MegaBlocks stores ``(E * ffn, hidden)`` and uses ``trans_b=True`` for w1.
  Gated experts keep MegaBlocks' ``w1`` (gate) and ``v1`` (up) side by side in one
  ``w1: (E, hidden, 2 * ffn)``, ``w1[..., :ffn]`` the gate: one GEMM computes both projections.
* No router jitter, uniform assignment, sequence parallelism, or shared expert. Expert
  parallelism is optional (``expert_parallel_group``, see :mod:`megablocks_core.layers.parallel` and
  docs/expert-parallelism.md).

Sync-free: the layer itself never reads device data on the host (no ``.item()``, ``.tolist()``,
no data-dependent Python branches), and the token counts given to ``ops.gmm`` stay on the device.
On CUDA a step is therefore free of device→host syncs, and can be captured in a CUDA graph,
whenever the backends serving ``route``/``gather``/``gmm``/``scatter`` do not read data on the
host themselves. The Triton backend's do not; the reference ``gmm`` copies the counts to the host
(it loops over experts), so on the reference backend the layer syncs once per ``gmm``. With an
``expert_parallel_group`` the layer makes exactly one more sync per call: the host read of the
all-to-all split sizes (:func:`megablocks_core.layers.parallel.expert_parallel_moe`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import fp8, ops
from ..activations import ACTIVATIONS, GATED, gelu_tanh
from ..autograd import fuse_grad_accumulation, is_grad_accumulation_fused
from .config import _LAYER, MoEConfig, _check_bool, _check_init, _got

#: A gate's activation → gmm_scatter's gated name for act(gate) * up ("silu" → "swiglu").
_GATED_BY_GATE = {gate: name for name, gate in GATED.items()}


def _tensor_cores(x: Tensor, router: Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and router.dtype == x.dtype


def _wide_logits(x: Tensor, router: Tensor) -> Tensor:
    """``x @ router.T`` in at least float32 (see :class:`_WideLogits`)."""
    if _tensor_cores(x, router):
        # 16-bit inputs on the tensor cores, float32 accumulation and output (not a float32
        # GEMM on the CUDA cores, several times slower).
        return torch.mm(x, router.t(), out_dtype=torch.float32)
    acc = torch.promote_types(x.dtype, torch.float32)
    return F.linear(x.to(acc), router.to(acc))


class _WideLogits(torch.autograd.Function):
    """``x @ router.T`` computed in at least float32, saving x in its own dtype for backward.

    ``F.linear(x.float(), router.float())`` would keep a float32 copy of every token for backward
    (256 MiB for 16K tokens of width 4096 in bf16); the casts are redone in backward instead. On
    CUDA, 16-bit inputs multiply on the tensor cores with a float32 result (``torch.mm`` with
    ``out_dtype``); the backward's GEMMs then run in the input dtype (float32 accumulation).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, router: Tensor) -> Tensor:
        ctx.save_for_backward(x, router)
        return _wide_logits(x, router)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, router = ctx.saved_tensors
        # The tensor-core path multiplies in x's dtype; otherwise in the logits' (float32+).
        dtype = x.dtype if _tensor_cores(x, router) else grad.dtype
        grad = grad.to(dtype)
        grad_x = (grad @ router.to(dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_router = (grad.t() @ x.to(dtype)).to(router.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_router


def load_balancing_loss(
    tokens_per_expert: Tensor, probs: Tensor, top_k: int, coefficient: float
) -> Tensor:
    """MegaBlocks' ``batched_load_balancing_loss`` for one layer (Switch Transformer's aux loss).

    ``loss = coefficient * E / (T * top_k) * sum_e tokens_per_expert[e] * mean_t probs[t, e]``
    where ``probs`` are the router's softmax probabilities (T tokens, E experts) and
    ``tokens_per_expert`` the routed counts (no gradient flows through them). A perfectly balanced
    router with uniform probabilities gives ``coefficient``. Zero tokens give 0.
    """
    tokens, experts = probs.shape
    if tokens == 0:  # a static shape, not data: no sync and no graph break
        return probs.new_zeros(())
    scale = coefficient * experts / (tokens * top_k)
    return scale * torch.dot(tokens_per_expert.to(probs.dtype), probs.mean(dim=0))


_MASK64 = (1 << 64) - 1


def expert_seed(seed: int, matrix: int, expert: int) -> int:
    """The seed of expert ``expert``'s matrix ``matrix`` (0: w1, the gate half of gated experts'
    w1; 1: its up half, MegaBlocks' v1; 2: w2) for a layer seeded with ``seed``: splitmix64 over
    the three, so that nearby seeds, matrices and experts give unrelated streams. Depends on
    nothing else (not the number of experts or ranks)."""
    z = (seed * 0x9E3779B97F4A7C15 + (matrix << 40) + expert) & _MASK64
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = ((z ^ (z >> shift)) * factor) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)  # torch seeds are < 2**64; keep it positive


class DroplessMoE(torch.nn.Module):
    """Dropless mixture of experts: top-k softmax router, expert MLPs via ``ops.gmm``, no token dropped.

    Args:
        config: every option of the layer, in one record (:class:`MoEConfig`, each field
            documented there; MegaBlocks' ``Arguments``): ``DroplessMoE(MoEConfig(4096, 14336,
            8, 2, glu=True, activation="silu"))``.
        **options: :class:`MoEConfig` fields by keyword, a convenience: without ``config``
            they build the record (``DroplessMoE(hidden_size=64, ffn_hidden_size=128,
            num_experts=8, top_k=2)``); with it they replace its fields
            (:func:`dataclasses.replace`). Either way the record checks them.

    The layer keeps its record as ``config``, and each field as an attribute of the same name
    (``layer.top_k``, ...); ``grad_accumulation_fusion`` may be reassigned on the layer later.

    ``forward(x)`` takes ``(..., hidden_size)`` and returns ``(out, aux_loss)``: ``out`` has x's
    shape and dtype; ``aux_loss`` is the 0-d load-balancing loss in float32 (float64 for float64
    input) in training mode, and 0 in eval mode or when the coefficient is 0 (as MegaBlocks saves
    it only while training). Add it to the task loss.

    Arguments are checked where they arrive: :class:`MoEConfig` refuses any field that is not
    what its documentation says (TypeError for a wrong type, a bool included where an int or a
    number is asked for; ValueError for a wrong value), the constructor anything but a
    :class:`MoEConfig` as ``config`` (TypeError), and ``forward`` refuses an x that is not
    a floating-point tensor of shape ``(..., hidden_size)`` in the expert weights' dtype on the
    parameters' device, each naming the argument. ``forward``'s checks read only static
    properties (shape, dtype, device): no host sync, and no graph break under ``torch.compile``.

    With an expert-parallel group, ``forward`` is a collective: every rank of the group calls it
    (with its own tokens, possibly none) the same number of times in the same order. ``out`` and
    ``aux_loss`` are those of this rank's tokens, exactly as the single-process layer gives them
    for those tokens; the gradients of the local experts accumulate over every rank's tokens,
    while the router's gradient covers this rank's tokens only (all-reduce it with the data).
    """

    def __init__(self, config: MoEConfig | None = None, /, **options: Any) -> None:
        super().__init__()
        if config is None:
            config = MoEConfig(**options)
        elif not isinstance(config, MoEConfig):
            raise TypeError(
                f"{_LAYER}: config must be a megablocks_core.layers.MoEConfig (or give its fields "
                f"by keyword); got {_got(config)}"
            )
        elif options:
            config = dataclasses.replace(config, **options)
        self.config = config
        # The fields the forward reads, as attributes (the layer's interface before the record).
        self.hidden_size, self.ffn_hidden_size = config.hidden_size, config.ffn_hidden_size
        self.num_experts, self.top_k, self.glu = config.num_experts, config.top_k, config.glu
        self.normalize_expert_weights = config.normalize_expert_weights
        self.load_balancing_loss_coefficient = config.load_balancing_loss_coefficient
        self.block_size = config.block_size
        self.fuse_permutation = config.fuse_permutation
        self.expert_parallel_group = group = config.expert_parallel_group
        self.expert_parallel_chunks = config.expert_parallel_chunks
        self.expert_parallel_dispatch = config.expert_parallel_dispatch
        # This rank's experts: [expert_offset, expert_offset + num_local_experts).
        self.num_local_experts, self.expert_offset = config.num_experts, 0
        if group is not None:
            import torch.distributed as dist  # only expert parallelism needs it

            self.num_local_experts = config.num_experts // dist.get_world_size(group)
            self.expert_offset = dist.get_rank(group) * self.num_local_experts
        if isinstance(config.activation, str):
            self.activation_name: str | None = config.activation
            self.activation = ACTIVATIONS[config.activation][0]
        else:  # any callable; a named one lets gmm_scatter apply it and recompute it in backward
            self.activation_name = None
            self.activation = config.activation

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, dtype=config.dtype, device=config.device))

        hidden, ffn, local = config.hidden_size, config.ffn_hidden_size, self.num_local_experts
        self.router = param(config.num_experts, hidden)  # torch.nn.Linear's layout, no bias
        # Gated experts: the gate and up projections side by side (one GEMM computes both).
        self.w1 = param(local, hidden, (2 if config.glu else 1) * ffn)
        self.w2 = param(local, ffn, hidden)
        self.reset_parameters(config.init_std, config.seed)
        self.grad_accumulation_fusion = config.grad_accumulation_fusion

    def _expert_weights(self) -> list[torch.nn.Parameter]:
        return [self.w1, self.w2]

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Gated experts saved with the gate and up projections apart (MegaBlocks' layout, this
        # layer's before they were joined): w1 (E, hidden, ffn) and v1 load as w1 = [w1 | v1].
        gate_key, up_key = prefix + "w1", prefix + "v1"
        gate, up = state_dict.get(gate_key), state_dict.get(up_key)
        apart = False
        if self.glu and gate is not None and up is not None and gate.shape != self.w1.shape:
            apart = True
            half = (*self.w1.shape[:-1], self.ffn_hidden_size)
            wrong = [(key, t) for key, t in ((gate_key, gate), (up_key, up)) if t.shape != half]
            if wrong:  # blame the half of the wrong width, not the joined w1
                del state_dict[gate_key]
                error_msgs.extend(
                    f"size mismatch for {key}: copying a param with shape {tuple(t.shape)} from "
                    f"checkpoint, the gate (w1) and up (v1) projections saved apart are each "
                    f"{half} here"
                    for key, t in wrong
                )
            else:
                state_dict[gate_key] = torch.cat((gate, up), dim=-1)
            del state_dict[up_key]
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if apart and gate_key in missing_keys:  # reported above as a size mismatch
            missing_keys.remove(gate_key)

    @property
    def grad_accumulation_fusion(self) -> bool:
        """Whether the expert weights are opted in to gradient-accumulation fusion (see the
        class docstring); assigning opts them in or out."""
        return all(is_grad_accumulation_fused(p) for p in self._expert_weights())

    @grad_accumulation_fusion.setter
    def grad_accumulation_fusion(self, enabled: bool) -> None:
        _check_bool("grad_accumulation_fusion", enabled)
        fuse_grad_accumulation(*self._expert_weights(), enabled=enabled)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, seed: int = 0) -> None:
        """Draw every parameter from N(0, std²) with CPU generators derived from ``seed``.

        The router comes from a generator seeded with ``seed``; each expert's matrix from its own
        (:func:`expert_seed` of ``seed``, the matrix and the expert's global id: 0 for ``w1``,
        or its gate half with gated experts, 1 for their up half, 2 for ``w2``), one expert at a
        time. Drawing on the CPU and copying makes the values identical on every device; an
        expert's values depend on nothing but its id, so with expert parallelism a rank draws
        only its own experts and they equal the single-process layer's with the same seed. Never
        more than one expert's float32 values are held on the host (a full (E, hidden, ffn) draw
        is 15 GB at DeepSeek-V3's widths). On the meta device nothing is drawn (``to_empty`` then
        loading values is the way to fill such a layer).
        """
        _check_init(std, seed)
        if self.router.is_meta:  # meta parameters hold no values: nothing to draw
            return
        # (tensor, the seed of its generator): the router, then each local expert's matrices.
        ffn = self.ffn_hidden_size
        gate_up = (self.w1[..., :ffn], self.w1[..., ffn:]) if self.glu else (self.w1, None)
        matrices = (*gate_up, self.w2)
        jobs = [(self.router, seed)] + [
            (p[local], expert_seed(seed, matrix, self.expert_offset + local))
            for matrix, p in enumerate(matrices)
            if p is not None
            for local in range(self.num_local_experts)
        ]

        @torch.no_grad()  # grad mode is per thread
        def draw(job: tuple[Tensor, int]) -> None:
            out, stream = job
            generator = torch.Generator().manual_seed(stream)
            out.copy_(torch.randn(out.shape, generator=generator, dtype=torch.float32) * std)

        # The experts' draws are independent and torch releases the GIL while drawing: large
        # experts are drawn on a few threads (a single thread draws ~2e8 values a second).
        workers = min(os.cpu_count() or 1, 8) if self.w1[0].numel() >= 1 << 20 else 1
        if workers == 1:
            list(map(draw, jobs))
            return
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(draw, jobs))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router: (probs (T, E), top-k weights (T, K), top-k expert ids (T, K) int32); probs and
        weights in the router's precision (float32, float64 for float64 input)."""
        probs, weights, experts = self._route(x, need_probs=True)
        assert probs is not None
        return probs, weights, experts

    def _route(self, x: Tensor, need_probs: bool) -> tuple[Tensor | None, Tensor, Tensor]:
        router = self.router
        if torch.is_grad_enabled() and (x.requires_grad or router.requires_grad):
            logits = _WideLogits.apply(x, router)
            probs = logits.softmax(dim=-1)
            # ops.router_topk ranks the logits (the probabilities' order, without their
            # rounding); the weights are taken from probs so that they carry its gradient.
            _, experts = ops.router_topk(logits.detach(), self.top_k, False)
            weights = probs.gather(1, experts.long())
        else:  # inference: no autograd node, and one op gives the ids and softmax weights
            logits = _wide_logits(x, router)
            weights, experts = ops.router_topk(logits, self.top_k, True)
            probs = logits.softmax(dim=-1) if need_probs else None
        if self.normalize_expert_weights is not None:
            weights = weights / weights.norm(p=self.normalize_expert_weights, dim=-1, keepdim=True)
        return probs, weights, experts

    def _activate(self, h: Tensor) -> Tensor:
        """act(h), or for gated experts act(gate) * up of h = [gate | up]."""
        if not self.glu:
            return self.activation(h)
        if self.activation_name is not None:  # one pass; its backward recomputes act(gate)
            return ops.glu(h, self.activation_name)
        gate, up = h.chunk(2, dim=-1)
        return self.activation(gate) * up

    def _gemms(self) -> tuple[Any, Any, Any]:
        """(gmm, gather_gmm, gmm_scatter): the ops, or their FP8 forms under ``config.fp8``."""
        recipe = fp8.recipe_of(self.config.fp8)
        if recipe is None:
            return ops.gmm, ops.gather_gmm, ops.gmm_scatter
        return (
            functools.partial(fp8.gmm, recipe=recipe),
            functools.partial(fp8.gather_gmm, recipe=recipe),
            functools.partial(fp8.gmm_scatter, recipe=recipe),
        )

    def experts(self, rows: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """Each expert's MLP over its contiguous group of rows (groups sized by tokens_per_expert)."""
        gmm = self._gemms()[0]
        h = self._activate(gmm(rows, self.w1, tokens_per_expert))
        return gmm(h, self.w2, tokens_per_expert)

    def _fused_experts(
        self,
        x: Tensor,
        weights: Tensor,
        indices: Tensor,
        bin_ids: Tensor,
        bins: Tensor,
        rows: int | None = None,
    ) -> Tensor:
        """The experts applied to tokens x and summed back per token, never writing a
        (tokens * top_k, hidden) tensor: the first GEMM reads x through the indices, the second
        sums each token's weighted rows, applying a named activation (gated experts: act(gate) *
        up) on its way in. Backward keeps only h, the first GEMM's output (with a named
        activation). ``rows``: only the first sorted pairs (bins[-1] of them; the rest are
        routed to no expert here) are computed and kept."""
        routing = (indices, bin_ids)
        _, gather_gmm, gmm_scatter = self._gemms()
        h = gather_gmm(x, self.w1, *routing, bins, self.top_k, False, rows)
        if self.activation_name is not None:
            # gmm_scatter applies the activation to h (a gated one: act(gate) * up) and keeps
            # only h for backward.
            name = _GATED_BY_GATE[self.activation_name] if self.glu else self.activation_name
            return gmm_scatter(h, self.w2, *routing, weights, bins, self.top_k, False, name, rows)
        return gmm_scatter(
            self._activate(h), self.w2, *routing, weights, bins, self.top_k, False, None, rows
        )

    def _check_input(self, x: object) -> None:
        """Refuses an input the layer would misread (a last dimension other than hidden_size whose
        element count happens to divide by it would be regrouped into other tokens) or that the
        ops would refuse with a message about their own arguments. Only static properties are
        read (shape, dtype, device): no host sync, and no graph break under torch.compile."""
        hidden = self.hidden_size
        if not isinstance(x, Tensor):
            raise TypeError(
                f"{_LAYER}: x must be a tensor of shape (..., hidden_size={hidden}); got "
                f"{type(x).__name__}"
            )
        if x.dim() < 1 or x.shape[-1] != hidden:
            # While dynamo traces, the sizes may be symbols that its error text cannot print: the
            # message is then a constant (eager, and dynamo's eager fallback, print the shape).
            got = "" if torch.compiler.is_compiling() else f"; got shape {tuple(x.shape)}"
            raise ValueError(f"{_LAYER}: x must have shape (..., hidden_size={hidden}){got}")
        weight = self.w1  # the ops take the tokens in the expert weights' dtype, on their device
        if not x.is_floating_point() or x.dtype != weight.dtype:
            raise TypeError(
                f"{_LAYER}: x must be floating point in the expert weights' dtype {weight.dtype} "
                f"(convert x, or the layer with .to(dtype)); got {x.dtype}"
            )
        if x.device != weight.device or x.device != self.router.device:
            raise ValueError(
                f"{_LAYER}: x must be on the parameters' device {weight.device} (router on "
                f"{self.router.device}); got {x.device}"
            )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        self._check_input(x)
        if self.expert_parallel_group is not None:
            return self._expert_parallel_forward(x)
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)
        aux_loss = self.training and self.load_balancing_loss_coefficient > 0
        probs, weights, top_experts = self._route(x, need_probs=aux_loss)
        # Routing metadata (integer tensors) carries no gradient; counts stay on the device
        # (sync-free gmm).
        indices, bin_ids, tokens_per_expert, bins, _ = ops.route(
            top_experts.flatten(), self.num_experts, self.block_size
        )
        if self.fuse_permutation:
            out = self._fused_experts(x, weights.flatten(), indices, bin_ids, bins)
        else:
            rows = self.experts(
                ops.gather(x, indices, bin_ids, bins, self.top_k), tokens_per_expert
            )
            out = ops.scatter(rows, indices, bin_ids, weights.flatten(), bins, self.top_k)
        if aux_loss:
            assert probs is not None
            aux = load_balancing_loss(
                tokens_per_expert, probs, self.top_k, self.load_balancing_loss_coefficient
            )
        else:
            aux = weights.new_zeros(())
        return out.reshape(shape), aux

    def _expert_parallel_forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``forward`` with the experts sharded over ``expert_parallel_group``."""
        # The constructor has checked the expert-parallel arguments: no second check per call.
        from .parallel import DEFAULT_CHUNKS, _expert_parallel_moe

        group, chunks = self.expert_parallel_group, self.expert_parallel_chunks
        dispatch = self.expert_parallel_dispatch
        assert group is not None
        if chunks is None:
            chunks = 1 if dispatch == "allgather" else DEFAULT_CHUNKS
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)
        probs, weights, top_experts = self.route(x)
        out = _expert_parallel_moe(
            x,
            weights,
            top_experts,
            self.num_experts,
            self._fused_experts,
            self._expert_weights(),
            group,
            chunks=chunks,
            dispatch=dispatch,
        )
        if self.training and self.load_balancing_loss_coefficient > 0:
            with torch.no_grad():
                tokens_per_expert = ops.histogram(top_experts.flatten(), self.num_experts)
            aux = load_balancing_loss(
                tokens_per_expert, probs, self.top_k, self.load_balancing_loss_coefficient
            )
        else:
            aux = probs.new_zeros(())
        return out.reshape(shape), aux

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"num_experts={self.num_experts}, top_k={self.top_k}, glu={self.glu}"
            + (
                f", local_experts=[{self.expert_offset}, "
                f"{self.expert_offset + self.num_local_experts})"
                if self.expert_parallel_group is not None
                else ""
            )
        )


def expert_parallel_baseline(layer: DroplessMoE, x: Tensor) -> tuple[Tensor, Tensor]:
    """``layer``'s forward (output, load-balancing loss) with the baseline exchange,
    :func:`~megablocks_core.layers.parallel.expert_parallel_apply` (one row per (token, expert)
    pair on the link), instead of :func:`~megablocks_core.layers.parallel.expert_parallel_moe`:
    what the benchmark times beside the layer, exact like it. ``x`` is (tokens, hidden);
    ``layer`` has an ``expert_parallel_group``. Here, not in ``parallel``, so that ``parallel``
    needs nothing of the layer (no import circle)."""
    from .parallel import expert_parallel_apply  # only expert parallelism needs it

    if layer.expert_parallel_group is None:
        raise ValueError("expert_parallel_baseline: the layer has no expert_parallel_group")
    probs, weights, top_experts = layer.route(x)
    with torch.no_grad():
        indices, bin_ids, counts, bins, _ = ops.route(
            top_experts.flatten(), layer.num_experts, layer.block_size
        )
    rows = ops.gather(x, indices, bin_ids, bins, layer.top_k)
    rows = expert_parallel_apply(rows, counts, layer.experts, layer.expert_parallel_group)
    out = ops.scatter(rows, indices, bin_ids, weights.flatten(), bins, layer.top_k)
    coefficient = layer.load_balancing_loss_coefficient
    return out, load_balancing_loss(counts, probs, layer.top_k, coefficient)


dMoE = DroplessMoE  # MegaBlocks' name

__all__ = [
    "ACTIVATIONS",
    "DroplessMoE",
    "MoEConfig",
    "dMoE",
    "gelu_tanh",
    "load_balancing_loss",
]
