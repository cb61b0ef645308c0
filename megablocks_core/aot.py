"""The ahead-of-time compile gate: ``megablocks backends compile``.

Each backend that implements :meth:`~megablocks_core.hookspecs.BackendHooks.megablocks_compile_jobs`
says, for a GPU arch and a named layer shape (:data:`SHAPES`), which kernels it would launch there
(:class:`CompileJob`: the jit function, its signature, constexprs and launch options; both records
are :mod:`megablocks_core.compile_records`'s). The gate
compiles each for that arch's compiler target, reads back what the compiled kernel uses
(registers, spills, scratch, shared memory / LDS) and checks it against the arch's limits
(:mod:`megablocks_core.archs`). No GPU is needed: Triton compiles for any of its targets on any
host.

Every target is compiled in its own worker process (``python -m megablocks_core.aot``): a
compiler failure may abort the process (LLVM "Cannot select") instead of raising. The parent
reports the job that was running as crashed and starts a new worker after it.

Passing proves that each kernel compiles and fits the arch's limits as the compiler sees them.
It does not run anything: neither results nor speed on the hardware are checked.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from .archs import LIMITS, ArchLimits, limits
from .compile_records import SHAPES, CompileJob, CompileShape
from .descriptors import DeviceInfo


@dataclass
class KernelReport:
    """The gate's finding for one :class:`CompileJob` (or one backend without jobs)."""

    backend: str
    target: str
    shape: str
    kernel: str
    op: str = ""
    variant: str = ""
    status: str = "ok"
    """``ok``, ``spills`` (spilled, see ``spill_reason``), ``over-limit``, ``error``, ``crash``
    or ``none`` (the backend declares no kernels here)."""
    problems: list[str] = field(default_factory=list)
    registers: int | None = None
    """Per thread (NVIDIA) or per lane, VGPRs + AGPRs (AMD)."""
    spills: int | None = None
    spill_unit: str = ""
    """``bytes`` (NVIDIA: ptxas's spill stores per thread) or ``registers`` (AMD: VGPRs spilled
    to scratch memory)."""
    sgpr_spills: int | None = None
    """AMD: scalar registers spilled, into VGPR lanes while ``scratch_bytes`` is 0 (no memory
    traffic): reported, not a failure."""
    scratch_bytes: int | None = None
    shared_bytes: int | None = None
    occupancy: int | None = None
    """Estimated resident warps per SM (NVIDIA) or wavefronts per SIMD (AMD)."""
    num_warps: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    spill_reason: str | None = None

    @property
    def failed(self) -> bool:
        return self.status in ("error", "crash", "over-limit") or (
            self.status == "spills" and not self.spill_reason
        )


# ---------------------------------------------------------------------------------------------
# Compiling one job (in a worker)
# ---------------------------------------------------------------------------------------------

_AMD_FIELDS = re.compile(
    r"\.(vgpr_count|agpr_count|vgpr_spill_count|sgpr_spill_count|private_segment_fixed_size):"
    r"\s+(\d+)"
)
_NV_RESOURCES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores")


def _source(job: CompileJob) -> Any:
    from triton.compiler.compiler import ASTSource  # type: ignore[import-untyped]

    cls = ASTSource
    try:  # Gluon kernels have their own source class (Gluon is experimental: optional here)
        from triton.experimental.gluon._runtime import (  # type: ignore[import-untyped]
            GluonASTSource,
            GluonJITFunction,
        )

        if isinstance(job.fn, GluonJITFunction):
            cls = GluonASTSource
    except ImportError:
        pass
    return cls(job.fn, dict(job.signature), dict(job.constexprs), dict(job.attrs))


