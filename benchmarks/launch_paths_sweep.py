"""The triton backend's small-call paths against its large-call ones, per op and token count
(GPU µs from a CUDA graph, host µs per eager call; JSON lines).

For T = 1, 16, 128, 256, 512, 1024 tokens (H=2048, E=128, top_k=8, the cases of host_cost.py)
and sort, route, histogram, gather, scatter it measures these launch policies:

* ``default``: ``megablocks_triton.LaunchConfigs`` as installed;
* ``large``: ``tests/launch_paths.py``'s ``LargeCallPaths`` (counting sort over several tiles,
  histogram adding into a zeroed output, inverse permutation + token-major gather/scatter);
* ``small``: the one-launch paths up to 4096 keys/rows (one program sorts every key, one
  program per histogram row, row-by-row gather, index-scanning scatter);
* ``recount``: sort and route in one launch of 256-key tiles whose programs each count every
  key themselves, up to 8192 keys (the default takes it from 257 to 2048 keys).

Used to set the default policy's limits between the two kinds of path. The host column is for
comparing paths within one run (it reads higher than ``host_cost.py``'s for the same path).

    python benchmarks/launch_paths_sweep.py [--compile-only]    # writes $OUT/sweep.jsonl or ./
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, "tests")
sys.path.insert(0, "benchmarks")
import host_cost
from launch_paths import LargeCallPaths
from megablocks_triton.config import LaunchConfigs, RoutingConfig, use_launch_configs
from megablocks_triton.launch import next_power_of_2


class SmallCallPaths(LaunchConfigs):
    """The one-launch paths for every call of up to 4096 keys or rows."""

    def routing(self, n: int, nb: int) -> RoutingConfig:
        if n <= 4096:
            return RoutingConfig(
                tile=max(next_power_of_2(n), 64),
                chunk=64,
                tile_rows=max(1, min(32, 8192 // nb)),
                num_warps=4,
                single=True,
            )
        return super().routing(n, nb)

    def histogram_block(self, n: int) -> int:
        return max(next_power_of_2(n), 32) if n <= 4096 else super().histogram_block(n)

    def gather_by_rows(self, *a: int) -> bool:
        return True

    def scatter_search(self, num_tokens: int, top_k: int) -> int:
        return min(next_power_of_2(num_tokens * top_k), 256)


class RecountPaths(LaunchConfigs):
    """Sort and route: one launch of 256-key tiles, each program counting every key, for every
    call of up to 8192 keys."""

    def routing(self, n: int, nb: int) -> RoutingConfig:
        if n <= 8192:
            return RoutingConfig(
                tile=256, chunk=64, tile_rows=max(1, min(32, 8192 // nb)), num_warps=4, recount=True
            )
        return super().routing(n, nb)


POLICIES = {
    "default": None,
    "large": LargeCallPaths(),
    "small": SmallCallPaths(),
    "recount": RecountPaths(),
}
TOKENS = (1, 16, 128, 256, 512, 1024)
OPS = ("sort", "route", "histogram", "gather", "scatter")
#: Policies that change only some ops' paths (the others would repeat the default's figures).
POLICY_OPS = {"recount": ("sort", "route")}


def wrapped(fn: Callable[[], Any], policy: LaunchConfigs | None) -> Callable[[], Any]:
    if policy is None:
        return fn

    def call() -> Any:
        with use_launch_configs(policy):
            return fn()

    return call


def main() -> None:
    compile_only = "--compile-only" in sys.argv
    out = os.environ.get("OUT", ".")
    rows: list[dict[str, Any]] = []
    for tokens in TOKENS:
        cases = host_cost.op_cases(tokens, 2048, 128, 8)
        for pname, policy in POLICIES.items():
            for op in POLICY_OPS.get(pname, OPS):
                fn = wrapped(cases[op], policy)
                try:
                    if compile_only:
                        fn()
                        continue
                    row = {
                        "T": tokens,
                        "policy": pname,
                        "op": op,
                        "gpu_us": round(host_cost._graph_us(fn), 2),
                        "host_us": round(host_cost._host_us(fn, 300), 2),
                    }
                except Exception as exc:
                    print("FAILED", tokens, pname, op, repr(exc)[:300], flush=True)
                    continue
                rows.append(row)
                print(json.dumps(row), flush=True)
        torch.cuda.synchronize()
    if not compile_only:
        with open(os.path.join(out, "sweep.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    else:
        torch.cuda.synchronize()
        print("compiled", flush=True)


if __name__ == "__main__":
    main()
