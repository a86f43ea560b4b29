"""``BenchConfig``: the shape of one ``kvflow bench`` run (importable without torch)."""

from __future__ import annotations

from attrs import frozen

from kvflow.connector.config import LOAD_PARTS
from kvflow.errors import ConfigError

MODEL_PRESETS = ("tiny", "small", "llama-1b")
"""The reference engine's model presets (``kvflow.engine.model.MODEL_CONFIGS``, which needs torch;
a test keeps the two equal), so a bad ``--model`` is found before torch is imported."""


def check_model(name: str) -> None:
    """Raise ConfigError unless ``name`` is a preset or ``PRESET-swaW`` (a ``W``-token window)."""
    base, sep, window = name.partition("-swa")
    if base not in MODEL_PRESETS or (sep and not (window.isdigit() and int(window) > 0)):
        raise ConfigError(
            f"model {name!r}: one of {', '.join(MODEL_PRESETS)}, "
            "or PRESET-swaW for its hybrid variant with a W-token sliding window (e.g. tiny-swa64)"
        )


def check_device(device: str, backend: str) -> None:
    """Raise ConfigError unless ``device`` is cpu, cuda or cuda:N and ``backend`` can copy there."""
    kind, sep, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (sep and (kind == "cpu" or not index.isdigit())):
        raise ConfigError(f"device {device!r}: one of cpu, cuda, cuda:N (N a GPU index)")
    if backend == "cuda" and kind == "cpu":
        raise ConfigError("backend 'cuda' copies GPU memory: it needs device cuda, not cpu")
    if backend == "host" and kind == "cuda":
        raise ConfigError("backend 'host' copies CPU tensors: on device cuda use backend cuda")


@frozen
class BenchConfig:
    """Everything one ``kvflow bench`` run needs; lengths in tokens."""

    model: str = "tiny"
    device: str = "cpu"
    users: int = 8
    rounds: int = 4
    system_prompt: int = 256
    first_question: int = 128
    question: int = 32
    answer: int = 16
    block_size: int = 16
    cache_fraction: float = 0.4
    cpu_bytes: int | None = None  # default: room for twice the working set
    store_policy: str = "eager"
    fence_loads: str = "idle"  # which CPU hits load in the step that computes them
    load_parts: int = LOAD_PARTS  # a fenced load lands in this many parts by layer
    backend: str = "auto"
    worker_loop: str = "inline"  # where the worker runtime's loop runs: inline or thread
    # EngineConfig.async_scheduling: None, the engine's default (on for one CUDA device)
    async_scheduling: bool | None = None
    max_batched_tokens: int = 2048
    seed: int = 0
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    # "full": both runs once untimed, so neither pays first-use costs of new shapes (fair);
    # "round": only one round, faster but it favours the second (offload-on) run.
    warmup: str = "full"

    @property
    def resolved_dtype(self) -> str:
        """``dtype``, or the engine's default for ``device`` (``build_model``'s)."""
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    def __attrs_post_init__(self) -> None:
        check_model(self.model)
        check_device(self.device, self.backend)
        if self.warmup not in ("round", "full"):
            raise ConfigError(f"warmup {self.warmup!r}: one of round, full")
        if self.fence_loads not in ("never", "idle", "always"):
            raise ConfigError(f"fence_loads {self.fence_loads!r}: one of never, idle, always")
        if type(self.load_parts) is not int or not 1 <= self.load_parts <= 64:
            raise ConfigError(f"load_parts must be an int in 1..64, got {self.load_parts!r}")
        if self.worker_loop not in ("thread", "inline"):
            raise ConfigError(f"worker_loop {self.worker_loop!r}: one of thread, inline")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype {self.dtype!r}: one of float32, bfloat16, float16")
        if not 0 < self.cache_fraction <= 4:
            raise ConfigError(f"cache_fraction must be in (0, 4], got {self.cache_fraction}")
        for name in ("users", "rounds", "question", "answer", "block_size", "max_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")


__all__ = ["MODEL_PRESETS", "BenchConfig", "check_device", "check_model"]
