"""The dMoE layer's argument checks: every field of its record (MoEConfig, however the record is
made), the grad_accumulation_fusion setter, and forward's input (shape, dtype, device), eagerly
and under torch.compile."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megablocks_core.activations import GATED
from megablocks_core.layers import DroplessMoE, MoEConfig, dMoE

pytestmark = pytest.mark.usefixtures("reference_backend")

LAYER = re.escape("megablocks_core.layers.dMoE: ")
HIDDEN, FFN, EXPERTS, TOP_K = 8, 12, 4, 2


def make(**changes: object) -> DroplessMoE:
    arguments: dict[str, object] = {
        "hidden_size": HIDDEN,
        "ffn_hidden_size": FFN,
        "num_experts": EXPERTS,
        "top_k": TOP_K,
        "dtype": torch.float64,
    }
    return dMoE(**(arguments | changes))  # type: ignore[arg-type]


# (argument changes, exception, the message after the layer's name)
BAD_ARGUMENTS: list[tuple[dict[str, object], type[Exception], str]] = [
    ({"hidden_size": -1}, ValueError, r"hidden_size must be an int >= 1; got -1 \(int\)"),
    ({"hidden_size": 0}, ValueError, r"hidden_size must be an int >= 1; got 0"),
    ({"hidden_size": 8.0}, TypeError, r"hidden_size must be an int >= 1; got 8.0 \(float\)"),
    ({"hidden_size": True}, TypeError, r"hidden_size must be an int >= 1; got True \(bool\)"),
    ({"hidden_size": "8"}, TypeError, r"hidden_size must be an int"),
    ({"ffn_hidden_size": -4}, ValueError, r"ffn_hidden_size must be an int >= 1; got -4"),
    ({"ffn_hidden_size": 12.5}, TypeError, r"ffn_hidden_size must be an int >= 1; got 12.5"),
    ({"ffn_hidden_size": False}, TypeError, r"ffn_hidden_size must be an int"),
    ({"num_experts": 0}, ValueError, r"num_experts must be an int >= 1; got 0"),
    ({"num_experts": 4.0}, TypeError, r"num_experts must be an int >= 1; got 4.0 \(float\)"),
    ({"num_experts": None}, TypeError, r"num_experts must be an int"),
    (
        {"top_k": "2"},
        TypeError,
        r"top_k must be an int in \[1, num_experts=4\]; got '2' \(str\)",
    ),
    ({"top_k": 0}, ValueError, r"top_k must be an int in \[1, num_experts=4\]; got 0"),
    ({"top_k": 5}, ValueError, r"top_k must be an int in \[1, num_experts=4\]; got 5"),
    ({"top_k": True}, TypeError, r"top_k must be an int in \[1, num_experts=4\]; got True"),
    ({"top_k": 2.0}, TypeError, r"top_k must be an int"),
    ({"glu": 1}, TypeError, r"glu must be a bool \(True or False\); got 1 \(int\)"),
    ({"glu": "yes"}, TypeError, r"glu must be a bool"),
    ({"fuse_permutation": None}, TypeError, r"fuse_permutation must be a bool"),
    ({"grad_accumulation_fusion": 1}, TypeError, r"grad_accumulation_fusion must be a bool"),
    ({"grad_accumulation_fusion": "no"}, TypeError, r"grad_accumulation_fusion must be a bool"),
    ({"activation": None}, TypeError, r"activation must be one of .* or a callable; got None"),
    ({"activation": 3}, TypeError, r"activation must be one of .* or a callable; got 3 \(int\)"),
    ({"activation": "swish"}, ValueError, r"activation must be one of .*; got 'swish'"),
    (
        {"activation": "swiglu"},
        ValueError,
        r"activation must be .*; got 'swiglu' \(gated experts: glu=True with activation='silu'\)",
    ),
    ({"normalize_expert_weights": 0}, ValueError, r"normalize_expert_weights must be the p of"),
    ({"normalize_expert_weights": -1.0}, ValueError, r"normalize_expert_weights must be"),
    ({"normalize_expert_weights": math.nan}, ValueError, r"normalize_expert_weights must be"),
    ({"normalize_expert_weights": "1"}, TypeError, r"normalize_expert_weights must be"),
    ({"normalize_expert_weights": True}, TypeError, r"normalize_expert_weights must be"),
    (
        {"load_balancing_loss_coefficient": -0.1},
        ValueError,
        r"load_balancing_loss_coefficient must be a finite number >= 0; got -0.1",
    ),
    ({"load_balancing_loss_coefficient": math.inf}, ValueError, r"load_balancing_loss_coeff"),
    ({"load_balancing_loss_coefficient": None}, TypeError, r"load_balancing_loss_coefficient"),
    ({"block_size": 0}, ValueError, r"block_size must be an int >= 1; got 0"),
    ({"block_size": 128.0}, TypeError, r"block_size must be an int >= 1; got 128.0"),
    ({"init_std": -0.02}, ValueError, r"init_std must be a finite number >= 0; got -0.02"),
    ({"init_std": math.nan}, ValueError, r"init_std must be a finite number >= 0; got nan"),
    ({"init_std": "0.02"}, TypeError, r"init_std must be a finite number >= 0"),
    ({"seed": 1 << 64}, ValueError, r"seed must be an int in \[-2\*\*63, 2\*\*64\)"),
    ({"seed": -(1 << 63) - 1}, ValueError, r"seed must be an int in \[-2\*\*63, 2\*\*64\)"),
    ({"seed": 1.0}, TypeError, r"seed must be an int"),
    ({"seed": True}, TypeError, r"seed must be an int"),
    (
        {"dtype": torch.int32},
        ValueError,
        r"dtype must be a floating torch.dtype .*; got torch.int32",
    ),
    ({"dtype": torch.bool}, ValueError, r"dtype must be a floating torch.dtype"),
    ({"dtype": torch.complex64}, ValueError, r"dtype must be a floating torch.dtype"),
    ({"dtype": "float32"}, TypeError, r"dtype must be a floating torch.dtype .*; got 'float32'"),
    ({"device": "cuda:x"}, ValueError, r"device must be a torch.device.*; got 'cuda:x' \(str\)"),
    ({"device": "nowhere"}, ValueError, r"device must be a torch.device"),
    ({"device": -1}, ValueError, r"device must be a torch.device"),
    ({"device": 1.5}, TypeError, r"device must be a torch.device.*; got 1.5 \(float\)"),
    ({"device": True}, TypeError, r"device must be a torch.device"),
    (
        {"expert_parallel_group": "world"},
        TypeError,
        r"expert_parallel_group must be a torch.distributed.ProcessGroup or None; got 'world'",
    ),
    (
        {"expert_parallel_chunks": 0},
        ValueError,
        r"expert_parallel_chunks must be an int >= 1 or None; got 0",
    ),
    ({"expert_parallel_chunks": 1.5}, TypeError, r"expert_parallel_chunks must be an int >= 1"),
    ({"expert_parallel_chunks": True}, TypeError, r"expert_parallel_chunks must be an int >= 1"),
    (
        {"expert_parallel_dispatch": "all2all"},
        ValueError,
        r"expert_parallel_dispatch must be one of \('alltoall', 'allgather'\); got 'all2all'",
    ),
    ({"expert_parallel_dispatch": None}, TypeError, r"expert_parallel_dispatch must be one of"),
    (
        {"expert_parallel_dispatch": "allgather", "expert_parallel_chunks": 2},
        ValueError,
        r"expert_parallel_dispatch='allgather' runs in one piece; "
        r"expert_parallel_chunks must be None or 1; got 2 \(int\)",
    ),
]


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    BAD_ARGUMENTS,
    ids=[",".join(f"{k}={v!r}" for k, v in c.items()) for c, _, _ in BAD_ARGUMENTS],
)
def test_constructor_refuses_a_bad_argument(
    changes: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=LAYER + message) as raised:
        make(**changes)
    assert type(raised.value) is error  # not a subclass standing in for the other kind


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    BAD_ARGUMENTS,
    ids=[",".join(f"{k}={v!r}" for k, v in c.items()) for c, _, _ in BAD_ARGUMENTS],
)
def test_the_record_refuses_a_bad_field_and_so_does_replacing_one(
    changes: dict[str, object], error: type[Exception], message: str
) -> None:
    # The one validation: the record's, whether it is made directly, derived from a good one,
    # or handed to the layer as keywords replacing the good one's fields.
    good = MoEConfig(HIDDEN, FFN, EXPERTS, TOP_K, dtype=torch.float64)
    for build in (
        lambda: MoEConfig(**(dataclasses.asdict(good) | changes)),  # type: ignore[arg-type]
        lambda: dataclasses.replace(good, **changes),  # type: ignore[arg-type]
        lambda: dMoE(good, **changes),
    ):
        with pytest.raises(error, match=LAYER + message) as raised:
            build()
        assert type(raised.value) is error


def test_the_layer_takes_its_record_or_keywords_alike() -> None:
    config = MoEConfig(HIDDEN, FFN, EXPERTS, TOP_K, glu=True, seed=5, dtype=torch.float64)
    layer = dMoE(config)
    assert layer.config is config and (layer.top_k, layer.glu) == (TOP_K, True)
    by_keywords = make(glu=True, seed=5)
    assert by_keywords.config == config
    for p, q in zip(layer.parameters(), by_keywords.parameters(), strict=True):
        assert torch.equal(p, q)
    # Keywords beside the record replace its fields; the record itself is left as it was.
    reseeded = dMoE(config, seed=6)
    assert reseeded.config == dataclasses.replace(config, seed=6) and config.seed == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.top_k = 1  # type: ignore[misc]


@pytest.mark.parametrize("config", [HIDDEN, {"hidden_size": HIDDEN}, "config"], ids=repr)
def test_the_layer_refuses_anything_but_a_record_as_config(config: object) -> None:
    message = LAYER + r"config must be a megablocks_core.layers.MoEConfig .*; got "
    with pytest.raises(TypeError, match=message):
        dMoE(config)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(GATED))
def test_a_gated_name_as_activation_suggests_only_what_the_layer_takes(name: str) -> None:
    """A gated unit's name is refused as the activation; where the error suggests a setting, that
    setting works (GPT-OSS's unit and the interleaved ones have none in the layer)."""
    with pytest.raises(ValueError, match=LAYER + f"activation must be .*; got {name!r}") as info:
        MoEConfig(HIDDEN, FFN, EXPERTS, TOP_K, activation=name)
    suggested = re.search(r"glu=True with activation='(\w+)'", str(info.value))
    if suggested:
        MoEConfig(HIDDEN, FFN, EXPERTS, TOP_K, glu=True, activation=suggested.group(1))
    else:
        assert "glu=True" in str(info.value)  # still says what the layer's gated experts take


def test_constructor_accepts_the_edges_of_each_range() -> None:
    make(num_experts=1, top_k=1, hidden_size=1, ffn_hidden_size=1, block_size=1)
    make(top_k=EXPERTS, seed=(1 << 64) - 1, init_std=0, load_balancing_loss_coefficient=0)
    make(seed=-(1 << 63), normalize_expert_weights=math.inf, dtype=None, device="cpu")
    make(activation=torch.tanh, device=torch.device("cpu"), expert_parallel_chunks=1)
    make(normalize_expert_weights=2, expert_parallel_dispatch="allgather", dtype=torch.bfloat16)


@pytest.mark.parametrize("enabled", [1, 0, "no", None, torch.tensor(True)])
def test_grad_accumulation_fusion_setter_refuses_a_non_bool(enabled: object) -> None:
    layer = make()
    with pytest.raises(TypeError, match=LAYER + "grad_accumulation_fusion must be a bool"):
        layer.grad_accumulation_fusion = enabled  # type: ignore[assignment]
    assert layer.grad_accumulation_fusion is False


@pytest.mark.parametrize(
    ("std", "seed", "error", "message"),
    [
        (-1.0, 0, ValueError, "init_std must be a finite number >= 0"),
        (0.02, 1 << 64, ValueError, "seed must be an int in"),
        (0.02, "0", TypeError, "seed must be an int in"),
    ],
)
def test_reset_parameters_refuses_a_bad_std_or_seed(
    std: object, seed: object, error: type[Exception], message: str
) -> None:
    layer = make()
    before = [p.clone() for p in layer.parameters()]
    with pytest.raises(error, match=LAYER + message):
        layer.reset_parameters(std, seed)  # type: ignore[arg-type]
    assert all(torch.equal(p, q) for p, q in zip(layer.parameters(), before, strict=True))


# ---------------------------------------------------------------------------
# forward's input

SHAPE_REFUSAL = LAYER + re.escape(f"x must have shape (..., hidden_size={HIDDEN})")
SHAPE_MESSAGE = SHAPE_REFUSAL + re.escape("; got shape ")


@pytest.mark.parametrize(
    "shape",
    [(4, 16), (2, 4), (3, 5), (), (0,), (2, 3, 16), (HIDDEN, 1), (2, HIDDEN, 4)],
    ids=str,
)
def test_forward_refuses_a_last_dimension_other_than_hidden_size(shape: tuple[int, ...]) -> None:
    # (4, 16) and (2, 4) hold a whole number of hidden_size rows: reshaped, they would pass.
    x = torch.randn(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=SHAPE_MESSAGE + re.escape(str(shape))):
        make()(x)


SHARED_LAYER = make()  # hypothesis calls the test many times: one layer for them all


@settings(max_examples=30, deadline=None)
@given(
    leading=st.lists(st.integers(0, 4), max_size=3),
    last=st.integers(0, 64).filter(lambda n: n != HIDDEN),
)
def test_forward_refuses_any_wrong_last_dimension(leading: list[int], last: int) -> None:
    shape = (*leading, last)
    with pytest.raises(ValueError, match=SHAPE_MESSAGE + re.escape(str(shape))):
        SHARED_LAYER(torch.zeros(shape, dtype=torch.float64))


def test_forward_refuses_a_non_tensor() -> None:
    with pytest.raises(TypeError, match=LAYER + r"x must be a tensor of shape .*; got list"):
        make()([[0.0] * HIDDEN])


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex128], ids=str
)
def test_forward_refuses_another_dtype_than_the_expert_weights(dtype: torch.dtype) -> None:
    x = torch.zeros(3, HIDDEN, dtype=dtype)
    message = LAYER + re.escape(
        "x must be floating point in the expert weights' dtype torch.float64 "
        f"(convert x, or the layer with .to(dtype)); got {dtype}"
    )
    with pytest.raises(TypeError, match=message):
        make()(x)


