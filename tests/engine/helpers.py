"""Shared builders for the engine tests: small engines and a cache-free greedy reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvflow.engine.engine import Clock, Engine, EngineConfig, GenerationRequest, perf_clock
from kvflow.engine.model import LlamaForCausalLM, model_config

_MODELS: dict[str, LlamaForCausalLM] = {}


def shared_model(name: str) -> LlamaForCausalLM:
    """One random model per preset name for the whole session (building one takes a while)."""
    if name not in _MODELS:
        from kvflow.engine.model import build_model

        _MODELS[name] = build_model(model_config(name), seed=0)
    return _MODELS[name]


def make_engine(name: str = "tiny", *, clock: Clock = perf_clock, **config: Any) -> Engine:
    """An engine on the shared random model; block size 4 unless ``config`` says otherwise."""
    cfg = model_config(name)
    defaults: dict[str, Any] = {"block_size": 4, "num_gpu_blocks": 128}
    defaults.update(config)
    return Engine(cfg, EngineConfig(**defaults), model=shared_model(name), clock=clock)


def prompts(lengths: Sequence[int], seed: int = 1, vocab: int = 1024) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def shared_prefix_prompts(prefix_len: int, tails: Sequence[int], seed: int = 2) -> list[list[int]]:
    """Prompts that share their first ``prefix_len`` tokens."""
    (prefix,) = prompts([prefix_len], seed)
    return [prefix + tail for tail in prompts(tails, seed + 1)]


def requests(ps: Sequence[Sequence[int]], max_tokens: int) -> list[GenerationRequest]:
    return [GenerationRequest(p, max_tokens, request_id=f"r{i}") for i, p in enumerate(ps)]


def dense_greedy(
    model: LlamaForCausalLM, prompt: Sequence[int], max_tokens: int
) -> tuple[int, ...]:
    """Greedy tokens from the cache-free reference forward pass."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(int(model.forward_dense(seq)[-1].argmax()))
    return tuple(seq[len(prompt) :])
