"""kvscope: observability and media verification for tiered LLM KV caches."""

__version__ = "0.1.0"