def _nvidia_tool(name: str) -> str:
    """The path of one of the NVIDIA tools Triton's wheel bundles (cuobjdump, ptxas, ...)."""
    import triton  # type: ignore[import-untyped]

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _nvidia_resources(compiled: Any, capability: int) -> tuple[int, int, int]:
    """(registers, bytes of spill stores, stack frame bytes) of a compiled kernel: the cubin's
    resource usage as the cuobjdump of Triton's wheel reads it; where it has a stack frame (spills
    live there), :func:`ptxas_log` counts the spills."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run(
            [_nvidia_tool("cuobjdump"), "--dump-resource-usage", cubin],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        found = _NV_RESOURCES.search(out)
        if found is None:
            raise RuntimeError(f"cuobjdump reported no resource usage: {out[-500:]}")
        regs, stack, _, local = (int(v) for v in found.groups())
    if not stack and not local:
        return regs, 0, 0
    spilled = _PTXAS_SPILLS.search(ptxas_log(compiled, capability))
    return regs, int(spilled.group(1)) if spilled else local, stack


def ptxas_log(compiled: Any, capability: int) -> str:
    """What ``ptxas -v`` (Triton's wheel's) says of a compiled kernel's PTX: its resource lines
    and its notes (a cached kernel keeps no log), e.g. a wait it injected between MMAs."""
    arch = re.search(r"\.target\s+(sm_\w+)", compiled.asm["ptx"])
    ptxas = _nvidia_tool("ptxas-blackwell" if capability >= 100 else "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        return subprocess.run(
            [ptxas, "-v", f"--gpu-name={arch.group(1) if arch else f'sm_{capability}'}", ptx,
             "-o", os.path.join(tmp, "out.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip


def compile_job(job: CompileJob, lim: ArchLimits, backend: str, shape: str) -> KernelReport:
    """Compile ``job`` for ``lim``'s target and check what it uses against ``lim``."""
    import triton

    report = KernelReport(
        backend=backend,
        target=lim.target,
        shape=shape,
        kernel=job.kernel,
        op=job.op,
        variant=job.variant,
        options={k: v for k, v in job.options.items() if k != "debug"},
        spill_reason=job.spill_reason,
    )
    start = time.perf_counter()
    try:
        compiled = triton.compile(
            _source(job), target=lim.triton_target(), options=dict(job.options)
        )
    except Exception as exc:
        report.seconds = time.perf_counter() - start
        report.status = "error"
        report.problems.append(f"{type(exc).__name__}: {str(exc).strip()[-2000:]}")
        return report
    report.num_warps = int(compiled.metadata.num_warps)
    report.shared_bytes = int(compiled.metadata.shared)
    if lim.vendor == "amd":
        found = {k: int(v) for k, v in _AMD_FIELDS.findall(compiled.asm["amdgcn"])}
        report.registers = found.get("vgpr_count", 0) + found.get("agpr_count", 0)
        report.spills = found.get("vgpr_spill_count", 0)
        report.sgpr_spills = found.get("sgpr_spill_count", 0)
        report.spill_unit = "registers"
        report.scratch_bytes = found.get("private_segment_fixed_size", 0)
    else:
        assert lim.capability is not None
        report.registers, report.spills, report.scratch_bytes = _nvidia_resources(
            compiled, lim.capability[0] * 10 + lim.capability[1]
        )
        report.spill_unit = "bytes"
    report.seconds = time.perf_counter() - start
    report.occupancy = lim.occupancy(report.num_warps, report.registers, report.shared_bytes)
    _check(report, lim)
    return report


def _check(report: KernelReport, lim: ArchLimits) -> None:
    shared, regs = report.shared_bytes or 0, report.registers or 0
    if shared > lim.shared_memory_per_block:
        report.problems.append(
            f"shared memory {shared / 1024:.1f} KiB > {lim.shared_memory_per_block // 1024} KiB "
            f"per block on {lim.target}"
        )
    if regs > lim.registers_per_thread:
        report.problems.append(
            f"{regs} registers > {lim.registers_per_thread} per thread on {lim.target}"
        )
    threads = (report.num_warps or 0) * lim.warp_size
    if threads > 1024:
        report.problems.append(f"{threads} threads > 1024 per block")
    if report.problems:
        report.status = "over-limit"
    elif report.spills:
        report.status = "spills"
        report.problems.append(f"spills {report.spills} {report.spill_unit}")


