"""The OpenAI-compatible HTTP server (FastAPI): `pagedllm serve`."""
