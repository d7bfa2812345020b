"""The math of a round: distributions, log-probabilities, rejection sampling, draft trees, cache-safe branches,
the adaptive policy, statistics and the cost models. Imports the layers below (`core`, `text`, `model`)."""
