"""The vocabulary in which every op's contract is written.

A contract is data: argument specs, rules over the arguments (Python
expressions over the argument names), output specs and prose. From that one
declaration the core derives input validation (:mod:`megablocks_core.validation`),
the fake implementations used by ``torch.compile`` (:mod:`megablocks_core.library`),
``docs/contracts.md`` (:func:`megablocks_core.docgen.render_markdown`) and the
checks of the conformance kit. The contracts themselves live in
:mod:`megablocks_core.contracts`.
"""

from __future__ import annotations

import ast
import builtins
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch

from . import formats

INT_DTYPES = frozenset({torch.int16, torch.int32, torch.int64})
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
COUNT_DTYPES = frozenset({torch.int32, torch.int64})

Family = Literal[
    "routing", "permutation", "grouped_gemm", "activation", "quantization", "composite"
]


def dtype_names(dtypes: frozenset[torch.dtype]) -> str:
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument."""

    name: str
    dtypes: frozenset[torch.dtype]
    """Accepted dtypes; empty means any dtype."""
    ndim: tuple[int, ...]
    """Accepted ranks; empty means any rank."""
    doc: str
    optional: bool = False
    """None is accepted (e.g. ``weights``)."""
    any_device: bool = False
    """May live on another device than the op's primary tensor (gmm's CPU ``batch_sizes``)."""
    public: bool = True
    """False: the argument exists only at kernel level (the public op passes None)."""
    mutable: bool = False
    """The op writes its result into this tensor in place (``Tensor(a!)`` in the torch schema)
    instead of returning it. It must be contiguous (checked on every call: a kernel writes
    through it, and a copy made to suit a kernel would take the result away) and on the op's
    device; no other argument may be mutated. Never optional."""
    serve: Callable[[Mapping[str, Any], Any], Any] | None = None
    """Set for a trailing option a kernel may leave to the core (e.g. the grouped GEMMs'
    ``bias``): ``serve(arguments by name, output)`` is what the option does to the output
    of a kernel whose function does not take it (:mod:`megablocks_core.registry`), so such a
    kernel keeps serving the op, option or not. Must be optional."""

    def __post_init__(self) -> None:
        if self.mutable and (self.optional or self.any_device or not self.public):
            raise ValueError(f"mutable tensor argument {self.name!r} must be required and public")
        if self.serve is not None and not self.optional:
            raise ValueError(f"tensor option {self.name!r} must be optional (None: not used)")

    def describe(self) -> str:
        ranks = " or ".join(f"{n}-D" for n in self.ndim) + " " if self.ndim else ""
        text = f"{ranks}tensor" + (f" of {dtype_names(self.dtypes)}" if self.dtypes else "")
        if self.mutable:
            return f"contiguous {text}, written in place"
        return text + " or None" if self.optional else text


@dataclass(frozen=True)
class RowsOption:
    """How the core serves a sorted-row count (``rows``, an :class:`IntArg` option a kernel may
    leave to the core) to a kernel whose function does not take it.

    The option says the op works on the first ``rows`` sorted rows only (those past them belong
    to no expert). ``pads`` names the tensor argument that then holds just those rows: a kernel
    without the option gets it with zero rows appended up to ``total`` rows. Without ``pads`` the
    kernel computes every sorted row and the core keeps the first ``rows`` of its output (a
    view). Either way such a kernel does the full op's work; one that takes ``rows`` need not."""

    total: str
    """Expression over the arguments: the number of sorted rows in all, e.g. ``indices.shape[0]``."""
    pads: str | None = None

    @staticmethod
    def pad(rows: torch.Tensor, total: int) -> torch.Tensor:
        """The first sorted rows ``rows`` as all ``total`` of them: zero rows appended."""
        if rows.shape[0] >= total:
            return rows
        return torch.cat([rows, rows.new_zeros((total - rows.shape[0], *rows.shape[1:]))])


@dataclass(frozen=True)
class IntArg:
    """A Python integer argument (``bool`` is not accepted)."""

    name: str
    doc: str
    min: int | None = None
    max: int | None = None
    optional: bool = False
    """None is accepted (and is the default)."""
    default: int | None = None
    option: RowsOption | None = None
    """Set for a trailing option a kernel may lack (see :class:`RowsOption`); must be optional."""

    def __post_init__(self) -> None:
        if self.option is not None and not self.optional:
            raise ValueError(f"int option {self.name!r} must be optional (None: not used)")

    def describe(self) -> str:
        if self.min is not None and self.max is not None:
            text = f"int in [{self.min}, {self.max}]"
        elif self.min is not None:
            text = f"int >= {self.min}"
        else:
            text = "int"
        return text + " or None" if self.optional else text


