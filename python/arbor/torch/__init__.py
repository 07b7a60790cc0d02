"""arbor's log-probs inside PyTorch: `CausalLM.token_logprobs` returns the values arbor's
engine computes (bit-identical to `arbor score` and `arbor serve` at any TP size and
batch), with the gradient of a plain PyTorch forward of the same model."""

from arbor.torch.config import ArchConfig
from arbor.torch.model import CausalLM

__all__ = ["ArchConfig", "CausalLM"]
