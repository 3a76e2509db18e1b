"""langchain-tests standard suites for ``KVCachedLLM``.

The unit suite needs no model. The integration suite runs the bundled SmolLM2-135M-Instruct (the
shared engine); generations are kept short. Tool calling, tool choice, structured output and JSON mode
are on; multimodal inputs are skipped through the suites' own flags. SmolLM2's chat template renders
no tools: the tool tests are expected to fail with UnsupportedModelError (docs/tools.md); structured
output runs constrained decoding (64 tokens: room for the object).
"""

from __future__ import annotations

import functools
import inspect

import pytest

pytest.importorskip("langchain_tests")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import AIMessage  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from kvrag.errors import UnsupportedModelError  # noqa: E402
from kvrag.integrations.langchain import KVCachedLLM, register_documents  # noqa: E402

# Long enough to be registered and cached as a chunk (the registry skips texts under 32 chars).
_DOC = (
    "The Harbor Street Library opened in 1921 in the old customs house of Port Alder. Its first "
    "librarian, Margaret Ellison, catalogued eleven thousand volumes donated by the shipping families."
)
_NO_TOOLS = pytest.mark.xfail(
    raises=UnsupportedModelError, strict=True, reason="SmolLM2's chat template renders no tools (docs/tools.md)"
)


def _no_tools(name: str):
    """The suite's test ``name``, expected to fail with UnsupportedModelError here: a new function (marking
    the suite's own would mark it in every class that inherits it)."""
    base = getattr(ChatModelIntegrationTests, name)
    if inspect.iscoroutinefunction(base):

        async def test(self, *args, **kwargs):
            return await base(self, *args, **kwargs)
    else:

        def test(self, *args, **kwargs):
            return base(self, *args, **kwargs)

    return _NO_TOOLS(functools.wraps(base)(test))


class ToolFlags:
    """Tool calling (the model's own template and format), tool choice and structured output (a
    grammar or JSON-schema constraint) and JSON mode are on."""

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True


class TestKVCachedLLMUnit(ToolFlags, ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[KVCachedLLM]:
        return KVCachedLLM

    @property
    def standard_chat_model_params(self) -> dict:
        # kvrag runs in-process: there is no API key, network timeout or retry to configure, and
        # unknown constructor keywords are errors rather than silently ignored.
        return {"temperature": 0, "max_tokens": 100, "stop": []}


@pytest.mark.model
class TestKVCachedLLMIntegration(ToolFlags, ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[KVCachedLLM]:
        return KVCachedLLM

    @property
    def chat_model_params(self) -> dict:
        # room for the structured-output tests' objects (constrained JSON cut at the limit is invalid);
        # the other tests' answers end at the model's end token well before it
        return {"max_tokens": 64, "temperature": 0}

    @property
    def model_override_value(self) -> str:
        return "SmolLM2-135M-Instruct"  # the bundled model by name: served by the same shared engine

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = KVCachedLLM(**self.chat_model_params)
        register_documents([Document(page_content=_DOC)], llm)
        messages = [("system", f"Answer from this document:\n{_DOC}"), ("human", "When did the library open?")]
        llm.invoke(messages)  # first sight: the document's KV is written back
        llm.get_engine().flush()
        if stream:
            full = None
            for chunk in llm.stream(messages):
                full = chunk if full is None else full + chunk
            msg = full
        else:
            msg = llm.invoke(messages)
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
        return msg

    # -- tools: the bundled model's template has none ---------------------------------------------------

    for _name in (
        "test_tool_calling",
        "test_tool_calling_async",
        "test_bind_runnables_as_tools",
        "test_tool_message_histories_string_content",
        "test_tool_message_histories_list_content",
        "test_tool_choice",
        "test_tool_calling_with_no_arguments",
        "test_tool_message_error_status",
        "test_structured_few_shot_examples",
        "test_agent_loop",
        "test_unicode_tool_call_integration",
    ):
        locals()[_name] = _no_tools(_name)
    del _name

    # -- structured output: SmolLM2-135M's findings (the 64 tokens are room enough for the object) ---------

    @pytest.mark.xfail(reason="SmolLM2-135M writes the optional punchline first and runs it past 64 tokens (a finding)")
    def test_structured_output_optional_param(self, model) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(reason="JSON mode constrains to an object only; SmolLM2-135M writes other fields (a finding)")
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)