def test_forward_refuses_an_input_on_another_device() -> None:
    # Meta parameters stand in for weights on an accelerator: the CPU input is on another device.
    layer = make(device="meta")
    message = LAYER + re.escape(
        "x must be on the parameters' device meta (router on meta); got cpu"
    )
    with pytest.raises(ValueError, match=message):
        layer(torch.zeros(3, HIDDEN, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(5, HIDDEN), (2, 3, HIDDEN), (HIDDEN,)], ids=str)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_forward_keeps_the_shape_of_a_valid_input(shape: tuple[int, ...], training: bool) -> None:
    layer = make(glu=True).train(training)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out, aux = layer(x)
    assert out.shape == x.shape and out.dtype == x.dtype and aux.shape == ()
    flat, _ = layer(x.reshape(-1, HIDDEN))  # the same tokens as rows: the same outputs
    torch.testing.assert_close(out, flat.reshape(shape), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(0, HIDDEN), (2, 0, HIDDEN)], ids=str)
def test_forward_takes_zero_tokens(shape: tuple[int, ...]) -> None:
    layer = make().train()
    x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    out, aux = layer(x)
    assert out.shape == shape and float(aux) == 0.0
    (out.sum() + aux).backward()
    assert x.grad is not None and x.grad.shape == shape


# ---------------------------------------------------------------------------
# Under torch.compile


