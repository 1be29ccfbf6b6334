"""The place for fastdraft's OpenAI-compatible HTTP server; the package holds no code yet."""
