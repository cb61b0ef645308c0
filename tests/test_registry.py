"""Plugin discovery, ranking, caching and overrides, through real entry points.

Every fake backend here is a real distribution (dist-info + entry_points.txt +
module) written into tmp_path and found by importlib.metadata; the registry's
internals are never patched. Fake kernels record their calls and delegate to
the reference kernels, so results stay correct.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from fake_plugins import permutation, routing_inputs
from megablocks_reference import kernels as reference

import megablocks_core as mb
from megablocks_core import DeviceInfo, NoKernelError, PluginLoadError, ops

CPU = DeviceInfo(kind="cpu", type="cpu", name="CPU")
F32 = {"x": torch.float32}
BF16 = {"x": torch.bfloat16}


def fast_plugin(
    plugins,
    name="fast",
    ops_=("gather",),
    devices=("cpu",),
    tier="GENERIC_ACCELERATOR",
    extra="",
    kernel_args="",
    **add_kwargs,
):
    kernels = ", ".join(
        f"Kernel(op={op!r}, fn=recording({op!r}), devices={devices!r}, tier=Tier.{tier}"
        f"{kernel_args})"
        for op in ops_
    )
    return plugins.add(name, permutation(f"[{kernels}]", extra), **add_kwargs)


def run_gather(dtype=torch.float32):
    x, indices, bin_ids, bins, _ = routing_inputs(dtype=dtype)
    out = ops.gather(x, indices, bin_ids, bins, 2)
    torch.testing.assert_close(out, reference.gather(x, indices, bin_ids, None, bins, 2))
    return out


def run_scatter(dtype=torch.float32):
    x, indices, bin_ids, bins, weights = routing_inputs(dtype=dtype)
    rows = reference.gather(x, indices, bin_ids, None, bins, 2)
    out = ops.scatter(rows, indices, bin_ids, weights, bins, 2)
    torch.testing.assert_close(out, reference.scatter(rows, indices, bin_ids, weights, bins, 2))
    return out


def candidate(trace, backend, variant=""):
    found = [
        c for c in trace.candidates if c.kernel.backend == backend and c.kernel.variant == variant
    ]
    assert len(found) == 1, trace.candidates
    return found[0]


# ---------------------------------------------------------------------------
# discovery and ranking


def test_fast_plugin_is_discovered_and_wins_on_cpu(plugins):
    fast_plugin(plugins)
    registry = plugins.reload()
    record = registry.plugins["fast"]
    assert (record.name, record.distribution, record.version, record.status, record.reason) == (
        "fast",
        "megablocks-fake-fast",
        "1.0",
        "ok",
        None,
    )
    assert record.ops == ("gather",) and record.device_kinds == ("cpu",)
    assert all(k.backend == "fast" for k in record.kernels)  # the core fills in the backend name
    assert registry.plugins["reference"].status == "ok"

    trace = mb.explain("gather", "cpu")
    assert trace.winner.backend == "fast"
    assert trace.why == "highest tier"
    assert not trace.fallback
    assert candidate(trace, "reference").accepted  # eligible, but outranked
    assert candidate(trace, "fast").reason.startswith("chosen:")

    assert plugins.calls("fast") == []
    run_gather()
    run_gather()
    assert plugins.calls("fast") == ["gather", "gather"]


def test_device_specific_kernel_beats_portable_one_of_equal_tier(plugins):
    # Named so that the backend-name tie-break alone would pick the portable kernel.
    fast_plugin(plugins, "aportable", devices=("any",))
    fast_plugin(plugins, "zspecific", devices=("cpu",))
    plugins.reload()
    assert mb.explain("gather", "cpu").winner.backend == "zspecific"
    run_gather()
    assert plugins.calls("zspecific") == ["gather"] and plugins.calls("aportable") == []

    npu = mb.explain("gather", DeviceInfo(kind="npu", type="npu"))
    assert npu.winner.backend == "aportable"  # the generic tier over the reference's portable
    assert candidate(npu, "zspecific").reason == "serves cpu, not npu"
    assert npu.fallback


def test_equal_tier_ties_are_broken_by_backend_name(plugins):
    fast_plugin(plugins, "beta")
    fast_plugin(plugins, "alpha")
    plugins.reload()
    trace = mb.explain("gather", "cpu")
    assert trace.winner.backend == "alpha"
    order = [c.kernel.backend for c in trace.candidates]
    assert order.index("alpha") < order.index("beta") < order.index("reference")


def test_contiguous_kernel_receives_contiguous_tensors_and_none(plugins):
    """A kernel declared ``contiguous=True`` gets every tensor contiguous (strided ones copied,
    contiguous ones as they are) and an absent optional tensor as None; other arguments as given."""
    extra = """
    SEEN = []

    def scatter(*args):
        SEEN.append(args)
        return _reference.scatter(*args)
    """
    module = plugins.add(
        "strided",
        permutation(
            "[Kernel(op='scatter', fn=scatter, devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR, contiguous=True)]",
            extra,
        ),
    )
    plugins.reload()
    x, indices, bin_ids, bins, weights = routing_inputs()
    rows = reference.gather(x, indices, bin_ids, None, bins, 2)
    strided_rows = torch.stack([rows, rows], dim=-1)[..., 0]  # same values, stride 2
    strided_weights = torch.stack([weights, weights], dim=1)[:, 0]
    assert not strided_rows.is_contiguous() and not strided_weights.is_contiguous()
    for weights_arg in (strided_weights, None):
        out = ops.scatter(strided_rows, indices, bin_ids, weights_arg, bins, 2)
        want = reference.scatter(rows, indices, bin_ids, weights_arg, bins, 2)
        torch.testing.assert_close(out, want)
    seen = sys.modules[module].SEEN
    assert len(seen) == 2
    for args, weights_arg in zip(seen, (strided_weights, None), strict=True):
        got_rows, got_indices, got_bin_ids, got_weights, got_bins, top_k = args
        assert got_rows.is_contiguous() and torch.equal(got_rows, rows)
        assert got_indices is indices and got_bin_ids is bin_ids and got_bins is bins
        if weights_arg is None:
            assert got_weights is None
        else:
            assert got_weights.is_contiguous() and torch.equal(got_weights, weights)
        assert type(top_k) is int and top_k == 2


def test_dtype_restriction_rejects_other_dtypes_and_reference_serves_them(plugins):
    fast_plugin(plugins, kernel_args=", dtypes={'x': {torch.float32}}")
    plugins.reload()
    bf16 = mb.explain("gather", "cpu", BF16)
    assert bf16.winner.backend == "reference"
    assert not candidate(bf16, "fast").accepted
    assert candidate(bf16, "fast").reason == "x must be float32, got bfloat16"
    assert mb.explain("gather", "cpu", F32).winner.backend == "fast"
    # an argument the restriction does not name does not matter
    assert mb.explain("gather", "cpu", {"indices": torch.int64}).winner.backend == "fast"

    run_gather(torch.bfloat16)
    assert plugins.calls("fast") == []
    run_gather(torch.float32)
    assert plugins.calls("fast") == ["gather"]


def test_capability_predicate_reason_rejects(plugins):
    fast_plugin(plugins, kernel_args=", capability=lambda dev: 'needs a widget v2'")
    plugins.reload()
    trace = mb.explain("gather", "cpu")
    assert trace.winner.backend == "reference"
    assert candidate(trace, "fast").reason == "needs a widget v2"
    run_gather()
    assert plugins.calls("fast") == []


def test_capability_predicate_that_raises_rejects_only_its_own_kernel(plugins):
    plugins.add(
        "fast",
        permutation(
            "[Kernel(op='gather', fn=recording('gather'), devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR, capability=boom),"
            " Kernel(op='scatter', fn=recording('scatter'), devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR,"
            "        capability=lambda dev: None)]",
            extra="def boom(device):\n    raise ZeroDivisionError('bad predicate')\n",
        ),
    )
    registry = plugins.reload()
    assert registry.plugins["fast"].status == "ok"
    gather = mb.explain("gather", "cpu")
    assert gather.winner.backend == "reference"
    assert (
        candidate(gather, "fast").reason
        == "capability check raised ZeroDivisionError: bad predicate"
    )
    assert mb.explain("scatter", "cpu").winner.backend == "fast"
    run_gather()
    run_scatter()
    assert plugins.calls("fast") == ["scatter"]


GPU_PLUGIN = permutation(
    "[Kernel(op='gather', fn=recording('gather'), devices=('rocm',), tier=Tier.GENERIC_ACCELERATOR, variant='hip',"
    "        capability=lambda d: None if (d.arch or '').startswith('gfx9') else f'needs gfx9, got {d.arch}'),"
    " Kernel(op='gather', fn=recording('gather'), devices=('cuda',), tier=Tier.GENERIC_ACCELERATOR, variant='sm90',"
    "        capability=lambda d: None if d.capability and d.capability >= (9, 0)"
    "                   else f'needs compute capability >= 9.0, device has {d.capability}')]"
)


@pytest.mark.parametrize(
    ("device", "winner", "fallback", "rejected"),
    [
        (DeviceInfo(kind="rocm", type="cuda", arch="gfx942"), "gpu/hip", False, None),
        (
            DeviceInfo(kind="rocm", type="cuda", arch="gfx1100"),
            "reference",
            True,
            ("hip", "needs gfx9, got gfx1100"),
        ),
        (
            DeviceInfo(kind="cuda", type="cuda", capability=(9, 0), arch="sm_90"),
            "gpu/sm90",
            False,
            None,
        ),
        (
            DeviceInfo(kind="cuda", type="cuda", capability=(10, 0), arch="sm_100"),
            "gpu/sm90",
            False,
            None,
        ),
        (
            DeviceInfo(kind="cuda", type="cuda", capability=(8, 0), arch="sm_80"),
            "reference",
            True,
            ("sm90", "needs compute capability >= 9.0, device has (8, 0)"),
        ),
        (CPU, "reference", False, ("hip", "serves rocm, not cpu")),
    ],
)
def test_simulated_devices(plugins, device, winner, fallback, rejected):
    plugins.add("gpu", GPU_PLUGIN)
    plugins.reload()
    trace = mb.explain("gather", device)
    assert trace.winner.label == winner
    assert trace.fallback is fallback
    assert trace.device == device
    if rejected:
        variant, reason = rejected
        assert candidate(trace, "gpu", variant).reason == reason
        assert not candidate(trace, "gpu", variant).accepted
    # the other vendor's kernel never serves this device
    other = "sm90" if device.kind == "rocm" else "hip"
    assert not candidate(trace, "gpu", other).accepted


def test_explain_rejects_unknown_op_and_serves_kernel_only_ops(plugins):
    plugins.reload()
    with pytest.raises(ValueError, match="unknown op 'gatherz'"):
        mb.explain("gatherz", "cpu")
    assert mb.explain("scatter_wgrad", "cpu").winner.backend == "reference"


# ---------------------------------------------------------------------------
# selection cache


def test_ranking_runs_once_per_signature_and_policy(plugins):
    fast_plugin(plugins, kernel_args=", capability=counting(lambda dev: None)")
    plugins.reload()
    caps = plugins.module("fast").CAP_CALLS
    assert caps[0] == 0
    for _ in range(3):
        run_gather()
    assert caps[0] == 1, "ranking must be cached per (op, device, dtypes, policy), not run per call"
    assert plugins.calls("fast") == ["gather"] * 3

    run_gather(torch.bfloat16)  # new dtype signature: ranked again
    assert caps[0] == 2
    run_gather(torch.bfloat16)
    run_gather(torch.float32)
    assert caps[0] == 2

    with mb.use_backend("reference"):  # new policy: ranked again, and reference serves it
        run_gather()
        run_gather()
    assert caps[0] == 3
    assert plugins.calls("fast") == ["gather"] * 6  # the two calls in the block went to reference
    run_gather()
    assert caps[0] == 3 and plugins.calls("fast")[-1:] == ["gather"]

    plugins.reload()  # reload forgets every cached choice
    run_gather()
    assert caps[0] == 4


def test_hooks_are_called_once_per_load(plugins):
    plugins.add(
        "fast",
        """
        HOOK_CALLS = [0]

        @hookimpl
        def megablocks_permutation_kernels():
            HOOK_CALLS[0] += 1
            return [Kernel(op="gather", fn=recording("gather"), devices=("cpu",), tier=Tier.GENERIC_ACCELERATOR)]
    """,
    )
    plugins.reload()
    module = plugins.module("fast")
    assert module.HOOK_CALLS == [1]
    run_gather()
    run_gather(torch.bfloat16)
    mb.explain("gather", "cpu")
    assert module.HOOK_CALLS == [1]
    plugins.reload()
    assert plugins.module("fast") is module and module.HOOK_CALLS == [2]  # once more per reload


# ---------------------------------------------------------------------------
# overrides


@pytest.fixture
def fast_and_slow(plugins):
    """fast: gather + scatter in the generic tier; slow: gather + scatter + scatter_wgrad in the
    portable tier, yielding to the reference, so slow serves only when a policy asks for it."""
    fast_plugin(plugins, "fast", ops_=("gather", "scatter"))
    fast_plugin(
        plugins,
        "slow",
        ops_=("gather", "scatter", "scatter_wgrad"),
        tier="PORTABLE",
        kernel_args=", yields_to=('reference',)",
    )
    return plugins


def winners(*op_names):
    return {op: mb.explain(op, "cpu").winner.backend for op in op_names}


def test_default_ranking_without_overrides(fast_and_slow):
    fast_and_slow.reload()
    assert winners("gather", "scatter", "scatter_wgrad", "gmm") == {
        "gather": "fast",
        "scatter": "fast",
        "scatter_wgrad": "reference",
        "gmm": "reference",
    }


def test_env_backend_forces_every_op(fast_and_slow):
    fast_and_slow.reload({"MEGABLOCKS_BACKEND": "slow"})
    trace = mb.explain("gather", "cpu")
    assert trace.winner.backend == "slow"
    assert trace.why == "forced by MEGABLOCKS_BACKEND"
    assert mb.current_policy().force == "slow"
    run_gather()
    run_scatter()
    assert fast_and_slow.calls("slow") == ["gather", "scatter"]
    assert fast_and_slow.calls("fast") == []


CANNOT_SERVE = {
    # name: (plugin kernel args, op runner, expected fragments)
    "wrong device": (dict(devices=("cuda",)), run_gather, ["serves cuda, not cpu"]),
    "dtype rejected": (
        dict(kernel_args=", dtypes={'x': {torch.float32}}"),
        lambda: run_gather(torch.bfloat16),
        ["x must be float32, got bfloat16", "bfloat16"],
    ),
    "capability": (
        dict(kernel_args=", capability=lambda d: 'needs a widget'"),
        run_gather,
        ["needs a widget"],
    ),
}


@pytest.mark.parametrize("case", sorted(CANNOT_SERVE))
def test_forced_backend_that_cannot_serve_raises(plugins, case):
    kwargs, runner, fragments = CANNOT_SERVE[case]
    fast_plugin(plugins, "forced", **kwargs)
    plugins.reload({"MEGABLOCKS_BACKEND": "forced"})
    with pytest.raises(NoKernelError) as info:
        runner()
    message = str(info.value)
    for fragment in ["'forced'", "'gather'", "cpu", "MEGABLOCKS_BACKEND", *fragments]:
        assert fragment in message, message
    assert plugins.calls("forced") == []
    trace = mb.explain("gather", "cpu", BF16 if case == "dtype rejected" else None)
    assert trace.winner is None and trace.error and "forced" in trace.error


def test_forced_backend_without_the_op_raises(fast_and_slow):
    fast_and_slow.reload({"MEGABLOCKS_BACKEND": "fast"})
    run_gather()  # fast provides gather
    with pytest.raises(NoKernelError, match="provides no such op") as info:
        ops.gmm(torch.ones(2, 3), torch.ones(1, 3, 4), torch.tensor([2]))
    assert "'fast'" in str(info.value) and "'gmm'" in str(info.value) and "cpu" in str(info.value)


def test_forced_backend_not_installed_raises(plugins):
    plugins.reload({"MEGABLOCKS_BACKEND": "nope"})
    with pytest.raises(NoKernelError) as info:
        run_gather()
    message = str(info.value)
    for fragment in ["'nope'", "'gather'", "not installed", "reference"]:
        assert fragment in message, message


def test_forced_backend_not_installed_error_names_the_device(plugins):
    plugins.reload({"MEGABLOCKS_BACKEND": "nope"})
    with pytest.raises(NoKernelError) as info:
        run_gather()
    assert "cpu" in str(info.value)


def test_forced_unavailable_backend_raises_with_its_reason(plugins):
    plugins.add(
        "nowidget",
        permutation(
            "[Kernel(op='gather', fn=recording('gather'), devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR)]",
            extra="@hookimpl\ndef megablocks_unavailable_reason():\n    return 'no widget'\n",
        ),
    )
    plugins.reload({"MEGABLOCKS_BACKEND": "gather=nowidget"})
    with pytest.raises(NoKernelError, match="no widget"):
        run_gather()


def test_preference_list_with_normal_fallback(fast_and_slow):
    fast_and_slow.reload({"MEGABLOCKS_BACKEND": "nope,slow"})
    policy = mb.current_policy()
    assert policy.force is None and policy.prefer == ("nope", "slow")
    trace = mb.explain("gather", "cpu")
    assert trace.winner.backend == "slow" and trace.why == "preferred by MEGABLOCKS_BACKEND"
    assert winners("gmm") == {"gmm": "reference"}  # slow has no gmm: normal ranking, no error

    fast_and_slow.reload({"MEGABLOCKS_BACKEND": "nope,reference"})
    assert winners("gather", "scatter") == {"gather": "reference", "scatter": "reference"}

    # a preferred backend that cannot serve the call is skipped
    fast_and_slow.reload({"MEGABLOCKS_BACKEND": "slow,fast"})
    assert mb.explain("gather", DeviceInfo(kind="npu", type="npu")).winner.backend == "reference"
    assert winners("gather") == {"gather": "slow"}


def test_per_op_force(fast_and_slow):
    fast_and_slow.reload({"MEGABLOCKS_BACKEND": "gather=slow"})
    assert winners("gather", "scatter") == {"gather": "slow", "scatter": "fast"}
    run_gather()
    run_scatter()
    assert fast_and_slow.calls("slow") == ["gather"]
    assert fast_and_slow.calls("fast") == ["scatter"]

    fast_and_slow.reload({"MEGABLOCKS_BACKEND": "gather=slow, scatter=reference"})
    assert winners("gather", "scatter") == {"gather": "slow", "scatter": "reference"}

    fast_and_slow.reload({"MEGABLOCKS_BACKEND": "slow,gather=reference"})  # force all but one op
    assert winners("gather", "scatter") == {"gather": "reference", "scatter": "slow"}

    fast_and_slow.reload({"MEGABLOCKS_BACKEND": "gmm=slow"})
    with pytest.raises(NoKernelError, match=r"'slow'.*'gmm'"):
        ops.gmm(torch.ones(2, 3), torch.ones(1, 3, 4), torch.tensor([2]))
    assert winners("gather") == {"gather": "fast"}


def _in_thread(fn):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # pragma: no cover - surfaced below
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=30)
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_use_backend_is_context_local(fast_and_slow):
    fast_and_slow.reload()
    assert winners("gather") == {"gather": "fast"}
    with mb.use_backend("slow") as policy:
        assert policy.force == "slow" and mb.current_policy() is policy
        assert mb.explain("gather", "cpu").why == "forced by use_backend()"
        run_gather()
        assert fast_and_slow.calls("slow") == ["gather"]
        # another thread does not see this block's override
        assert _in_thread(lambda: mb.explain("gather", "cpu").winner.backend) == "fast"
        with mb.use_backend(gather="reference"):
            assert winners("gather", "scatter") == {"gather": "reference", "scatter": "fast"}
        assert winners("gather", "scatter") == {"gather": "slow", "scatter": "slow"}
        with mb.use_backend("nope", "slow"):
            assert winners("gather", "scatter") == {"gather": "slow", "scatter": "slow"}
    assert mb.current_policy().is_default
    assert winners("gather") == {"gather": "fast"}
    run_gather()
    assert fast_and_slow.calls("slow") == ["gather"] and fast_and_slow.calls("fast") == ["gather"]


def test_use_backend_restores_after_an_exception_and_overrides_env(fast_and_slow):
    fast_and_slow.reload({"MEGABLOCKS_BACKEND": "reference"})
    with pytest.raises(KeyError), mb.use_backend("slow"):
        assert winners("gather") == {"gather": "slow"}
        raise KeyError("x")
    assert winners("gather") == {"gather": "reference"}
    assert mb.current_policy().source == "MEGABLOCKS_BACKEND"


def test_use_backend_rejects_unknown_op_names(plugins):
    with pytest.raises(ValueError, match="gatherz"), mb.use_backend(gatherz="reference"):
        pass  # pragma: no cover
    with pytest.raises(ValueError, match="gatherz"):
        mb.set_backend(gatherz="reference")


def test_set_backend_is_process_wide_and_clearable(fast_and_slow):
    fast_and_slow.reload({"MEGABLOCKS_BACKEND": "reference"})
    mb.set_backend("slow")
    assert winners("gather") == {"gather": "slow"}
    assert _in_thread(lambda: mb.explain("gather", "cpu").winner.backend) == "slow"
    with mb.use_backend("fast"):  # context beats set_backend
        assert winners("gather") == {"gather": "fast"}
    mb.set_backend(gather="fast")
    assert winners("gather", "scatter") == {"gather": "fast", "scatter": "fast"}
    mb.set_backend()  # cleared: back to the environment's policy
    assert winners("gather") == {"gather": "reference"}
    assert _in_thread(lambda: mb.explain("gather", "cpu").winner.backend) == "reference"


def test_backward_runs_on_the_backend_forced_for_the_forward(fast_and_slow):
    fast_and_slow.reload()
    x, indices, bin_ids, bins, weights = routing_inputs()
    x.requires_grad_()
    with mb.use_backend("slow"):
        out = ops.gather(x, indices, bin_ids, bins, 2)
    assert fast_and_slow.calls("slow") == ["gather"]
    grad = torch.randn_like(out)
    out.backward(grad)  # outside the block: the default ranking would pick fast's scatter
    assert fast_and_slow.calls("slow") == ["gather", "scatter"]
    assert fast_and_slow.calls("fast") == []
    torch.testing.assert_close(x.grad, reference.scatter(grad, indices, bin_ids, None, bins, 2))

    rows = reference.gather(x.detach(), indices, bin_ids, None, bins, 2).requires_grad_()
    weights.requires_grad_()
    with mb.use_backend("slow"):
        out = ops.scatter(rows, indices, bin_ids, weights, bins, 2)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert fast_and_slow.calls("slow")[2:] == ["scatter", "gather", "scatter_wgrad"]
    assert fast_and_slow.calls("fast") == []
    torch.testing.assert_close(
        rows.grad, reference.gather(grad, indices, bin_ids, weights.detach(), bins, 2)
    )
    torch.testing.assert_close(
        weights.grad, reference.scatter_wgrad(rows.detach(), grad, indices, bin_ids, bins, 2)
    )

    # control: without the override, forward and backward both rank normally (fast)
    out = ops.gather(x, indices, bin_ids, bins, 2)
    out.backward(torch.ones_like(out))
    assert fast_and_slow.calls("fast") == ["gather", "scatter"]


def test_backward_with_forced_backend_lacking_the_backward_op_raises(plugins):
    fast_plugin(plugins, "gatheronly", tier="PORTABLE", kernel_args=", yields_to=('reference',)")
    plugins.reload()
    x, indices, bin_ids, bins, _ = routing_inputs()
    x.requires_grad_()
    with mb.use_backend("gatheronly"):
        out = ops.gather(x, indices, bin_ids, bins, 2)
    with pytest.raises(NoKernelError, match=r"'gatheronly'.*'scatter'"):
        out.sum().backward()


# ---------------------------------------------------------------------------
# broken, incompatible, disabled and unavailable plugins

KERNEL = "Kernel(op='gather', fn=recording('gather'), devices=('cpu',), tier=Tier.VENDOR)"

BROKEN = {
    "import error": ("raise ImportError('kaboom on import')\n", "ImportError: kaboom on import"),
    "unknown hook": (
        "@hookimpl\ndef megablocks_routing_kernelz():\n    return []\n\n"
        + permutation(f"[{KERNEL}]"),
        "ValueError: implements unknown hook 'megablocks_routing_kernelz'",
    ),
    "non-kernel": (
        permutation(f"[{KERNEL}, 'histogram']"),
        "TypeError: megablocks_permutation_kernels returned str, expected megablocks_core.Kernel",
    ),
    "unknown op": (
        permutation(f"[{KERNEL}, Kernel(op='gatherz', fn=recording('gather'), devices=('cpu',))]"),
        "ValueError: megablocks_permutation_kernels returned a kernel for unknown op 'gatherz'",
    ),
    "wrong family": (
        permutation(f"[{KERNEL}, Kernel(op='gmm', fn=recording('gmm'), devices=('cpu',))]"),
        "ValueError: megablocks_permutation_kernels returned a kernel for 'gmm', a grouped_gemm op",
    ),
    "hook raises": (
        "@hookimpl\ndef megablocks_permutation_kernels():\n    raise OSError('no lib')\n",
        "OSError: no lib",
    ),
    "uppercase device": (
        permutation("[Kernel(op='gather', fn=recording('gather'), devices=('CPU',))]"),
        "devices must be lowercase kinds",
    ),
    "unknown dtype arg": (
        permutation(
            "[Kernel(op='gather', fn=recording('gather'), devices=('cpu',), dtypes={'y': {torch.float32}})]"
        ),
        "dtypes names unknown arguments ['y']",
    ),
    "fn not callable": (
        permutation("[Kernel(op='gather', fn=42, devices=('cpu',))]"),
        "fn is not callable",
    ),
    "same variant twice": (
        permutation(f"[{KERNEL}, {KERNEL}]"),
        "two kernels for 'gather' with the same variant ''",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_plugin_is_recorded_and_others_keep_working(plugins, case):
    body, reason = BROKEN[case]
    plugins.add("bad", body, version="2.3")
    registry = plugins.reload()
    record = registry.plugins["bad"]
    assert record.status == "broken"
    assert (record.name, record.distribution, record.version) == (
        "bad",
        "megablocks-fake-bad",
        "2.3",
    )
    assert reason in record.reason
    assert record.kernels == ()  # nothing of a broken plugin takes part, not even its valid kernels
    assert record.as_dict()["status"] == "broken" and reason in record.as_dict()["reason"]
    assert registry.plugins["reference"].status == "ok"
    assert all(k.backend != "bad" for _, k in registry.kernels_for("gather"))
    assert mb.explain("gather", "cpu").winner.backend == "reference"
    run_gather()
    run_scatter()
    module = sys.modules.get("mbfake_bad")
    assert module is None or module.CALLS == []


@pytest.mark.parametrize("case", ["import error", "unknown hook", "non-kernel", "wrong family"])
def test_strict_mode_raises_plugin_load_error(plugins, case):
    body, reason = BROKEN[case]
    plugins.add("bad", body)
    with pytest.raises(PluginLoadError, match="'bad'") as info:
        plugins.reload({"MEGABLOCKS_STRICT_PLUGINS": "1"})
    assert reason in str(info.value)
    # "0" is not strict
    assert plugins.reload({"MEGABLOCKS_STRICT_PLUGINS": "0"}).plugins["bad"].status == "broken"


def test_strict_mode_without_problems_loads_normally(plugins):
    fast_plugin(plugins)
    registry = plugins.reload({"MEGABLOCKS_STRICT_PLUGINS": "1"})
    assert registry.plugins["fast"].status == "ok"


#: A plugin whose scatter kernel could not be built: its gather kernel still loads.
HALF = permutation(
    "[KernelProblem(op='scatter', reason='no dtypes declared for it'), "
    "Kernel(op='gather', fn=recording('gather'), devices=('cpu',), tier=Tier.VENDOR)]",
    extra="from megablocks_core.plugin import KernelProblem",
)


def test_a_kernel_problem_fails_only_its_op(plugins):
    plugins.add("half", HALF)
    registry = plugins.reload()
    record = registry.plugins["half"]
    assert record.status == "ok" and record.reason is None
    assert record.ops == ("gather",)  # its other kernel loaded
    assert [(p.op, p.variant, p.reason) for p in record.problems] == [
        ("scatter", "", "no dtypes declared for it")
    ]
    assert record.as_dict()["problems"] == [
        {"op": "scatter", "variant": "", "reason": "no dtypes declared for it"}
    ]
    run_gather()
    run_scatter()  # served by the reference
    assert plugins.calls("half") == ["gather"]


def test_the_kit_fails_the_op_whose_kernel_did_not_load(plugins):
    from megablocks_core import testing

    plugins.add("half", HALF)
    plugins.reload()
    result = testing.check_op("half", "scatter", quick=True)
    assert result.status == "fail"
    assert result.message == "its kernel for 'scatter' did not load: no dtypes declared for it"


def test_strict_mode_refuses_a_kernel_problem(plugins):
    plugins.add("half", HALF)
    with pytest.raises(
        PluginLoadError,
        match="plugin 'half': its kernel for 'scatter' did not load: no dtypes declared for it",
    ):
        plugins.reload({"MEGABLOCKS_STRICT_PLUGINS": "1"})


def test_a_kernel_problem_without_a_reason_breaks_the_plugin(plugins):
    plugins.add(
        "bad",
        permutation(
            "[KernelProblem(op='scatter', reason='')]",
            extra="from megablocks_core.plugin import KernelProblem",
        ),
    )
    record = plugins.reload().plugins["bad"]
    assert record.status == "broken"
    assert "returned a KernelProblem for 'scatter' without a reason" in record.reason


INCOMPATIBLE_BODY = """
from pathlib import Path
Path(__file__).with_name("imported.flag").write_text("imported")
raise RuntimeError("an incompatible plugin must not be imported")
"""


@pytest.mark.parametrize(
    "requirement", ["megablocks-core<0.1", "Megablocks_Core>=0.2,<1", "megablocks-core==0.0.9"]
)
def test_incompatible_plugin_is_not_imported(plugins, requirement):
    module = plugins.add("old", INCOMPATIBLE_BODY, requires=("numpy", requirement), prelude=False)
    registry = plugins.reload()
    record = registry.plugins["old"]
    assert record.status == "incompatible"
    assert record.reason.startswith("requires megablocks-core")
    assert mb.__version__ in record.reason
    assert module not in sys.modules
    assert not (plugins.root / "site" / "imported.flag").exists()
    assert registry.plugins["reference"].status == "ok"
    with pytest.raises(PluginLoadError, match="'old'"):
        plugins.reload({"MEGABLOCKS_STRICT_PLUGINS": "1"})
    assert module not in sys.modules


@pytest.mark.parametrize(
    "requirement",
    [
        "megablocks-core>=0.1",
        "megablocks-core>=0.1,<0.2",
        'megablocks-core<0.1; extra == "old"',
        "other-package<0.1",
    ],
)
def test_compatible_requirements_load(plugins, requirement):
    fast_plugin(plugins, requires=(requirement,))
    assert plugins.reload().plugins["fast"].status == "ok"


@pytest.mark.parametrize(
    "env",
    [
        {"MEGABLOCKS_PLUGINS": "reference"},
        {"MEGABLOCKS_PLUGINS": " reference , other"},
        {"MEGABLOCKS_DISABLE_PLUGINS": "fast"},
        {"MEGABLOCKS_DISABLE_PLUGINS": "other,fast"},
    ],
)
def test_allow_and_deny_lists_disable_plugins(plugins, env):
    module = fast_plugin(plugins)
    registry = plugins.reload(env)
    record = registry.plugins["fast"]
    assert record.status == "disabled"
    assert "MEGABLOCKS_PLUGINS" in record.reason and "MEGABLOCKS_DISABLE_PLUGINS" in record.reason
    assert record.distribution == "megablocks-fake-fast" and record.version == "1.0"
    assert module not in sys.modules  # a disabled plugin is not imported
    assert registry.plugins["reference"].status == "ok"
    assert mb.explain("gather", "cpu").winner.backend != "fast"
    run_gather()


def test_allow_list_that_includes_the_plugin(plugins):
    fast_plugin(plugins)
    registry = plugins.reload({"MEGABLOCKS_PLUGINS": "fast"})
    assert registry.plugins["fast"].status == "ok"
    assert registry.plugins["reference"].status == "disabled"
    assert mb.explain("gather", "cpu").winner.backend == "fast"
    trace = mb.explain("scatter", "cpu")
    assert trace.winner is None and "no implementation of 'scatter'" in trace.error
    with pytest.raises(NoKernelError, match="scatter"):
        run_scatter()


def test_unavailable_plugin_never_wins(plugins):
    plugins.add(
        "nowidget",
        permutation(
            "[Kernel(op='gather', fn=recording('gather'), devices=('cpu', 'any'), tier=Tier.SPECIALISED)]",
            extra="@hookimpl\ndef megablocks_unavailable_reason():\n    return 'no widget'\n",
        ),
    )
    plugins.add(
        "widget",
        permutation(
            "[Kernel(op='gather', fn=recording('gather'), devices=('cpu',), tier=Tier.VENDOR)]",
            extra="@hookimpl\ndef megablocks_unavailable_reason():\n    return None\n",
        ),
    )
    registry = plugins.reload()
    record = registry.plugins["nowidget"]
    assert (record.status, record.reason) == ("unavailable", "no widget")
    assert record.ops == ("gather",)  # still listed, for the CLI
    assert registry.plugins["widget"].status == "ok" and registry.plugins["widget"].reason is None
    for device in (CPU, DeviceInfo(kind="npu", type="npu")):
        trace = mb.explain("gather", device)
        assert trace.winner.backend != "nowidget"
        assert candidate(trace, "nowidget").reason == "backend unavailable: no widget"
    run_gather()
    assert plugins.calls("nowidget") == [] and plugins.calls("widget") == ["gather"]
    with mb.use_backend("nowidget", "reference"):
        assert mb.explain("gather", "cpu").winner.backend == "reference"


def test_duplicate_entry_point_names(plugins):
    plugins.add(
        "dup",
        permutation(f"[{KERNEL}]"),
        distribution="megablocks-fake-dup-a",
        module="mbfake_dup_a",
        sub="a",
    )
    plugins.add(
        "dup",
        permutation(f"[{KERNEL}]"),
        distribution="megablocks-fake-dup-b",
        module="mbfake_dup_b",
        sub="b",
    )  # prepended last: first on sys.path
    registry = plugins.reload()
    assert registry.plugins["dup"].distribution == "megablocks-fake-dup-b"
    assert registry.plugins["dup"].status == "ok"
    with pytest.raises(PluginLoadError, match="already taken"):
        plugins.reload({"MEGABLOCKS_STRICT_PLUGINS": "1"})


# ---------------------------------------------------------------------------
# fallback visibility


def test_portable_reference_on_an_accelerator_is_a_visible_fallback(plugins):
    plugins.reload()
    npu = DeviceInfo(kind="npu", type="npu", index=0)
    trace = mb.explain("gather", npu)
    assert trace.winner.backend == "reference"
    assert trace.fallback is True
    assert "portable fallback" in trace.why
    assert mb.explain("gather", "cpu").fallback is False
    assert "portable fallback" not in mb.explain("gather", "cpu").why


def test_device_specific_plugin_removes_the_fallback(plugins):
    fast_plugin(plugins, "npu", devices=("npu",))
    plugins.reload()
    trace = mb.explain("gather", DeviceInfo(kind="npu", type="npu"))
    assert trace.winner.backend == "npu" and not trace.fallback


def test_meta_device_fallback_flag_and_why_agree(plugins):
    plugins.reload()
    trace = mb.explain("gather", DeviceInfo(kind="meta", type="meta"))
    assert trace.fallback == ("portable fallback" in trace.why)


def test_backend_env_with_an_unknown_op_is_an_error():
    with pytest.raises(ValueError, match=r"unknown op\(s\) \['gathr'\]"):
        mb.reload({"MEGABLOCKS_BACKEND": "gathr=reference"})
    mb.reload({})
    assert mb.current_policy().is_default


@pytest.mark.parametrize(
    "value, checked", [("1", True), ("TRUE", True), ("on", True), ("false", False), ("0", False)]
)
def test_megablocks_check_reads_on_and_off(value, checked):
    from megablocks_core.policy import overrides

    try:
        mb.reload({"MEGABLOCKS_CHECK": value})
        assert overrides.checked is checked
    finally:
        mb.reload({})
    assert overrides.checked is False


def test_megablocks_check_of_another_value_is_an_error():
    from megablocks_core.policy import overrides

    with pytest.raises(ValueError, match="MEGABLOCKS_CHECK='maybe'"):
        mb.reload({"MEGABLOCKS_CHECK": "maybe"})
    assert overrides.checked is False
    mb.reload({})


#: A gather kernel that serves only float32 data by itself and hands other dtypes to the reference
#: (``backend=``), or, as ``DELEGATING.format(backend="")``, calls its own op again.
DELEGATING = """
from megablocks_core.plugin import call_op


