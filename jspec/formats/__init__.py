"""Checkpoints: jspec's own directories, the draft heads published for vLLM and SGLang, and `load()`, which
reads any of them or a Hugging Face directory. Imports every layer up to `jspec.engine`."""
