"""What the ingress (or a Python caller) hands an engine replica: one prompt and its sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass

from ddtree.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    """Exactly one of `prompt` (text or token ids, used as is) and `messages` (chat messages, rendered with the
    model's chat template on the engine replica). `strict_max_tokens`: a prompt that leaves fewer than
    `params.max_tokens` tokens of the context window is refused (the client asked for them, as the OpenAI API
    refuses it); otherwise generation stops at the window's end (finish reason "length")."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    params: SamplingParams | None = None
    request_id: str | None = None
    strict_max_tokens: bool = False

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None and not (
            isinstance(self.prompt, str)
            or isinstance(self.prompt, (list, tuple))
            and all(isinstance(t, int) and not isinstance(t, bool) for t in self.prompt)
        ):
            raise ValueError(f"the prompt must be a string or a list of token ids (ints), got {self.prompt!r:.80}")
        if isinstance(self.prompt, tuple):
            self.prompt = list(self.prompt)
        if self.params is None:
            self.params = SamplingParams()
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a ddtree.SamplingParams, got {type(self.params).__name__}")
        if self.messages is not None and not isinstance(self.messages, list):
            raise ValueError("messages must be a list of {'role', 'content'} dicts")

    @property
    def prompt_param(self) -> str:
        """The request field an error about the prompt refers to."""
        return "messages" if self.messages is not None else "prompt"
