"""ec-cache server: a shared cache for multimodal encoder outputs."""

__version__ = "0.1.0"
