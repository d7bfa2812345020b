"""The previous home of `make_decoder` and `drafter_kind`, kept as aliases: both live in `jspec.decoder`."""
from jspec.decoder import drafter_kind, make_decoder  # noqa: F401
