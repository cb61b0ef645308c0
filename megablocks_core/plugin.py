"""The plugin API: everything a backend may import from the core, in one module.

A backend imports this module (and :mod:`megablocks_core.ops` where its kernels compose other
ops); every other module of the core is private and may change between minor versions. The
backends in this repository use nothing else, like any third-party plugin.

- :data:`hookimpl` marks the hook implementations (the hooks: :class:`BackendHooks`);
- :class:`Kernel` is what the kernel hooks return, ranked by its :class:`Tier` and, within a
  tier, its cost hint (a :class:`KernelProblem` in the place of one the backend could not build:
  that op alone then fails to load); :class:`DeviceInfo`, :class:`TensorMeta` and
  :data:`CallInfo` are what its predicates and cost hints receive;
- :func:`family_ops` and :func:`contract` say which ops exist and what each promises;
  :func:`call_op` runs any dispatched op, kernel-level ones included, for a kernel that
  composes them (as :mod:`megablocks_core.ops` does for the public ones), or on a backend of
  its choice (a kernel delegating a call to the reference);
- :class:`CompileJob` is what the optional ahead-of-time hook returns for a
  :class:`CompileShape` (:data:`COMPILE_SHAPES`); :func:`device_limits` gives a device's
  :class:`ArchLimits` (shared memory, registers; the table: :data:`ARCH_LIMITS`), for a launch to
  refuse what exceeds them;
- :func:`describe_device` gives the :class:`DeviceInfo` of a torch device; :func:`arch_family`
  (table :data:`ARCH_FAMILIES`) names an arch's family and :func:`base_arch` strips a gfx name's
  feature suffixes. Tuning (tiles, measured points, dense rates) is each backend's own, in one
  per-arch table of its own;
- :func:`gmm_cost_hint` turns a grouped-GEMM provider's measured points (:data:`GmmPoint`) into a
  ``Kernel.cost`` hint (:func:`gmm_estimate_us` and :func:`gmm_problem` are its parts);
- :class:`ContractError` / :class:`ContractTypeError` are what a kernel raises for input it
  cannot serve safely (the core names the op and backend);
- :func:`glu_definition`, :func:`glu_backward_definition` and
  :func:`activation_backward_definition` are the activation ops' arithmetic in plain torch
  (float32, rounded once), which a kernel must match; :data:`GATED_ACTIVATIONS` maps the gated
  activation names (``gmm_scatter``, ``activation_backward``) to the glu names that compute them
  (:data:`SWIGLU_OAI_ALPHA` and :data:`SWIGLU_OAI_LIMIT` are GPT-OSS's unit's default constants;
  :func:`clamp_constants` gives a call's ``alpha`` and ``limit``, its defaults for None);
- :data:`SCALED_FORMATS` (:class:`Format`) and :data:`FP8_ENCODINGS` (:class:`Encoding`) are the
  low-precision formats of the scaled ops, :func:`quantize_definition`,
  :func:`quantize_transposed_definition` (a weight gradient's operands) and
  :func:`dequantize_definition` their arithmetic in plain torch, which a quantizing kernel matches
  bit for bit; :func:`encoding_of` / :func:`native_encoding` say which encoding a device takes.
"""

from __future__ import annotations

from typing import Any

from .activations import GATED as GATED_ACTIVATIONS
from .activations import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, clamp_constants
from .activations import activation_backward as activation_backward_definition
from .activations import glu as glu_definition
from .activations import glu_backward as glu_backward_definition
from .archs import LIMITS as ARCH_LIMITS
from .archs import ArchLimits, device_limits
from .compile_records import SHAPES as COMPILE_SHAPES
from .compile_records import CompileJob, CompileShape
from .contracts import BY_NAME, family_ops
from .costs import GmmPoint, gmm_cost_hint, gmm_estimate_us, gmm_problem
from .descriptors import (
    ANY_DEVICE,
    CallInfo,
    CapabilityCheck,
    CostEstimate,
    DeviceInfo,
    Kernel,
    KernelProblem,
    ShapeCheck,
    TensorMeta,
    Tier,
)
from .devices import ARCH_FAMILIES, arch_family, base_arch
from .devices import describe as describe_device
from .formats import ENCODINGS as FP8_ENCODINGS
from .formats import FORMATS as SCALED_FORMATS
from .formats import FP8_DTYPES, Encoding, Format, encoding_of, native_encoding, out_dtype_of
from .formats import dequantize as dequantize_definition
from .formats import quantize as quantize_definition
from .formats import quantize_transposed as quantize_transposed_definition
from .hookspecs import ENTRY_POINT_GROUP, BackendHooks, hookimpl
from .schema import OpContract
from .validation import ContractError, ContractTypeError


def contract(op: str) -> OpContract:
    """The contract of ``op`` (arguments in kernel order, outputs, rules, edge cases)."""
    return BY_NAME[op]


def call_op(op: str, *args: Any, backend: str | None = None) -> Any:
    """Run the dispatched op ``op`` with its kernel-order arguments, through validation and the
    ranking like any call (e.g. a composing kernel's ``gmm_weight_grad``, which
    :mod:`megablocks_core.ops` does not export). ``backend`` (a name, or ``NAME/VARIANT``) runs
    it on that backend whatever the ranking, the other ops as they were: how a kernel hands a
    call it does not serve to another, ``call_op(op, *args, backend="reference")``. (Without it, a
    kernel calling its own op is chosen again, a RecursionError.)"""
    from .entries import call  # the entries import the registry, which imports plugins

    if backend is None:
        return call(op, *args)
    from .policy import current_policy, policy_scope, with_op_forced

    with policy_scope(with_op_forced(current_policy(), op, backend)):
        return call(op, *args)


__all__ = [
    "ANY_DEVICE",
    "ARCH_FAMILIES",
    "ARCH_LIMITS",
    "COMPILE_SHAPES",
    "ENTRY_POINT_GROUP",
    "FP8_DTYPES",
    "FP8_ENCODINGS",
    "GATED_ACTIVATIONS",
    "SCALED_FORMATS",
    "SWIGLU_OAI_ALPHA",
    "SWIGLU_OAI_LIMIT",
    "ArchLimits",
    "BackendHooks",
    "CallInfo",
    "CapabilityCheck",
    "CompileJob",
    "CompileShape",
    "ContractError",
    "ContractTypeError",
    "CostEstimate",
    "DeviceInfo",
    "Encoding",
    "Format",
    "GmmPoint",
    "Kernel",
    "KernelProblem",
    "OpContract",
    "ShapeCheck",
    "TensorMeta",
    "Tier",
    "activation_backward_definition",
    "arch_family",
    "base_arch",
    "call_op",
    "clamp_constants",
    "contract",
    "dequantize_definition",
    "describe_device",
    "device_limits",
    "encoding_of",
    "family_ops",
    "glu_backward_definition",
    "glu_definition",
    "gmm_cost_hint",
    "gmm_estimate_us",
    "gmm_problem",
    "hookimpl",
    "native_encoding",
    "out_dtype_of",
    "quantize_definition",
    "quantize_transposed_definition",
]
