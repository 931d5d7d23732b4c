"""The tiny Hugging Face models the integration tests train and generate with: one builder per
architecture (the Trainer worker and the ZeRO-3 generation test differ only in context length and
initialisation). Weights are drawn from seed 0, so every rank and every reference builds the same."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 64


def tiny_gpt2(positions: int, **config: Any) -> GPT2LMHeadModel:
    """2 layers, 2 heads, 32 wide, no dropout, ``positions`` tokens of context; ``config``: more
    `GPT2Config` fields (e.g. ``initializer_range``)."""
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=positions,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **config,
    )
    return GPT2LMHeadModel(cfg)


def tiny_llama(positions: int, **config: Any) -> LlamaForCausalLM:
    """2 layers, 2 heads (2 key/value heads), 32 wide with a 64-wide MLP, ``positions`` tokens of
    context; ``config``: more `LlamaConfig` fields (e.g. ``initializer_range``)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        **config,
    )
    return LlamaForCausalLM(cfg)
