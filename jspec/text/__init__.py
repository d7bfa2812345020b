"""Text: tokenizers and chat templates, constraint automata and their compilation, and token maps between two
vocabularies. Imports `jspec.core` only."""
