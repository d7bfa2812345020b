"""What a model is: `ModelConfig`, RoPE, the KV cache, attention (the reference loop; `kernels/` holds the
Pallas kernels it may call), the one transformer and `Model`, the sharding rules on a mesh, and Hugging Face
directories read and written. Imports `jspec.core` and `jspec.text`."""
