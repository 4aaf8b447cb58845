"""DeepSpeed ZeRO on the guide's terms: on CPU with gloo, no compiler, plain Adam.

The catalog's ``deepspeed_zero1`` to ``deepspeed_zero3`` strategies and their offload
variants are built here (:func:`fsdp_guide.catalog.wrap_for_strategy` calls
:func:`initialize` with a :func:`zero_config`). DeepSpeed is an optional extra
(``pip install -e ".[deepspeed]"`` from a checkout) and is imported only when an engine is
built: importing this package does not import it.

What it takes to run DeepSpeed on a laptop, and where each step lives:

* :func:`prepare_cpu`: ``DS_ACCELERATOR=cpu`` when no GPU is visible, before DeepSpeed is
  imported (it picks its accelerator once per process); inside a launched rank
  :func:`rank_accelerator` decides from the rank's device (a gloo rank uses the CPU even
  where a GPU is visible).
* :func:`import_deepspeed`: turns off the shared-memory collectives op that
  ``deepspeed.init_distributed`` would otherwise build with the C++ compiler in every
  process (75 s the first time; a failed init without a compiler).
* :func:`zero_config`: torch's Adam (no compiled optimizer, also when offloading),
  ``"adam_w_mode": False`` (else ``"Adam"`` means AdamW), buckets and a ZeRO-3 persistence
  threshold small enough that a small model is really sharded.
* :func:`preflight`: before any process starts, a one-line
  :class:`~fsdp_guide.errors.MissingRequirementError` naming the fix when the extra is
  missing, or when a config would compile an op and no compiler is on ``PATH``.
* :func:`backward_and_step`: ``engine.backward(loss)`` and ``engine.step()`` in place of
  ``loss.backward()`` and ``optimizer.step()``.

DeepSpeed's own documentation: `ZeRO <https://deepspeed.readthedocs.io/en/latest/zero3.html>`__
and the `configuration keys <https://www.deepspeed.ai/docs/config-json/>`__.

Examples:
    >>> from fsdp_guide.deepspeed import zero_config
    >>> zero_config(2)["zero_optimization"]["stage"]
    2
"""

from __future__ import annotations

from fsdp_guide.deepspeed._config import BUCKET_ELEMENTS, zero_config
from fsdp_guide.deepspeed._engine import (
    backward_and_step,
    import_deepspeed,
    initialize,
    is_engine,
    prepare_cpu,
    rank_accelerator,
)
from fsdp_guide.deepspeed._preflight import (
    INSTALL_COMMAND,
    check_compiler,
    compiled_ops,
    deepspeed_installed,
    find_compiler,
    preflight,
)

__all__ = [
    "BUCKET_ELEMENTS",
    "INSTALL_COMMAND",
    "backward_and_step",
    "check_compiler",
    "compiled_ops",
    "deepspeed_installed",
    "find_compiler",
    "import_deepspeed",
    "initialize",
    "is_engine",
    "preflight",
    "prepare_cpu",
    "rank_accelerator",
    "zero_config",
]
