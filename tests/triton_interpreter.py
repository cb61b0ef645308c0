"""Test-only workaround for a Triton 3.6 interpreter bug (compiled kernels are unaffected).

Applied once by ``conftest.py``. (The interpreter's other known bug, triton-lang/triton#9171 with
numpy >= 2.4, is avoided by pinning numpy < 2.4 in the test environment; the triton plugin reports
it as unavailable.)
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def apply_shims() -> None:
    """Work around a Triton 3.6 interpreter bug (test-only; compiled kernels are unaffected):
    tl.dot on bf16 multiplies the raw uint16 bit patterns (the interpreter stores bf16 as
      uint16 and only converts fp8 before np.matmul).
    """
    if not interpreting() or importlib.util.find_spec("triton") is None:
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    if getattr(ti.InterpreterBuilder.create_dot, "_megablocks_shim", False):
        return
    create_dot = ti.InterpreterBuilder.create_dot

    def _bf16_to_f32(h: object) -> object:
        if h.dtype != tl.bfloat16:
            return h
        bits = h.data.astype(np.uint32) << 16
        return ti.TensorHandle(bits.view(np.float32), tl.float32)

    def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        return create_dot(self, _bf16_to_f32(a), _bf16_to_f32(b), d, input_precision,
                          max_num_imprecise_acc)  # fmt: skip

    _create_dot._megablocks_shim = True  # type: ignore[attr-defined]
    ti.InterpreterBuilder.create_dot = _create_dot
    ti.interpreter_builder.create_dot = _create_dot.__get__(ti.interpreter_builder)
