"""Wrapping and activation checkpointing for every engine: the public entry point.

How a model is cut into FSDP units decides peak memory and how communication overlaps
compute; activation checkpointing trades recomputation for activation memory. Import
everything from here:

* policies: :class:`SizePolicy`, :class:`LayerPolicy`, their union ``a | b``, usable with
  FairScale, FSDP1 and FSDP2, and :class:`WrapPolicy` to write one of your own;
* sharding: :func:`shard` with a policy, and manual wrapping with :func:`wrapping` and
  :func:`wrap`, for the FSDP engines (each engine's adapter, a
  :class:`fsdp_guide.engines.UnitEngine`, says how);
* building a model already sharded, never whole on a rank: :func:`build_sharded`;
* activation checkpointing: :func:`checkpoint_layers`, and :func:`saved_activation_bytes`
  to measure what it saves;
* :func:`describe` and :func:`sharded_units`: the units of a model;
* :func:`check_optimizer`: an optimizer built before wrapping.

PyTorch's documentation of the engines: `FSDP2 fully_shard
<https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html>`__ and `FSDP1
<https://docs.pytorch.org/docs/stable/fsdp.html>`__; the design is in the `PyTorch FSDP paper
<https://arxiv.org/abs/2304.11277>`__.

Examples:
    >>> from fsdp_guide.models import Block, TinyTransformer, TransformerConfig
    >>> from fsdp_guide.wrap import LayerPolicy, describe
    >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
    >>> print(describe(model, policy=LayerPolicy(Block), max_depth=2))
    (root): TinyTransformer  [unit: planned, 17,472 params]
      tok_emb: Embedding
      pos_emb: Embedding
      blocks: ModuleList
        0: Block  [unit: planned, 12,704 params]
        1: Block  [unit: planned, 12,704 params]
      ln_f: LayerNorm
      head: Linear
"""

from __future__ import annotations

# Where each lives: _policy (policies), _shard (shard), _manual (wrapping, wrap), _build
# (build_sharded), _activations (checkpoint_layers, saved_activation_bytes), _inspect
# (describe, sharded_units), _optimizer_check (check_optimizer).
# The errors are documented in fsdp_guide.errors; still importable from here, as before.
from fsdp_guide.errors import EngineUnavailableError as EngineUnavailableError
from fsdp_guide.errors import MetaInitError as MetaInitError
from fsdp_guide.errors import OptimizerMismatchError as OptimizerMismatchError
from fsdp_guide.wrap._activations import CheckpointImplementation as CheckpointImplementation
from fsdp_guide.wrap._activations import checkpoint_layers, saved_activation_bytes
from fsdp_guide.wrap._activations import checkpointed_names as checkpointed_names
from fsdp_guide.wrap._build import build_sharded, uninitialisable_modules
from fsdp_guide.wrap._inspect import ModuleNode as ModuleNode
from fsdp_guide.wrap._inspect import describe, sharded_units
from fsdp_guide.wrap._inspect import is_checkpointed as is_checkpointed
from fsdp_guide.wrap._inspect import module_tree as module_tree
from fsdp_guide.wrap._manual import wrap, wrapping
from fsdp_guide.wrap._optimizer_check import check_optimizer
from fsdp_guide.wrap._policy import AnyOf as AnyOf
from fsdp_guide.wrap._policy import LayerPolicy, SizePolicy, WrapPolicy, selected_modules
from fsdp_guide.wrap._policy import any_of as any_of
from fsdp_guide.wrap._policy import check_layer_classes as check_layer_classes
from fsdp_guide.wrap._shard import shard

__all__ = [
    "LayerPolicy",
    "SizePolicy",
    "WrapPolicy",
    "build_sharded",
    "check_optimizer",
    "checkpoint_layers",
    "describe",
    "saved_activation_bytes",
    "selected_modules",
    "shard",
    "sharded_units",
    "uninitialisable_modules",
    "wrap",
    "wrapping",
]
