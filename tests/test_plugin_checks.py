"""Plugin descriptors are validated at load, kernels' failures and wrong outputs name backend and
op, a forced broken backend says why, strict mode fails at import, and the conformance kit blames
the op whose kernel is wrong. Every plugin is a real distribution (see fake_plugins)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from fake_plugins import kernels_body, permutation, routing_inputs
from megablocks_reference import kernels as reference

import megablocks_core as mb
from megablocks_core import BackendError, NoKernelError, PluginLoadError, ops, testing
from megablocks_core.activations import ACTIVATIONS


def gather_args():
    x, indices, bin_ids, bins, _ = routing_inputs()
    return x, indices, bin_ids, bins, 2


def broken_reason(plugins, body: str) -> str:
    plugins.add("bad", body)
    record = plugins.reload().plugins["bad"]
    assert record.status == "broken" and record.kernels == ()
    return record.reason


@pytest.mark.parametrize(
    "devices, expected",
    [
        (
            '"cpu"',
            "kernel for 'gather': devices must be a tuple of device kinds such as ('cpu',), got str 'cpu'",
        ),
        ('("gpu",)', "kernel for 'gather': unknown device kind(s) ['gpu']"),
        ('("cpu", "cdua")', "unknown device kind(s) ['cdua']"),
        ("()", "devices must be lowercase kinds"),
    ],
)
def test_bad_device_kinds_break_the_plugin_at_load(plugins, devices, expected):
    reason = broken_reason(
        plugins,
        permutation(
            f"[Kernel(op='gather', fn=recording('gather'), devices={devices}, variant='v1')]"
        ),
    )
    assert expected.replace("'gather'", "'gather' (variant 'v1')") in reason


@pytest.mark.parametrize(
    "kind",
    ["cpu", "cuda", "rocm", "xpu", "npu", "mps", "hpu", "any", "privateuseone", "mtia", "xla"],
)
def test_known_and_torch_device_kinds_are_accepted(plugins, kind):
    plugins.add(
        "fine", permutation(f"[Kernel(op='gather', fn=recording('gather'), devices=[{kind!r}])]")
    )
    record = plugins.reload().plugins["fine"]
    assert record.status == "ok", record.reason
    assert record.kernels[0].devices == (kind,)  # a list is accepted and stored as a tuple


@pytest.mark.parametrize(
    "fn, expected",
    [
        (
            "lambda x, indices: x",
            "cannot take the 7 arguments (x, indices, bin_ids, weights, bins, top_k, rows)",
        ),
        (
            "lambda x, indices, bin_ids, weights, bins, top_k, rows, extra: x",
            "missing a required argument: 'extra'",
        ),
        ("lambda *, x: x", "cannot take the 7 arguments"),
    ],
)
def test_a_kernel_of_the_wrong_arity_breaks_the_plugin_at_load(plugins, fn, expected):
    reason = broken_reason(
        plugins, permutation(f"[Kernel(op='gather', fn={fn}, devices=('cpu',))]")
    )
    assert reason.startswith("TypeError: kernel for 'gather': fn ") and expected in reason, reason


@pytest.mark.parametrize(
    "fn",
    [
        "lambda *args: None",
        "lambda x, indices, *rest: None",
        "lambda x, indices, bin_ids, weights, bins, top_k, extra=1: None",
    ],
)
def test_kernels_that_can_take_the_arguments_load(plugins, fn):
    plugins.add("fine", permutation(f"[Kernel(op='gather', fn={fn}, devices=('cpu',))]"))
    assert plugins.reload().plugins["fine"].status == "ok"


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("tier", "100", "tier must be a megablocks_core.plugin.Tier"),
        ("yields_to", "'triton'", "yields_to must be a tuple of backend names"),
        ("contiguous", "1", "contiguous must be a bool"),
        ("capability", "'sm_90'", "capability must be callable or None"),
        (
            "dtypes",
            "{'x': torch.float32}",
            "dtypes must map argument names to sets of torch dtypes",
        ),
        ("variant", "3", "variant must be a str"),
    ],
)
def test_descriptor_fields_of_the_wrong_type_break_the_plugin(plugins, field, value, expected):
    reason = broken_reason(
        plugins,
        permutation(
            f"[Kernel(op='gather', fn=recording('gather'), devices=('cpu',), {field}={value})]"
        ),
    )
    assert expected in reason, reason


def test_a_forced_broken_plugin_says_why_it_did_not_load(plugins):
    plugins.add("broken", "raise ImportError('libvendor.so: cannot open shared object file')\n")
    plugins.reload({"MEGABLOCKS_BACKEND": "broken", "MEGABLOCKS_PLUGINS": "reference,broken"})
    try:
        with pytest.raises(NoKernelError) as info:
            ops.gather(*gather_args())
        message = str(info.value)
        assert (
            "backend 'broken' was forced for 'gather' by MEGABLOCKS_BACKEND but did not load: broken: "
            "ImportError: libvendor.so: cannot open shared object file" in message
        )
        assert "provides no such op" not in message
    finally:
        plugins.reload()


def test_a_forced_disabled_plugin_says_it_was_disabled(plugins):
    plugins.reload({"MEGABLOCKS_DISABLE_PLUGINS": "reference"})
    with (
        mb.use_backend("reference"),
        pytest.raises(NoKernelError, match="did not load: disabled: excluded"),
    ):
        ops.gather(*gather_args())


def test_strict_mode_raises_without_first_warning_that_the_plugin_was_skipped(plugins, caplog):
    plugins.add("bad", "raise ImportError('kaboom on import')\n")
    with caplog.at_level(logging.WARNING, logger="megablocks_core"), pytest.raises(PluginLoadError):
        plugins.reload({"MEGABLOCKS_STRICT_PLUGINS": "1"})
    assert not any("skipped" in r.getMessage() for r in caplog.records), caplog.records


def test_strict_mode_raises_at_import(plugins):
    plugins.add("bad", "raise ImportError('kaboom on import')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGABLOCKS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(plugins.site()), env.get("PYTHONPATH", "")])
    code = "import megablocks_core\nprint('imported')"
    strict = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "MEGABLOCKS_STRICT_PLUGINS": "1"},
    )
    assert strict.returncode != 0 and "imported" not in strict.stdout
    assert (
        "PluginLoadError: plugin 'bad' failed to load: ImportError: kaboom on import"
        in strict.stderr
    )
    assert "skipped" not in strict.stderr
    lenient = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert (
        lenient.returncode == 0 and "imported" in lenient.stdout
    )  # nothing loads at import otherwise


VENDOR_DEVICE = """
import torch
from megablocks_core import Kernel, Tier, hookimpl
from megablocks_reference import kernels as _reference

