"""Backends for other frameworks (HF transformers `generate` first); see the integration issue."""
