"""docs/contracts.md, rendered from the contracts (a test keeps the file in step)."""

from __future__ import annotations

from .contracts import ALL
from .schema import DataDim, OpContract, Rule, TensorArg

FAMILIES = (
    ("routing", "Routing"),
    ("permutation", "Permutation"),
    ("grouped_gemm", "Grouped GEMM"),
    ("activation", "Activation"),
    ("quantization", "Quantization (the low-precision formats: megablocks_core.formats)"),
    ("composite", "Composite ops (plain torch, run by the core on every device)"),
)


def _shape(contract: OpContract, index: int) -> str:
    shape = contract.outputs[index].shape
    if isinstance(shape, str):
        return f"`{shape}`"
    dims = [f"{d.expr} (data-dependent)" if isinstance(d, DataDim) else d for d in shape]
    return "`(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")`"


def _row(*cells: str) -> str:
    """A table row; a ``|`` inside a cell (code spans included: GitHub's tables split there too)
    is escaped, so that it stays in its cell."""
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _rule_when(rule: Rule) -> str:
    if rule.checked is True:
        return "checked mode"
    if isinstance(rule.checked, str):
        return f"always if `{rule.checked}` is on the CPU, else checked mode"
    return "always"


def _render(contract: OpContract) -> list[str]:
    lines = [f"### `{contract.signature()}`", ""]
    if not contract.public:
        lines += ["Kernel-level op (used by backward passes; not in `megablocks_core.ops`).", ""]
    lines += [contract.summary, ""]
    if contract.public and contract.signature() != contract.signature(public=False):
        lines += [f"Kernel signature: `{contract.signature(public=False)}`.", ""]
    lines += ["| argument | type | meaning |", "|---|---|---|"]
    for a in contract.args:
        kernel_only = " (kernel only)" if isinstance(a, TensorArg) and not a.public else ""
        lines.append(_row(f"`{a.name}`", a.describe() + kernel_only, a.doc))
    if contract.outputs:
        lines += ["", "| output | dtype | shape | note |", "|---|---|---|---|"]
        for i, out in enumerate(contract.outputs):
            lines.append(_row(f"`{out.name}`", f"`{out.dtype}`", _shape(contract, i), out.doc))
    else:
        written = ", ".join(f"`{a.name}`" for a in contract.mutated)
        lines += ["", f"Returns nothing: writes {written} in place (no other argument changes)."]
    if contract.rules:
        lines += ["", "| rule | why | checked |", "|---|---|---|"]
        lines += [_row(f"`{r.expr}`", r.why, _rule_when(r)) for r in contract.rules]
    lines.append("")
    if contract.differentiable:
        lines += ["Gradients: " + ", ".join(f"`{n}`" for n in contract.differentiable) + ".", ""]
    if contract.semantics:
        lines += [contract.semantics, ""]
    if contract.edge_cases:
        lines += ["Edge cases: " + "; ".join(contract.edge_cases) + ".", ""]
    if contract.deviations:
        lines += ["Differs from MegaBlocks:", "", *(f"- {d}" for d in contract.deviations), ""]
    return lines


def render_markdown() -> str:
    lines = [
        "# Op contracts",
        "",
        "Generated from `megablocks_core/contracts/` by `megablocks contracts`; do not edit by hand.",
        "",
        "Arguments are listed in kernel order: a backend's kernel receives exactly these, positionally.",
        "Every rule marked *always* is checked on every call without reading tensor data; rules marked",
        "*checked mode* read data (a device sync) and run only with `MEGABLOCKS_CHECK=1`. A broken",
        "rule raises `ValueError` (`TypeError` for types and dtypes) naming the op and the values.",
        "",
    ]
    for family, title in FAMILIES:
        lines += [f"## {title}", ""]
        for contract in ALL:
            if contract.family == family:
                lines += _render(contract)
    return "\n".join(lines).rstrip() + "\n"
