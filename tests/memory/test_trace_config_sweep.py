"""The trace plans what a real forward saves, across the configuration flags of several
transformers model families.

Each case builds a tiny causal language model from its config (offline), runs one real forward
and loss on its example batch and counts what autograd saves
(:func:`fsdp_guide.wrap.saved_activation_bytes`), then plans the same model on fake tensors
(:func:`fsdp_guide.memory.traced_activation_bytes`). One flag moves at a time from each
family's base, under ``use_cache`` on and off: the attention implementation, dropout, tied
embeddings, grouped and multi-query attention, rope scaling and a sliding window shorter than
the sequence. Counting bytes is exact, so the two must be equal.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_guide.inputs import example_batch
from fsdp_guide.memory import traced_activation_bytes
from fsdp_guide.models import loss_fn
from fsdp_guide.wrap import saved_activation_bytes

tf = pytest.importorskip("transformers")

BATCH, SEQ = 2, 16
_SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
_ATTENTION = {"eager": {"attn_implementation": "eager"}, "sdpa": {"attn_implementation": "sdpa"}}
_KV_HEADS = {"mha": {"num_key_value_heads": 4}, "gqa": {"num_key_value_heads": 2}}
_KV_HEADS["mqa"] = {"num_key_value_heads": 1}
_TIED = {"tied": {"tie_word_embeddings": True}, "untied": {"tie_word_embeddings": False}}


def _rope(**extra: float) -> dict[str, dict[str, Any]]:
    """Linear and dynamic rope scaling (by 2)."""
    return {
        f"rope_{kind}": {
            "rope_parameters": {"rope_type": kind, "factor": 2.0, "rope_theta": 1e4, **extra}
        }
        for kind in ("linear", "dynamic")
    }


_ROPE = _rope()
_LLAMA_LIKE = {
    **_ATTENTION,
    "dropout": {"attention_dropout": 0.1},
    **_TIED,
    **_KV_HEADS,
    **_ROPE,
}

#: family: (config class, model class, base settings, the flags varied one at a time).
FAMILIES: dict[str, tuple[str, str, dict[str, Any], dict[str, dict[str, Any]]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**_SMALL, "num_key_value_heads": 2}, _LLAMA_LIKE),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        {**_SMALL, "num_key_value_heads": 2, "sliding_window": None},
        {**_LLAMA_LIKE, "sliding_window": {"sliding_window": SEQ // 2}},
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {**_SMALL, "num_key_value_heads": 2},
        {
            **_LLAMA_LIKE,
            "sliding_window": {
                "use_sliding_window": True,
                "sliding_window": SEQ // 2,
                "max_window_layers": 0,
            },
        },
    ),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        {**_SMALL, "num_key_value_heads": 2, "head_dim": 8},
        {**_ATTENTION, **_TIED, **_KV_HEADS},
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {**_SMALL, "num_key_value_heads": 2, "pad_token_id": 0, "eos_token_id": 1},
        {
            **_ATTENTION,
            "dropout": {"attention_dropout": 0.1, "resid_pdrop": 0.1},
            **_KV_HEADS,
            "sliding_window": {"sliding_window": SEQ // 2},
        },
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        _SMALL,
        {
            **_ATTENTION,
            "dropout": {"attention_dropout": 0.1, "hidden_dropout": 0.1},
            **_TIED,
            # GPT-NeoX rotates part of each head: 8 dims * 0.5 (dynamic scaling needs > 2).
            **_rope(partial_rotary_factor=0.5),
        },
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 64},
        {**_ATTENTION, "no_dropout": {"attn_pdrop": 0.0, "resid_pdrop": 0.0}, **_TIED},
    ),
}

CASES = [
    pytest.param(
        family, flag, use_cache, id=f"{family}-{flag}-{'cache' if use_cache else 'nocache'}"
    )
    for family, (_, _, _, flags) in FAMILIES.items()
    for flag in ("base", *flags)
    for use_cache in (True, False)
]


def build(family: str, flag: str, use_cache: bool) -> nn.Module:
    """The tiny model of ``family`` with ``flag`` set, in training mode (dropout on)."""
    config_name, model_name, base, flags = FAMILIES[family]
    settings = {**base, **(flags[flag] if flag != "base" else {}), "use_cache": use_cache}
    attention = settings.pop("attn_implementation", None)
    bos_eos = {k: 0 for k in ("bos_token_id", "eos_token_id") if k not in settings}
    config = getattr(tf, config_name)(**bos_eos, **settings)
    if attention is not None:
        config._attn_implementation = attention
    torch.manual_seed(0)
    model: nn.Module = getattr(tf, model_name)(config)
    return model.train()


@pytest.mark.parametrize(("family", "flag", "use_cache"), CASES)
def test_the_trace_saves_what_the_forward_saves(family: str, flag: str, use_cache: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(family, flag, use_cache)
        data = example_batch(model).build(BATCH, SEQ)
        real, _ = saved_activation_bytes(model, lambda: loss_fn(model, data))
        planned = traced_activation_bytes(model, BATCH, SEQ)
    assert planned == real


@pytest.mark.parametrize(
    ("family", "flag"), [("mistral", "sliding_window"), ("qwen2", "sliding_window")]
)
def test_the_sliding_window_flag_changes_what_the_forward_saves(family: str, flag: str) -> None:
    # Otherwise its cases above would check nothing the base cases do not.
    def saved(flag: str) -> int:
        model = build(family, flag, use_cache=False)
        data = example_batch(model).build(BATCH, SEQ)
        return saved_activation_bytes(model, lambda: loss_fn(model, data))[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert saved(flag) != saved("base")
