"""pagedllm: a readable LLM inference engine built around PagedAttention."""
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
