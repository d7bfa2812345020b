"""`python -m jspec.serve`: an OpenAI-compatible HTTP server over the online engine (`jspec.engine.engine`)."""
