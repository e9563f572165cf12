"""specdraft: a Triton-kernel draft decode runtime for speculative decoding."""

__version__ = "0.1.0"
