"""The conformance kit's stages: one op's kernel forced on a backend and checked on one sample.

:func:`_check_sample` runs each scenario's sample (outputs against the contract and the reference,
inputs unmodified, a repeated call equal, gradients equal); on the first sample the backend
serves, the kit (:mod:`.kit`) then runs :func:`_check_bad_inputs`, :func:`_check_opcheck`,
:func:`_check_compile` and :func:`_check_double_backward`; a row-map op of :data:`ROW_MAP_OPS`
also gets :func:`_check_row_map_pairing` on every sample. Each raises
:class:`~.comparison.Mismatch` on the first difference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..devices import describe
from ..dispatch import describe_call, explain, explain_call
from ..entries import ENTRIES
from ..formats import FP8_DTYPES
from ..policy import Policy, use_backend
from ..schema import BoolArg, ChoiceArg, FloatArg, IntArg, OpContract, TensorArg
from .comparison import Mismatch, call_on_copies, check_meta, compare, compare_calls

REFERENCE = "reference"

#: The opcheck tests run: the ones that exercise a backend's kernel (aliasing, mutation, fake vs
#: real output metadata, autograd registration). The aot_dispatch tests check the core's own
#: registration and are part of the core's test suite.
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor")


# ---------------------------------------------------------------------------
# Running an op on a backend


@contextlib.contextmanager
def _on(backend: str, op: str) -> Iterator[None]:
    """``op`` forced onto ``backend`` and every other op (those its backward or a composite kernel
    calls) onto the reference: a failure is the op under test's own. (A backend's gather that is
    wrong fails gather's check, not scatter's, whose backward would otherwise run it.) ``backend``
    may name one kernel, ``backend/variant``."""
    with use_backend(REFERENCE, **{op: backend}):
        yield


def _cannot_serve(
    backend: str, contract: OpContract, device: torch.device, args: tuple[Any, ...]
) -> str | None:
    dtypes = {
        a.name: v.dtype
        for a, v in zip(contract.args, args, strict=True)
        if isinstance(v, torch.Tensor)
    }
    trace = explain(
        contract.name, describe(device), dtypes, Policy(force=backend, source="the kit")
    )
    if trace.winner is None:
        return trace.error
    # A kernel may decline some shapes (Kernel.supports, e.g. alignment): those samples are the
    # next backend's, not a failure.
    kernel, why = explain_call(trace, describe_call(contract, args))
    return None if kernel is not None else why


def _with_grad_leaves(
    contract: OpContract, args: tuple[Any, ...]
) -> tuple[tuple[Any, ...], list[str]]:
    """``args`` with fresh leaves requiring grad for every floating-point differentiable input."""
    names = [
        a.name
        for a, v in zip(contract.args, args, strict=True)
        if a.name in contract.differentiable
        and isinstance(v, torch.Tensor)
        and v.is_floating_point()
    ]
    new = tuple(
        v.detach().requires_grad_() if a.name in names else v
        for a, v in zip(contract.args, args, strict=True)
    )
    return new, names


def _grads(
    fn: Callable[..., Any], contract: OpContract, args: tuple[Any, ...]
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Run ``fn`` and return (output, gradient of each differentiable input) for a fixed cotangent."""
    leaves, names = _with_grad_leaves(contract, args)
    with torch.enable_grad():
        out = fn(*leaves)
        gen = torch.Generator().manual_seed(7)
        cotangent = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
        inputs = [leaves[contract.arg_names.index(n)] for n in names]
        grads = torch.autograd.grad(
            out, inputs, cotangent, allow_unused=True, materialize_grads=True
        )
    return out.detach(), dict(zip(names, grads, strict=True))


def _second_order(
    fn: Callable[..., Any], contract: OpContract, args: tuple[Any, ...]
) -> dict[str, torch.Tensor]:
    """The gradient of <∇fn · cotangent, directions> with respect to each differentiable input and
    to the cotangent: what a double backward (``create_graph=True``) through ``fn`` records."""
    leaves, names = _with_grad_leaves(contract, args)
    gen = torch.Generator().manual_seed(11)
    with torch.enable_grad():
        out = fn(*leaves)
        cotangent = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
        cotangent.requires_grad_()
        inputs = [leaves[contract.arg_names.index(n)] for n in names]
        grads = torch.autograd.grad(
            out, inputs, cotangent, create_graph=True, allow_unused=True, materialize_grads=True
        )
        inner = sum(
            (g * torch.randn(g.shape, generator=gen).to(g.device, g.dtype)).sum()
            for g in grads
            if g.requires_grad
        )
        wrt = [*inputs, cotangent]
        if not isinstance(inner, torch.Tensor):  # no gradient depends on anything: all zero
            second = [torch.zeros_like(t) for t in wrt]
        else:
            second = list(
                torch.autograd.grad(inner, wrt, allow_unused=True, materialize_grads=True)
            )
    return dict(zip([*names, "the cotangent"], second, strict=True))


