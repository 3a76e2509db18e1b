"""The compute dtype: ``auto`` follows what the hardware computes natively, an explicit dtype is kept,
the fingerprint tells dtypes apart, ``Engine.info()`` says which and why; one dtype table."""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import pytest
import torch

from kvrag import Engine, EngineConfig, InvalidRequestError, SamplingParams
from kvrag.engine.model import dtypes, loading
from kvrag.engine.model.dtypes import FLOAT_DTYPES, native_bf16, resolve_dtype, weights_dtype
from tests.helpers import as_dtype


@pytest.fixture
def cpu_flags(monkeypatch):
    """Pretend this is a Linux CPU with the given /proc/cpuinfo flags."""

    def pretend(*flags: str) -> None:
        monkeypatch.setattr(dtypes.platform, "system", lambda: "Linux")
        monkeypatch.setattr(dtypes, "_cpu_flags", lambda: frozenset(("sse2", "avx2", *flags)))

    return pretend


@pytest.mark.parametrize("flag", ["amx_bf16", "avx512_bf16"])
def test_auto_is_bfloat16_on_a_cpu_that_multiplies_it(cpu_flags, flag):
    cpu_flags(flag)
    choice = resolve_dtype("auto", "cpu")
    assert choice.name == "bfloat16" and choice.torch is torch.bfloat16
    assert flag in choice.why and choice.why.startswith("auto:")


def test_auto_is_float32_elsewhere(cpu_flags, monkeypatch):
    cpu_flags()  # an x86 CPU without bf16 units: bf16 would be emulated, slower than float32
    choice = resolve_dtype("auto", "cpu")
    assert choice.name == "float32" and "neither amx_bf16 nor avx512_bf16" in choice.why
    cpu_flags("amx_bf16")  # the units, but a torch without oneDNN to use them
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert resolve_dtype("auto", "cpu").name == "float32" and "oneDNN" in resolve_dtype("auto", "cpu").why
    monkeypatch.setattr(dtypes.platform, "system", lambda: "Darwin")  # no detection there: conservative
    assert resolve_dtype("auto", "cpu") == dtypes.DtypeChoice("float32", "auto: no bf16 detection on Darwin CPUs")
    assert resolve_dtype("auto", "mps").name == "float32"


