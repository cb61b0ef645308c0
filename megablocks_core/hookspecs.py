"""The plugin interface: every hook a backend may implement, in one place.

A backend is a module (or object) registered under the entry-point group
``megablocks.backends``. It implements any subset of these hooks with
``@hookimpl``. The core calls each hook **once per plugin**, when it loads the
registry (first op call, ``megablocks backends …``, or
:func:`megablocks_core.reload`), never per op call.

Each ``*_kernels`` hook returns :class:`~megablocks_core.descriptors.Kernel`
descriptors for ops of its family; the op names and argument orders are the
contracts in :mod:`megablocks_core.contracts`. In the place of a kernel it could not
build it returns a :class:`~megablocks_core.descriptors.KernelProblem`: that op alone
then does not load, with the reason shown by ``megablocks backends list`` and ``explain``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

import pluggy

from .compile_records import CompileJob, CompileShape
from .contracts import family_ops
from .descriptors import DeviceInfo, Kernel, KernelProblem

PROJECT_NAME = "megablocks"
ENTRY_POINT_GROUP = "megablocks.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class BackendHooks:
    """Hook specifications (pluggy project ``"megablocks"``)."""

    @hookspec
    def megablocks_unavailable_reason(self) -> str | None:
        """Say why this backend cannot work on this host at all, or return None.

        Use it for host-wide facts (no GPU, toolkit missing, torch built without
        CUDA). The backend is then listed as "unavailable here" with that reason,
        and its kernels take no part in ranking. Per-device facts belong in a
        kernel's ``capability`` predicate instead.

        Example::

            @hookimpl
            def megablocks_unavailable_reason():
                import torch
                return None if torch.cuda.is_available() else "no CUDA device visible"
        """

    @hookspec
    def megablocks_routing_kernels(self) -> Iterable[Kernel | KernelProblem]:  # type: ignore[empty-body]
        """Return kernels for the routing ops (``megablocks_core.plugin.family_ops("routing")``).

        Example::

            @hookimpl
            def megablocks_routing_kernels():
                return [Kernel(op="histogram", fn=my_histogram, devices=("cuda",),
                               tier=Tier.GENERIC_ACCELERATOR)]
        """

    @hookspec
    def megablocks_permutation_kernels(self) -> Iterable[Kernel | KernelProblem]:  # type: ignore[empty-body]
        """Return kernels for the permutation ops
        (``megablocks_core.plugin.family_ops("permutation")``).

        Example::

            @hookimpl
            def megablocks_permutation_kernels():
                return [Kernel(op="gather", fn=my_gather, devices=("npu",), tier=Tier.VENDOR)]
        """

    @hookspec
    def megablocks_grouped_gemm_kernels(self) -> Iterable[Kernel | KernelProblem]:  # type: ignore[empty-body]
        """Return kernels for the grouped GEMM ops
        (``megablocks_core.plugin.family_ops("grouped_gemm")``).

        Example::

            @hookimpl
            def megablocks_grouped_gemm_kernels():
                return [Kernel(op="gmm", fn=my_gmm, devices=("cuda",), tier=Tier.GENERIC_ACCELERATOR,
                               dtypes={"a": {torch.bfloat16}, "b": {torch.bfloat16}})]
        """

    @hookspec
    def megablocks_activation_kernels(self) -> Iterable[Kernel | KernelProblem]:  # type: ignore[empty-body]
        """Return kernels for the activation ops
        (``megablocks_core.plugin.family_ops("activation")``).

        Example::

            @hookimpl
            def megablocks_activation_kernels():
                return [Kernel(op="glu", fn=my_glu, devices=("cuda",),
                               tier=Tier.GENERIC_ACCELERATOR)]
        """

    @hookspec
    def megablocks_quantization_kernels(self) -> Iterable[Kernel | KernelProblem]:  # type: ignore[empty-body]
        """Return kernels for the quantization ops
        (``megablocks_core.plugin.family_ops("quantization")``). A kernel of an op with a
        ``format`` argument declares the formats it takes (``Kernel.formats``).

        Example::

            @hookimpl
            def megablocks_quantization_kernels():
                return [Kernel(op="quantize", fn=my_quantize, devices=("npu",), tier=Tier.VENDOR,
                               formats=("fp8_rowwise",))]
        """

    @hookspec
    def megablocks_compile_jobs(  # type: ignore[empty-body]
        self, device: DeviceInfo, shape: CompileShape
    ) -> Iterable[CompileJob]:
        """Optional: the kernels this backend would launch on ``device`` for a layer of
        ``shape``, as :class:`~megablocks_core.compile_records.CompileJob` s to compile ahead of time.

        Called only by ``megablocks backends compile`` (never when the registry loads), in a
        worker process of its own per target, with a *simulated* ``device``
        (:meth:`megablocks_core.archs.ArchLimits.device`: the arch, CU/SM count and wavefront
        width of a product of that arch; no GPU is present). Return every variant your launch
        policy would pick there at that shape (each dtype in ``shape.dtypes`` the kernel serves,
        and every alternative path, e.g. a kernel chosen only for some alignments), built from
        the same config functions your launch path uses, so that what is compiled is what would
        run. Return an empty list for a device you do not serve. A backend without this hook is
        reported as "declares no ahead-of-time kernels", not as an error.

        Example::

            @hookimpl
            def megablocks_compile_jobs(device, shape):
                if device.kind != "rocm":
                    return []
                return [CompileJob(kernel="my_kernel", op="histogram", variant="int32",
                                   fn=_histogram_kernel,
                                   signature={"x_ptr": "*i32", "out_ptr": "*i32", "n": "i32",
                                              "BLOCK": "constexpr"},
                                   constexprs={(3,): 1024}, options={"num_warps": 4})]
        """


#: Hook name → the op family its kernels must belong to.
KERNEL_HOOKS = {
    "megablocks_routing_kernels": "routing",
    "megablocks_permutation_kernels": "permutation",
    "megablocks_grouped_gemm_kernels": "grouped_gemm",
    "megablocks_activation_kernels": "activation",
    "megablocks_quantization_kernels": "quantization",
}


def _list_family_ops(hook: str, family: str) -> None:
    """Write the family's ops, as the contracts name them, into the hook's docstring after its
    first paragraph: a list kept by hand would miss the ops added later."""
    spec = getattr(BackendHooks, hook)
    if spec.__doc__ is None:  # python -OO strips docstrings
        return
    summary, rest = spec.__doc__.split("\n\n", 1)
    ops = textwrap.fill(
        ", ".join(family_ops(family)) + ".",
        width=96,
        initial_indent=" " * 8 + "Its ops: ",
        subsequent_indent=" " * 8,
    )
    spec.__doc__ = f"{summary}\n\n{ops}\n\n{rest}"


for _hook, _family in KERNEL_HOOKS.items():
    _list_family_ops(_hook, _family)
