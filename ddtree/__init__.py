"""DDTree Serve: DFlash draft trees verified in one target pass, batched across requests.

from ddtree import LLM, SamplingParams
llm = LLM()                                   # embedded SmolLM2-135M-Instruct + shipped drafter, CPU
print(llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=64))[0].text)
"""

from ddtree.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # The engine pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from ddtree.llm import LLM

        return LLM
    raise AttributeError(f"module 'ddtree' has no attribute {name!r}")
