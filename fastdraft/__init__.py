"""fastdraft: fast LLM inference on ordinary hardware.

Front doors: :class:`LLM` (vLLM style), :class:`AutoModelForCausalLM` (HF style),
:class:`TextGenerator` (streaming), and the ``fastdraft`` command line. A program that runs
models calls :func:`configure_process` once at start (malloc tuning, threads): fastdraft's
constructors leave process-wide settings alone.
"""

from fastdraft.model_config import ModelConfig
from fastdraft.engine.loader import load_model
from fastdraft.engine.metrics import GenerationMetrics
from fastdraft.engine.output import CompletionOutput, RequestOutput
from fastdraft.generator import TextGenerator
from fastdraft.llm import LLM, AutoModelForCausalLM
from fastdraft.process import configure_process
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.sampling_params import Constraint, SamplingParams
from fastdraft.speculative.speculative_config import SpeculativeConfig

__version__ = "0.1.0"
__all__ = [
    "LLM", "AutoModelForCausalLM", "CompletionOutput", "Constraint", "GenerationMetrics", "ModelConfig", "QuantConfig",
    "RequestOutput", "SamplingParams", "SpeculativeConfig", "TextGenerator", "configure_process", "load_model",
    "__version__",
]
