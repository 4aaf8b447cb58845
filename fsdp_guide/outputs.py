"""From a model's inputs to its training loss, whatever the model returns.

A batch's inputs are passed the way they are given: a tensor as the one
argument, a tuple or list as positional arguments, a dict as keyword arguments (``T5``'s
``forward(input_ids=..., decoder_input_ids=...)``). :func:`model_loss` turns the output into
the scalar a training step calls ``backward()`` on:

* a Hugging Face ``ModelOutput`` (or any mapping): its ``loss`` when the model computed one
  (labels were among the inputs), else its ``logits`` with the usual loss;
* a tuple or list (``return_dict=False``, or a module returning extras): a leading 0-d tensor
  is the loss; otherwise the first tensor is the output;
* a tensor: cross-entropy against integer targets (over the last dimension), mean squared
  error against floating-point ones, and without targets cross-entropy over the last
  dimension against class 0, the usual loss of a classifier or language model.

Anything else is a :class:`~fsdp_guide.errors.PlanError` that names what to pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fsdp_guide.errors import PlanError

__all__ = ["model_loss"]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model`` called on ``inputs``: one tensor, positional (tuple, list) or keywords (dict).

    Examples:
        >>> call_model(nn.Bilinear(2, 3, 1), (torch.ones(4, 2), torch.ones(4, 3))).shape
        torch.Size([4, 1])
        >>> call_model(nn.Linear(2, 1), {"input": torch.ones(4, 2)}).shape
        torch.Size([4, 1])
    """
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    return model(inputs)


def _tensor_loss(out: Tensor, targets: Tensor | None) -> Tensor:
    if not out.is_floating_point():
        raise PlanError(
            f"the model returned a {out.dtype} tensor, which has no gradient; return the "
            "output before argmax or rounding, or the loss itself"
        )
    if out.dim() == 0:
        return out
    if targets is None:
        scores = out.reshape(-1, out.shape[-1]) if out.dim() > 1 else out.reshape(1, -1)
        return F.cross_entropy(
            scores, torch.zeros(scores.shape[0], dtype=torch.long, device=out.device)
        )
    if targets.is_floating_point():
        return F.mse_loss(out, targets)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def output_loss(output: Any, targets: Tensor | None = None) -> Tensor:
    """The training loss of a model's ``output`` (see the module's rules).

    Args:
        output: What the model's forward returned.
        targets: Targets for a tensor output or a ``ModelOutput`` without loss; ``None`` when
            the model computes its loss from labels among its inputs.

    Raises:
        PlanError: For an output with neither a loss nor something to compute one from.

    Examples:
        >>> output_loss({"loss": torch.tensor(2.0), "logits": torch.zeros(1, 3)})
        tensor(2.)
        >>> output_loss((torch.zeros(2, 3), "extras"), torch.tensor([0, 1])).item() > 0
        True
        >>> output_loss({"last_hidden_state": torch.zeros(2, 3)})
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.PlanError: the model returned dict with last_hidden_state and no ...
    """
    if isinstance(output, Tensor):
        return _tensor_loss(output, targets)
    if isinstance(output, Mapping):
        if output.get("loss") is not None:
            return _tensor_loss(output["loss"], None)
        if isinstance(output.get("logits"), Tensor):
            return _tensor_loss(output["logits"], targets)
        fields = ", ".join(k for k, v in output.items() if v is not None) or "nothing"
        raise PlanError(
            f"the model returned {type(output).__name__} with {fields} and no loss or logits; "
            "plan the model with a task head (LlamaForCausalLM, not LlamaModel), or "
            "pass labels among the inputs (--input labels:int64[B,S]), or wrap it so forward "
            "returns a tensor"
        )
    if isinstance(output, tuple | list):
        tensors = [t for t in output if isinstance(t, Tensor)]
        if tensors and isinstance(output[0], Tensor) and output[0].dim() == 0:
            return _tensor_loss(output[0], None)  # (loss, logits, ...) of return_dict=False
        if tensors:
            return _tensor_loss(tensors[0], targets)
    raise PlanError(
        f"the model returned {type(output).__name__}, not a tensor, tuple or ModelOutput; "
        "make forward return the logits or the loss (a tensor)"
    )


def model_loss(model: nn.Module, batch: tuple[Any, Tensor | None]) -> Tensor:
    """The loss of ``model`` on ``batch = (inputs, targets)``: the model called, then its loss.

    Examples:
        >>> model = nn.Linear(4, 3)
        >>> model_loss(model, (torch.ones(2, 4), torch.tensor([0, 2]))).shape
        torch.Size([])
    """
    inputs, targets = batch
    return output_loss(call_model(model, inputs), targets)
