"""A Llama-architecture decoder in plain torch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` (``model.layers.{i}.
self_attn.q_proj.weight`` ...), so a safetensors checkpoint of that shape loads as it is. Weights
are random from a fixed seed by default. Attention reads and writes the paged KV cache through
``kvflow.engine.kv_cache``; ``forward_dense`` is the cache-free reference used to check it.

Layers listed in ``ModelConfig.sliding_window_layers`` attend only to the last ``sliding_window``
tokens; the engine gives them their own KV cache group.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from attrs import field, frozen
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvflow.engine import triton_ops
from kvflow.engine.kv_cache import AttentionMetadata, paged_attention, write_kv
from kvflow.errors import ConfigError


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@frozen
class ModelConfig:
    """Shape of a Llama-style decoder. ``head_dim`` defaults to ``hidden_size // num_heads``."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = field(default=(), converter=_int_tuple)

    def __attrs_post_init__(self) -> None:
        for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, attr) <= 0:
                raise ConfigError(f"model {self.name}: {attr} must be positive")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model {self.name}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ConfigError(f"model {self.name}: hidden_size not divisible by num_heads")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ConfigError(f"model {self.name}: head_dim must be even for RoPE")
        if self.sliding_window_layers:
            if self.sliding_window is None or self.sliding_window <= 0:
                raise ConfigError(f"model {self.name}: sliding layers need a positive window")
            bad = [i for i in self.sliding_window_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ConfigError(f"model {self.name}: sliding_window_layers out of range: {bad}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` in tokens, or None for full attention."""
        return self.sliding_window if layer in self.sliding_window_layers else None

    def with_sliding_window(self, window: int, every: int = 2) -> ModelConfig:
        """A hybrid variant: every ``every``-th layer (1, 1+every, ...) uses a sliding window."""
        layers = tuple(range(1, self.num_layers, every))
        return attrs.evolve(
            self,
            name=f"{self.name}-swa{window}",
            sliding_window=window,
            sliding_window_layers=layers,
        )

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head


MODEL_CONFIGS: Mapping[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=False,  # tied random weights just repeat the last token
    ),
    "small": ModelConfig(
        name="small",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        tie_word_embeddings=False,
    ),
    "llama-1b": ModelConfig(
        name="llama-1b",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}


def model_config(name: str) -> ModelConfig:
    """A preset by name; ``NAME-swaW`` gives its hybrid variant with a ``W``-token window."""
    base, _, swa = name.partition("-swa")
    if base not in MODEL_CONFIGS:
        raise ConfigError(f"unknown model {name!r}; presets: {sorted(MODEL_CONFIGS)}")
    cfg = MODEL_CONFIGS[base]
    if swa:
        if not swa.isdigit():
            raise ConfigError(f"model {name!r}: window after '-swa' must be an integer")
        cfg = cfg.with_sliding_window(int(swa))
    return cfg


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


_FUSED_RMS_NORM = hasattr(F, "rms_norm")
"""``F.rms_norm`` (torch 2.4 on): one call instead of seven elementwise kernels per norm."""

# cuDNN's SDPA is left out: it builds an execution plan for every new (query, key) shape, which
# took hundreds of milliseconds per shape on the H200, and decode key lengths change every step.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _FUSED_RMS_NORM:
            out: torch.Tensor = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
            return out
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _add_and_norm(
    x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, norm(x + delta))``; one kernel on CUDA with Triton; ``delta`` None adds
    nothing."""
    if delta is None:
        return x, norm(x)
    if triton_ops.usable(x):
        return triton_ops.add_rms_norm(x, delta, norm.weight, norm.eps)
    x = x + delta
    return x, norm(x)


def fuse_linears(linears: Sequence[nn.Linear]) -> torch.Tensor:
    """Stack the weights of linears that read the same input into one matrix, and make each
    linear's weight a view of its rows, so one GEMM computes them all and loading weights into
    the linears still updates the stack. Returns the stack."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[row : row + n], requires_grad=lin.weight.requires_grad)
        row += n
    return fused


def _still_fused(fused: torch.Tensor | None, first: nn.Linear) -> torch.Tensor | None:
    """``fused`` while ``first``'s weight is still its first rows (a ``.to()`` since the fusion
    gives every parameter storage of its own: then the linears are used one by one)."""
    if fused is None or first.weight.data_ptr() != fused.data_ptr():
        return None
    return fused


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos/sin tables for ``positions``, shape ``(T, head_dim)`` (Llama's half-split)."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(T, heads, head_dim)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.qkv_weight: torch.Tensor | None = None

    def fuse(self) -> None:
        self.qkv_weight = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        fused = _still_fused(self.qkv_weight, self.q_proj)
        if fused is None:
            q = self.q_proj(x).view(t, h, self.head_dim)
            k = self.k_proj(x).view(t, kvh, self.head_dim)
            v = self.v_proj(x).view(t, kvh, self.head_dim)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        qkv = F.linear(x, fused).view(t, h + 2 * kvh, self.head_dim)
        # Queries and keys rotate together: one set of RoPE kernels instead of two.
        qk = apply_rope(qkv[:, : h + kvh], cos, sin)
        return qk[:, :h], qk[:, h:], qkv[:, h + kvh :]

    def queries_writing_kv(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Rotated queries of the normed ``x``; its keys and values written to their ``slots`` of
        ``cache``. ``rope`` is the tokens' (cos, sin)."""
        cos, sin = rope
        fused = _still_fused(self.qkv_weight, self.q_proj)
        if (
            fused is not None
            and triton_ops.usable(x)
            and triton_ops.rope_fits(self.head_dim)
            and cache.is_contiguous()
        ):
            h, kvh = self.num_heads, self.num_kv_heads
            qkv = F.linear(x, fused).view(x.shape[0], h + 2 * kvh, self.head_dim)
            return triton_ops.rope_write_kv(qkv, cos, sin, cache, slots, h, kvh)
        q, k, v = self.qkv(x, cos, sin)
        write_kv(cache, slots, k, v)
        return q


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None

    def fuse(self) -> None:
        self.gate_up_weight = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = _still_fused(self.gate_up_weight, self.gate_proj)
        if fused is None:
            out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
            return out
        gate_up = F.linear(x, fused)
        if triton_ops.usable(x):
            fused_out: torch.Tensor = self.down_proj(triton_ops.silu_mul(gate_up))
            return fused_out
        gate, up = gate_up.chunk(2, dim=-1)
        torch_out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return torch_out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. ``forward`` runs one engine step over a paged KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Sums the row-parallel partial outputs (o_proj, down_proj) over tensor-parallel ranks;
        # the identity on one rank. ``kvflow.engine.tp`` sets it on a shard.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _identity

    @property
    def sharded(self) -> bool:
        """Whether this is a tensor-parallel shard (its layers reduce over ranks)."""
        return self.reduce is not _identity

    def fuse(self) -> None:
        """Fuse each layer's q/k/v and gate/up projections into one GEMM each (same weights,
        same parameter names). Call it again after moving the model to another device."""
        for i in range(self.config.num_layers):
            layer = self._layer(i)
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def _layer(self, i: int) -> LlamaDecoderLayer:
        layer = self.model.layers[i]
        assert isinstance(layer, LlamaDecoderLayer)
        return layer

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        layer_metadata: Sequence[AttentionMetadata],
        logits_indices: torch.Tensor,
        before_attention: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states for a flat batch of tokens; logits only at ``logits_indices``.

        ``kv_caches[i]`` is layer ``i``'s ``(2, num_blocks, block_size, kv_heads, head_dim)``
        tensor; ``layer_metadata[i]`` is the attention metadata of layer ``i``'s cache group;
        ``before_attention(i)`` is called before layer ``i`` writes or reads its cache.
        """
        x, cos, sin = self.embed(input_ids, positions)
        mlp_out: torch.Tensor | None = None
        with sdpa_kernel(SDPA_BACKENDS):
            for i in range(self.config.num_layers):
                meta = layer_metadata[i]
                if before_attention is not None:
                    before_attention(i)
                q, x = self.pre_attention(i, x, cos, sin, kv_caches[i], meta.slot_mapping, mlp_out)
                x, mlp_out = self.post_attention(i, x, paged_attention(q, kv_caches[i], meta))
        return self.head(x, logits_indices, mlp_out)

    # The pieces of ``forward``, apart so that ``kvflow.engine.decode_graphs`` can capture all
    # but the attention into CUDA graphs. A layer hands the next its residual and its MLP's
    # output apart: the next layer's input norm adds them, in one kernel on CUDA.

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token embeddings and the rotary tables of their positions."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        return x, cos, sin

    def pre_attention(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        mlp_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i`` up to its attention: writes the tokens' keys and values; returns the
        queries and the residual, ``x`` plus the previous layer's ``mlp_out`` if given."""
        layer = self._layer(i)
        x, normed = _add_and_norm(x, mlp_out, layer.input_layernorm)
        q = layer.self_attn.queries_writing_kv(normed, (cos, sin), kv_cache, slot_mapping)
        return q, x

    def post_attention(
        self, i: int, x: torch.Tensor, attn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i`` from its attention output ``(T, heads, head_dim)`` on: the residual
        before its MLP's output, and that output (the next layer or ``head`` adds them)."""
        layer = self._layer(i)
        delta = self.reduce(layer.self_attn.o_proj(attn.reshape(attn.shape[0], -1)))
        x, normed = _add_and_norm(x, delta, layer.post_attention_layernorm)
        return x, self.reduce(layer.mlp(normed))

    def head(
        self, x: torch.Tensor, logits_indices: torch.Tensor, mlp_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 logits of the rows ``logits_indices`` of the last residual (``x`` plus the
        last layer's ``mlp_out`` if given)."""
        rows = x[logits_indices]
        extra = None if mlp_out is None else mlp_out[logits_indices]
        _, normed = _add_and_norm(rows, extra, self.model.norm)
        logits: torch.Tensor = self.lm_head(normed)
        return logits.float()

    @torch.inference_mode()
    def forward_dense(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Reference: logits at every position of one sequence, causal attention, no cache."""
        cfg = self.config
        device = self.model.embed_tokens.weight.device
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
        t = ids.shape[0]
        x = self.model.embed_tokens(ids)
        pos = torch.arange(t, device=device)
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, x.dtype)
        rep = cfg.num_heads // cfg.num_kv_heads
        for i in range(cfg.num_layers):
            layer = self._layer(i)
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            allowed = pos[None, :] <= pos[:, None]
            window = cfg.layer_window(i)
            if window is not None:
                allowed &= pos[None, :] > pos[:, None] - window
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.repeat_interleave(rep, dim=1).transpose(0, 1),
                v.repeat_interleave(rep, dim=1).transpose(0, 1),
                attn_mask=allowed,
            ).transpose(0, 1)
            x = x + self.reduce(layer.self_attn.o_proj(out.reshape(t, -1)))
            x = x + self.reduce(layer.mlp(layer.post_attention_layernorm(x)))
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits.float()


def init_random_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Deterministic random weights. Scaled so logits are peaked: greedy argmax has clear
    margins and is stable under the reordering of float sums that batching causes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            # Unit-scale embeddings and LM head: logits with a standard deviation of about
            # sqrt(hidden_size), so the top two are rarely within float noise of each other.
            is_table = "embed" in name or name == "lm_head.weight"
            std = 1.0 if is_table else 1.0 / math.sqrt(param.shape[-1])
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def build_model(
    cfg: ModelConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    weights: str | Path | None = None,
) -> LlamaForCausalLM:
    """A model on ``device`` (float32 on CPU, bf16 on CUDA unless ``dtype`` says otherwise)."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(cfg)
    if weights is None:
        init_random_weights(model, seed)
    else:
        load_weights(model, weights)
    model = model.to(device=device, dtype=dtype).eval()
    model.fuse()
    return model


# ---- safetensors ------------------------------------------------------------------------------

_ST_DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file on CPU: through the ``safetensors`` package when it is
    installed, else through this small reader of the (simple, documented) format."""
    try:
        from safetensors.torch import load_file  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return _read_safetensors(Path(path))
    out: dict[str, torch.Tensor] = load_file(str(path))
    return out


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    raw = path.read_bytes()
    if len(raw) < 8:
        raise ConfigError(f"{path}: too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if 8 + header_len > len(raw):
        raise ConfigError(f"{path}: header length {header_len} runs past the end of the file")
    try:
        header = json.loads(raw[8 : 8 + header_len])
    except ValueError as exc:
        raise ConfigError(f"{path}: header is not JSON: {exc}") from exc
    data = memoryview(raw)[8 + header_len :]
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ConfigError(
                f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}"
            )
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - start != math.prod(shape) * itemsize or end > len(data):
            raise ConfigError(f"{path}: tensor {name!r} has inconsistent data offsets")
        buf = bytearray(data[start:end])
        tensor = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        out[name] = tensor.reshape(shape)
    return out


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Write tensors (any device) as a safetensors file, e.g. to save a random model's weights."""
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        if t.dtype not in _ST_NAMES:
            raise ConfigError(f"tensor {name!r}: dtype {t.dtype} cannot be written to safetensors")
        blob = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {
            "dtype": _ST_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8-byte alignment
    Path(path).write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def load_weights(model: LlamaForCausalLM, path: str | Path) -> None:
    """Load a Hugging Face style Llama checkpoint; names a missing or misshapen tensor."""
    tensors = read_safetensors(path)
    params = dict(model.named_parameters(remove_duplicate=True))
    missing = [n for n in params if n not in tensors]
    if missing and model.config.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise ConfigError(f"{path}: missing tensors {missing[:5]} (of {len(missing)})")
    with torch.no_grad():
        for name, param in params.items():
            if name not in tensors:
                continue
            src = tensors[name]
            if tuple(src.shape) != tuple(param.shape):
                raise ConfigError(
                    f"{path}: tensor {name!r} has shape {tuple(src.shape)}, model expects "
                    f"{tuple(param.shape)}"
                )
            param.copy_(src.to(param.dtype))


def save_weights(model: LlamaForCausalLM, path: str | Path) -> None:
    """Save the model's parameters (tied ones once) as safetensors."""
    write_safetensors(dict(model.named_parameters(remove_duplicate=True)), path)


__all__ = [
    "MODEL_CONFIGS",
    "LlamaForCausalLM",
    "ModelConfig",
    "build_model",
    "init_random_weights",
    "load_weights",
    "model_config",
    "read_safetensors",
    "save_weights",
    "write_safetensors",
]
