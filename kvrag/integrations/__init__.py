"""Drop-in integrations: ``kvrag.integrations.langchain`` and ``kvrag.integrations.llama_index``.

Importing this package imports neither LangChain nor LlamaIndex.
"""