def test_auto_on_cuda_asks_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU 9000")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda:0") == dtypes.DtypeChoice("bfloat16", "auto: GPU 9000 supports bf16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # before Ampere
    assert resolve_dtype("auto", "cuda") == dtypes.DtypeChoice("float32", "auto: GPU 9000 has no native bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto", "cuda") == dtypes.DtypeChoice("float32", "auto: CUDA is not available")


def test_auto_on_this_machine_follows_its_cpu_flags():
    """Here, a Xeon with AMX-BF16: bf16 (where a bf16 prefill is ~3x faster than float32)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    native = platform.system() == "Linux" and ("amx_bf16" in flags or "avx512_bf16" in flags)
    native = native and torch.backends.mkldnn.is_available()
    assert resolve_dtype("auto", "cpu").name == ("bfloat16" if native else "float32")
    assert native_bf16("cpu")[0] == native


def test_an_explicit_dtype_is_never_overridden(cpu_flags):
    for flags in ((), ("amx_bf16",)):
        cpu_flags(*flags)
        for name in FLOAT_DTYPES:
            assert resolve_dtype(name, "cpu") == dtypes.DtypeChoice(name, "set explicitly")


@pytest.mark.parametrize("bad", ["fp32", "float64", "", None, 32])
def test_a_bad_dtype_gets_one_clear_error(bad):
    with pytest.raises(InvalidRequestError, match=r"dtype must be 'auto' or one of \('float32'"):
        EngineConfig(dtype=bad)
    with pytest.raises(InvalidRequestError, match="dtype must be one of"):
        resolve_dtype(bad, "cpu")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512_bf16 amx_bf16 amx_tile\n\nprocessor\t: 1\nflags: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert {"avx512_bf16", "amx_bf16"} <= dtypes._cpu_flags(str(x86))
    assert "bf16" in dtypes._cpu_flags(str(arm))  # read, but Arm's bf16 is not taken as native (conservative)
    assert dtypes._cpu_flags(str(tmp_path / "absent")) == frozenset()


def test_a_given_model_computes_in_its_own_dtype(tiny_model, tiny_tokenizer):
    model = as_dtype(tiny_model, "bfloat16")
    assert weights_dtype(torch.bfloat16, "auto") == dtypes.DtypeChoice("bfloat16", "the given model's own dtype")
    with pytest.raises(InvalidRequestError, match=r"dtype='float32' but the given model's weights are bfloat16"):
        Engine.from_model(model, tiny_tokenizer, dtype="float32")
    with pytest.raises(InvalidRequestError, match="weights are torch.float64"):
        weights_dtype(torch.float64, "auto")
    with Engine.from_model(model, tiny_tokenizer) as engine:
        info = engine.info()
        assert engine.config.dtype == info.dtype == "bfloat16" and info.dtype_reason == "the given model's own dtype"
        assert engine.hf_model.dtype == torch.bfloat16  # the gate's float32 reference was a copy
    with Engine.from_model(tiny_model, tiny_tokenizer, dtype="float32") as engine:
        assert engine.info().dtype == "float32" and engine.info().dtype_reason == "set explicitly"


def test_info_says_what_the_engine_runs(tiny_engine):
    info = tiny_engine.info()
    assert info.model and info.family == "llama" and info.device == "cpu"
    assert info.dtype == "float32" and info.threads == torch.get_num_threads()
    assert info.context_window == tiny_engine.context_window
    assert info.gate_ok and info.gate.startswith("passed in float32: placement ")
    assert info.decode.startswith(("packed: ", "plain: "))  # which path, and why (tests/engine/model/test_decode.py)
    assert info.decode.startswith(tiny_engine.decoding.decoder.description)
    assert info.blend.startswith("probe, auto (balanced): ")  # the default selection, quality and budget
    assert info.malloc  # what the process's allocator does (tests/engine/model/test_host.py)
    assert set(info.to_dict()) == {
        "model", "family", "dtype", "dtype_reason", "device", "threads", "context_window", "gate_ok", "gate",
        "decode", "blend", "malloc",
    }  # fmt: skip


def test_the_fingerprint_tells_dtypes_apart(tiny_tokenizer):
    prints = {name: loading.fingerprint_model("w" * 64, tiny_tokenizer, name) for name in FLOAT_DTYPES}
    assert len(set(prints.values())) == len(FLOAT_DTYPES)
    with pytest.raises(ValueError, match="resolved dtype"):
        loading.fingerprint_model("w" * 64, tiny_tokenizer, "auto")


def test_one_dtype_table():
    """The kernels (below the model layer) take exactly the compute dtypes the model layer names;
    the store's codec names its dtypes through the model layer's table."""
    from kvrag.engine.store.codec import PlainCodec
    from kvrag.kernels._checks import KERNEL_FLOATS

    assert set(KERNEL_FLOATS) == set(FLOAT_DTYPES.values())
    for name, dtype in FLOAT_DTYPES.items():
        assert PlainCodec(name).dtype is dtype and PlainCodec(dtype).dtype_name == name
    with pytest.raises(InvalidRequestError, match="plain KV at rest must be one of"):
        PlainCodec("float64")
    with pytest.raises(ValueError, match="plain KV at rest is float16, bfloat16 or float32"):
        PlainCodec(torch.int32)


@pytest.mark.parametrize("native", [True, False])
def test_from_pretrained_resolves_auto_before_loading(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch, caplog, native
):
    """A local model directory loaded with ``dtype="auto"``: bf16 where the detector finds native
    bf16, float32 where it does not; the weights are loaded in that dtype and ``info()`` says why."""
    directory = tmp_path / "tiny"
    tiny_model.save_pretrained(directory)
    tiny_tokenizer.save_pretrained(directory)
    evidence = "the CPU has amx_bf16" if native else "the CPU has neither amx_bf16 nor avx512_bf16"
    monkeypatch.setattr(dtypes, "native_bf16", lambda device: (native, evidence))
    with caplog.at_level(logging.INFO, logger="kvrag"):
        engine = Engine.from_pretrained(str(directory), cache_dir=str(tmp_path / "cache"))
    with engine:
        want = "bfloat16" if native else "float32"
        said = [r.getMessage() for r in caplog.records if "computes in" in r.getMessage()]
        assert said == [f"kvrag: tiny computes in {want} (auto: {evidence})"]  # once, at load
        assert engine.hf_model.dtype == FLOAT_DTYPES[want] and engine.config.dtype == want
        assert engine.info().dtype == want and engine.info().dtype_reason == f"auto: {evidence}"
        assert engine.gate.ok and engine.gate.dtype == want
    with Engine.from_pretrained(str(directory), dtype="float16", cache_dir=str(tmp_path / "cache")) as engine:
        assert engine.info().dtype == "float16" and engine.info().dtype_reason == "set explicitly"


def test_a_hub_id_in_the_local_hugging_face_cache_loads_offline(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    """``"org/name"`` resolves to its snapshot in the Hugging Face cache, never a download; one not
    cached is the usual unknown-model error, naming the cache."""
    import huggingface_hub.constants

    from kvrag.errors import ModelNotFoundError

    hub = tmp_path / "hub"
    snapshot = hub / "models--kvrag-test--tiny" / "snapshots" / "0123abcd"
    tiny_model.save_pretrained(snapshot)
    tiny_tokenizer.save_pretrained(snapshot)
    (hub / "models--kvrag-test--tiny" / "refs").mkdir()
    (hub / "models--kvrag-test--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)  # no local directory of that name
    with Engine.from_pretrained("kvrag-test/tiny", dtype="float32", cache_dir=str(tmp_path / "cache")) as engine:
        assert engine.generate(prompt="The king", sampling=SamplingParams(max_new_tokens=2)).token_ids
        assert engine.model_name == "tiny"
    with pytest.raises(ModelNotFoundError, match="hub id already in the Hugging Face cache"):
        Engine.from_pretrained("kvrag-test/absent", cache_dir=str(tmp_path / "cache"))
