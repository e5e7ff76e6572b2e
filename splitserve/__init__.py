"""splitserve: LLM serving with disaggregated prefill and decode.

The offline API mirrors vLLM's::

    from splitserve import LLM, SamplingParams
    llm = LLM()  # the default model, converted on first use
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
"""

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "LoRARequest", "PoolingParams", "SamplingParams", "StructuredOutputsParams", "Client", "AsyncClient", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it on first use only.
    if name == "LLM":
        from splitserve.engine.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from splitserve.common.beam_search_params import BeamSearchParams

        return BeamSearchParams
    if name == "PoolingParams":
        from splitserve.engine.pooling import PoolingParams

        return PoolingParams
    if name == "LoRARequest":
        from splitserve.engine.lora import LoRARequest

        return LoRARequest
    if name in ("Client", "AsyncClient"):
        from splitserve import client

        return getattr(client, name)
    raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
