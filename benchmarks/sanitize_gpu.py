"""Bad data and valid calls of every installed GPU backend, to run under compute-sanitizer.

A GPU reports an out-of-bounds access only when it leaves the process's memory; memcheck
reports every one. Run on an NVIDIA GPU:

    compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python benchmarks/sanitize_gpu.py --device cuda:0

For each installed backend that serves the device (triton, cuda; the reference backend is the
oracle) it runs the bad-data cases of ``megablocks_core.testing.bad_data`` and the ops on the
conformance kit's quick scenarios (compared with the reference), prints one line per backend and
exits non-zero on a failure. Shapes are small: the sanitizer slows kernels by ~100x.

Environment, set here before torch loads (an explicit setting wins):

* ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: one cudaMalloc per tensor. With torch's caching
  allocator a tensor sits inside a larger block and an access just past it stays invisible to
  memcheck.
* ``MEGABLOCKS_CHECK`` is removed: the data rules must stay off so bad data reaches the kernels.
* Triton needs nothing special under compute-sanitizer (its kernels are ordinary cubins launched
  with cuLaunchKernel); the first run compiles them, slowly, into ``TRITON_CACHE_DIR``.
* ``--device cpu`` sets ``TRITON_INTERPRET=1`` (Triton's kernels on the CPU, where an
  out-of-bounds access is a segfault), to try the script without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _prepare_env(device: str) -> None:
    os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    os.environ.pop("MEGABLOCKS_CHECK", None)
    if device.startswith("cpu"):
        os.environ["TRITON_INTERPRET"] = "1"


def _valid_calls(backend: str, device: str, ops: list[str]) -> tuple[list[str], int]:
    """Each op on the quick scenarios, compared with the reference backend: (failures, calls)."""
    import torch

    from megablocks_core import NoKernelError, use_backend
    from megablocks_core.contracts import BY_NAME
    from megablocks_core.entries import ENTRIES
    from megablocks_core.testing import QUICK, Mismatch, routing, sample
    from megablocks_core.testing.kit import call_on_copies, compare_calls

    failures, calls = [], 0
    for scenario in QUICK:
        r = routing(scenario, device)
        for op in ops:
            args = sample(op, r)
            try:
                # On copies of any argument the op writes in place (its outputs are compared too).
                with use_backend("reference"):
                    want = call_on_copies(ENTRIES[op], BY_NAME[op], args)
                with use_backend(backend, "reference", **{op: backend}):
                    got = call_on_copies(ENTRIES[op], BY_NAME[op], args)
                if torch.device(device).type == "cuda":
                    torch.cuda.synchronize(device)
                compare_calls(BY_NAME[op], got, want, "valid call")
                calls += 1
            except NoKernelError:  # the backend does not serve this sample (dtype, shape)
                continue
            except Mismatch as exc:
                failures.append(f"{op} ({scenario.name}): {exc}")
            except Exception as exc:  # a kernel error, or a device fault
                failures.append(f"{op} ({scenario.name}): {type(exc).__name__}: {str(exc)[:200]}")
    return failures, calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument(
        "--backends", nargs="*", help="default: every installed backend serving the device"
    )
    parser.add_argument("--ops", nargs="*", help="default: every op the backend provides")
    args = parser.parse_args(argv)
    _prepare_env(args.device)

    import torch

    from megablocks_core.devices import describe
    from megablocks_core.dispatch import registry
    from megablocks_core.testing import DISPATCHED, bad_data

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"sanitize_gpu: no CUDA device for {device}", file=sys.stderr)
        return 2
    info = describe(device)
    reg = registry()
    names = args.backends or [n for n in reg.backend_names if n != "reference"]
    failed = False
    for name in names:
        record = reg.plugins.get(name)
        if record is None or record.status != "ok":
            print(
                f"{name}: skipped ({'not installed' if record is None else record.reason or record.status})"
            )
            continue
        ops = [op for op in (args.ops or DISPATCHED) if op in record.ops]
        start = time.perf_counter()
        failures, ran = bad_data.run(name, device, ops=ops)
        valid, calls = _valid_calls(name, str(device), ops)
        seconds = time.perf_counter() - start
        if ran == 0 and calls + len(valid) == 0:  # ops without bad data still run valid calls
            print(f"{name}: skipped (serves none of the cases on {info.kind})")
            continue
        ok = not failures and not valid
        failed |= not ok
        print(
            f"{name}: {'PASS' if ok else 'FAIL'}  bad-data cases {ran - len(failures)}/{ran} ok, "
            f"valid calls {calls}/{calls + len(valid)} ok, {seconds:.1f} s on {device}"
        )
        for failure in failures:
            print(f"  bad data: {failure.case}: {failure.message}")
        for line in valid:
            print(f"  valid call: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
