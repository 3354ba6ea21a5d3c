"""Graph capture: tracing a model's forward into a networkx op graph (spec-only, nothing computed)."""
