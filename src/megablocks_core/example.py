"""A small dropless MoE layer on the ops API, checked against a per-token loop.

``megablocks example`` runs it: routing → gather → gmm → GELU → gmm → scatter,
forward and backward, then recomputes every token with plain matrix products
and compares outputs and gradients. It ends with a table of which backend
served each op.
"""

from __future__ import annotations

import time

import torch

from . import dispatch, ops


def moe_forward(x: torch.Tensor, router: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                top_k: int) -> torch.Tensor:
    """Dropless MoE: each token goes to its top_k experts; outputs are summed with router weights."""
    experts = w1.shape[0]
    probs = torch.softmax(x.float() @ router.float(), dim=-1)
    weights, top_experts = torch.topk(probs, top_k, dim=-1)
    weights, top_experts = weights.flatten().to(x.dtype), top_experts.flatten().int()
    end_bit = max((experts - 1).bit_length(), 1)
    bin_ids, indices = ops.sort(top_experts, end_bit)
    tokens_per_expert = ops.histogram(top_experts, experts)
    bins = ops.inclusive_cumsum(tokens_per_expert, 0)
    rows = ops.gather(x, indices, bin_ids, bins, top_k)
    hidden = torch.nn.functional.gelu(ops.gmm(rows, w1, tokens_per_expert))
    rows = ops.gmm(hidden, w2, tokens_per_expert)
    return ops.scatter(rows, indices, bin_ids, weights, bins, top_k)


def loop_forward(x: torch.Tensor, router: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 top_k: int) -> torch.Tensor:
    """The same layer token by token in float64, with no MoE op at all."""
    x, router, w1, w2 = (t.double() for t in (x, router, w1, w2))
    probs = torch.softmax(x @ router, dim=-1)
    weights, top_experts = torch.topk(probs, top_k, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(top_k):
            e = int(top_experts[t, k])
            out[t] += weights[t, k] * (torch.nn.functional.gelu(x[t] @ w1[e]) @ w2[e])
    return out


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def run(device: str = "cpu", tokens: int = 64, hidden: int = 32, ffn: int = 48, experts: int = 8,
        top_k: int = 2, dtype: str = "float32") -> int:
    torch.manual_seed(0)
    dev, dt = torch.device(device), getattr(torch, dtype)
    print("megablocks-core example: dropless MoE layer on megablocks_core.ops")
    print(f"tokens={tokens} hidden={hidden} ffn={ffn} experts={experts} top_k={top_k} "
          f"dtype={dtype} device={dev}\n")
    x = torch.randn(tokens, hidden, device=dev, dtype=dt, requires_grad=True)
    router = torch.randn(hidden, experts, device=dev, dtype=dt)
    w1 = (torch.randn(experts, hidden, ffn, device=dev) / hidden**0.5).to(dt).requires_grad_()
    w2 = (torch.randn(experts, ffn, hidden, device=dev) / ffn**0.5).to(dt).requires_grad_()

    started = time.perf_counter()
    out = moe_forward(x, router, w1, w2, top_k)
    out.square().sum().backward()
    elapsed = time.perf_counter() - started

    x64 = x.detach().double().requires_grad_()
    w1_64, w2_64 = (w.detach().double().requires_grad_() for w in (w1, w2))
    want = loop_forward(x64, router, w1_64, w2_64, top_k)
    want.square().sum().backward()
    tolerance = 1e-5 if dt == torch.float32 else 3e-2
    checks = {
        "output": _relative_error(out.detach(), want.detach()),
        "grad x": _relative_error(x.grad, x64.grad),
        "grad w1": _relative_error(w1.grad, w1_64.grad),
        "grad w2": _relative_error(w2.grad, w2_64.grad),
    }
    print(f"forward + backward: {elapsed * 1e3:.1f} ms")
    print("relative error against a float64 per-token loop:")
    for name, err in checks.items():
        print(f"  {name:<8} {err:.2e} {'ok' if err <= tolerance else 'FAILED'}")
    print("\nbackends that served each op:")
    for op, labels in sorted(dispatch.served().items()):
        print(f"  {op:<18} {', '.join(labels)}")
    ok = all(err <= tolerance for err in checks.values())
    print("\nresult: " + ("ok" if ok else f"FAILED (tolerance {tolerance:g})"))
    return 0 if ok else 1
