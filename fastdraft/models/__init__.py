"""Model implementations, model registry (offline pull) and loading."""
