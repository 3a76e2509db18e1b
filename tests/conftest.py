import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton decides at import (its own and its lazy submodules') whether @jit functions run in its
# interpreter, and torch imports triton as soon as transformers builds a model: so the variable is
# set for the whole session, before anything imports triton. Only tests/kernels/test_kernels.py launches
# Triton kernels; on CPU tensors only the interpreter can run them. Left alone on a CUDA machine.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import make_docs, make_tiny_llama, make_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return make_tiny_llama(len(tiny_tokenizer))


@pytest.fixture
def tiny_engine(tiny_model, tiny_tokenizer):
    from kvrag import Engine

    engine = Engine.from_model(tiny_model, tiny_tokenizer, max_new_tokens=8)
    yield engine
    engine.close()


@pytest.fixture
def docs():
    return make_docs(4)


@pytest.fixture(scope="session")
def smol_engine():
    """The bundled SmolLM2-135M-Instruct (converted once into the user cache dir)."""
    from kvrag import Engine

    engine = Engine.from_pretrained(max_new_tokens=16)
    yield engine
    engine.close()
