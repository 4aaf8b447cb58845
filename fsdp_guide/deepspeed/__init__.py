"""DeepSpeed ZeRO on the guide's terms: on CPU with gloo, no compiler, plain Adam.

The catalog's ``deepspeed_zero1`` to ``deepspeed_zero3`` strategies and their offload
variants are built here (their engine calls :func:`initialize` with a
:func:`zero_config`). DeepSpeed is an optional extra
(``pip install -e ".[deepspeed]"`` from a checkout) and is imported only when an engine is
built: importing this package does not import it.

What it takes to run DeepSpeed on a laptop, and where each step lives:

* :func:`prepare_cpu`: ``DS_ACCELERATOR=cpu`` when no GPU is visible, before DeepSpeed is
  imported (it picks its accelerator once per process); inside a launched rank the rank's
  device decides (a gloo rank uses the CPU even where a GPU is visible).
* :func:`import_deepspeed`: turns off the shared-memory collectives op that
  ``deepspeed.init_distributed`` would otherwise build with the C++ compiler in every
  process (75 s the first time; a failed init without a compiler).
* :func:`zero_config`: torch's Adam (no compiled optimizer, also when offloading),
  ``"adam_w_mode": False`` (else ``"Adam"`` means AdamW), buckets and a ZeRO-3 persistence
  threshold small enough that a small model is really sharded.
* Before any process starts, a one-line
  ``MissingRequirementError`` names the fix when the extra is
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

from fsdp_guide.deepspeed._config import BUCKET_ELEMENTS as BUCKET_ELEMENTS
from fsdp_guide.deepspeed._config import zero_config
from fsdp_guide.deepspeed._engine import (
    backward_and_step,
    import_deepspeed,
    initialize,
    prepare_cpu,
)
from fsdp_guide.deepspeed._engine import is_engine as is_engine
from fsdp_guide.deepspeed._engine import rank_accelerator as rank_accelerator
from fsdp_guide.deepspeed._preflight import INSTALL_COMMAND as INSTALL_COMMAND
from fsdp_guide.deepspeed._preflight import check_compiler as check_compiler
from fsdp_guide.deepspeed._preflight import compiled_ops as compiled_ops
from fsdp_guide.deepspeed._preflight import deepspeed_installed as deepspeed_installed
from fsdp_guide.deepspeed._preflight import find_compiler as find_compiler
from fsdp_guide.deepspeed._preflight import preflight as preflight

__all__ = [
    "backward_and_step",
    "import_deepspeed",
    "initialize",
    "prepare_cpu",
    "zero_config",
]
