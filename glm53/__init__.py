"""glm53: serve GLM-5.3-Flash from one 24 GB NVIDIA GPU plus host RAM behind an OpenAI-compatible API."""

__version__ = "0.1.0"
