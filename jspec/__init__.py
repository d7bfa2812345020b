"""jspec: lossless speculative decoding in JAX."""
from jspec.api import Result, generate
from jspec.checkpoint import Model, load, save
from jspec.config import ModelConfig

__all__ = ["Model", "ModelConfig", "Result", "generate", "load", "save"]
