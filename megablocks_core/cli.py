"""The ``megablocks`` command line."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from . import __version__, contracts, dispatch, docgen, ranking
from .descriptors import DeviceInfo, TensorMeta
from .devices import describe
from .ranking import Trace
from .schema import TensorArg


class CLIError(Exception):
    """A user error: printed on stderr, exit status 2."""


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
    will run ops there, so the device must exist (``explain`` describes any device)."""
    dispatch.registry()
    try:
        info = describe(torch.device(text))
    except (RuntimeError, ValueError) as exc:
        raise CLIError(f"device {text!r}: {str(exc).splitlines()[0]}") from exc
    if runs and info.type not in ("cpu", "meta", "cuda"):  # cuda: describe() has checked it
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
                "priority": c.kernel.priority,
                "devices": list(c.kernel.devices),
                "accepted": c.accepted,
                "reason": c.reason,
            }
            for c in trace.candidates
        ],
    }


def cmd_list(args: argparse.Namespace) -> int:
    plugins = list(dispatch.registry().plugins.values())
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
    trace = dispatch.explain(args.op, _device(args.device), _parse_dtypes(args.op, args.dtype))
    if args.json:
        print(json.dumps(_trace_dict(trace), indent=2))
        return 0 if trace.winner else 1
    dtypes = ", ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in trace.dtypes.items())
    print(f"{args.op} on {trace.device}" + (f" with {dtypes}" if dtypes else ""))
    print(f"policy: {trace.policy.describe()}\n")
    rows = [
        [
            c.kernel.label,
            str(c.kernel.priority),
            ", ".join(c.kernel.devices),
            "yes" if c.accepted else "no",
            c.reason,
        ]
        for c in trace.candidates
    ]
    print(
        _table(rows, ["candidate", "priority", "devices", "eligible", "reason"])
        if rows
        else "no candidates"
    )
    if trace.winner:
        print(f"\nwinner: {trace.winner.label} ({trace.why})")
        if trace.cost_tier:
            _print_cost_choices(trace, _explain_calls(args.op, trace, args.shape))
        elif trace.per_call:  # shape predicates only
            for label, call in _explain_calls(args.op, trace, args.shape).items():
                kernel, why = dispatch.explain_call(trace, call)
                print(f"{label}: {kernel.label if kernel else 'no kernel'} ({why})")
        if trace.fallback:
            print(
                "note: this is the portable fallback; no kernel specific to this device can serve it"
            )
        return 0
    print(f"\nno winner: {trace.error}", file=sys.stderr)
    return 1


def _explain_calls(op: str, trace: Trace, shapes: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Calls to show per-shape choices for: ``--shape ARG=AxB`` items, else well-known model shapes."""
    from .layers.shapes import SHAPES

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
        for item in shapes:
            name, _, dims = item.partition("=")
            try:
                call[name] = meta(name, tuple(int(d) for d in dims.lower().split("x")))
            except (ValueError, KeyError) as exc:
                raise CLIError(
                    f"--shape {item!r}: expected ARG=DIMxDIM… for an argument of {op}"
                ) from exc
        return {" ".join(shapes): call}
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
    results = testing.check(args.names or None, device=args.device, quick=args.quick)
    ok = testing.passed(results, required=args.names)
    for name in args.names:
        if not any(r.backend == name and r.status == "pass" for r in results):
            print(
                f"megablocks: nothing of {name} could be checked on {args.device}", file=sys.stderr
            )
    if args.json:
        print(
            json.dumps(
                {
                    "device": args.device,
                    "quick": args.quick,
                    "passed": ok,
                    "results": [r.as_dict() for r in results],
                },
                indent=2,
            )
        )
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
    return 0 if ok else 1


def cmd_contracts(args: argparse.Namespace) -> int:
    print(docgen.render_markdown(), end="")
    return 0


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def cmd_demo(args: argparse.Namespace) -> int:
    from .layers import demo

    _device(args.device, runs=True)
    _positive(args, "tokens", "experts", "top_k")
    if args.steps < 2:
        raise CLIError(f"--steps must be at least 2, got {args.steps}")
    if args.top_k > args.experts:
        raise CLIError(f"--top-k ({args.top_k}) cannot exceed --experts ({args.experts})")
    if args.backend:
        installed = dispatch.registry().plugins
        unknown = [
            n for n in args.backend.split(",") if n.strip().partition("/")[0] not in installed
        ]
        if unknown:
            raise CLIError(
                f"--backend: {', '.join(unknown)} not installed "
                f"(installed: {', '.join(sorted(installed))})"
            )
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
        metavar="ARG=DIMS",
        help="an argument's shape, e.g. a=32768x4096 (repeatable): shows which kernel a "
        "call of that shape gets when cost hints decide (default: mixtral, qwen3, dsv3, tiny)",
    )
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.set_defaults(func=cmd_explain)
    check = backend_commands.add_parser(
        "check", help="run the conformance kit: each op a backend provides, against the reference"
    )
    check.add_argument(
        "names", nargs="*", metavar="NAME", help="backends to check (default: all installed)"
    )
    check.add_argument(
        "--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default cpu)"
    )
    check.add_argument(
        "--quick", action="store_true", help="a few scenarios instead of the full set"
    )
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=cmd_check)

    contracts_cmd = commands.add_parser("contracts", help="print every op's contract as Markdown")
    contracts_cmd.set_defaults(func=cmd_contracts)

    demo = commands.add_parser(
        "demo",
        help="train a tiny MoE model on synthetic data; show the loss falling and which backend ran each op",
    )
    demo.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    demo.add_argument(
        "--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default cpu)"
    )
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    demo.add_argument(
        "--backend",
        default=None,
        metavar="NAME[,NAME]",
        help="backend preference as in use_backend() (default: the normal ranking)",
    )
    demo.add_argument("--tokens", type=int, default=256, help="tokens per step (default 256)")
    demo.add_argument("--experts", type=int, default=8)
    demo.add_argument("--top-k", type=int, default=2)
    demo.add_argument("--seed", type=int, default=0)
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
        "scatter, padded_gather, padded_scatter, scatter_wgrad, gmm, gmm_train, layer",
    )
    bench.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device (default: cuda when torch sees one, else cpu)",
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
    except (CLIError, ValueError, RuntimeError) as exc:
        print(f"megablocks: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
