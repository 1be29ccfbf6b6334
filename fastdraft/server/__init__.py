"""The OpenAI-compatible HTTP server: the app and its endpoints (``app.py``), the request
bodies (``protocol.py``), the engine loop on a thread (``async_engine.py``) or in a child
process (``engine_process.py``) behind one protocol (``engine_client.py``), and Prometheus
metrics (``prometheus.py``)."""