@dataclass(frozen=True)
class BoolArg:
    name: str
    doc: str
    default: bool = False

    def describe(self) -> str:
        return "bool"


@dataclass(frozen=True)
class ChoiceArg:
    """One of a few names, or None (the default): e.g. ``gmm_scatter``'s ``activation``.

    With ``apply`` set it is an option a kernel may leave to the core:
    ``apply(args[applies_to], value)`` is what it does to one tensor argument before the op
    proper, and a kernel whose function does not take the option (the reference's, for one) is
    called without it on the transformed argument (:mod:`megablocks_core.registry`), so it keeps
    serving the op, option or not. Without ``apply`` every kernel must take it (``glu``'s
    activation is the op itself)."""

    name: str
    doc: str
    choices: tuple[str, ...]
    applies_to: str | None = None
    apply: Callable[..., Any] | None = None
    """``apply(tensor, value, *parameters)``: the values of the choice's parameters
    (:class:`FloatArg` options with ``of`` naming it, in the contract's order) follow its own."""

    def __post_init__(self) -> None:
        if (self.applies_to is None) != (self.apply is None):
            raise ValueError(f"choice argument {self.name!r}: give applies_to and apply together")

    def describe(self) -> str:
        return "one of " + ", ".join(repr(c) for c in self.choices) + ", or None"


@dataclass(frozen=True)
class FloatArg:
    """A Python float option that parametrizes a :class:`ChoiceArg` (``of``): e.g. the clamped
    SwiGLU's ``alpha`` and ``limit``. None (the default) means the choice's own default.

    A trailing option a kernel may lack, but one the core cannot serve: a kernel whose function
    takes the choice and not this parameter computes the default only, so it declines every call
    that sets it (:mod:`megablocks_core.registry`), and the call goes to the next kernel in the
    ranking. A kernel that leaves the choice itself to the core gets it applied with the
    parameters (``ChoiceArg.apply``)."""

    name: str
    doc: str
    of: str
    """The name of the :class:`ChoiceArg` it parametrizes."""

    def describe(self) -> str:
        return "float or None"


@dataclass(frozen=True)
class SequenceArg:
    """A list or tuple of Python ints (``repeat``'s tiling)."""

    name: str
    doc: str

    def describe(self) -> str:
        return "sequence of int"


Arg = TensorArg | IntArg | BoolArg | ChoiceArg | FloatArg | SequenceArg


def is_option(arg: Arg) -> bool:
    """An option a kernel may leave to the core and a caller may leave out (the op's trailing
    arguments): a :class:`ChoiceArg` the core can apply itself, a sorted-row count it can serve
    by padding or cutting (:class:`RowsOption`), a tensor whose effect it adds to the output
    (``TensorArg.serve``: ``bias``), or a choice's parameter (:class:`FloatArg`: a kernel that
    takes the choice but not it declines the calls that set it). A kernel leaves an option to
    the core by not taking it; if a published op's option ever changes meaning, the op gets a
    new contract version rather than a second path here."""
    if isinstance(arg, FloatArg):
        return True
    if isinstance(arg, ChoiceArg):
        return arg.apply is not None
    if isinstance(arg, TensorArg):
        return arg.serve is not None
    return isinstance(arg, IntArg) and arg.option is not None


@dataclass(frozen=True)
class Rule:
    """A relation the arguments must satisfy, as a Python expression over their names.

    ``checked=True`` marks a rule that must read tensor data (a device→host
    sync on accelerators); it runs only in checked mode (``MEGABLOCKS_CHECK=1``).
    """

    expr: str
    why: str
    checked: bool | str = False
    """True: checked mode only. An argument's name: always when that tensor is on
    the CPU (reading it costs no device sync), otherwise checked mode only."""
    error: type[Exception] = ValueError

    @cached_property
    def code(self) -> Any:
        return compile(self.expr, f"<rule {self.expr}>", "eval")

    @cached_property
    def operands(self) -> tuple[str, ...]:
        """The sub-expressions worth printing when the rule fails (``x.shape[0]``, ``top_k``)."""
        found: list[str] = []

        def visit(node: ast.AST) -> None:
            if isinstance(node, ast.Name | ast.Attribute | ast.Subscript | ast.Call):
                text = ast.unparse(node)
                if text not in found and not text.startswith("torch.") and text not in HELPER_NAMES:
                    found.append(text)
                return
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(ast.parse(self.expr, mode="eval"))
        return tuple(found)


@dataclass(frozen=True)
class DataDim:
    """An output size that depends on tensor data (read on the host when run eagerly)."""

    expr: str


Dim = str | DataDim


