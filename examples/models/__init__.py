"""Example models written as plain paddle Layers, unaware of parallelism: GPT and a LLaMA-style decoder."""
from .common import count_parameters, initialize_lazy
from .gpt import GPT, GPTConfig, PRESETS as GPT_PRESETS
from .llama import Llama, LlamaConfig, PRESETS as LLAMA_PRESETS

PRESETS = {**GPT_PRESETS, **LLAMA_PRESETS}


def build(name_or_config, lazy: bool = False):
    """A model from a preset name ("gpt-tiny", "gpt-100m", "gpt-1b", "llama-tiny", "llama-1b") or a config.

    ``lazy=True`` builds under ``paddle.LazyGuard``: shapes are known, nothing is allocated until
    ``initialize_lazy(model)``.
    """
    import paddle

    config = name_or_config
    if isinstance(name_or_config, str):
        if name_or_config not in PRESETS:
            raise ValueError(f"unknown model preset {name_or_config!r}; known: {sorted(PRESETS)}")
        config = PRESETS[name_or_config]
    cls = {GPTConfig: GPT, LlamaConfig: Llama}.get(type(config))
    if cls is None:
        raise TypeError(f"expected a preset name, GPTConfig or LlamaConfig, got {type(config).__name__}")
    if lazy:
        with paddle.LazyGuard():
            return cls(config)
    return cls(config)


__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "PRESETS", "build", "count_parameters", "initialize_lazy"]
