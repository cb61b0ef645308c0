"""The ahead-of-time compile gate (``megablocks backends compile``): compiled for one AMD and one
NVIDIA target on a few kernels (no GPU needed), its report, its exit code, and its limits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from device_infos import H200, MI300

from megablocks_core import aot
from megablocks_core.archs import LIMITS, limits

pytest.importorskip("triton")

FIELDS = ("kernel", "target", "registers", "spills", "scratch_bytes", "shared_bytes", "occupancy",
          "seconds", "status")  # fmt: skip


def _gate(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    run = subprocess.run(
        [sys.executable, "-m", "megablocks_core.cli", "backends", "compile", *args, "--json"],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert run.stdout.strip(), run.stderr[-3000:]
    return run.returncode, json.loads(run.stdout)


def test_compiles_for_an_amd_and_an_nvidia_target() -> None:
    env = {"MEGABLOCKS_TRITON_GMM_CONFIG": ""}
    rc, report = _gate("triton", "reference", "--target", "gfx942", "--target", "sm_90a",
                       "--shapes", "decode", "--ops", "histogram,gmm", env=env)  # fmt: skip
    assert rc == 0, report
    assert report["ok"] is True
    compiled = [k for k in report["kernels"] if k["backend"] == "triton"]
    for target in ("gfx942", "sm_90a"):
        ours = [k for k in compiled if k["target"] == target]
        assert {k["op"] for k in ours} == {"histogram", "gmm"}
        assert report["summary"][target]["kernels"] == len(ours)  # notes are not kernels
        assert report["summary"][target]["failed"] == 0
        for k in ours:
            assert all(k[f] is not None for f in FIELDS), k
            assert k["status"] == "ok" and k["registers"] > 0 and k["seconds"] > 0
            assert k["occupancy"] > 0
        gemm = [k for k in ours if k["kernel"] == "gmm._gmm_kernel"]
        assert gemm and all(k["shared_bytes"] > 0 for k in gemm)
    assert {k["spill_unit"] for k in compiled} == {"registers", "bytes"}  # AMD, NVIDIA
    assert any(k["options"].get("num_warps") for k in compiled)
    # A backend without the hook is a note, not a failure.
    notes = [k for k in report["kernels"] if k["backend"] == "reference"]
    assert notes and all(k["status"] == "none" for k in notes)
    assert "declares no ahead-of-time kernels" in notes[0]["problems"][0]


def test_a_forced_config_over_the_lds_is_reported_over_the_limit() -> None:
    # 256x256x64 16-bit tiles, 3 stages: two buffered stages of 64 KiB on AMD, CDNA3 has 64 KiB.
    env = {"MEGABLOCKS_TRITON_GMM_CONFIG": "256,256,64,4,8,3"}
    rc, report = _gate("triton", "--target", "gfx942", "--shapes", "decode", "--ops", "gmm",
                       env=env)  # fmt: skip
    assert rc == 1 and report["ok"] is False
    over = [k for k in report["kernels"] if k["status"] == "over-limit"]
    assert over, report["kernels"]
    assert all(k["shared_bytes"] > 64 * 1024 for k in over)
    assert "> 64 KiB per block on gfx942" in over[0]["problems"][0]


def test_a_forced_config_over_the_limit_is_refused_at_launch(monkeypatch) -> None:
    from megablocks_triton import gmm

    monkeypatch.setenv("MEGABLOCKS_TRITON_GMM_CONFIG", "256,256,64,4,8,3")
    with pytest.raises(
        ValueError, match=r"MEGABLOCKS_TRITON_GMM_CONFIG=.*128 KiB.* 64 KiB .*gfx942"
    ):
        gmm.choose_config("gmm", 4096, 2048, 2048, 8, torch.bfloat16, MI300)
    # The H200 has room for it (3 x 64 KiB of 227 KiB): taken as given.
    assert gmm.choose_config("gmm", 4096, 2048, 2048, 8, torch.bfloat16, H200).block_m == 256
    monkeypatch.setenv("MEGABLOCKS_TRITON_GMM_WGRAD_CONFIG", "128,128,64,4,8,2")
    assert gmm.choose_config("wgrad", 2048, 768, 4096, 8, torch.bfloat16, MI300).block_n == 128


def test_a_crashing_compile_is_reported_and_the_rest_compiled(monkeypatch) -> None:
    # A worker that dies in its first job (as LLVM's "Cannot select" aborts the process) and
    # compiles the second when restarted after it.
    script = (
        "import json, os, sys\n"
        "start = int(sys.argv[1])\n"
        "base = dict(backend='fake', target='gfx942', shape='decode')\n"
        "print(json.dumps({'start': start, **base, 'kernel': f'k{start}'}), flush=True)\n"
        "if start == 0:\n"
        "    os.abort()\n"
        "print(json.dumps({'report': {**base, 'kernel': 'k1', 'seconds': 0.1}}))\n"
    )
    monkeypatch.setattr(
        aot, "_worker_command", lambda *args: [sys.executable, "-c", script, str(args[-1])]
    )
    reports = aot.run_gate(["gfx942"], shapes=["decode"], jobs=1)
    assert [(r.kernel, r.status) for r in reports] == [("k0", "crash"), ("k1", "ok")]
    assert reports[0].failed and not reports[1].failed


def test_the_limits_table() -> None:
    kib = {t: lim.shared_memory_per_block // 1024 for t, lim in LIMITS.items()}
    assert kib == {"gfx90a": 64, "gfx942": 64, "gfx950": 160, "sm_80": 163, "sm_90a": 227,
                   "sm_100a": 227}  # fmt: skip
    assert limits("sm_90").target == "sm_90a"
    assert limits("gfx942").device().kind == "rocm"
    with pytest.raises(ValueError, match="unknown target"):
        limits("sm_75")


def test_an_unknown_target_or_backend_is_a_user_error(capsys) -> None:
    from megablocks_core import cli

    assert cli.main(["backends", "compile", "--target", "gfx1100"]) == 2
    assert "unknown target 'gfx1100'" in capsys.readouterr().err
    assert cli.main(["backends", "compile", "nosuch", "--target", "gfx942"]) == 2
    assert "no installed backend named nosuch" in capsys.readouterr().err


_GLUON_JOBS = """
import json
from megablocks_core.archs import limits
from megablocks_core.aot import SHAPES
from megablocks_triton import aot
found = {}
for target in ("sm_80", "sm_90a", "sm_100a", "gfx942"):
    jobs = aot.compile_jobs(limits(target).device(), SHAPES["training"])
    found[target] = sorted({j.kernel for j in jobs if j.op.startswith("gmm_weight_grad")})