@pytest.fixture
def compiled_layer() -> tuple[DroplessMoE, Callable[..., Any], Callable[..., Any]]:
    torch._dynamo.reset()
    layer = make(glu=True, load_balancing_loss_coefficient=0.1)
    full = torch.compile(layer, fullgraph=True, backend="aot_eager")
    partial = torch.compile(layer, backend="aot_eager")
    return layer, full, partial


def test_compiled_forward_checks_and_keeps_valid_inputs_in_one_graph(
    compiled_layer: tuple[DroplessMoE, Callable[..., Any], Callable[..., Any]],
) -> None:
    layer, full, partial = compiled_layer
    x = torch.randn(2, 3, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # fullgraph=True: the checks trace into the graph without a break.
    for got, want in zip(full(x), layer(x), strict=True):
        torch.testing.assert_close(got, want)
    for bad in ((4, 16), (2, 4), (3, 5)):
        # fullgraph=True: torch._dynamo.exc.Unsupported whose text holds the refusal (without the
        # shape, which may be symbolic while dynamo traces), or the ValueError itself once dynamo
        # runs the frame eagerly.
        refusals = (torch._dynamo.exc.Unsupported, ValueError)
        with pytest.raises(refusals, match=SHAPE_REFUSAL):
            full(torch.randn(bad, dtype=torch.float64))
        # Without fullgraph, dynamo hands the user's exception through unchanged.
        with pytest.raises(ValueError, match=SHAPE_MESSAGE + re.escape(str(bad))):
            partial(torch.randn(bad, dtype=torch.float64))
    with pytest.raises(TypeError, match=LAYER + "x must be floating point"):
        partial(torch.randn(3, HIDDEN, dtype=torch.float32))
    # A refusal leaves the compiled layer working for the next valid input.
    y = torch.randn(5, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for got, want in zip(full(y), layer(y), strict=True):
        torch.testing.assert_close(got, want)