# What a vendor's torch extension does on import (torch_npu names its device "npu").
torch.utils.rename_privateuse1_backend("{kind}")


@hookimpl
def megablocks_permutation_kernels():
    return [Kernel(op="gather", fn=_reference.gather, devices=("{kind}",), tier=Tier.VENDOR)]
"""


@pytest.mark.parametrize("kind", ["npu", "myaccel"])
def test_a_vendor_registered_device_kind_is_declarable_and_named_on_the_cli(plugins, kind):
    plugins.add("vendor", VENDOR_DEVICE.format(kind=kind), prelude=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGABLOCKS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(plugins.site()), env.get("PYTHONPATH", "")])
    env["MEGABLOCKS_PLUGINS"] = "reference,vendor"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megablocks_core.cli",
            "backends",
            "explain",
            "gather",
            "--device",
            f"{kind}:0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert (
        f"gather on {kind}:0" in result.stdout and "winner: vendor (highest tier)" in result.stdout
    )


# ---------------------------------------------------------------------------
# Kernels that raise, and (checked mode) kernels whose outputs break the contract


RAISING = """
class VendorError(Exception):
    def __init__(self, code, detail):
        super().__init__(f"status {code}: {detail}")

def gather_value_error(x, indices, bin_ids, weights, bins, top_k):
    raise ValueError("bad launch config")

def scatter_vendor_error(x, indices, bin_ids, weights, bins, top_k):
    raise VendorError(7, "device lost")