def gather(*args):
    CALLS.append("gather")
    if args[0].dtype == torch.float32:
        return _reference.gather(*args)
    return call_op("gather", *args{backend})
"""


def _delegating(plugins, backend):
    kernel = "[Kernel(op='gather', fn=gather, devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR)]"
    plugins.add("delegating", permutation(kernel, DELEGATING.format(backend=backend)))
    plugins.reload()


def test_a_kernel_delegates_a_call_to_the_reference(plugins):
    _delegating(plugins, ", backend='reference'")
    with mb.use_backend("delegating"):  # the other ops stay forced; gather goes to the reference
        for dtype in (torch.float32, torch.float64):
            run_gather(dtype)
    assert plugins.calls("delegating") == ["gather", "gather"]
    assert mb.current_policy().is_default


def test_a_kernel_that_calls_its_own_op_gets_one_short_error_naming_the_way(plugins):
    _delegating(plugins, "")
    with pytest.raises(RecursionError) as caught:
        run_gather(torch.float64)
    message = str(caught.value)
    assert message.startswith("megablocks_core.ops.gather: the 'delegating' kernel raised ")
    assert "call_op('gather', ..., backend='reference')" in message
    assert len(message) < 1000, message[:2000]


def test_nothing_to_serve_a_call_says_how_to_get_the_reference(plugins):
    from types import SimpleNamespace

    from megablocks_core.ranking import rank

    # the core alone: no backend installed
    bare = SimpleNamespace(plugins={}, kernels_for=lambda op: [])
    error = rank(bare, "gather", CPU).error
    assert error.startswith("no implementation of 'gather' can serve cpu (CPU)")
    assert "pip install megablocks-core[reference]" in error
    # the reference installed but left out
    fast_plugin(plugins)
    plugins.reload({"MEGABLOCKS_PLUGINS": "fast"})
    error = mb.explain("scatter", "cpu").error
    assert "the reference backend, which serves every op on any device, is disabled" in error
    plugins.reload()
    assert mb.explain("scatter", "cpu").error is None
