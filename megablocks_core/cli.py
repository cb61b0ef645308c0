"""The ``megablocks`` command line: its parser, ``main``, and the ``contracts``, ``demo`` and ``bench``
commands (the benchmark loaded from the source checkout). The ``backends`` commands are in
:mod:`megablocks_core.cli_backends` (``compile`` in :mod:`megablocks_core.aot`); what every command
shares (:class:`CLIError`, the registry, ``--device``) in :mod:`megablocks_core.cli_common`."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from . import __version__, contracts, docgen
from .cli_backends import cmd_check, cmd_explain, cmd_list
from .cli_common import CLIError, _device, _registry
from .formats import FORMAT_NAMES
from .policy import Policy
from .ranking import NoKernelError
from .registry import PluginLoadError
from .validation import ContractError, ContractTypeError

__all__ = [
    "BENCHMARK_MODULE",
    "CLIError",
    "benchmark_path",
    "build_parser",
    "load_benchmark",
    "main",
]

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
        fp8=args.fp8,
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
        "--device",
        default="cpu",
        help="torch device, e.g. cpu or cuda:0 (default cpu; one this host lacks is described)",
    )
    explain.add_argument(
        "--dtype",
        action="append",
        default=[],
        metavar="[ARG=]DTYPE",
        help="dtype of the call's tensors (repeatable), e.g. bfloat16 or x=float16 (one "
        "argument's dtype overrides a dtype for all)",
    )
    explain.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="ARG=DIMxDIM",
        help="a tensor argument's shape, sizes of 0 or more, e.g. a=32768x4096 (repeatable; give "
        "each tensor the choice reads): shows which kernel a call of that shape gets (default, "
        "where cost hints decide: mixtral, qwen3, dsv3, tiny)",
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
    check.add_argument(
        "--ops",
        metavar="OP[,OP...]",
        help="only these ops (comma-separated; default: every dispatched op), e.g. to split "
        "the full set over several processes",
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
    demo.add_argument(
        "--fp8",
        default=None,
        choices=FORMAT_NAMES,
        help="run the experts' GEMMs in FP8 in this format (default: off)",
    )
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