"""


def test_a_kernel_exception_names_backend_and_op_and_keeps_type_and_cause(plugins):
    plugins.add(
        "raiser",
        permutation(
            "[Kernel(op='gather', fn=gather_value_error, devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR),"
            " Kernel(op='scatter', fn=scatter_vendor_error, devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR)]",
            RAISING,
        ),
    )
    plugins.reload()
    x, indices, bin_ids, bins, weights = routing_inputs()
    with pytest.raises(ValueError) as info:
        ops.gather(x, indices, bin_ids, bins, 2)
    assert str(info.value) == (
        "megablocks_core.ops.gather: the 'raiser' kernel raised ValueError: bad launch config"
    )
    assert (
        isinstance(info.value.__cause__, ValueError)
        and str(info.value.__cause__) == "bad launch config"
    )
    rows = reference.gather(x, indices, bin_ids, None, bins, 2)
    # An exception type that cannot be rebuilt from a message becomes BackendError (a RuntimeError).
    with pytest.raises(
        BackendError,
        match=r"ops\.scatter: the 'raiser' kernel raised VendorError: "
        r"status 7: device lost",
    ) as info:
        ops.scatter(rows, indices, bin_ids, weights, bins, 2)
    assert type(info.value.__cause__).__name__ == "VendorError"
    with pytest.raises(
        ValueError, match=r"ops\.gather: the 'raiser' kernel raised"
    ):  # also with autograd
        ops.gather(x.requires_grad_(), indices, bin_ids, bins, 2)


WRONG_OUTPUTS = """
def gather_short(x, indices, bin_ids, weights, bins, top_k):
    return _reference.gather(x, indices, bin_ids, weights, bins, top_k)[1:]

def scatter_float64(x, indices, bin_ids, weights, bins, top_k):
    return _reference.scatter(x, indices, bin_ids, weights, bins, top_k).double()

def sort_one_output(x, end_bit):
    return _reference.sort(x, end_bit)[0]
"""


def test_checked_mode_compares_kernel_outputs_with_the_contract(plugins):
    plugins.add(
        "sloppy",
        permutation(
            "[Kernel(op='gather', fn=gather_short, devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR),"
            " Kernel(op='scatter', fn=scatter_float64, devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR)]",
            WRONG_OUTPUTS,
        )
        + "\n@hookimpl\ndef megablocks_routing_kernels():\n"
        "    return [Kernel(op='sort', fn=sort_one_output, devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR)]\n",
    )
    plugins.reload({"MEGABLOCKS_CHECK": "1"})
    x, indices, bin_ids, bins, weights = routing_inputs()
    with pytest.raises(
        BackendError,
        match=r"ops\.gather: the 'sloppy' kernel returned output 'out' of shape "
        r"\(11, 4\) torch.float32 on cpu; the contract says \(12, 4\)",
    ):
        ops.gather(x, indices, bin_ids, bins, 2)
    rows = reference.gather(x, indices, bin_ids, None, bins, 2)
    with pytest.raises(
        BackendError,
        match=r"ops\.scatter: the 'sloppy' kernel .* torch.float64 .* "
        r"the contract says \(6, 4\) torch.float32",
    ):
        ops.scatter(rows, indices, bin_ids, weights, bins, 2)
    with pytest.raises(
        BackendError,
        match=r"ops\.sort: the 'sloppy' kernel returned 1 output\(s\); "
        r"the contract says 2",
    ):
        ops.sort(indices, 4)
    plugins.reload()  # unchecked: the wrong shape goes through (no cost on the hot path)
    assert ops.gather(x, indices, bin_ids, bins, 2).shape == (11, 4)


def test_checked_mode_passes_correct_kernels_with_data_dependent_sizes(only_reference):
    mb.reload({"MEGABLOCKS_CHECK": "1", "MEGABLOCKS_PLUGINS": "reference"})
    x, indices, bin_ids, bins, _ = routing_inputs()
    padded = torch.cumsum(
        torch.diff(bins, prepend=bins.new_zeros(1)).add(3).div(4, rounding_mode="floor").mul(4), 0
    ).int()
    out = ops.padded_gather(x, indices, bin_ids, bins, padded, 2)
    assert out.shape == (int(padded[-1]), 4)


# ---------------------------------------------------------------------------
# The conformance kit blames the op whose kernel is wrong


WRONG_GATHER = """
def gather_wrong(x, indices, bin_ids, weights, bins, top_k):
    out = _reference.gather(x, indices, bin_ids, weights, bins, top_k)
    return out * 2  # wrong; the backward of scatter is a (weighted) gather
"""


def test_the_kit_blames_gather_not_scatter_whose_backward_calls_it(plugins):
    plugins.add(
        "halfright",
        permutation(
            "[Kernel(op='gather', fn=gather_wrong, devices=('cpu',)),"
            " Kernel(op='scatter', fn=recording('scatter'), devices=('cpu',))]",
            WRONG_GATHER,
        ),
    )
    plugins.reload()
    results = {r.op: r for r in testing.check(["halfright"], quick=True, ops=["gather", "scatter"])}
    assert (
        results["gather"].status == "fail" and "forward output 'out'" in results["gather"].message
    )
    assert results["scatter"].status == "pass", results["scatter"].message
    assert "scatter" in plugins.calls("halfright")  # scatter's own kernel was the one checked


OLD_GMM_SCATTER = """
SEEN = []


