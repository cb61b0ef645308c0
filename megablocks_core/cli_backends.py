"""``megablocks backends list / explain / check``: the commands that inspect the installed
backends (``compile``, the ahead-of-time gate, lives in :mod:`megablocks_core.aot`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from . import __version__, contracts, dispatch, ranking
from .cli_common import CLIError, _device, _registry, _table, progress
from .descriptors import TensorMeta
from .ranking import Trace
from .schema import BoolArg, ChoiceArg, IntArg, TensorArg


def _parse_dtypes(op: str, items: Sequence[str]) -> dict[str, torch.dtype]:
    """``bfloat16`` applies to every tensor argument that accepts it; ``x=bfloat16`` to one, over
    a dtype for all. Two dtypes for one argument at the same level are an error, not the last."""
    contract = contracts.BY_NAME[op]
    for_all: dict[str, torch.dtype] = {}
    for_one: dict[str, torch.dtype] = {}
    for item in items:
        arg, _, name = item.rpartition("=")
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise CLIError(f"unknown dtype {name!r} (try bfloat16, float16, float32, int32, int64)")
        targets = [
            a
            for a in contract.tensor_args
            if (not arg or a.name == arg) and (not a.dtypes or dtype in a.dtypes)
        ]
        if not targets:
            raise CLIError(f"{op} has no tensor argument {arg or ''} that accepts {name}")
        chosen = for_one if arg else for_all
        for a in targets:
            given = chosen.setdefault(a.name, dtype)
            if given != dtype:
                raise CLIError(
                    f"--dtype {item!r}: {a.name} is given {str(given).removeprefix('torch.')} "
                    f"and {name}"
                )
    return for_all | for_one


def _parse_shapes(op: str, items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``--shape ARG=DIMxDIM…`` items: each names a tensor argument of ``op`` once, with one
    non-negative size per dimension, as many dimensions as the argument may have."""
    tensors = {a.name: a for a in contracts.BY_NAME[op].tensor_args}
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, equals, dims = (part.strip() for part in item.partition("="))
        where = f"--shape {item!r}"
        if not equals or not name or not dims:
            raise CLIError(f"{where}: expected ARG=DIMxDIM…, e.g. a=32768x4096")
        spec = tensors.get(name)
        if spec is None:
            raise CLIError(
                f"{where}: {op} has no tensor argument {name!r} (it has {', '.join(tensors)})"
            )
        if name in shapes:
            raise CLIError(f"{where}: {name} is given twice")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise CLIError(f"{where}: sizes must be integers joined by x, got {dims!r}") from None
        if any(d < 0 for d in shape):
            raise CLIError(f"{where}: sizes must be at least 0, got {dims!r}")
        if spec.ndim and len(shape) not in spec.ndim:
            raise CLIError(f"{where}: {name} is a {spec.describe()}, got {len(shape)}-D")
        shapes[name] = shape
    return shapes


def _trace_dict(trace: Trace) -> dict[str, Any]:
    return {
        "op": trace.op,
        "device": str(trace.device),
        "device_kind": trace.device.kind,
        "dtypes": {k: str(v).removeprefix("torch.") for k, v in trace.dtypes.items()},
        "policy": trace.policy.describe(),
        "winner": trace.winner.label if trace.winner else None,
        "why": trace.why,
        "fallback": trace.fallback,
        "error": trace.error,
        "cost_tier": [k.label for k in trace.cost_tier],
        "candidates": [
            {
                "backend": c.kernel.backend,
                "variant": c.kernel.variant,
                "tier": c.kernel.tier.label,
                "devices": list(c.kernel.devices),
                "accepted": c.accepted,
                "reason": c.reason,
            }
            for c in trace.candidates
        ],
    }


