"""Serving: continuous batching with lossless speculative decoding (:mod:`spire.serving.engine`) behind an
OpenAI-compatible HTTP API (:mod:`spire.serving.api`, run by ``spire serve``)."""