def gmm_scatter(x, b, indices, bin_ids, weights, bins, top_k, trans_b):
    # Written before gmm_scatter had its activation and row-count options: eight arguments. A
    # plain loop; rows routed to no expert (bin id past the last expert) add nothing.
    SEEN.append(x.clone())
    out = x.new_zeros(indices.shape[0] // top_k, b.shape[1] if trans_b else b.shape[2])
    for i, flat in enumerate(indices.tolist()):
        e = int(bin_ids[i])
        if e < b.shape[0]:
            w = 1.0 if weights is None else weights[flat]
            out[flat // top_k] += w * (x[i] @ (b[e].T if trans_b else b[e]))
    return out
"""


def test_only_trailing_options_may_be_missing_from_a_kernel(plugins):
    """Leaving out gmm_scatter's trans_b (not an option) as well breaks the plugin at load."""
    body = kernels_body(
        "megablocks_grouped_gemm_kernels",
        "[Kernel(op='gmm_scatter', fn=lambda x, b, indices, bin_ids, weights, bins, top_k: x,"
        " devices=('cpu',))]",
    )
    reason = broken_reason(plugins, body)
    assert "cannot take the 13 arguments" in reason and "activation" in reason, reason


def test_a_glu_kernel_must_take_its_activation(plugins):
    """glu's activation is the op itself, not an option the core could apply: a kernel without
    it breaks the plugin at load."""
    body = kernels_body(
        "megablocks_activation_kernels", "[Kernel(op='glu', fn=lambda x: x, devices=('cpu',))]"
    )
    reason = broken_reason(plugins, body)
    assert "cannot take the 4 arguments" in reason and "activation" in reason, reason


def _old_plugin(plugins, hook: str, kernel: str, source: str):
    """The module of plugin "old", loaded with the one kernel ``kernel`` (source text) of
    ``hook``, defined in ``source``."""
    plugins.add("old", kernels_body(hook, f"[{kernel}]", source))
    record = plugins.reload().plugins["old"]
    assert record.status == "ok", record.reason
    return plugins.module("old")


def test_a_kernel_written_before_an_option_existed_still_serves_the_op(plugins):
    """A kernel function without gmm_scatter's trailing ``activation`` loads, and the core gives
    it act(x) in place of x when an activation is asked for (the option's composition), with
    the clamped SwiGLU's constants."""
    module = _old_plugin(
        plugins,
        "megablocks_grouped_gemm_kernels",
        "Kernel(op='gmm_scatter', fn=gmm_scatter, devices=('cpu',))",
        OLD_GMM_SCATTER,
    )
    x, indices, bin_ids, bins, weights = routing_inputs(tokens=5, experts=3, top_k=2, hidden=4)
    rows = torch.randn(10, 4, generator=torch.Generator().manual_seed(3))
    b = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(4))
    for activation in (None, "gelu", "silu", "relu"):
        with mb.use_backend("old"):
            got = mb.ops.gmm_scatter(rows, b, indices, bin_ids, weights, bins, 2, False, activation)
        given = module.SEEN.pop()
        want_rows = rows if activation is None else ACTIVATIONS[activation][0](rows)
        assert torch.equal(given, want_rows), activation
        want = reference.gmm_scatter(want_rows, b, indices, bin_ids, weights, bins, 2, False)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # The clamped SwiGLU is applied (through the dispatched glu) with the call's constants.
    gate_up = torch.randn(10, 8, generator=torch.Generator().manual_seed(5)) * 4
    with mb.use_backend(gmm_scatter="old"):
        ops.gmm_scatter(gate_up, b, indices, bin_ids, weights, bins, 2, False, "swiglu_oai",
                        None, None, 1.25, 1.5)  # fmt: skip
    torch.testing.assert_close(module.SEEN.pop(), reference.glu(gate_up, "silu_oai", 1.25, 1.5))


OLD_GLU = """
CALLS = []


def glu(x, activation):
    # Written before glu had the clamped SwiGLU's constants: it computes GPT-OSS's 1.702 and 7.0.
    CALLS.append(activation)
    return _reference.glu(x, activation)
"""


def test_a_kernel_without_a_choices_parameters_declines_calls_that_set_them(plugins):
    """A glu kernel that takes the activation but not alpha and limit serves the calls that
    leave them at GPT-OSS's defaults; a call that sets one goes to the next kernel (the
    reference), and forced onto it, fails naming the parameter, rather than computing with the
    defaults."""
    calls = _old_plugin(
        plugins,
        "megablocks_activation_kernels",
        "Kernel(op='glu', fn=glu, devices=('cpu',), tier=Tier.VENDOR)",
        OLD_GLU,
    ).CALLS
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)) * 4
    torch.testing.assert_close(ops.glu(x, "silu_oai"), reference.glu(x, "silu_oai"))
    assert calls == ["silu_oai"]
    got = ops.glu(x, "silu_oai", 1.25, 1.5)
    assert calls == ["silu_oai"]  # declined: the reference computed it
    torch.testing.assert_close(got, reference.glu(x, "silu_oai", 1.25, 1.5))
    assert not torch.allclose(got, reference.glu(x, "silu_oai"))
    with mb.use_backend("old"), pytest.raises(NoKernelError, match="takes no 'limit'"):
        ops.glu(x, "silu_oai", limit=1.5)


