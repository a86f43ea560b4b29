"""Model configs and building blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.engine.model import (
    LlamaForCausalLM,
    ModelConfig,
    apply_rope,
    build_model,
    load_weights,
    model_config,
    rope_cos_sin,
    save_weights,
)
from kvflow.errors import ConfigError


@pytest.mark.parametrize("name", ["tiny", "small", "llama-1b", "tiny-swa8"])
def test_num_params_counts_the_module(name: str) -> None:
    """The config's parameter count is the module's; llama-1b is about a billion."""
    cfg = model_config(name)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert cfg.num_params == sum(p.numel() for p in model.parameters())
    if name == "llama-1b":
        assert 1.0e9 < cfg.num_params < 1.2e9


def test_hybrid_preset_names_and_validation() -> None:
    """NAME-swaW makes every other layer sliding; bad shapes and names are refused."""
    cfg = model_config("small-swa32")
    assert cfg.sliding_window == 32
    assert cfg.sliding_window_layers == (1, 3, 5)
    assert [cfg.layer_window(i) for i in range(3)] == [None, 32, None]
    with pytest.raises(ConfigError, match="unknown model"):
        model_config("huge")
    with pytest.raises(ConfigError, match="integer"):
        model_config("tiny-swaX")
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        ModelConfig("bad", 10, 16, 16, 1, num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match="positive window"):
        ModelConfig("bad", 10, 16, 16, 2, 4, 2, sliding_window_layers=(1,))


def test_rope_scores_depend_only_on_relative_position() -> None:
    """Rotated q·k is unchanged when both positions shift by the same amount."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 16, generator=gen)
    k = torch.randn(1, 1, 16, generator=gen)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([pq]), 16, 10000.0, torch.float32)
        ck, sk = rope_cos_sin(torch.tensor([pk]), 16, 10000.0, torch.float32)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert score(7, 3) == pytest.approx(score(107, 103), rel=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)


def test_random_weights_are_seeded() -> None:
    """Same seed → same weights; another seed → different ones."""
    cfg = model_config("tiny")
    a, b, c = build_model(cfg, seed=1), build_model(cfg, seed=1), build_model(cfg, seed=2)
    torch.testing.assert_close(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def _unfused_copy(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The same weights in a model whose projections run one by one."""
    plain = LlamaForCausalLM(model.config)
    plain.load_state_dict(model.state_dict())
    return plain.eval()


def test_fused_projections_compute_what_separate_ones_do() -> None:
    """One GEMM for q/k/v and one for gate/up give the logits of the separate projections."""
    cfg = model_config("tiny-swa6")
    fused = build_model(cfg, seed=3)
    assert fused._layer(0).self_attn.qkv_weight is not None
    ids = list(range(40, 61))
    torch.testing.assert_close(
        fused.forward_dense(ids), _unfused_copy(fused).forward_dense(ids), rtol=1e-5, atol=1e-5
    )


def test_loading_weights_into_a_fused_model_updates_its_fused_matrices(tmp_path: Path) -> None:
    """Weights loaded after fusion reach the fused GEMMs (parameters are views into them)."""
    cfg = model_config("tiny")
    source, target = build_model(cfg, seed=1), build_model(cfg, seed=2)
    save_weights(source, tmp_path / "w.safetensors")
    load_weights(target, tmp_path / "w.safetensors")
    ids = list(range(5, 30))
    torch.testing.assert_close(target.forward_dense(ids), source.forward_dense(ids))


def test_a_fused_model_moved_afterwards_falls_back_to_separate_projections() -> None:
    """After ``.to()`` gives parameters storage of their own, the stale fused matrix is unused."""
    cfg = model_config("tiny")
    model = build_model(cfg, seed=4)
    ids = list(range(3, 20))
    want = model.forward_dense(ids)
    moved = model.to(torch.float64)
    attn = moved._layer(0).self_attn
    assert attn.qkv_weight is not None
    assert attn.qkv_weight.dtype == torch.float32
    torch.testing.assert_close(moved.forward_dense(ids).float(), want, rtol=1e-4, atol=1e-4)
    moved.fuse()
    assert attn.qkv_weight is not None
    assert attn.qkv_weight.dtype == torch.float64
