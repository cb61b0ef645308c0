"""An example megablocks-core backend: two routing ops on the CPU, written the way vendors write theirs.

The core finds it through the ``megablocks.backends`` entry point ``example``
(see pyproject.toml) and imports :mod:`megablocks_example_plugin.plugin`.
"""

__version__ = "0.1.0"