OLD_GATHER = """
SEEN = []


def gather(x, indices, bin_ids, weights, bins, top_k):
    # Written before gather had its row count: six arguments, every sorted row. A plain loop.
    out = x.new_zeros(indices.shape[0], x.shape[1])
    for i, flat in enumerate(indices.tolist()):
        out[i] = x[flat // top_k] * (1.0 if weights is None else weights[flat])
    SEEN.append(out.shape[0])
    return out
"""


def _unrouted_routing(
    tokens: int = 5, experts: int = 3, top_k: int = 2, seed: int = 5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """indices, bin_ids, bins of tokens * top_k pairs, some routed to no expert (the sentinel
    key ``experts``, sorted last), and the number of routed pairs."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, experts + 1, (tokens * top_k,), generator=gen)
    keys[0] = experts  # at least one unrouted pair
    indices, bin_ids, _, bins, _ = mb.ops.route(keys.int(), experts + 1, 4)
    return indices, bin_ids, bins[:experts], int(bins[experts - 1])


def test_a_kernel_written_before_the_row_count_serves_it(plugins):
    """A gather kernel without the trailing ``rows`` computes every sorted row and the core keeps
    the first ``rows``; a gmm_scatter kernel without it gets x with zero rows appended up to
    every sorted row (and, without ``activation`` either, act(x) first)."""
    plugins.add(
        "old",
        kernels_body(
            "megablocks_permutation_kernels",
            "[Kernel(op='gather', fn=gather, devices=('cpu',))]",
            OLD_GATHER,
        ),
    )
    plugins.add(
        "oldgmm",
        kernels_body(
            "megablocks_grouped_gemm_kernels",
            "[Kernel(op='gmm_scatter', fn=gmm_scatter, devices=('cpu',))]",
            OLD_GMM_SCATTER,
        ),
    )
    registry = plugins.reload()
    assert registry.plugins["old"].status == "ok" and registry.plugins["oldgmm"].status == "ok"
    indices, bin_ids, bins, routed = _unrouted_routing()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(6))
    weights = torch.rand(10, generator=torch.Generator().manual_seed(7))
    rows = routed + 1
    with mb.use_backend("old"):
        got = mb.ops.gather(x, indices, bin_ids, bins, 2, rows)
    assert plugins.module("old").SEEN.pop() == 10  # the old kernel made every row
    want = x[indices.long() // 2][:rows]  # numpy-style oracle: row i is its token's row
    assert got.shape == (rows, 4) and torch.equal(got, want)

    h = torch.randn(rows, 4, generator=torch.Generator().manual_seed(8))
    b = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(9))
    with mb.use_backend("oldgmm"):
        out = mb.ops.gmm_scatter(h, b, indices, bin_ids, weights, bins, 2, False, "relu", rows)
    given = plugins.module("oldgmm").SEEN.pop()
    assert given.shape == (10, 4)
    assert torch.equal(given[:rows], torch.relu(h)) and not given[rows:].any()
    # An independent loop: token t sums w * relu(h[i]) @ b[e] over its routed sorted rows i.
    expected = torch.zeros(5, 6)
    ends = bins.tolist()
    for i, flat in enumerate(indices.tolist()[:routed]):
        e = sum(1 for end in ends if end <= i)
        expected[flat // 2] += weights[flat] * (torch.relu(h[i]) @ b[e])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
