"""Serving: continuous batching with lossless speculative decoding (:mod:`spire.engine`) behind an
OpenAI-compatible HTTP API (:mod:`spire.serving.api`, run by ``spire serve``)."""
