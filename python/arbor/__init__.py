"""arbor inside Python: arbor's own log-probs, bit for bit, next to a PyTorch trainer.

`arbor.Model` loads a checkpoint (an HF directory or a GGUF file) with arbor's loader in
this process (one rank, CPU) and scores sequences exactly as `arbor score` does;
`arbor.torch.CausalLM` wraps it as a `torch.nn.Module` with HF parameter names.
"""

from arbor._native import (
    ArborError,
    CheckpointError,
    InvalidInput,
    Model,
    __version__,
    read_checkpoint,
)

__all__ = [
    "ArborError",
    "CheckpointError",
    "InvalidInput",
    "Model",
    "__version__",
    "read_checkpoint",
]
