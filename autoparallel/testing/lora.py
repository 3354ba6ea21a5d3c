"""A hand-written LoRA adapter for tests and benchmarks: a frozen ``Linear(n, n)`` plus trainable ``A [n, r]`` and
``B [r, n]``, ``out = base(x) + x @ A @ B``."""
from paddle import nn


class HandLoRA(nn.Layer):
    """``a_std`` / ``b_std``: the normal initialisers' deviations; ``b_std=0`` starts B at zero, as LoRA does."""

    def __init__(self, n: int, r: int, a_std: float = 0.02, b_std: float = 0.0):
        super().__init__()
        self.base = nn.Linear(n, n)
        self.lora_A = self.create_parameter([n, r], default_initializer=nn.initializer.Normal(0, a_std))
        b_init = nn.initializer.Normal(0, b_std) if b_std else nn.initializer.Constant(0.0)
        self.lora_B = self.create_parameter([r, n], default_initializer=b_init)
        for p in self.base.parameters():
            p.stop_gradient = True

    def forward(self, x):
        return self.base(x) + x @ self.lora_A @ self.lora_B