def _check_double_backward(backend: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    if not _with_grad_leaves(contract, args)[1]:
        return
    run = _caller(contract.name)
    with _on(backend, contract.name):
        got = _second_order(run, contract, args)
    with use_backend(REFERENCE):
        want = _second_order(run, contract, args)
    for name, g in got.items():
        compare(g, want[name], f"second-order gradient through '{name}'")


def _caller(op: str) -> Callable[..., Any]:
    entry = ENTRIES[op]

    def run(*args: Any) -> Any:
        return entry(*args)

    return run


def _same(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Equal values, NaN included (router scores hold NaN on purpose)."""
    if old.is_floating_point():
        return old.shape == new.shape and bool(torch.isclose(old, new, 0, 0, equal_nan=True).all())
    return torch.equal(old, new)


def _check_sample(backend: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    op = contract.name
    run = _caller(op)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with _on(backend, op):
        got = call_on_copies(run, contract, args)
    for spec, old, new in zip(contract.args, before, args, strict=True):
        # A mutable argument is written on a copy: the sample's own must not change either.
        if isinstance(old, torch.Tensor) and not _same(old, new):
            raise Mismatch(f"modified its input '{spec.name}'")
    check_meta(contract, args, got[0])
    with use_backend(REFERENCE):
        want = call_on_copies(run, contract, args)
    compare_calls(contract, got, want, "forward")
    if not _with_grad_leaves(contract, args)[1]:
        with _on(backend, op):
            again = call_on_copies(run, contract, args)
        compare_calls(contract, again, got, "repeated call", "the first call")
        return
    # The forward of the gradient run is the repeated call (one kernel launch fewer per sample:
    # under Triton's interpreter that is a third of the kit's time).
    with _on(backend, op):
        again, got_grads = _grads(run, contract, args)
    compare_calls(contract, (again, ()), got, "repeated call", "the first call")
    with use_backend(REFERENCE):
        _, want_grads = _grads(run, contract, args)
    for name, g in got_grads.items():
        compare(g, want_grads[name], f"gradient of '{name}'")


def _non_contiguous(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s values in a non-contiguous view (every other slice of its first dimension longer
    than 1); None when every dimension has size 1 (such a tensor is always contiguous)."""
    dim = next((d for d, n in enumerate(t.shape) if n > 1), None)
    if dim is None:
        return None
    wide = t.new_zeros(*t.shape[:dim], 2 * t.shape[dim], *t.shape[dim + 1 :])
    view = wide[(slice(None),) * dim + (slice(None, None, 2),)]
    return view.copy_(t)


def bad_inputs(
    contract: OpContract, args: tuple[Any, ...]
) -> Iterator[tuple[str, str, tuple[Any, ...], type[Exception]]]:
    """Mutations of a valid sample that break one argument's spec in the contract:
    (argument, what was done, the mutated arguments, the error type the contract promises)."""
    primary = contract.primary.name
    for i, (spec, value) in enumerate(zip(contract.args, args, strict=True)):

        def swap(new: Any, i: int = i) -> tuple[Any, ...]:
            return (*args[:i], new, *args[i + 1 :])

        if isinstance(spec, TensorArg) and isinstance(value, torch.Tensor):
            wrong = next(
                (d for d in (torch.float32, torch.int32, torch.bool) if d not in spec.dtypes), None
            )
            if spec.dtypes and wrong is not None:
                yield spec.name, f"dtype {wrong}", swap(value.to(wrong)), TypeError
            if spec.ndim:
                extra = max(spec.ndim) + 1 - value.dim()
                yield (
                    spec.name,
                    f"{value.dim() + extra}-D",
                    swap(value[(None,) * extra]),
                    ValueError,
                )
            if spec.name != primary and not spec.any_device and value.device.type != "cpu":
                yield spec.name, "on the CPU", swap(value.cpu()), ValueError
            strided = _non_contiguous(value) if spec.mutable else None
            if strided is not None:  # written in place: the contract wants it contiguous
                yield spec.name, "non-contiguous", swap(strided), ValueError
        elif isinstance(spec, IntArg) and value is not None:
            yield spec.name, "a float", swap(value + 0.5), TypeError
            if spec.min is not None:
                yield spec.name, f"{spec.min - 1}", swap(spec.min - 1), ValueError
        elif isinstance(spec, BoolArg):
            yield spec.name, "an int", swap(int(value)), TypeError
        elif isinstance(spec, ChoiceArg):
            yield spec.name, "an unknown name", swap("no such name"), ValueError
        elif isinstance(spec, FloatArg) and value is not None:
            yield spec.name, "a str", swap(str(value)), TypeError


def _check_bad_inputs(backend: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    run = _caller(contract.name)
    for name, what, bad, error in bad_inputs(contract, args):
        try:
            with _on(backend, contract.name):
                run(*bad)
        except error as exc:
            if f"ops.{contract.name}" not in str(exc) or f"'{name}'" not in str(exc):
                raise Mismatch(
                    f"'{name}' as {what} raised {type(exc).__name__} without naming the op "
                    f"and the argument: {exc}"
                ) from None
            continue
        except Exception as exc:
            raise Mismatch(
                f"'{name}' as {what} raised {type(exc).__name__}, the contract says "
                f"{error.__name__}: {exc}"
            ) from None
        raise Mismatch(f"'{name}' as {what} was accepted; the contract says {error.__name__}")


def _check_opcheck(backend: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    leaves, _ = _with_grad_leaves(contract, args)
    # opcheck calls the op several times: mutable arguments get a copy (the sample stays as is).
    leaves = tuple(
        v.clone() if a in contract.mutated else v
        for a, v in zip(contract.args, leaves, strict=True)
    )
    tests: tuple[str, ...] = OPCHECK_TESTS
    if any(isinstance(v, torch.Tensor) and v.dtype in FP8_DTYPES for v in leaves):
        # test_schema compares inputs with arithmetic torch lacks for 8-bit floats on the CPU;
        # every sample's own check already finds a kernel that modifies its inputs.
        tests = tuple(t for t in tests if t != "test_schema")
    with _on(backend, contract.name):
        try:
            torch.library.opcheck(
                getattr(torch.ops.megablocks, contract.name), leaves, test_utils=tests
            )
        except Exception as exc:
            raise Mismatch(f"torch.library.opcheck: {str(exc).splitlines()[0]}") from None


def _check_compile(backend: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    torch._dynamo.reset()  # one fresh graph per op: no recompile limits, no stale guards
    run = _caller(contract.name)
    compiled = torch.compile(_caller(contract.name), fullgraph=True, backend="aot_eager")
    differentiable = bool(_with_grad_leaves(contract, args)[1])
    with _on(backend, contract.name):
        if not differentiable:
            compare_calls(
                contract,
                call_on_copies(compiled, contract, args),
                call_on_copies(run, contract, args),
                "torch.compile",
                "eager",
            )
            return
        got, got_grads = _grads(compiled, contract, args)
        want, want_grads = _grads(run, contract, args)
    compare(got, want, "torch.compile output", "eager")
    for name, g in got_grads.items():
        compare(g, want_grads[name], f"torch.compile gradient of '{name}'", "eager")


# ---------------------------------------------------------------------------
# Row maps across backends


#: The moe_permute ops that write or read a row map. Each is also run inside the whole
#: pipeline (moe_permute_map → moe_permute → moe_unpermute) with the other two on the reference,
#: so that a row map written by one backend and read by another is proven to agree.
ROW_MAP_OPS = ("moe_permute_map", "moe_permute", "moe_unpermute")


def _check_row_map_pairing(label: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    op = contract.name
    routing_map: tuple[Any, ...] | None = None
    if op == "moe_permute_map":
        routing_map = args
        tokens, rows = args[0].shape[0], args[2]
        given_map = None
        like = torch.empty(0, device=args[0].device)
    else:
        given_map = args[1]
        tokens = given_map.shape[0]
        rows = args[3] if op == "moe_permute" else args[0].shape[0]
        like = args[0]
    gen = torch.Generator().manual_seed(tokens + rows)
    hidden = like.shape[1] if like.dim() == 2 else 3
    dtype = like.dtype if like.is_floating_point() else torch.float32
    x = torch.randn(tokens, hidden, generator=gen).to(device=like.device, dtype=dtype)
    slots = (given_map if given_map is not None else args[0]).shape[1]
    probs = torch.rand(tokens, slots, generator=gen).to(device=like.device, dtype=dtype)

    def pipeline() -> torch.Tensor:
        row_map = given_map
        if routing_map is not None:
            row_map, _ = ENTRIES["moe_permute_map"](*routing_map)
        permuted = ENTRIES["moe_permute"](x, row_map, None, rows)
        return ENTRIES["moe_unpermute"](permuted * 2, row_map, probs)

    with use_backend(REFERENCE):
        want = pipeline()
    with _on(label, op):
        got = pipeline()
    compare(
        got, want, f"moe_unpermute(moe_permute(x)) with {op} on {label}, the rest on the reference"
    )
