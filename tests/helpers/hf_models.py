"""Tiny transformers models (built from config classes, no download) and their batches.

Each model is wrapped so that ``model(x)`` returns a logits tensor: the planner's loss
(cross-entropy over the last dimension) reads it as it reads the demo models'. Llama gets an
attention mask of ones, as a tokenizer gives it, BERT a
padding mask (the last two positions of every sample padded) built inside the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

VOCAB = 96
SEQ = 16
IMAGE = 16
CLASSES = 5


class Logits(nn.Module):
    """``inner(**inputs(x)).logits``: a transformers model as a tensor-in, tensor-out module."""

    def __init__(self, inner: nn.Module, kind: str) -> None:
        super().__init__()
        self.inner = inner
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "t5":
            return self.inner(input_ids=x, decoder_input_ids=x).logits
        if self.kind == "bert_padded":
            seq = x.shape[1]
            mask = (torch.arange(seq, device=x.device) < seq - 2).long().expand(x.shape[0], seq)
            return self.inner(input_ids=x, attention_mask=mask).logits
        if self.kind == "image":
            return self.inner(pixel_values=x).logits
        if self.kind == "tokens_mask":  # a tokenizer's mask: all ones, no padding
            return self.inner(input_ids=x, attention_mask=torch.ones_like(x)).logits
        return self.inner(input_ids=x).logits


def _build(name: str) -> nn.Module:
    import transformers as tf

    small = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)
        return Logits(tf.GPT2LMHeadModel(cfg), "tokens")
    if name == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=VOCAB,
            num_hidden_layers=2,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            **small,
        )
        return Logits(tf.LlamaForCausalLM(cfg), "tokens_mask")
    if name == "bert":
        cfg = tf.BertConfig(
            vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=SEQ, **small
        )
        return Logits(tf.BertForMaskedLM(cfg), "bert_padded")
    if name == "t5":
        cfg = tf.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        )
        return Logits(tf.T5ForConditionalGeneration(cfg), "t5")
    if name == "vit":
        cfg = tf.ViTConfig(
            image_size=IMAGE,
            patch_size=4,
            num_channels=3,
            num_hidden_layers=2,
            num_labels=CLASSES,
            **small,
        )
        return Logits(tf.ViTForImageClassification(cfg), "image")
    if name == "resnet":
        cfg = tf.ResNetConfig(
            num_channels=3,
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            num_labels=CLASSES,
        )
        return Logits(tf.ResNetForImageClassification(cfg), "image")
    raise ValueError(name)


MODELS = ("gpt2", "llama", "bert", "t5", "vit", "resnet")


def builder(name: str) -> Callable[[], nn.Module]:
    """A seeded builder of the tiny model ``name``."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return _build(name)

    return build


def batch_fn(name: str) -> Callable[[int, int], tuple[Tensor, Tensor]]:
    """``(inputs, targets)`` of ``batch_size`` samples for ``name`` (``seq_len`` for tokens)."""
    image = name in ("vit", "resnet")

    def make(batch_size: int, seq_len: int) -> tuple[Tensor, Tensor]:
        if image:
            x = torch.ones(batch_size, 3, IMAGE, IMAGE)
            return x, torch.zeros(batch_size, dtype=torch.long)
        ids = torch.ones(batch_size, seq_len, dtype=torch.long)
        return ids, ids.clone()

    return make


def measure_and_plan(
    rank: int, world_size: int, name: str, strategy: str, batch_size: int = 2, steps: int = 3
) -> dict[str, dict[str, int]]:
    """On a launched rank: train ``name`` under ``strategy``; measured and planned fields.

    ``batch_size`` samples per rank. Measured in the last step (the third by default: DDP
    rebuilds its buckets and DeepSpeed settles its prefetch order in the second, with a
    broadcast each, once): the model state after ``optimizer.step()``
    (:func:`fsdp_guide.memory.measure_model_state`), the bytes saved by the forward
    (:func:`fsdp_guide.wrap.saved_activation_bytes`) and the payload per collective kind
    (:func:`fsdp_guide.comm.count_collectives`); under DDP (``ddp``, ``zero1``, ``oss``) also
    what it sent once: all the wrap and the steps sent, less the steady steps'.
    """
    import warnings

    from fsdp_guide.comm import count_collectives
    from fsdp_guide.engines import DDP, engine_for, wrap_for_strategy
    from fsdp_guide.memory import measure_model_state, plan
    from fsdp_guide.models import loss_fn
    from fsdp_guide.wrap import saved_activation_bytes

    engine = engine_for(strategy)
    model = builder(name)()
    make = batch_fn(name)
    sent: dict[str, int] = {}  # every step's elements by kind, and the wrap's

    def add(stats: Any) -> None:
        for kind, count in stats.kinds.items():
            sent[kind] = sent.get(kind, 0) + count.elements

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with count_collectives() as wrapping:
            module, optimizer = wrap_for_strategy(model, strategy, world_size)
        add(wrapping.stats)
        for step in range(steps):
            batch = make(batch_size, SEQ)
            with count_collectives() as counted:
                saved, loss = saved_activation_bytes(
                    module, lambda batch=batch: loss_fn(module, batch)
                )
                engine.train_step(module, optimizer, loss)
            add(counted.stats)
            if step == steps - 1:
                state = measure_model_state(module, optimizer)
            engine.zero_grad(module, optimizer)
        planned = plan(
            builder(name),
            batch_size=batch_size,
            seq_len=SEQ,
            world_size=world_size,
            strategy=strategy,
            batch=make,
        )
    mine = planned.ranks[rank]
    fields = ("params", "grads", "optimizer", "buckets", "master")
    steady = {k: v.elements for k, v in counted.stats.kinds.items()}
    measured_once: dict[str, int] = {}
    if isinstance(engine, DDP):  # what DDP sends once: all it sent, less the steady steps
        once = {k: n - steps * steady.get(k, 0) for k, n in sent.items()}
        measured_once = {f"once_{k}": n for k, n in once.items() if n}
    return {
        "measured": {
            **{f: getattr(state, f) for f in fields},
            "activations": saved,
            **{f"comm_{k}": v for k, v in steady.items()},
            **measured_once,
        },
        "planned": {
            **{f: getattr(mine, f) for f in fields},
            "activations": planned.activations,
            **{f"comm_{k}": v for k, v in planned.communication.payload.items()},
            **{f"once_{k}": v for k, v in planned.communication.once.items()},
        },
    }