print(json.dumps(found))
"""


def test_the_gluon_weight_gradient_is_declared_for_sm90_only() -> None:
    # Built for another arch it aborts the compiler: the launch path's capability check (Hopper
    # only) keeps it off them, and so off the jobs.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _GLUON_JOBS], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert "hopper_wgrad._gmm_wgrad_kernel" in found["sm_90a"]
    assert "gmm._gmm_wgrad_kernel" in found["sm_90a"]  # its alternative, for other calls
    for target in ("sm_80", "sm_100a", "gfx942"):
        assert found[target] == ["gmm._gmm_wgrad_kernel"], target


def test_each_report_comes_as_it_is_compiled(monkeypatch, tmp_path, capsys) -> None:
    """A person watching sees each kernel as it is done (on stderr, at a terminal): the worker
    below compiles its second kernel only once the parent has shown the first."""
    from megablocks_core import cli

    shown = tmp_path / "shown"
    script = (
        "import json, os, sys, time\n"
        "base = dict(backend='fake', target='gfx942', shape='decode')\n"
        "for i in range(2):\n"
        "    print(json.dumps({'start': i, **base, 'kernel': f'k{i}'}), flush=True)\n"
        "    print(json.dumps({'report': {**base, 'kernel': f'k{i}', 'seconds': 0.1}}),"
        " flush=True)\n"
        "    deadline = time.monotonic() + 30\n"
        f"    while i == 0 and not os.path.exists({str(shown)!r}):\n"
        "        if time.monotonic() > deadline:\n"
        "            sys.exit('the first report was not shown while the worker ran')\n"
        "        time.sleep(0.05)\n"
    )
    monkeypatch.setattr(aot, "_worker_command", lambda *args: [sys.executable, "-c", script])

    def show(report: aot.KernelReport) -> None:
        shown.touch()

    reports = aot.run_gate(["gfx942"], shapes=["decode"], jobs=1, on_report=show)
    assert [(r.kernel, r.status) for r in reports] == [("k0", "ok"), ("k1", "ok")]
    # the command shows them on a terminal only
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main(["backends", "compile", "--target", "gfx942", "--shapes", "decode"]) == 0
    err = capsys.readouterr().err
    assert "compiled for gfx942: fake k0: ok, 0.1 s\n" in err and "fake k1" in err, err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert cli.main(["backends", "compile", "--target", "gfx942", "--shapes", "decode"]) == 0
    assert capsys.readouterr().err == ""
