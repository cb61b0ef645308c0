"""The ``megablocks`` command line."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from . import __version__, contracts, dispatch, docgen, ranking
from .descriptors import DeviceInfo, TensorMeta
from .devices import describe
from .policy import Policy, environment_policy
from .ranking import NoKernelError, Trace
from .registry import PluginLoadError, Registry
from .schema import TensorArg
from .validation import ContractError, ContractTypeError


class CLIError(Exception):
    """A user error: printed on stderr, exit status 2."""


#: What the user can put right (an option's value, the environment, the installed plugins, inputs
#: an op's contract rejects): one line on stderr, exit status 2. Any other exception is a bug and
#: propagates with its traceback, so that it is not mistaken for a wrong option.
USER_ERRORS: tuple[type[Exception], ...] = (
    CLIError,
    ContractError,
    ContractTypeError,
    NoKernelError,
    PluginLoadError,
)


def _registry() -> Registry:
    """The plugin registry, once MEGABLOCKS_BACKEND is known to name only real ops (loading the
    registry reports a bad one as a ValueError, which outside this check would read as a bug)."""
    try:
        environment_policy(os.environ)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    return dispatch.registry()


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    return "\n".join(lines)


def _device(text: str, runs: bool = False) -> DeviceInfo:
    """Describe a ``--device`` value, after the plugins have loaded: a vendor's torch extension
    (imported by its plugin) may register the device type (e.g. ``npu``). ``runs``: the command
    will run ops there, so the device must exist and hold data (``explain`` describes any
    device, ``meta`` included)."""
    _registry()
    try:
        info = describe(torch.device(text))
    except (RuntimeError, ValueError) as exc:
        raise CLIError(f"device {text!r}: {str(exc).splitlines()[0]}") from exc
    if runs and info.type == "meta":
        raise CLIError(f"device {text!r}: meta tensors hold no data, so no op can run there")
    if runs and info.type not in ("cpu", "cuda"):  # cuda: describe() has checked it
        module = getattr(torch, info.type, None)
        available = getattr(module, "is_available", None)
        if callable(available) and not available():
            raise CLIError(f"device {text!r}: torch sees no {info.type} device")
    return info


def _parse_dtypes(op: str, items: Sequence[str]) -> dict[str, torch.dtype]:
    """``bfloat16`` applies to every tensor argument that accepts it; ``x=bfloat16`` to one."""
    contract = contracts.BY_NAME[op]
    chosen: dict[str, torch.dtype] = {}
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
        chosen.update({a.name: dtype for a in targets})
    return chosen


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
    if args.json:
        report = _trace_dict(trace)
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
        call: dict[str, Any] = {"trans_b": False}
        call.update({name: meta(name, dims) for name, dims in shapes.items()})
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
    results = testing.check(args.names or None, device=args.device, quick=args.quick)
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
    labels = {
        "pass": "pass",
        "fail": "FAIL",
        "not provided": "not provided",
        "unavailable": "unavailable here",
    }
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


def cmd_contracts(args: argparse.Namespace) -> int:
    print(docgen.render_markdown(), end="")
    return 0


#: Bounds of the demo's sizes. Memory grows with the rows routed per step (tokens × top-k) and the
#: synthetic task's 1 KiB per token: at the largest, 65536 tokens × top-k 4 with 256 experts, a
#: two-step run on the CPU peaks at about 1.2 GiB.
DEMO_MAX_TOKENS = 65536
DEMO_MAX_ROUTED_ROWS = 262144
DEMO_MAX_EXPERTS = 256
#: torch seeds lie in [-2**63, 2**64); the demo also seeds with seed + 1.
DEMO_MAX_SEED = 2**63 - 1


def _in_range(args: argparse.Namespace, name: str, low: int, high: int | None = None) -> None:
    value = getattr(args, name)
    option = f"--{name.replace('_', '-')}"
    if value < low:
        raise CLIError(f"{option} must be at least {low}, got {value}")
    if high is not None and value > high:
        raise CLIError(f"{option} must be at most {high}, got {value}")


def _backend_policy(spec: str) -> Policy:
    """``--backend``, read as MEGABLOCKS_BACKEND is (:meth:`Policy.parse`), naming only known ops
    and installed backends."""
    policy = Policy.parse(spec, source="--backend")
    if policy.is_default:
        raise CLIError(f"--backend {spec!r} names no backend")
    unknown_ops = [op for op, _ in policy.per_op if op not in contracts.BY_NAME]
    if unknown_ops:
        raise CLIError(
            f"--backend {spec!r}: unknown op(s) {', '.join(map(repr, unknown_ops))}; "
            f"ops: {', '.join(sorted(contracts.BY_NAME))}"
        )
    unnamed = [op for op, backend in policy.per_op if not backend]
    if unnamed:
        raise CLIError(f"--backend {spec!r}: no backend after {'=, '.join(unnamed)}=")
    installed = _registry().plugins
    named = [*policy.prefer, *([policy.force] if policy.force else [])]
    named += [backend for _, backend in policy.per_op]
    missing = [n for n in dict.fromkeys(named) if n.partition("/")[0] not in installed]
    if missing:
        raise CLIError(
            f"--backend: {', '.join(missing)} not installed "
            f"(installed: {', '.join(sorted(installed))})"
        )
    return policy


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    _device(args.device, runs=True)
    _in_range(args, "steps", 2)
    _in_range(args, "tokens", 1, DEMO_MAX_TOKENS)
    _in_range(args, "experts", 1, DEMO_MAX_EXPERTS)
    _in_range(args, "top_k", 1)
    _in_range(args, "seed", 0, DEMO_MAX_SEED)
    if args.top_k > args.experts:
        raise CLIError(f"--top-k ({args.top_k}) cannot exceed --experts ({args.experts})")
    if args.tokens * args.top_k > DEMO_MAX_ROUTED_ROWS:
        raise CLIError(
            f"--tokens × --top-k ({args.tokens} × {args.top_k}) must be at most "
            f"{DEMO_MAX_ROUTED_ROWS} rows routed per step"
        )
    if args.backend:
        _backend_policy(args.backend)
    return demo.run(
        steps=args.steps,
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        tokens=args.tokens,
        experts=args.experts,
        top_k=args.top_k,
        seed=args.seed,
    )


#: The name the benchmark module is loaded under (:func:`load_benchmark`).
BENCHMARK_MODULE = "megablocks_bench"


def benchmark_path() -> Path | None:
    """``benchmarks/bench.py`` of the source checkout that holds this package, or None (an installed
    wheel has no benchmark: it needs MegaBlocks, grouped_gemm and the checkout's docs beside it)."""
    package = Path(__file__).resolve().parent
    for root in (
        package.parent,
        package.parent.parent,
    ):  # <root>/megablocks_core or <root>/<dir>/megablocks_core
        candidate = root / "benchmarks" / "bench.py"
        if candidate.is_file():
            return candidate
    return None


def load_benchmark() -> ModuleType:
    """Import the checkout's benchmark (once per process)."""
    loaded = sys.modules.get(BENCHMARK_MODULE)
    if loaded is not None:
        return loaded
    path = benchmark_path()
    if path is None:
        raise CLIError(
            "the benchmark runs from a source checkout (benchmarks/bench.py beside the "
            "megablocks_core package); this installation has none"
        )
    spec = importlib.util.spec_from_file_location(BENCHMARK_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[BENCHMARK_MODULE] = module  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[BENCHMARK_MODULE]
        raise
    return module


def cmd_bench(args: argparse.Namespace) -> int:
    bench = load_benchmark()
    _device(args.device, runs=True)
    return int(bench.main(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megablocks",
        description="Mixture-of-Experts ops with pluggable backends: inspect backends and run examples.",
    )
    parser.add_argument("--version", action="version", version=f"megablocks-core {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    backends = commands.add_parser("backends", help="list installed backends and explain choices")
    backend_commands = backends.add_subparsers(dest="backends_command", metavar="SUBCOMMAND")
    backend_commands.required = True
    listing = backend_commands.add_parser("list", help="installed plugins: status, devices, ops")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.add_argument("-v", "--verbose", action="store_true", help="also list each plugin's ops")
    listing.set_defaults(func=cmd_list)
    explain = backend_commands.add_parser(
        "explain", help="every candidate for an op on a device, why it was accepted or rejected"
    )
    explain.add_argument("op", help="op name, e.g. gather or gmm")
    explain.add_argument(
        "--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default cpu)"
    )
    explain.add_argument(
        "--dtype",
        action="append",
        default=[],
        metavar="[ARG=]DTYPE",
        help="dtype of the call's tensors (repeatable), e.g. bfloat16 or x=float16",
    )
    explain.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="ARG=DIMxDIM",
        help="a tensor argument's shape, sizes of 0 or more, e.g. a=32768x4096 (repeatable): shows "
        "which kernel a call of that shape gets (default, where cost hints decide: mixtral, "
        "qwen3, dsv3, tiny)",
    )
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.set_defaults(func=cmd_explain)
    check = backend_commands.add_parser(
        "check",
        help="run the conformance kit: each op a backend provides, against the reference",
        description="Run the conformance kit: each op a backend provides, against the reference. "
        "Exit status 1 if a check fails or if nothing could be checked (no backend but the "
        "reference, or none that can run on the device).",
    )
    check.add_argument(
        "names", nargs="*", metavar="NAME", help="backends to check (default: all installed)"
    )
    check.add_argument(
        "--device",
        default="cpu",
        help="torch device that can run ops, e.g. cpu or cuda:0 (default cpu; not meta)",
    )
    check.add_argument(
        "--quick", action="store_true", help="a few scenarios instead of the full set"
    )
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=cmd_check)
    from . import aot  # the ahead-of-time compile gate lives in its own module

    compile_gate = backend_commands.add_parser(
        "compile",
        help="compile each backend's kernels for GPU targets (no GPU needed) and check them "
        "against each arch's limits",
    )
    aot.add_arguments(compile_gate)
    compile_gate.set_defaults(func=aot.main)

    contracts_cmd = commands.add_parser("contracts", help="print every op's contract as Markdown")
    contracts_cmd.set_defaults(func=cmd_contracts)

    demo = commands.add_parser(
        "demo",
        help="train a tiny MoE model on synthetic data; show the loss falling and which backend ran each op",
    )
    demo.add_argument(
        "--steps", type=int, default=40, help="training steps, at least 2 (default 40)"
    )
    demo.add_argument(
        "--device",
        default="cpu",
        help="torch device that can run ops, e.g. cpu or cuda:0 (default cpu; not meta)",
    )
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    demo.add_argument(
        "--backend",
        default=None,
        metavar="SPEC",
        help="backend choice, written as MEGABLOCKS_BACKEND is: NAME forces one backend, "
        "NAME,NAME prefers them in order, OP=NAME[/VARIANT] forces one op's "
        "(e.g. gather=triton,reference); default: the normal ranking",
    )
    demo.add_argument(
        "--tokens",
        type=int,
        default=256,
        help=f"tokens per step, 1 to {DEMO_MAX_TOKENS} (default 256)",
    )
    demo.add_argument(
        "--experts", type=int, default=8, help=f"experts, 1 to {DEMO_MAX_EXPERTS} (default 8)"
    )
    demo.add_argument(
        "--top-k",
        type=int,
        default=2,
        help=f"experts per token, 1 to --experts; --tokens × --top-k at most "
        f"{DEMO_MAX_ROUTED_ROWS} (default 2)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed, 0 to 2**63-1 (default 0)")
    demo.set_defaults(func=cmd_demo)

    bench = commands.add_parser(
        "bench",
        help="time every installed provider of each op against peers and the hardware limit",
    )
    bench.add_argument(
        "--shapes",
        default="",
        help="comma list of named shapes: mixtral, qwen3, dsv3, tiny "
        "(default unless --shape is given: mixtral,qwen3,dsv3 on accelerators, tiny on the CPU)",
    )
    bench.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="T,H,F,E,K",
        help="a custom shape (repeatable)",
    )
    bench.add_argument(
        "--ops",
        default="",
        help="comma list of ops (default: all): routing, gather, "
        "scatter, padded_gather, padded_scatter, scatter_wgrad, gmm, gmm_train, layer, "
        "host (CUDA)",
    )
    bench.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device that can run ops (default: cuda when torch sees one, else cpu; "
        "not meta)",
    )
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    bench.add_argument(
        "--layer-experts",
        default="mlp,glu",
        metavar="KINDS",
        help="the layer item's expert MLPs, comma list of mlp, glu (default: mlp,glu)",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument(
        "--no-peers", action="store_true", help="skip torch / MegaBlocks / grouped_gemm peers"
    )
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except USER_ERRORS as exc:
        print(f"megablocks: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