@dataclass(frozen=True)
class Output:
    name: str
    dtype: str
    """Expression giving the dtype, e.g. ``"x.dtype"`` or ``"torch.int32"``."""
    shape: tuple[Dim, ...] | str
    """One expression per dimension (:class:`DataDim` for data-dependent sizes), or
    one expression giving the whole shape when the rank varies."""
    doc: str = ""


@dataclass(frozen=True)
class OpContract:
    """Everything the core promises about one op."""

    name: str
    family: Family
    summary: str
    args: tuple[Arg, ...]
    outputs: tuple[Output, ...]
    """What the op returns; empty for an op that only writes its mutable arguments (it returns
    None)."""
    rules: tuple[Rule, ...] = ()
    differentiable: tuple[str, ...] = ()
    """Arguments that receive gradients (the core's autograd computes them)."""
    public: bool = True
    """In :mod:`megablocks_core.ops`; False for kernels used only by backward passes."""
    semantics: str = ""
    edge_cases: tuple[str, ...] = ()
    deviations: tuple[str, ...] = ()
    """Where this op knowingly differs from MegaBlocks, and why."""
    tolerance: float = 0.0
    """The least relative tolerance a kernel's float outputs are held to against the reference
    (beside its output dtype's own): what the contract's arithmetic leaves open, e.g. the scaled
    GEMMs' sums between two promotions, which FP8 matrix units keep in fewer than 24 bits."""

    @cached_property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)

    @property
    def public_args(self) -> tuple[Arg, ...]:
        return tuple(a for a in self.args if not (isinstance(a, TensorArg) and not a.public))

    @cached_property
    def tensor_args(self) -> tuple[TensorArg, ...]:
        return tuple(a for a in self.args if isinstance(a, TensorArg))

    @property
    def mutated(self) -> tuple[TensorArg, ...]:
        """The arguments the op writes in place (see :attr:`TensorArg.mutable`)."""
        return tuple(a for a in self.tensor_args if a.mutable)

    @property
    def primary(self) -> TensorArg:
        """The tensor whose device and dtype pick the implementation (the first one)."""
        return self.tensor_args[0]

    @property
    def dispatched(self) -> bool:
        """True if backends provide kernels for it (composite ops run in the core)."""
        return self.family != "composite"

    def arg(self, name: str) -> Arg:
        for a in self.args:
            if a.name == name:
                return a
        raise KeyError(name)

    def parameters_of(self, choice: str) -> tuple[str, ...]:
        """The names of the :class:`FloatArg` options that parametrize the choice ``choice``."""
        return tuple(a.name for a in self.args if isinstance(a, FloatArg) and a.of == choice)

    def signature(self, public: bool = True) -> str:
        parts = []
        for a in self.public_args if public else self.args:
            if (isinstance(a, IntArg) and (a.optional or a.default is not None)) or isinstance(
                a, BoolArg
            ):
                parts.append(f"{a.name}={a.default!r}")
            elif isinstance(a, ChoiceArg | FloatArg) or (
                isinstance(a, TensorArg) and a.serve is not None
            ):
                parts.append(f"{a.name}=None")
            else:
                parts.append(a.name)
        return f"{self.name}({', '.join(parts)})"

    def bind(self, args: tuple[Any, ...]) -> dict[str, Any]:
        """Name the kernel-order positional arguments; trailing options left out (as a caller
        written before they existed leaves them) are None."""
        names = self.arg_names
        missing = len(names) - len(args)
        if missing > 0 and all(is_option(a) for a in self.args[len(args) :]):
            args = (*args, *(None,) * missing)
        return dict(zip(names, args, strict=True))


# Helpers that rule expressions may call; kept here so the rules stay one-liners.
def _nondecreasing(t: torch.Tensor) -> bool:
    return t.numel() < 2 or bool((t[1:] >= t[:-1]).all())


def _is_permutation(t: torch.Tensor) -> bool:
    n = t.numel()
    if n == 0:
        return True
    # Compared in int64: a bound such as n = 32768 does not fit an int16 tensor's dtype and would wrap.
    values = t.long()
    if bool(((values < 0) | (values >= n)).any()):
        return False
    seen = torch.zeros(n, dtype=torch.int64, device=t.device)
    seen.scatter_add_(0, values, torch.ones_like(values))
    return bool((seen == 1).all())


