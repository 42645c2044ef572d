"""The model layer: family catalog, loading, tiny models, batched generation, reward scoring,
value model, placement of large models. Import the modules themselves; this package imports
nothing (the orchestrator may import pita.models.catalog without torch)."""
