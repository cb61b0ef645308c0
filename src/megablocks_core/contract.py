"""The former name of :mod:`megablocks_core.schema`; remaining importers should use that module."""

from .schema import RULE_HELPERS, BoolArg, IntArg, OpContract, TensorArg

__all__ = ["RULE_HELPERS", "BoolArg", "IntArg", "OpContract", "TensorArg"]
