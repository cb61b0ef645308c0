"""Compiling a Gluon kernel for sm_90 on a host without a GPU, for the tests of the Hopper kernels.

Triton's own compiler and ptxas build the cubin; the CUDA driver is replaced by a stand-in that
only names the target. It runs in a fresh process: outside the Triton interpreter, which the CPU
test run enables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

#: Run before a test's own script: the stand-in driver, and the names such scripts use.
_PRELUDE = """
import json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver

class Sm90(CudaDriver):
    def __init__(self):
        pass
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
    def get_current_device(self):
        return 0
    def get_current_stream(self, device=None):
        return 0

driver.set_active(Sm90())
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

def report(compiled):
    from megablocks_core.aot import _nvidia_resources, ptxas_log
    registers, spills, _ = _nvidia_resources(compiled, 90)
    print(json.dumps({"ptx": compiled.asm["ptx"], "cubin": len(compiled.asm["cubin"]),
                      "shared": compiled.metadata.shared, "registers": registers,
                      "spills": spills, "ptxas_log": ptxas_log(compiled, 90)}))
"""


def compile_sm90(script: str, *args: str) -> dict[str, Any]:
    """Runs ``script`` (which compiles a kernel with ``warmup`` and passes the result to
    ``report``) with ``args`` as sys.argv[1:]; checks that it targets sm_90a, that ptxas built a
    cubin and that its shared memory fits the 227 KB a block gets; returns the PTX, the cubin's
    size, the shared memory it uses, its registers a thread, the bytes it spills (as the
    compile gate counts them) and ptxas's log (``ptxas_log``)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run(
        [sys.executable, "-c", _PRELUDE + script, *args],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    built: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    assert ".target sm_90a" in built["ptx"]
    assert built["cubin"] > 0  # ptxas accepted it
    assert built["shared"] <= 227 * 1024
    return built