def _in_range(t: torch.Tensor, low: int, high: int) -> bool:
    """Every element in [low, high). Bounds beyond the dtype's range are compared as Python ints,
    never converted to the tensor's dtype (where 1 << 15 would wrap for int16, 1 << 64 overflow)."""
    if t.numel() == 0:
        return True
    info = torch.iinfo(t.dtype) if not (t.is_floating_point() or t.is_complex()) else None
    if info is not None and (high <= info.min or low > info.max):
        return False  # the range holds no value of this dtype
    ok = torch.ones((), dtype=torch.bool, device=t.device)
    if info is None or low > info.min:
        ok = ok & (t >= low).all()
    if info is None or high <= info.max:
        ok = ok & (t < high).all()
    return bool(ok)


def _multiple_of(t: torch.Tensor, value: int) -> bool:
    """Every element is a multiple of ``value`` (any positive int, even one the dtype cannot hold)."""
    if t.numel() == 0:
        return True
    if value > torch.iinfo(t.dtype).max:  # |element| < value: only 0 is a multiple
        return bool((t == 0).all())
    return bool((t.long() % value == 0).all())


#: Up to this many group sizes, reading them as a Python list is cheaper than torch reductions
#: (this rule runs on every gmm call with CPU batch_sizes).
_SMALL = 128


def _sizes_within(sizes: torch.Tensor, rows: int) -> bool:
    """Every group size lies in [0, rows] (checked before any sum, so that a sum cannot wrap)."""
    if sizes.numel() == 0:
        return True
    if sizes.numel() <= _SMALL:
        values = sizes.tolist()
        return min(values) >= 0 and max(values) <= rows
    low, high = torch.aminmax(sizes)
    return int(low) >= 0 and int(high) <= rows


def _total(sizes: torch.Tensor, rows: int) -> int:
    """The exact sum of sizes that each lie in [0, rows] (see :func:`_sizes_within`)."""
    if sizes.numel() > _SMALL and sizes.numel() * max(rows, 1) < 2**63:  # the int64 sum cannot wrap
        return int(sizes.sum())
    return builtins.sum(sizes.tolist())  # Python ints: exact


def _repeated_shape(x: torch.Tensor, tiling: tuple[int, ...]) -> tuple[int, ...]:
    shape = (1,) * (len(tiling) - x.dim()) + tuple(x.shape)
    return tuple(s * t for s, t in zip(shape, tiling, strict=True))


def _last(t: torch.Tensor, empty: int = 0) -> int:
    return int(t[-1]) if t.numel() else empty


def _bins_match(bin_ids: torch.Tensor, bins: torch.Tensor) -> bool:
    """bin_ids[i] is the bin whose [bins[e-1], bins[e]) range holds position i."""
    positions = torch.arange(bin_ids.numel(), device=bins.device, dtype=torch.int64)
    expected = torch.searchsorted(bins.long().contiguous(), positions, right=True)
    return bool((expected == bin_ids.long()).all())


def _fits(t: torch.Tensor, bins: torch.Tensor) -> bool:
    """Each padded bin is at least as large as its unpadded twin."""
    sizes = torch.diff(t.long(), prepend=t.new_zeros(1, dtype=torch.int64))
    needed = torch.diff(bins.long(), prepend=bins.new_zeros(1, dtype=torch.int64))
    return bool((sizes >= needed).all())


def _cumsum_fits(x: torch.Tensor, dim: int) -> bool:
    """The running sums along ``dim`` fit x's dtype. They are taken in int64 and an int64 sum that
    wrapped is caught by its sign: adding a positive value never makes a running sum smaller."""
    if x.numel() == 0:
        return True
    info = torch.iinfo(x.dtype)
    values = x.long()
    total = values.cumsum(dim)
    before = (
        total - values
    )  # what the sum was before each element (the same wrap-around arithmetic)
    wrapped = ((values > 0) & (total < before)) | ((values < 0) & (total > before))
    return not bool(wrapped.any()) and bool(((total >= info.min) & (total <= info.max)).all())


RULE_HELPERS: Mapping[str, Any] = {
    "torch": torch,
    "operand_scale_shape": formats.operand_scale_shape,
    "has_grouped_columns": formats.has_grouped_columns,
    "grouped_column_scale_shape": formats.grouped_column_scale_shape,
    "encoding_of": formats.encoding_of,
    "out_dtype_of": formats.out_dtype_of,
    "nondecreasing": _nondecreasing,
    "is_permutation": _is_permutation,
    "in_range": _in_range,
    "last": _last,
    "bins_match": _bins_match,
    "fits": _fits,
    "cumsum_fits": _cumsum_fits,
    "multiple_of": _multiple_of,
    "sizes_within": _sizes_within,
    "total": _total,
    "repeated_shape": _repeated_shape,
    "int": int,
    "bool": bool,
    "len": len,
    "min": min,
    "all": all,
    "isinstance": isinstance,
    "isfinite": math.isfinite,
}
HELPER_NAMES = frozenset(RULE_HELPERS)
