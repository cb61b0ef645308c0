"""MoE layer shapes of well-known models, named: the benchmark's shapes and the default calls for
which ``megablocks backends explain`` shows the per-shape choice."""

from __future__ import annotations

#: name → (tokens, hidden, ffn, experts, top_k)
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "mixtral": (16384, 4096, 14336, 8, 2),
    "qwen3": (16384, 2048, 768, 128, 8),
    "dsv3": (16384, 7168, 2048, 256, 8),
    "tiny": (64, 32, 48, 8, 2),
}
