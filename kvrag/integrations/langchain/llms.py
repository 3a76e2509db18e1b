"""``KVCachedTextLLM``: a LangChain text-completion LLM over the kvrag engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import GenerationChunk, LLMResult
from pydantic import ConfigDict

from kvrag.integrations._shared import Prompt
from kvrag.integrations.langchain._common import EngineSettings, engine_pieces

__all__ = ["KVCachedTextLLM"]


class KVCachedTextLLM(EngineSettings, BaseLLM):
    """A text-completion LLM (string in, string out) that reuses the KV cache of documents.

    The prompt goes to the model as is; with ``chat_template=True`` it is first wrapped as one
    user message in the model's chat template (instruct models answer better that way). Settings,
    conversation identity and metadata are those of :class:`KVCachedLLM`; each generation's
    ``generation_info`` holds the response metadata plus ``usage_metadata``.
    """

    # unknown constructor keywords are errors (LangChain's base models ignore them)
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    chat_template: bool = False
    """Wrap the prompt as a user message in the model's chat template."""

    @property
    def _llm_type(self) -> str:
        return "kvrag-text"

    def _prompt(self, prompt: str) -> Prompt:
        if not self.chat_template:
            return Prompt.plain(prompt)
        return Prompt.chat([{"role": "user", "content": prompt}])

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for text, info in engine_pieces(self, self._prompt(prompt), stop, kwargs, run_manager):
            chunk = GenerationChunk(text=text, generation_info=info)
            if info is None and run_manager is not None:  # BaseLLM leaves token callbacks to the integration
                run_manager.on_llm_new_token(text, chunk=chunk)
            yield chunk

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = []
        for prompt in prompts:
            chunks = list(self._stream(prompt, stop, None, **kwargs))
            total = chunks[0]
            for chunk in chunks[1:]:
                total += chunk
            generations.append([total])
        return LLMResult(generations=generations, llm_output=_llm_output(generations))


def _llm_output(generations) -> dict[str, Any]:
    totals = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "cache_read": 0}
    for (g,) in generations:
        u = (g.generation_info or {}).get("usage_metadata", {})
        for key in ("input_tokens", "output_tokens", "total_tokens"):
            totals[key] += u.get(key, 0)
        totals["cache_read"] += u.get("input_token_details", {}).get("cache_read", 0)
    return {"token_usage": totals}
