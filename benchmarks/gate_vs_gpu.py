"""On a GPU: are the kernels the compile gate checks for this GPU's target the ones it runs?

The compile gate (``megablocks backends compile --target sm_90a``) lists megablocks-triton's
launches at its shapes on a *simulated* device of the target and compiles them on the CPU. Here,
on the real GPU, the same op calls (``megablocks_triton.aot``'s list and the FP8 ops' of
``megablocks_triton.scaled.compile_calls``, at each gate shape) run for
real on zero-filled tensors of those shapes (values do not change which kernel variant a launch
takes: no launch reads a size on the host). Then every kernel Triton compiled in this process is
compared with the gate's jobs. The comparison key is the kernel, its source's specialisation
hash (signature, constexprs, alignment and divisibility attributes) and its warps and stages:

* ``ran_not_gated``: compiled and run here, not among the gate's jobs (the gate misses it);
* ``gated_not_ran``: among the gate's jobs, not run here (the gate checks a variant this GPU
  does not take);
* ``warps_differ``: the same kernel variant with other warps than the gate's job (expected for
  Gluon warp-specialized kernels, which report their workers' warps too);

once for the gate's simulated device (what CI checks) and once for this GPU's own description.
Exit status 1 if a kernel ran that the CI gate does not check, or a gate call failed on the GPU
(``calls_failed``: each call's error; the other calls still run).

    python benchmarks/gate_vs_gpu.py [--shapes training,decode] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any
from unittest import mock

import torch

Key = tuple[str, str, int, int]


def gate_keys(device: Any, shapes: Iterable[Any]) -> dict[Key, str]:
    """Key → "op: variant" of every compile job megablocks-triton lists for ``device``."""
    from megablocks_triton import aot
    from triton.compiler.compiler import make_backend  # type: ignore[import-untyped]

    from megablocks_core.aot import _source
    from megablocks_core.plugin import device_limits

    lim = device_limits(device)
    if lim is None:
        raise SystemExit(f"gate_vs_gpu: no compile target for {device.arch}")
    backend = make_backend(lim.triton_target())
    keys: dict[Key, str] = {}
    for shape in shapes:
        for job in aot.compile_jobs(device, shape):
            options = backend.parse_options(dict(job.options))
            key = (job.kernel, _source(job).hash(), options.num_warps, options.num_stages)
            keys.setdefault(key, f"{job.op}: {job.variant}")
    return keys


def _jit_functions() -> Iterator[Any]:
    from triton.runtime.jit import JITFunction  # type: ignore[import-untyped]

    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("megablocks_triton") or module is None:
            continue
        for value in vars(module).values():
            if isinstance(value, JITFunction) and id(value) not in seen:
                seen.add(id(value))
                yield value


def compiled_keys() -> set[Key]:
    """Every kernel Triton compiled in this process, from each jit function's caches."""
    from megablocks_triton.aot import kernel_name

    keys: set[Key] = set()
    for fn in _jit_functions():
        for kernel_cache, *_ in fn.device_caches.values():
            for compiled in kernel_cache.values():
                meta = compiled.metadata
                keys.add((kernel_name(fn), compiled.src.hash(), meta.num_warps, meta.num_stages))
    return keys


def run_gate_calls(shapes: Iterable[Any], device: Any) -> list[str]:
    """The gate's op calls (and declared variants) at ``shapes``, run on zero-filled CUDA tensors;
    returns the calls that raised (each one's error), so one bad call does not hide the rest."""
    from megablocks_triton import aot, scaled

    def real(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device="cuda")

    failed: list[str] = []

    def attempt(label: str, call: Any) -> None:
        try:
            call()
        except Exception as exc:
            failed.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")

    with mock.patch.object(aot, "_meta", real), mock.patch.object(scaled, "_meta", real):
        for shape in shapes:
            for dtype in shape.dtypes:
                label = f"{shape.name} {str(dtype).removeprefix('torch.')}"
                for op, call in aot._op_calls(shape, dtype):
                    attempt(f"{label} {op}", call)
                    for alternative in aot._alternatives(op, device, shape, dtype):
                        attempt(f"{label} {op} (variant)", alternative)
            for op, call in scaled.compile_calls(shape, device):  # FP8, as the gate lists them
                attempt(f"{shape.name} {op} (FP8)", call)
    torch.cuda.synchronize()
    return failed


def _label(key: Key) -> str:
    kernel, source_hash, warps, stages = key
    return f"{kernel} w{warps} s{stages} {source_hash[:12]}"


def _variant(key: Key) -> tuple[str, str, int]:
    kernel, source_hash, _, stages = key
    return kernel, source_hash, stages


def compare(ran: set[Key], gate: dict[Key, str]) -> dict[str, Any]:
    """The ran kernels against the gate's jobs. A kernel matches a job by name, specialisation hash
    and stages; warps are compared apart (``warps_differ``), because a Gluon warp-specialized
    kernel reports its total warps, its default partition's and its workers' in whole warpgroups
    (hopper_wgrad launched with 8 and a 1-warp loader reports 12), not the num_warps it asked for."""
    gated_warps: dict[tuple[str, str, int], set[int]] = {}
    for key in gate:
        gated_warps.setdefault(_variant(key), set()).add(key[2])
    ran_variants = {_variant(key) for key in ran}
    return {
        "ran": len(ran),
        "gated": len(gate),
        "ran_not_gated": sorted(_label(k) for k in ran if _variant(k) not in gated_warps),
        "gated_not_ran": sorted(
            f"{v} ({k[0]} w{k[2]} s{k[3]})"
            for k, v in gate.items()
            if _variant(k) not in ran_variants
        ),
        "warps_differ": sorted(
            f"{_label(k)} (gated w{'/w'.join(map(str, sorted(gated_warps[_variant(k)])))})"
            for k in ran
            if _variant(k) in gated_warps and k[2] not in gated_warps[_variant(k)]
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="training,decode")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--gate-only",
        metavar="TARGET",
        help="only list the CI gate's keys for TARGET (e.g. sm_90a; no GPU needed)",
    )
    args = parser.parse_args(argv)
    from megablocks_core.aot import SHAPES
    from megablocks_core.archs import limits

    shapes = [SHAPES[name] for name in args.shapes.split(",")]
    if args.gate_only:
        keys = gate_keys(limits(args.gate_only).device(), shapes)
        print(json.dumps(sorted(_label(k) for k in keys), indent=1))
        return 0
    if not torch.cuda.is_available():
        print("gate_vs_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    from megablocks_core.devices import describe
    from megablocks_core.plugin import device_limits

    here = describe(torch.device("cuda"))
    lim = device_limits(here)
    if lim is None:
        print(f"gate_vs_gpu: the gate has no target for {here.arch}", file=sys.stderr)
        return 2
    simulated = limits(lim.target).device()
    failed = run_gate_calls(shapes, here)
    ran = compiled_keys()
    result = {
        "device": here.name,
        "target": lim.target,
        "shapes": [s.name for s in shapes],
        "calls_failed": failed,
        "ci_gate": compare(ran, gate_keys(simulated, shapes)),
        "this_gpu": compare(ran, gate_keys(here, shapes)),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 1 if result["ci_gate"]["ran_not_gated"] or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
