"""pita: a Hydra-driven multi-GPU orchestrator for LLM post-training experiments."""

__version__ = "0.1.0"
