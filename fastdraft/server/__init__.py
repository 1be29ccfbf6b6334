"""OpenAI-compatible HTTP server (to come)."""