def cmd_list(args: argparse.Namespace) -> int:
    plugins = list(_registry().plugins.values())
    if args.json:
        print(
            json.dumps(
                {"core_version": __version__, "plugins": [p.as_dict() for p in plugins]}, indent=2
            )
        )
        return 0
    if not plugins:
        print("no backends installed (pip install megablocks-reference)")
        return 0
    status_text = {"ok": "ok", "unavailable": "unavailable here"}
    rows = [
        [
            p.name,
            f"{p.distribution or '?'} {p.version or ''}".strip(),
            status_text.get(p.status, p.status),
            ", ".join(p.device_kinds) or "-",
            str(len(p.ops)),
        ]
        for p in plugins
    ]
    print(_table(rows, ["backend", "distribution", "status", "devices", "ops"]))
    for p in plugins:
        if p.reason:
            print(f"\n{p.name}: {p.reason}")
        for problem in p.problems:
            print(f"\n{p.name}: its {problem.what} did not load: {problem.reason}")
    if args.verbose:
        for p in plugins:
            print(f"\n{p.name} provides: {', '.join(p.ops) or 'nothing'}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    if args.op not in contracts.BY_NAME or not contracts.BY_NAME[args.op].dispatched:
        names = ", ".join(c.name for c in contracts.ALL if c.dispatched)
        raise CLIError(f"unknown op {args.op!r}; ops: {names}")
    shapes = _parse_shapes(args.op, args.shape)
    trace = dispatch.explain(args.op, _device(args.device), _parse_dtypes(args.op, args.dtype))
    not_loaded = [
        (name, problem)
        for name, record in _registry().plugins.items()
        for problem in record.problems_for(args.op)
    ]
    if shapes and trace.winner:
        _check_given_call(args.op, trace, shapes)
    if args.json:
        report = _trace_dict(trace)
        report["not_loaded"] = [
            {"backend": name, "variant": problem.variant, "reason": problem.reason}
            for name, problem in not_loaded
        ]
        if shapes:
            [call] = _explain_calls(args.op, trace, shapes).values()
            kernel, why = dispatch.explain_call(trace, call)
            report["call"] = {
                "shapes": {name: list(dims) for name, dims in shapes.items()},
                "kernel": kernel.label if kernel else None,
                "why": why,
            }
        print(json.dumps(report, indent=2))
        return 0 if trace.winner else 1
    dtypes = ", ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in trace.dtypes.items())
    print(f"{args.op} on {trace.device}" + (f" with {dtypes}" if dtypes else ""))
    print(f"policy: {trace.policy.describe()}\n")
    rows = [
        [
            c.kernel.label,
            c.kernel.tier.label,
            ", ".join(c.kernel.devices),
            "yes" if c.accepted else "no",
            c.reason,
        ]
        for c in trace.candidates
    ]
    print(
        _table(rows, ["candidate", "tier", "devices", "eligible", "reason"])
        if rows
        else "no candidates"
    )
    for name, problem in not_loaded:
        print(f"not loaded: {name}'s {problem.what}: {problem.reason}")
    if trace.winner:
        print(f"\nwinner: {trace.winner.label} ({trace.why})")
        if trace.cost_tier:
            _print_cost_choices(trace, _explain_calls(args.op, trace, shapes))
        elif trace.per_call or shapes:  # shape predicates only, or the winner for any shape
            for label, call in _explain_calls(args.op, trace, shapes).items():
                kernel, why = dispatch.explain_call(trace, call)
                print(f"{label}: {kernel.label if kernel else 'no kernel'} ({why})")
        if trace.fallback:
            print(
                "note: this is the portable fallback; no kernel specific to this device can serve it"
            )
        return 0
    print(f"\nno winner: {trace.error}", file=sys.stderr)
    return 1


class _GivenCall(dict[str, Any]):
    """A call built from ``--shape``: remembers the arguments a shape check or cost hint asked
    for and was not given (they would otherwise read as the kernel declining the call)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.missing: list[str] = []

    def __missing__(self, key: str) -> Any:
        self.missing.append(key)
        raise KeyError(key)


def _given_call(op: str, metas: dict[str, TensorMeta]) -> _GivenCall:
    """The call of ``--shape``: its tensors, every other argument at its default (an optional
    tensor not given: None, absent)."""
    call = _GivenCall(metas)
    for arg in contracts.BY_NAME[op].args:
        if arg.name in call:
            continue
        if isinstance(arg, TensorArg):
            if arg.optional:
                call[arg.name] = None
        elif isinstance(arg, BoolArg | IntArg):
            if isinstance(arg, BoolArg) or arg.optional or arg.default is not None:
                call[arg.name] = arg.default
        elif isinstance(arg, ChoiceArg):
            call[arg.name] = None
    return call


def _check_given_call(op: str, trace: Trace, shapes: dict[str, tuple[int, ...]]) -> None:
    """Make the choice for the ``--shape`` call once: CLIError when a shape check or cost hint
    read an argument ``--shape`` did not give."""
    [call] = _explain_calls(op, trace, shapes).values()
    dispatch.explain_call(trace, call)
    if trace.cost_tier:
        ranking.estimates(trace, call)
    assert isinstance(call, _GivenCall)
    missing = list(dict.fromkeys(call.missing))
    if not missing:
        return
    tensor_args = contracts.BY_NAME[op].tensor_args
    unshaped = [name for name in missing if any(a.name == name for a in tensor_args)]
    others = [name for name in missing if name not in unshaped]
    if unshaped:  # a check stops at the first one it lacks: name the others not given too
        rest = [a.name for a in tensor_args if not a.optional and a.name not in shapes]
        raise CLIError(
            f"--shape: the choice of {op}'s kernel for this call reads {', '.join(unshaped)}, "
            "not given: add "
            + " ".join(f"--shape {name}=DIMxDIM" for name in unshaped)
            + f" (the tensors not given: {', '.join(rest)})"
        )
    raise CLIError(
        f"--shape: the choice of {op}'s kernel for this call reads {', '.join(others)}, which "
        "--shape cannot give"
    )


def _explain_calls(
    op: str, trace: Trace, shapes: dict[str, tuple[int, ...]]
) -> dict[str, dict[str, Any]]:
    """Calls to show per-shape choices for: the ``--shape`` items (:func:`_parse_shapes`), else
    well-known model shapes."""
    from .shapes import SHAPES

    def meta(name: str, shape: tuple[int, ...]) -> TensorMeta:
        spec = contracts.BY_NAME[op].arg(name)
        if not isinstance(spec, TensorArg):
            raise KeyError(name)  # only tensors have shapes
        allowed = spec.dtypes
        fallback = (
            torch.bfloat16 if not allowed or torch.bfloat16 in allowed else min(allowed, key=str)
        )
        return TensorMeta(shape, trace.dtypes.get(name) or fallback, trace.device.type)

    if shapes:
        call = _given_call(op, {name: meta(name, dims) for name, dims in shapes.items()})
        label = " ".join(f"{name}={'x'.join(map(str, dims))}" for name, dims in shapes.items())
        return {label: call}
    calls = {}
    for label, (tokens, hidden, ffn, experts, top_k) in SHAPES.items():
        rows = tokens * top_k
        if op == "gmm":
            calls[label] = {
                "a": meta("a", (rows, hidden)),
                "b": meta("b", (experts, hidden, ffn)),
                "batch_sizes": meta("batch_sizes", (experts,)),
                "trans_b": False,
            }
        elif op == "gmm_weight_grad":
            calls[label] = {
                "a": meta("a", (rows, hidden)),
                "grad": meta("grad", (rows, ffn)),
                "batch_sizes": meta("batch_sizes", (experts,)),
            }
    return calls


def _print_cost_choices(trace: Trace, calls: dict[str, dict[str, Any]]) -> None:
    print(
        "per call shape, the lowest cost hint (estimated µs) wins among "
        f"{', '.join(k.label for k in trace.cost_tier)}:"
    )
    if not calls:
        print("  (pass --shape ARG=DIMxDIM… to see one call's choice)")
        return
    rows = []
    for label, call in calls.items():
        values = [v for _, v in ranking.estimates(trace, call)]
        kernel, _ = dispatch.explain_call(trace, call)
        rows.append(
            [
                label,
                *(f"{v:.1f}" if v is not None else "no estimate" for v in values),
                kernel.label if kernel else "-",
            ]
        )
    print(_table(rows, ["shape", *(k.label for k in trace.cost_tier), "chosen"]))


def _ops(names: str | None, dispatched: Sequence[str]) -> list[str] | None:
    """``--ops a,b`` as a list of dispatched ops (None: all of them)."""
    if names is None:
        return None
    ops = [op.strip() for op in names.split(",") if op.strip()]
    unknown = [op for op in ops if op not in dispatched]
    if unknown or not ops:
        raise CLIError(
            f"--ops: {', '.join(unknown) or 'no op named'} "
            f"(dispatched ops: {', '.join(dispatched)})"
        )
    return ops


def cmd_check(args: argparse.Namespace) -> int:
    from . import testing

    _device(args.device, runs=True)  # a clear error for a device this host cannot use
    installed = _registry().plugins
    unknown = [name for name in args.names if name not in installed]
    if unknown:
        raise CLIError(
            f"backend(s) {', '.join(unknown)} not installed "
            f"(installed: {', '.join(sorted(installed)) or 'none'})"
        )
    oracle = installed.get(testing.REFERENCE)
    if oracle is None or oracle.status != "ok":
        raise CLIError(
            "the reference backend is the conformance kit's oracle: install megablocks-reference "
            "(and do not disable it)"
        )
    ops = _ops(args.ops, testing.DISPATCHED)
    labels = {
        "pass": "pass",
        "fail": "FAIL",
        "not provided": "not provided",
        "unavailable": "unavailable here",
    }

    def checked(r: testing.Result) -> None:
        progress(f"checked {r.op} on {r.backend}: {labels[r.status]} ({r.seconds:.1f} s)")

    results = testing.check(
        args.names or None, device=args.device, quick=args.quick, ops=ops, progress=checked
    )
    # A run that compared nothing proves nothing: it must not pass.
    scenarios = sum(r.scenarios for r in results if r.status == "pass")
    ok = testing.passed(results, required=args.names) and scenarios > 0
    unchecked = [
        f"megablocks: nothing of {name} could be checked on {args.device}"
        for name in args.names
        if not any(r.backend == name and r.status == "pass" for r in results)
    ]
    if not scenarios and not args.names:
        others = [
            name
            for name, record in installed.items()
            if name != testing.REFERENCE and record.status != "disabled"
        ]
        unchecked.append(
            f"megablocks: nothing was checked on {args.device}: "
            + (
                "no backend but the reference (the kit's oracle) is installed and enabled"
                if not others
                else f"none of {', '.join(others)} could run an op here"
            )
        )
    if args.json:
        print(
            json.dumps(
                {
                    "device": args.device,
                    "quick": args.quick,
                    "passed": ok,
                    "scenarios": scenarios,
                    "results": [r.as_dict() for r in results],
                },
                indent=2,
            )
        )
        for line in unchecked:
            print(line, file=sys.stderr)
        return 0 if ok else 1
    backends = list(dict.fromkeys(r.backend for r in results))
    cells = {(r.op, r.backend): labels[r.status] for r in results}
    ops = list(dict.fromkeys(r.op for r in results))
    print(
        _table(
            [[op, *(cells.get((op, b), "-") for b in backends)] for op in ops], ["op", *backends]
        )
    )
    for r in results:
        if r.status == "fail":
            print(f"\nFAIL {r.backend}: {r.message}")
    for backend, reason in dict.fromkeys(
        (r.backend, r.message) for r in results if r.status == "unavailable"
    ):
        print(f"\n{backend}: unavailable here: {reason}")
    counts = {s: sum(r.status == s for r in results) for s in labels}
    print(
        f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['not provided']} not provided, "
        f"{counts['unavailable']} unavailable here; on {args.device}"
        f"{' (--quick)' if args.quick else ''} in {sum(r.seconds for r in results):.1f} s"
    )
    for line in unchecked:
        print(line, file=sys.stderr)
    return 0 if ok else 1
