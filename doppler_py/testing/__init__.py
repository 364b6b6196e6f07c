"""Helpers for tests and benchmarks: tiny random models in the HF folder format (no download)."""
