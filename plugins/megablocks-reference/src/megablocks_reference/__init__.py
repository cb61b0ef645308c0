"""Pure-PyTorch reference backend for megablocks-core."""

__version__ = "0.1.0"
