"""Fresh virtual environments for install tests (no network, no copy of torch).

A venv created here sees the third-party packages of the interpreter running the tests (torch,
triton, numpy, pluggy, packaging, pip …) through a .pth file, because installing those offline is
not possible (torch comes from a local wheel cache in CI; pip's HTTP cache cannot be used as an
index) and copying them would take longer than the tests. ``--system-site-packages`` would expose
the *base* interpreter's packages, not this environment's, hence the .pth file.

``hide``: distribution-name prefixes kept out of that view, so an install test proves that those
come from the wheels it installs and not from the developer's editable checkouts.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path


def _belongs_to(entry: str, prefixes: tuple[str, ...]) -> bool:
    # Packages, their dist-info, and setuptools' editable-install hooks (__editable__.NAME-…,
    # __editable___NAME_finder.py) all carry the distribution's name, "-" written as "_".
    name = entry.lower().removeprefix("__editable__").lstrip("._").replace("-", "_")
    return name.startswith(tuple(p.lower().replace("-", "_") for p in prefixes))


def fresh_env(root: Path, hide: tuple[str, ...] = ()) -> Path:
    """Create ``root/venv`` and return its python."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    dirs = [Path(d) for d in site.getsitepackages()]
    if hide:
        # A view of each site directory without the hidden distributions: symlinks, so it is
        # built in milliseconds whatever the size of torch.
        views = []
        for i, d in enumerate(dirs):
            view = root / f"outer-site-{i}"
            view.mkdir()
            for entry in os.listdir(d) if d.is_dir() else ():
                if not _belongs_to(entry, hide):
                    (view / entry).symlink_to(d / entry)
            views.append(view)
        dirs = views
    lines = [f"import site; site.addsitedir({str(d)!r})" for d in dirs]
    (Path(purelib) / "outer_site.pth").write_text("\n".join(lines) + "\n")
    return python
