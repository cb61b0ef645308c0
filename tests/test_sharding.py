"""``--shard K/N`` (tests/sharding.py): the N shards partition the collected tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sharding

ROOT = Path(__file__).resolve().parents[1]

NODEIDS = [
    *(f"tests/test_a.py::test_wide[{i}]" for i in range(40)),
    *(f"tests/test_a.py::test_narrow[{i}-x]" for i in range(3)),
    "tests/test_a.py::test_plain",
    *(f"tests/test_b.py::TestThing::test_method[{d}]" for d in ("float32", "bfloat16")),
    *(f"tests/test_b.py::test_case_{i}" for i in range(25)),
    *(f"tests/test_c.py::test_param[{i}]" for i in range(12)),
]


def _shard(nodeids: list[str], index: int, count: int) -> list[str]:
    keep = sharding.in_shard(nodeids, index, count)
    return [nodeid for nodeid, kept in zip(nodeids, keep, strict=True) if kept]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 200])
def test_shards_partition_the_tests(count: int) -> None:
    chosen = [sharding.in_shard(NODEIDS, index, count) for index in range(1, count + 1)]
    for position, nodeid in enumerate(NODEIDS):
        assert sum(shard[position] for shard in chosen) == 1, nodeid


@pytest.mark.parametrize("count", [2, 3, 4])
def test_the_shards_balance(count: int) -> None:
    nodeids = [
        f"tests/test_{f}.py::test_{t}[{p}]" for f in range(30) for t in range(20) for p in range(5)
    ]
    sizes = [len(_shard(nodeids, index, count)) for index in range(1, count + 1)]
    mean = len(nodeids) / count
    assert max(abs(size - mean) for size in sizes) < 0.05 * mean, sizes


def test_a_tests_shard_depends_on_that_test_alone() -> None:
    """Others added, removed or reordered (a suite edited between shard runs) move no test."""
    subset = list(reversed(NODEIDS[::3]))
    for index in (1, 2, 3):
        assert set(_shard(subset, index, 3)) == set(_shard(NODEIDS, index, 3)) & set(subset)


@pytest.mark.parametrize("text", ["0/3", "4/3", "1/0", "3", "a/b", "1/3/5", "/3", ""])
def test_a_bad_shard_is_a_usage_error(text: str) -> None:
    with pytest.raises(pytest.UsageError, match="K/N"):
        sharding.parse_shard(text)


def _collected(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_the_option_splits_a_real_collection() -> None:
    files = ["tests/test_sharding.py", "tests/test_dispatch_overhead.py"]
    whole = _collected(*files)
    shards = [_collected("--shard", f"{index}/3", *files) for index in (1, 2, 3)]
    assert all(shards)
    assert sorted(n for shard in shards for n in shard) == sorted(whole)
