"""The serving engine: requests checked (``request.py``) and queued, scheduled a step at a time
over a paged KV cache (``scheduler.py``, ``block_manager.py``, ``sequence.py``), run as one flat
batch (``model_runner.py``), and handed out as per-step deltas (``output.py``); speculative
decoding plugs in through ``speculation.py``. ``loader.py`` loads a model for it."""
