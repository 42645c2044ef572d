"""My own algorithm (Copycat) and dataset (short_walk) for pita: docs/extending.md."""
