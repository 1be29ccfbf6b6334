"""fastdraft: fast LLM inference on ordinary hardware."""

from fastdraft.config import ModelConfig
from fastdraft.engine.generate import GenerationMetrics, TextGenerator
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.models.loader import load_model

__version__ = "0.1.0"
__all__ = ["ModelConfig", "GenerationMetrics", "SamplingParams", "TextGenerator", "load_model", "__version__"]
