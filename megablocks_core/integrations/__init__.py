"""Bridges to other MoE frameworks' APIs, built on :mod:`megablocks_core.ops`: one submodule per
framework (e.g. :mod:`.transformer_engine`, Transformer Engine's ``moe_permute`` family with its
names and signatures, and :mod:`.megatron`, whose ``install()`` makes Megatron-Core's
``fused=True`` permutation path use it where Transformer Engine is absent).

``import megablocks_core`` imports none of them, and none imports its framework at import time,
except :mod:`.transformers`, whose import registers ``experts_implementation="megablocks"`` with
Hugging Face transformers (the one line a user adds).
"""
