"""Tiny third-party models built from config classes (nothing downloaded), for ``--model``.

Each builder returns the transformers model itself, as a user's ``package.module:builder``
would; ``cnn`` is a plain torch network. Sizes are the smallest that keep each model's
features: GPT-2's tied head, Llama's grouped-query attention (4 heads, 2 key/value heads),
BERT's padding mask, T5's encoder and decoder, ViT's patches, a convolutional stem.
"""

from __future__ import annotations

from torch import nn

VOCAB = 128
POSITIONS = 64


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=POSITIONS)
    return GPT2LMHeadModel(config)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=POSITIONS,
    )
    return LlamaForCausalLM(config)


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=POSITIONS,
    )
    return BertForMaskedLM(config)


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(num_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=VOCAB)
    return T5ForConditionalGeneration(config)


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=16,
        patch_size=8,
        num_labels=5,
    )
    return ViTForImageClassification(config)


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )


BUILDERS = {"gpt2": gpt2, "llama": llama, "bert": bert, "t5": t5, "vit": vit, "cnn": cnn}
