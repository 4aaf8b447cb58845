"""The example batch of a model, built from what the model declares.

Planning a model (:func:`fsdp_guide.memory.plan`) runs its forward and loss on fake tensors,
so it needs a batch of the right names, shapes and dtypes, never real data. :func:`example_batch`
builds one:

* the demo models (:class:`~fsdp_guide.models.TinyTransformer`, :class:`~fsdp_guide.models.MLP`)
  get the batches their lessons train on;
* a Hugging Face ``transformers`` model is read from its ``config`` and ``main_input_name``:
  token ids for ``input_ids`` (and an all-ones ``attention_mask`` for models that are not
  causal language models, where padding masks are the rule), images of the config's
  ``num_channels`` and ``image_size`` (224 when the config has none) for ``pixel_values``,
  ``decoder_input_ids`` too for an encoder-decoder, and the ``labels`` its task trains on
  (next tokens, masked tokens, one class per sample or per token), so the model computes its
  own loss as it does in training;
* any other module from its ``forward`` signature: one required argument, shaped by the
  first layer that reads it (token ids for an ``nn.Embedding``, features for an
  ``nn.Linear``, 224 x 224 images for an ``nn.Conv2d``);
* or stated as ``name:dtype[dims]`` (``input_ids:int64[B,S]``, ``--input`` on the command line),
  ``B`` and ``S`` standing for the batch size and sequence length.

Integer inputs are zeros (masks ones): valid token ids and labels for any vocabulary. The
batch is ``(inputs, targets)``: inputs as a tensor or a dict of keyword arguments, targets
``None`` when the labels are among the inputs (:func:`fsdp_guide.outputs.model_loss`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fsdp_guide._batch_records import BatchBuilder as BatchBuilder
from fsdp_guide._batch_records import ExampleBatch as ExampleBatch
from fsdp_guide._batch_records import InputSpec as InputSpec
from fsdp_guide._batch_records import parse_input as parse_input
from fsdp_guide.errors import PlanError

__all__ = ["example_batch"]

_IMAGE_SIDE = 224  # ImageNet's crop, for a config or a network that does not give one


def _from_specs(specs: Sequence[InputSpec], loss: str) -> ExampleBatch:
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise PlanError(f"an input is stated twice: {', '.join(names)}")

    def build(batch_size: int, seq_len: int) -> tuple[Any, Tensor | None]:
        return {s.name: s.make(batch_size, seq_len) for s in specs}, None

    return ExampleBatch(
        build=build,
        description=f"{', '.join(str(s) for s in specs)}; {loss}",
        uses_seq_len=any("S" in s.dims for s in specs),
    )


def _accepts(model: nn.Module, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def _demo_batch(model: nn.Module) -> ExampleBatch | None:
    from fsdp_guide.models import MLP, TinyTransformer

    if isinstance(model, TinyTransformer):
        longest = model.config.seq_len

        def tokens(batch_size: int, seq_len: int) -> tuple[Any, Tensor | None]:
            if seq_len > longest:
                raise PlanError(
                    f"seq_len={seq_len} is longer than the model's position embedding "
                    f"({longest}); build the model with TransformerConfig(seq_len={seq_len})"
                )
            ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
            return ids, ids.clone()

        loss = "cross-entropy on next-token targets int64[B,S]"
        return ExampleBatch(
            build=tokens, description=f"tokens:int64[B,S]; {loss}", uses_seq_len=True
        )
    if isinstance(model, MLP):
        linears = [m for m in model.net if isinstance(m, nn.Linear)]
        n_in, n_out = linears[0].in_features, linears[-1].out_features
        return ExampleBatch(
            build=lambda b, _s: (torch.zeros(b, n_in), torch.zeros(b, n_out)),
            description=f"x:float32[B,{n_in}]; mean squared error on targets float32[B,{n_out}]",
            uses_seq_len=False,
        )
    return None


def _hf_batch(model: nn.Module) -> ExampleBatch:
    from fsdp_guide.hf import label_kind  # transformers itself only if the model is one

    config: Any = model.config
    main = getattr(model, "main_input_name", "input_ids")
    labels = label_kind(model) if _accepts(model, "labels") else None
    specs: list[InputSpec]
    if main == "input_ids":
        specs = [InputSpec(name="input_ids", dtype="int64", dims=("B", "S"))]
        if labels != "causal_lm" and _accepts(model, "attention_mask"):
            specs.append(InputSpec(name="attention_mask", dtype="int64", dims=("B", "S")))
    elif main == "pixel_values":
        side = getattr(config, "image_size", None) or _IMAGE_SIDE
        height, width = (side, side) if isinstance(side, int) else tuple(side)
        channels = getattr(config, "num_channels", 3)
        specs = [
            InputSpec(name="pixel_values", dtype="float32", dims=("B", channels, height, width))
        ]
    else:
        raise PlanError(
            f"{type(model).__name__} takes {main!r}, which the planner cannot make up; "
            f"state it, e.g. --input {main}:float32[B,S] (Python: batch=)"
        )
    if getattr(config, "is_encoder_decoder", False) and _accepts(model, "decoder_input_ids"):
        specs.append(InputSpec(name="decoder_input_ids", dtype="int64", dims=("B", "S")))
    if labels in ("causal_lm", "masked_lm", "seq2seq_lm", "token_class"):
        specs.append(InputSpec(name="labels", dtype="int64", dims=("B", "S")))
    elif labels == "class":
        specs.append(InputSpec(name="labels", dtype="int64", dims=("B",)))
    loss = "the model's own loss on its labels" if labels else "cross-entropy on its logits"
    batch = _from_specs(specs, loss)
    limit = _learned_positions(model)
    if limit is None:
        return batch

    def build(batch_size: int, seq_len: int) -> tuple[Any, Tensor | None]:
        if seq_len > limit:
            raise PlanError(
                f"seq_len={seq_len} is longer than {type(model).__name__}'s {limit} learned "
                "positions; plan a shorter sequence or a config with more positions"
            )
        return batch.build(batch_size, seq_len)

    return ExampleBatch(build=build, description=batch.description, uses_seq_len=True)


def _learned_positions(model: nn.Module) -> int | None:
    """The config's position limit when an embedding table has that many rows (GPT-2, BERT),
    not when positions are rotary or relative (Llama, T5), which take longer sequences."""
    config = getattr(model, "config", None)
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    tables = (m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding))
    return limit if isinstance(limit, int) and limit in tables else None


def _first_reader(model: nn.Module) -> nn.Module | None:
    """The first parameterised layer in registration order: the one that reads the input."""
    for module in model.modules():
        if isinstance(module, nn.Embedding | nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d):
            return module
    return None


def _signature_batch(model: nn.Module) -> ExampleBatch:
    params = inspect.signature(model.forward).parameters.values()
    required = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    name = type(model).__name__
    if len(required) != 1:
        wanted = ", ".join(required) or "none"
        raise PlanError(
            f"{name}.forward takes {len(required)} required inputs ({wanted}); state each "
            "with --input name:dtype[dims], e.g. --input x:float32[B,S,512] (Python: batch=)"
        )
    (arg,) = required
    layer = _first_reader(model)
    dims: tuple[int | str, ...]
    if isinstance(layer, nn.Embedding):
        dtype, dims = "int64", ("B", "S")
    elif isinstance(layer, nn.Linear):
        dtype, dims = "float32", ("B", layer.in_features)
    elif isinstance(layer, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        spatial = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[type(layer)]
        dtype, dims = "float32", ("B", layer.in_channels, *([_IMAGE_SIDE] * spatial))
    else:
        raise PlanError(
            f"cannot tell what {name}.forward's {arg!r} is (its first layer is not an "
            f"Embedding, Linear or Conv); state it with --input {arg}:dtype[dims] (Python: batch=)"
        )
    spec = InputSpec(name=arg, dtype=dtype, dims=dims)
    return _from_specs([spec], "cross-entropy over the output's last dimension")


def example_batch(model: nn.Module, inputs: Sequence[InputSpec] = ()) -> ExampleBatch:
    """The example batch of ``model``: stated ``inputs``, else read from the model.

    Args:
        model: The model (on any device: only its classes, config and signature are read).
        inputs: Inputs stated by the user (``name:dtype[dims]``), passed as keywords; a
            ``labels`` among them makes the model compute its own loss.

    Raises:
        PlanError: When the inputs cannot be read from the model; the message says what to state.

    Examples:
        >>> from fsdp_guide.models import MLP
        >>> example_batch(MLP(in_features=8)).description
        'x:float32[B,8]; mean squared error on targets float32[B,8]'
        >>> batch = example_batch(nn.Embedding(10, 4))
        >>> batch.description, batch.build(2, 5)[0]["input"].shape
        ("input:int64[B,S]; cross-entropy over the output's last dimension", torch.Size([2, 5]))
        >>> example_batch(nn.Bilinear(2, 2, 1))
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.PlanError: Bilinear.forward takes 2 required inputs (input1, input2); ...
    """
    if inputs:
        loss = "labels" in {s.name for s in inputs}
        return _from_specs(inputs, "the model's own loss" if loss else "loss from its output")
    demo = _demo_batch(model)
    if demo is not None:
        return demo
    own = getattr(model, "example_batch", None)
    if callable(own):  # a model that states its batch (fsdp_guide.parallel's models do)
        return ExampleBatch(
            build=own,
            description=f"{type(model).__name__}.example_batch(B, S)",
            uses_seq_len=True,
        )
    if hasattr(model, "config") and hasattr(model, "main_input_name"):
        return _hf_batch(model)
    return _signature_batch(model)


def default_seq_len(model: nn.Module) -> int:
    """The sequence length to plan at when none is given: the longest the model takes.

    A ``seq_len`` of the demo transformer, ``n_positions`` or ``max_position_embeddings`` of a
    transformers config; 512 for a model without a limit (T5's relative positions).

    Examples:
        >>> from fsdp_guide.models import TinyTransformer
        >>> default_seq_len(TinyTransformer()), default_seq_len(nn.Linear(2, 2))
        (32, 512)
    """
    config = getattr(model, "config", None)
    for field in ("seq_len", "n_positions", "max_position_embeddings"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return 512