# ---------------------------------------------------------------------------------------------
# The worker: one target, every backend's jobs, one JSON line per event
# ---------------------------------------------------------------------------------------------


def _plugins(names: Sequence[str]) -> list[tuple[str, importlib.metadata.EntryPoint]]:
    from .hookspecs import ENTRY_POINT_GROUP

    found = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    wanted = set(names)
    unknown = wanted - {ep.name for ep in found}
    if unknown:
        raise ValueError(f"no installed backend named {', '.join(sorted(unknown))}")
    return [(ep.name, ep) for ep in found if not wanted or ep.name in wanted]


def _jobs_of(plugin: object, device: DeviceInfo, shape: CompileShape) -> list[CompileJob] | None:
    """The plugin's jobs, or None where it does not implement the hook."""
    import pluggy

    from .hookspecs import PROJECT_NAME, BackendHooks

    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(BackendHooks)
    pm.register(plugin)
    impls = pm.hook.megablocks_compile_jobs.get_hookimpls()
    if not impls:
        return None
    jobs: list[CompileJob] = []
    for impl in impls:
        returned = cast("Iterable[CompileJob] | None", impl.function(device=device, shape=shape))
        jobs.extend(returned or ())
    return jobs


def _emit(event: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _note(index: int, base: Mapping[str, str], kernel: str, status: str, problem: str) -> None:
    """A report of a backend's jobs rather than of a kernel (none declared, or the hook raised)."""
    _emit({"start": index, **base, "kernel": kernel})
    report = KernelReport(base["backend"], base["target"], base["shape"], kernel, status=status)
    report.problems.append(problem)
    _emit({"report": dataclasses.asdict(report)})


def worker(target: str, backends: Sequence[str], shapes: Sequence[str], ops: Sequence[str],
           start: int) -> int:  # fmt: skip
    """Compile every job for ``target`` from index ``start`` on (an earlier worker's crash
    skips the job that crashed), writing JSON lines: ``{"start": i, ...}`` before job ``i``,
    ``{"report": ...}`` after it."""
    lim = limits(target)
    device = lim.device()
    index = 0
    for name, ep in _plugins(backends):
        for shape_name in shapes:
            shape = SHAPES[shape_name]
            base = dict(backend=name, target=lim.target, shape=shape_name)
            try:
                jobs = _jobs_of(ep.load(), device, shape)
            except Exception as exc:
                if index >= start:
                    _note(index, base, "(compile jobs)", "error", f"{type(exc).__name__}: {exc}")
                index += 1
                continue
            if not jobs:
                if index >= start:
                    none = "declares no ahead-of-time kernels" if jobs is None else ""
                    _note(index, base, "-", "none", none or f"no kernels for {lim.target}")
                index += 1
                continue
            for job in jobs:
                if ops and job.op not in ops:
                    continue
                if index >= start:
                    _emit({"start": index, **base, "kernel": job.kernel, "op": job.op,
                           "variant": job.variant})  # fmt: skip
                    _emit({"report": dataclasses.asdict(compile_job(job, lim, name, shape_name))})
                index += 1
    return 0


# ---------------------------------------------------------------------------------------------
# The parent: workers per target (at most ``jobs`` at once), the report, the exit code
# ---------------------------------------------------------------------------------------------


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the interpreter compiles nothing
    return env


def _worker_command(
    target: str, backends: Sequence[str], shapes: Sequence[str], ops: Sequence[str], start: int
) -> list[str]:
    cmd = [sys.executable, "-m", "megablocks_core.aot", "--worker", target,
           "--shapes", ",".join(shapes), "--start", str(start)]  # fmt: skip
    if backends:
        cmd += ["--backends", ",".join(backends)]
    if ops:
        cmd += ["--ops", ",".join(ops)]
    return cmd


def _run_target(target: str, backends: Sequence[str], shapes: Sequence[str],
                ops: Sequence[str], on_report: Callable[[KernelReport], None] | None = None,
                ) -> list[KernelReport]:  # fmt: skip
    reports: list[KernelReport] = []

    def found(report: KernelReport) -> None:
        reports.append(report)
        if on_report is not None:
            on_report(report)

    start = 0
    while True:
        cmd = _worker_command(target, backends, shapes, ops, start)
        # The worker's reports are read as they come (progress); its stderr goes to a file, as
        # a pipe nobody reads could fill up and stall it.
        with (
            tempfile.TemporaryFile("w+") as errors,
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=errors, text=True, env=_worker_env()
            ) as proc,
        ):
            assert proc.stdout is not None
            running: dict[str, Any] | None = None
            for line in proc.stdout:
                if not line.startswith("{"):
                    continue  # a compiler's own output
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "start" in event:
                    running = event
                elif "report" in event:
                    found(KernelReport(**event["report"]))
                    running = None
            returncode = proc.wait()
            errors.seek(0)
            stderr = errors.read().strip()
        if returncode == 0:
            return reports
        if running is None:  # died outside a job: nothing to skip
            found(KernelReport(
                backend=",".join(backends) or "*", target=target, shape=",".join(shapes),
                kernel="(worker)", status="crash",
                problems=[f"worker exited {returncode}: {stderr[-1500:]}"],
            ))  # fmt: skip
            return reports
        crash = KernelReport(
            backend=running["backend"], target=running["target"], shape=running["shape"],
            kernel=running["kernel"], op=running.get("op", ""),
            variant=running.get("variant", ""), status="crash",
        )  # fmt: skip
        tail = stderr.splitlines()[-3:]
        crash.problems.append(f"compiler process died ({returncode}): " + " | ".join(tail))
        found(crash)
        start = int(running["start"]) + 1


