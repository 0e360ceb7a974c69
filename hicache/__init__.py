"""hicache: a hierarchical GPU / host / disk KV-cache tier daemon for LLM inference."""

__version__ = "0.1.0"
