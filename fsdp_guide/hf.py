"""Hugging Face ``transformers`` models from their config classes: offline, nothing downloaded.

:func:`hf_builder` turns a model type (``"llama"``, ``"gpt2"``, ``"t5"``) or a model class name
(``"LlamaForSequenceClassification"``) and config overrides into a function that builds the
model from its config class, so the planner can call it on the meta device: a 70B-parameter
Llama is built in seconds and allocates nothing. It is what ``estimate --hf`` does.
What a model's ``labels`` are comes from the task tables of ``transformers``' auto
classes. ``transformers`` (the ``transformers`` extra) is imported
when these are called, never by ``import fsdp_guide``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from fsdp_guide.errors import MissingRequirementError, PlanError

__all__ = ["hf_builder"]

_INSTALL = 'pip install -c requirements/constraints.txt -e ".[transformers]"'
# transformers' task tables, in the order a model type is given its head: the task a bare
# model type is usually trained for first. Each is (table, what its labels are).
_TASKS = (
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq_lm"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked_lm"),
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal_lm"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "class"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "class"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token_class"),
)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise MissingRequirementError(
            f"planning transformers models needs the transformers extra: {_INSTALL}"
        ) from exc
    return transformers


def _tables() -> Any:
    _transformers()
    from transformers.models.auto import modeling_auto

    return modeling_auto


def _names(value: object) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(str(v) for v in value)  # type: ignore[attr-defined]


def label_kind(model: nn.Module) -> str | None:
    """What the ``labels`` of ``model``'s task are, from the class's task in ``transformers``.

    ``"causal_lm"``, ``"masked_lm"``, ``"seq2seq_lm"`` (a token per position), ``"class"`` (one
    per sample), ``"token_class"`` (one per token), or ``None`` for a model without a known
    task (a bare ``LlamaModel``). A subclass has its base's task.

    Examples:
        >>> from torch import nn
        >>> label_kind(nn.Linear(2, 2)) is None
        True
    """
    classes = [c.__name__ for c in type(model).__mro__]
    if not any(name.endswith("PreTrainedModel") for name in classes):
        return None
    tables = _tables()
    for table, kind in _TASKS:
        known = {n for v in getattr(tables, table, {}).values() for n in _names(v)}
        if any(name in known for name in classes):
            return kind
    return None


def _model_class(name: str) -> tuple[Any, str]:
    """The model class ``name`` names (a class name, or a model type's usual task class)."""
    transformers, tables = _transformers(), _tables()
    cls: Any = getattr(transformers, name, None) if name[:1].isupper() else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        found: Any = cls
        return found, found.config_class.model_type
    if name not in transformers.CONFIG_MAPPING:
        close = difflib.get_close_matches(name, list(transformers.CONFIG_MAPPING), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise PlanError(
            f"unknown transformers model type or class {name!r}{hint} (model types are the "
            "config's model_type, e.g. llama, gpt2, bert, t5, vit; classes e.g. "
            "LlamaForSequenceClassification)"
        )
    for table, _kind in [*_TASKS, ("MODEL_MAPPING_NAMES", "")]:
        found = getattr(tables, table, {}).get(name)
        if found is not None:
            return getattr(transformers, _names(found)[0]), name
    raise PlanError(f"transformers has no model class for the model type {name!r}")


def hf_builder(name: str, overrides: Mapping[str, Any] | None = None) -> Callable[[], nn.Module]:
    """A function building a ``transformers`` model from its config class, with ``overrides``.

    Args:
        name: A model type (the config's ``model_type``: ``"llama"``, ``"gpt2"``, ``"bert"``,
            ``"t5"``, ``"vit"``), built with its usual head (sequence-to-sequence LM, else
            masked LM, else causal LM, else image classification, ...); or a class name of
            ``transformers`` (``"BertForSequenceClassification"``).
        overrides: Fields of the config to set (``hidden_size=8192``); each must be a field
            the config class has, so a misspelt one is an error, not a silent extra.

    Returns:
        A function of no arguments; call it under ``torch.device("meta")`` to allocate nothing
        (:func:`fsdp_guide.memory.plan` does).

    Raises:
        ValueError: ``MissingRequirementError``: Without the ``transformers`` extra.
        PlanError: For an unknown model type or class, or a field its config does not have.

    Examples:
        >>> build = hf_builder("gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 2})
        >>> type(build()).__name__
        'GPT2LMHeadModel'
        >>> hf_builder("gpt2", {"n_layers": 2})
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.PlanError: GPT2Config has no field 'n_layers'; did you mean n_layer? ...
    """
    cls, model_type = _model_class(name)
    config_class = cls.config_class
    fields = set(config_class().to_dict())
    for key in overrides or {}:
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise PlanError(
                f"{config_class.__name__} has no field {key!r}{hint} (its fields: "
                f"{config_class.__name__}().to_dict())"
            )
    config = config_class(**dict(overrides or {}))

    def build() -> nn.Module:
        model: nn.Module = cls(config)
        return model

    build.__qualname__ = f"{cls.__name__} ({model_type})"
    return build
