"""Checks run before any rank starts: is DeepSpeed installed, would a config compile (private).

Nothing here imports DeepSpeed unless a config asks for an op that DeepSpeed compiles: the
command line runs these checks while parsing its arguments.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

from fsdp_guide.catalog import extra_installed, install_command
from fsdp_guide.errors import MissingRequirementError

#: The command that installs the extra, pinned like the rest of the project.
INSTALL_COMMAND = install_command("deepspeed")
#: Compilers torch's JIT extension builder calls (``$CXX`` first).
COMPILERS = ("c++", "g++", "clang++", "cc")
# DeepSpeed optimizer types whose update is a compiled op unless torch's Adam is asked for.
_COMPILED_OPTIMIZERS = {
    "adam": "fused_adam",
    "adamw": "fused_adam",
    "lamb": "fused_lamb",
    "lion": "fused_lion",
    "adagrad": "cpu_adagrad",
    "onebitadam": "fused_adam",
    "zerooneadam": "fused_adam",
    "onebitlamb": "fused_lamb",
}


def deepspeed_installed() -> bool:
    """Whether ``import deepspeed`` would find DeepSpeed (it is not imported here).

    Examples:
        >>> isinstance(deepspeed_installed(), bool)
        True
    """
    return extra_installed("deepspeed")


def check_installed(what: str = "DeepSpeed ZeRO") -> None:
    """Raise a one-line ``MissingRequirementError`` naming the fix unless DeepSpeed is there.

    Args:
        what: What needs it, for the message.
    """
    if not deepspeed_installed():
        raise MissingRequirementError(
            f"{what} needs the optional extra 'deepspeed', which is not installed: "
            f"{INSTALL_COMMAND}"
        )


def compiled_ops(config: Mapping[str, Any], *, cuda: bool = False) -> list[str]:
    """The DeepSpeed ops a config makes DeepSpeed build with a C++ compiler.

    Only the optimizer can ask for one here: torch's Adam (``"torch_adam": True``) needs
    none; DeepSpeed's own Adam is ``cpu_adam`` when it steps on the CPU (optimizer offload,
    or no GPU) and ``fused_adam`` on a GPU. The shared-memory collectives op that
    ``deepspeed.init_distributed`` builds on CPU is turned off by
    :func:`~fsdp_guide.deepspeed.import_deepspeed`, so it is not listed.

    Args:
        config: A DeepSpeed config dictionary.
        cuda: Whether it runs on GPUs.

    Returns:
        Op names, empty when nothing is compiled.

    Examples:
        >>> from fsdp_guide.deepspeed import zero_config
        >>> compiled_ops(zero_config(2, offload_optimizer=True))
        []
        >>> compiled_ops({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 1}})
        ['cpu_adam']
        >>> compiled_ops({"optimizer": {"type": "AdamW"}}, cuda=True)
        ['fused_adam']
    """
    optimizer = config.get("optimizer") or {}
    kind = str(optimizer.get("type", "")).lower()
    params = optimizer.get("params") or {}
    if kind not in _COMPILED_OPTIMIZERS or (kind in ("adam", "adamw") and params.get("torch_adam")):
        return []
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    on_cpu = offload.get("device") in ("cpu", "nvme") or not cuda
    if kind in ("adam", "adamw") and on_cpu:
        return ["cpu_adam"]
    if kind == "lion" and on_cpu:
        return ["cpu_lion"]
    return [_COMPILED_OPTIMIZERS[kind]]


def find_compiler() -> str | None:
    """The C++ compiler a JIT build would use: ``$CXX``, else the first of ``COMPILERS``.

    Examples:
        >>> find_compiler() is None or isinstance(find_compiler(), str)
        True
    """
    for name in (os.environ.get("CXX", ""), *COMPILERS):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def _prebuilt(op: str) -> bool:
    from deepspeed.git_version_info import installed_ops

    return bool(installed_ops.get(op, False))


def check_compiler(config: Mapping[str, Any], *, cuda: bool = False) -> None:
    """Raise unless every op the config compiles is prebuilt or a compiler is on ``PATH``.

    Raises:
        ValueError: ``MissingRequirementError``: One line naming the ops and the two fixes.

    Examples:
        >>> from fsdp_guide.deepspeed import zero_config
        >>> check_compiler(zero_config(3, offload_optimizer=True, offload_params=True))
    """
    needed = [op for op in compiled_ops(config, cuda=cuda) if not _prebuilt(op)]
    if needed and find_compiler() is None:
        raise MissingRequirementError(
            f"this DeepSpeed config compiles {', '.join(needed)} with a C++ compiler, and none "
            f"is on PATH ({', '.join(COMPILERS)}): install one (apt-get install g++), or use "
            'torch\'s Adam: "optimizer": {"type": "Adam", "params": {"torch_adam": true, '
            '"adam_w_mode": false}} with "zero_force_ds_cpu_optimizer": false'
        )


def preflight(config: Mapping[str, Any] | None = None, *, cuda: bool = False) -> None:
    """Everything that can be checked before a DeepSpeed run starts any process.

    Args:
        config: The DeepSpeed config to run, if known; checked for ops needing a compiler.
        cuda: Whether it runs on GPUs.

    Raises:
        ValueError: ``MissingRequirementError``: The ``deepspeed`` extra is not installed, or the
            config needs a compiler and there is none.
    """
    check_installed()
    if config is not None:
        check_compiler(config, cuda=cuda)