def measure_and_plan_many(
    rank: int, world_size: int, cases: list[tuple[str, str]]
) -> list[dict[str, dict[str, int]]]:
    """:func:`measure_and_plan` for each ``(model, strategy)`` in one launch."""
    return [measure_and_plan(rank, world_size, name, strategy) for name, strategy in cases]


def _bf16_model(name: str, strategy: str, orig_params: bool = True) -> tuple[nn.Module, Any]:
    """``name`` wrapped to compute in bf16 as users run it under ``strategy``, and the
    context its forward runs in: FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16)`` and
    FSDP1 with ``MixedPrecision(param_dtype=bf16)`` (``use_orig_params=orig_params``), a
    unit per block; DDP (gradients as bucket views, the catalog's ``"ddp"``) under
    ``torch.autocast("cpu", dtype=bf16)``."""
    import contextlib

    from torch.distributed.fsdp import (
        FullyShardedDataParallel,
        MixedPrecision,
        MixedPrecisionPolicy,
        fully_shard,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.nn.parallel import DistributedDataParallel

    from fsdp_guide.engines import block_classes, unit_names

    model = builder(name)()
    autocast: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if strategy == "fsdp2":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for unit in unit_names(model):
            fully_shard(model.get_submodule(unit), mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    elif strategy == "fsdp":
        # Each unit casts its inputs: ViT reads its dtype from a weight outside that
        # weight's unit (fp32 there) and casts the root's bf16 pixels back to fp32.
        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy(set(block_classes(model))),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True),
            device_id=torch.device("cpu"),
            use_orig_params=orig_params,
        )
    elif strategy == "ddp":
        model = DistributedDataParallel(model, gradient_as_bucket_view=True)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    else:
        raise ValueError(f"no bf16 run for {strategy!r}")
    return model, autocast


def _bf16_plan(name: str, strategy: str, world_size: int) -> Any:
    from fsdp_guide.memory import plan

    return plan(
        builder(name),
        batch_size=2,
        seq_len=SEQ,
        world_size=world_size,
        strategy=strategy,
        precision="mixed",
        batch=batch_fn(name),
        reduce_dtype="bf16",  # MixedPrecision(param_dtype=bf16) reduces in it too
    )


def bf16_saved(
    rank: int, world_size: int, names: list[str], strategy: str
) -> list[tuple[int, int]]:
    """On a launched rank: (measured, planned) saved bytes of each model in bf16 under
    ``strategy`` (see :func:`_bf16_model`)."""
    from fsdp_guide.models import loss_fn
    from fsdp_guide.wrap import saved_activation_bytes

    pairs = []
    for name in names:
        model, autocast = _bf16_model(name, strategy)
        batch = batch_fn(name)(2, SEQ)
        with autocast:
            saved, _ = saved_activation_bytes(model, lambda: loss_fn(model, batch))  # noqa: B023
        pairs.append((saved, _bf16_plan(name, strategy, world_size).activations))
    return pairs


def bf16_state(
    rank: int, world_size: int, names: list[str], strategy: str
) -> list[tuple[dict[str, int], dict[str, int]]]:
    """On a launched rank: (measured, planned) model state of each model after three Adam
    steps in bf16 under ``strategy`` (see :func:`_bf16_model`), field by field, and the bytes
    of each collective kind in the third step (DDP regroups its buckets in the second)."""
    from fsdp_guide.comm import count_collectives
    from fsdp_guide.memory import measure_model_state
    from fsdp_guide.models import loss_fn

    fields = ("params", "grads", "optimizer", "buckets", "master")
    pairs = []
    for name in names:
        # FSDP1 as the catalog's "fsdp" builds it: Adam over each unit's flat parameter.
        model, autocast = _bf16_model(name, strategy, orig_params=False)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(3):
            with count_collectives() as counted:
                with autocast:
                    loss = loss_fn(model, batch_fn(name)(2, SEQ))
                loss.backward()
            optimizer.step()
        state = measure_model_state(model, optimizer)
        planned = _bf16_plan(name, strategy, world_size)
        sent = planned.communication
        pairs.append(
            (
                {
                    **{f: getattr(state, f) for f in fields},
                    **{f"comm_{k}": v.bytes for k, v in counted.stats.kinds.items()},
                },
                {
                    **{f: getattr(planned.ranks[rank], f) for f in fields},
                    **{f"comm_{k}": n * sent.bytes_per_element(k) for k, n in sent.payload.items()},
                },
            )
        )
    return pairs
