"""cudflash: speculative decoding with block-diffusion drafters (DFlash) on numpy or CuPy."""
from cudflash.engine.llm_engine import LLM, GenerationResult
from cudflash.errors import CudflashError
from cudflash.sampling_params import SamplingParams

__all__ = ["LLM", "GenerationResult", "SamplingParams", "CudflashError"]
__version__ = "0.1.0"
