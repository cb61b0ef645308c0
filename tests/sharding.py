"""``--shard K/N``: run one of N parts of the collected tests, so that a suite too long for one
invocation runs completely in N (e.g. the GPU suite: see README, "Running the tests").

A test's shard is a CRC-32 of its node id (``tests/test_x.py::test_y[param]``, relative to the
repository root) modulo N: it depends on that test alone, not on the rest of the collection or
its order, so shards run at different times, or with other tests added in between, still
together run each test exactly once. Over the suite's thousands of tests the shards come out
within a few percent of each other in size.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import pytest


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` as ``(K, N)`` with 1 <= K <= N."""
    index_text, slash, count_text = text.partition("/")
    try:
        index, count = int(index_text), int(count_text)
    except ValueError:
        index = count = 0
    if not slash or not 1 <= index <= count:
        raise pytest.UsageError(f"--shard {text!r}: expected K/N with 1 <= K <= N, e.g. 2/3")
    return index, count


def shard_of(nodeid: str, count: int) -> int:
    """The shard (1-based) among ``count`` that the test ``nodeid`` belongs to."""
    return zlib.crc32(nodeid.encode()) % count + 1


def in_shard(nodeids: Sequence[str], index: int, count: int) -> list[bool]:
    """For each node id, whether it belongs to shard ``index`` (1-based) of ``count``."""
    return [shard_of(nodeid, count) == index for nodeid in nodeids]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard",
        metavar="K/N",
        default=None,
        help="run only shard K of N of the collected tests (1 <= K <= N); the N shards, each run "
        "with the same other arguments, together run every test exactly once",
    )


def pytest_configure(config: pytest.Config) -> None:
    text = config.getoption("--shard")
    if text is not None:
        parse_shard(text)  # a bad value fails before collection


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    text = config.getoption("--shard")
    if text is None:
        return
    index, count = parse_shard(text)
    keep = in_shard([item.nodeid for item in items], index, count)
    deselected = [item for item, kept in zip(items, keep, strict=True) if not kept]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = [item for item, kept in zip(items, keep, strict=True) if kept]