def _validate(targets: Sequence[str], backends: Sequence[str], shapes: Sequence[str]) -> None:
    """ValueError for an unknown target, backend or shape, before any work."""
    for t in targets:
        limits(t)
    _plugins(backends)
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"unknown shape {s!r} (known: {', '.join(SHAPES)})")


def run_gate(targets: Sequence[str], backends: Sequence[str] = (),
             shapes: Sequence[str] = ("training", "decode"), ops: Sequence[str] = (),
             jobs: int = 2, on_report: Callable[[KernelReport], None] | None = None,
             ) -> list[KernelReport]:  # fmt: skip
    """Compile every backend's jobs for every target (one worker process each, ``jobs`` at
    once) and return the reports, in target order. ``on_report`` is called with each report as
    it comes (from the workers' threads)."""
    _validate(targets, backends, shapes)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(_run_target, t, backends, shapes, ops, on_report) for t in targets]
        return [r for f in futures for r in f.result()]


def _progress_line(report: KernelReport) -> str:
    what = f"{report.op} {report.variant}".strip()
    return (
        f"compiled for {report.target}: {report.backend} {report.kernel}"
        + (f" ({what})" if what else "")
        + f": {report.status}, {report.seconds:.1f} s"
    )


def _summary(reports: Iterable[KernelReport]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in reports:
        s = out.setdefault(
            r.target,
            {"kernels": 0, "errors": 0, "over_limit": 0, "spills": 0, "failed": 0, "seconds": 0.0},
        )
        if r.status == "none":
            continue
        s["kernels"] += 1
        s["errors"] += r.status in ("error", "crash")
        s["over_limit"] += r.status == "over-limit"
        s["spills"] += bool(r.spills)
        s["failed"] += r.failed
        s["seconds"] = round(s["seconds"] + r.seconds, 2)
    return out


def _table(reports: Sequence[KernelReport], wall: float) -> str:
    lines = [
        f"{'backend':8} {'target':8} {'shape':8} {'op, variant':64} {'kernel':34} {'regs':>4} "
        f"{'spill':>6} {'scr':>5} {'shared':>8} {'occ':>3} {'s':>5}  status"
    ]
    for r in reports:

        def num(v: int | None) -> str:
            return "-" if v is None else str(v)

        shared = "-" if r.shared_bytes is None else f"{r.shared_bytes / 1024:.1f}K"
        status = r.status + (f": {'; '.join(r.problems)}" if r.problems else "")
        if r.status == "spills" and r.spill_reason:
            status += f" (accepted: {r.spill_reason})"
        lines.append(
            f"{r.backend:8} {r.target:8} {r.shape:8} {(r.op + ' ' + r.variant)[:64]:64} "
            f"{r.kernel[:34]:34} {num(r.registers):>4} {num(r.spills):>6} "
            f"{num(r.scratch_bytes):>5} {shared:>8} {num(r.occupancy):>3} {r.seconds:5.1f}  "
            f"{status[:400]}"
        )
    lines.append("")
    for target, s in _summary(reports).items():
        lines.append(
            f"{target}: {s['kernels']} kernels, {s['errors']} errors, {s['over_limit']} over "
            f"the limit, {s['spills']} spilling, {s['failed']} failed ({s['seconds']:.1f} s "
            "compiling)"
        )
    lines.append(f"wall time {wall:.1f} s")
    return "\n".join(lines)


def _names(option: str, text: str, noun: str) -> list[str]:
    """A comma list given to ``option``; ValueError when it names no ``noun`` (``--target ''``
    must not mean every target)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"{option} {text!r} names no {noun}")
    return names


def _ops(text: str) -> list[str]:
    """``--ops``: known op names only (an unknown one would compile nothing and pass)."""
    from .contracts import BY_NAME

    ops = _names("--ops", text, "op")
    unknown = [op for op in ops if op not in BY_NAME]
    if unknown:
        raise ValueError(
            f"--ops: unknown op(s) {', '.join(map(repr, unknown))}; ops: {', '.join(sorted(BY_NAME))}"
        )
    return ops


def main(args: argparse.Namespace) -> int:
    """``megablocks backends compile``: run the gate; 1 when any kernel failed."""
    try:
        named = [t for spec in args.target for t in _names("--target", spec, "target")]
        targets = named or list(LIMITS)
        shapes = _names("--shapes", args.shapes, "shape")
        ops = _ops(args.ops) if args.ops is not None else []
        if args.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
        _validate(targets, args.names, shapes)
    except ValueError as exc:  # a user mistake: one line, exit status 2 (as the CLI's others)
        print(f"megablocks: error: {exc}", file=sys.stderr)
        return 2
    from .cli_common import progress

    start = time.perf_counter()
    reports = run_gate(
        targets, args.names, shapes, ops, jobs=args.jobs,
        on_report=lambda report: progress(_progress_line(report)),
    )  # fmt: skip
    wall = time.perf_counter() - start
    failed = any(r.failed for r in reports)
    if args.json:
        print(json.dumps({
            "ok": not failed, "wall_seconds": round(wall, 2), "summary": _summary(reports),
            "kernels": [dataclasses.asdict(r) for r in reports],
        }, indent=1))  # fmt: skip
    else:
        print(_table(reports, wall))
    return 1 if failed else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``megablocks backends compile``."""
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help="backends to compile (default: all installed)"
    )
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        help=f"compiler target, repeatable or comma list: {', '.join(LIMITS)} (default: all)",
    )
    parser.add_argument(
        "--shapes",
        default="training,decode",
        help=f"comma list of layer shapes: {', '.join(SHAPES)} (default: both)",
    )
    parser.add_argument("--ops", help="only these ops' kernels (comma list; default: every op)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="targets compiled at once, one process each, at least 1 (default 2)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _worker_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m megablocks_core.aot")
    parser.add_argument("--worker", required=True, metavar="TARGET")
    parser.add_argument("--shapes", default="training,decode")
    parser.add_argument("--backends", default="")
    parser.add_argument("--ops", default="")
    parser.add_argument("--start", type=int, default=0)
    args = parser.parse_args(argv)
    split = lambda text: [v for v in text.split(",") if v]  # noqa: E731
    return worker(
        args.worker, split(args.backends), split(args.shapes), split(args.ops), args.start
    )


if __name__ == "__main__":
    raise SystemExit(_worker_main(sys.argv[1:]))
