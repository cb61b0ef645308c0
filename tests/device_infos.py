"""Device descriptions for tests of per-device choices (tile policies, kernel selection): what
``megablocks_core.devices.describe`` reports for these GPUs, without the GPUs."""

from __future__ import annotations

import dataclasses

from megablocks_core.plugin import DeviceInfo

H200 = DeviceInfo(
    kind="cuda",
    type="cuda",
    index=0,
    name="NVIDIA H200",
    arch="sm_90",
    capability=(9, 0),
    warp_size=32,
    multiprocessors=132,
)
B200 = dataclasses.replace(H200, name="NVIDIA B200", arch="sm_100", capability=(10, 0))
RTX5090 = dataclasses.replace(H200, name="NVIDIA RTX 5090", arch="sm_120", capability=(12, 0))
MI300 = DeviceInfo(
    kind="rocm",
    type="cuda",
    index=0,
    name="AMD Instinct MI300X",
    arch="gfx942",
    warp_size=64,
    multiprocessors=304,
)
RX7900 = dataclasses.replace(
    MI300, name="Radeon RX 7900 XTX", arch="gfx1100", warp_size=32, multiprocessors=48
)
