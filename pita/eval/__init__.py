"""Evaluation metrics (pure Python; no torch)."""
