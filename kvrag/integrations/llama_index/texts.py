"""The forms in which LlamaIndex puts a node's text into a prompt: what kvrag registers and warms.

LlamaIndex renders a node into a prompt as ``node.get_content(MetadataMode.LLM)`` (metadata header
+ text); the response synthesizers strip each text before packing it. Node registration
(:mod:`.nodes`) and speculative retrieval (:mod:`.speculation`) both read these forms.
"""

from __future__ import annotations

from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from kvrag.errors import InvalidRequestError

__all__ = ["node_texts", "prompt_form"]


def node_texts(node: BaseNode | NodeWithScore) -> list[str]:
    """The forms in which LlamaIndex may put a node's text into a prompt (distinct, in order)."""
    if isinstance(node, NodeWithScore):
        node = node.node
    if not isinstance(node, BaseNode):
        raise InvalidRequestError(f"expected LlamaIndex nodes, got {type(node).__name__}")
    out: list[str] = []
    for mode in (MetadataMode.LLM, MetadataMode.NONE):
        text = node.get_content(metadata_mode=mode)
        for form in (text, text.strip()):
            if form and form not in out:
                out.append(form)
    return out


def prompt_form(forms: list[str]) -> str | None:
    """The form the response synthesizers put into prompts (metadata header, stripped), of a node's
    :func:`node_texts`; ``None`` for a node without text."""
    return forms[0].strip() if forms else None
