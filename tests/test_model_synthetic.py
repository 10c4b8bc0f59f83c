from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import onnxruntime_genai as og
import pytest

from common.model_folder import DEFAULT_CUDA_MODEL_NAME, default_model_dir, is_complete
from ortfleet.commands.model import register
from ortfleet.modelbuild import convert as convert_module
from ortfleet.modelbuild import default as default_module
from ortfleet.modelbuild import synthetic as synthetic_module
from ortfleet.modelbuild.build_server import BuilderServer
from ortfleet.modelbuild.convert import BUILDER_MODULE, BuilderFailed, builder_command, run_builder
from ortfleet.modelbuild.default import ensure_default_model
from ortfleet.modelbuild.random_weights import block_view, random_model
from ortfleet.modelbuild.synthetic import (
    LLAMA3_8B,
    PHI3_MINI,
    QWEN25_7B,
    RANDOM_WEIGHTS_MODULE,
    SHAPES,
    Shape,
    build_synthetic_model,
    byte_pair_tokenizer,
)
from tests.test_architectures import tiny_shape

EVENT_TOKEN = 1
EVENT_FAILED = 8
SMALL_PHI3 = PHI3_MINI.resized(layers=1, hidden=512)


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory: pytest.TempPathFactory, builder_server: BuilderServer) -> Path:
    return build_synthetic_model(tmp_path_factory.mktemp("synthetic") / "phi3", SMALL_PHI3, device="cpu")


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ortfleet")
    register(parser.add_subparsers(dest="command", required=True), lambda: Path("/nonexistent"))
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


class FakeBuilder:
    """Stands in for run_builder: records its arguments and writes a minimal model folder."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, hf_dir: Path, out_dir: Path, cache_dir: Path, **kwargs: Any) -> None:
        self.calls.append(kwargs)
        out_dir.mkdir(parents=True)
        (out_dir / "genai_config.json").write_text("{}")


def refuse_check(model_dir: Path) -> None:
    raise AssertionError("the generation check ran without CUDA")


@pytest.mark.unit
def test_phi3_mini_shape_is_phi3_minis_config() -> None:
    assert (PHI3_MINI.hidden_size, PHI3_MINI.num_layers, PHI3_MINI.num_heads) == (3072, 32, 32)
    assert (PHI3_MINI.intermediate_size, PHI3_MINI.vocab_size, PHI3_MINI.context_length) == (
        8192,
        32064,
        4096,
    )
    assert (PHI3_MINI.rope_theta, PHI3_MINI.rms_norm_eps) == (10000.0, 1e-5)


@pytest.mark.unit
def test_llama3_8b_and_qwen25_7b_shapes_are_their_configs_with_their_own_architectures() -> None:
    assert (LLAMA3_8B.architecture, LLAMA3_8B.hidden_size, LLAMA3_8B.intermediate_size) == (
        "LlamaForCausalLM",
        4096,
        14336,
    )
    assert (LLAMA3_8B.num_layers, LLAMA3_8B.num_heads, LLAMA3_8B.num_kv_heads) == (32, 32, 8)
    assert (LLAMA3_8B.vocab_size, LLAMA3_8B.rope_theta) == (128256, 500000.0)
    assert (QWEN25_7B.architecture, QWEN25_7B.hidden_size, QWEN25_7B.intermediate_size) == (
        "Qwen2ForCausalLM",
        3584,
        18944,
    )
    assert (QWEN25_7B.num_layers, QWEN25_7B.num_heads, QWEN25_7B.num_kv_heads) == (28, 28, 4)
    assert (QWEN25_7B.vocab_size, QWEN25_7B.rope_theta) == (152064, 1e6)
    assert sorted(SHAPES) == ["llama3-8b", "phi3-mini", "qwen2.5-7b"]


@pytest.mark.unit
def test_resized_shape_keeps_vocab_heads_and_context() -> None:
    assert SMALL_PHI3 == Shape(
        name="phi3-mini",
        architecture="Phi3ForCausalLM",
        model_type="phi3",
        hidden_size=512,
        num_layers=1,
        num_heads=32,
        num_kv_heads=32,
        intermediate_size=1344,
        vocab_size=32064,
        context_length=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        config_overrides=(("original_max_position_embeddings", 4096),),
    )


@pytest.mark.parametrize(
    ("layers", "hidden", "message"),
    [(0, None, "--layers must be from 1 to 32"), (33, None, "--layers"), (None, 256, "multiple of 512")],
)
@pytest.mark.unit
def test_resizing_beyond_the_shape_is_rejected(layers: int | None, hidden: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PHI3_MINI.resized(layers=layers, hidden=hidden)


@pytest.mark.parametrize("vocab_size", [32064, 152064])
@pytest.mark.unit
def test_tokenizer_vocab_matches_the_model_and_round_trips_text(vocab_size: int) -> None:
    tokenizer = byte_pair_tokenizer(vocab_size)
    assert len(tokenizer) == vocab_size
    text = "What is the capital of France? Ünïcödé ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.convert_ids_to_tokens(vocab_size - 1)  # the last id is a token of its own


def test_synthetic_model_generates_on_the_cpu(synthetic_model: Path) -> None:
    assert is_complete(synthetic_model)
    config = json.loads((synthetic_model / "genai_config.json").read_text())
    assert config["model"]["vocab_size"] == 32064
    assert config["model"]["context_length"] == 4096
    assert config["model"]["decoder"]["num_hidden_layers"] == 1
    model = og.Model(str(synthetic_model))
    tokenizer = og.Tokenizer(model)
    engine = og.Engine(model)
    request = engine.create_request()
    options = og.TurnOptions(request)
    options.set_max_generated_tokens(5)
    options.set_do_sample(False)
    prompt = tokenizer.apply_chat_template(
        messages=json.dumps([{"role": "user", "content": "Hello!"}]), add_generation_prompt=True
    )
    request.begin_turn(tokenizer.encode(prompt), options)
    buffer = engine.create_event_buffer(16)
    tokens: list[int] = []
    flags = 0
    while engine.has_pending_requests():
        for event in engine.run(buffer):
            flags |= int(event.flags.value)
            if event.flags.value & EVENT_TOKEN:
                tokens.append(event.token)
    request.close()
    assert not flags & EVENT_FAILED
    assert 1 <= len(tokens) <= 5
    assert isinstance(tokenizer.decode(tokens), str)


def test_builder_server_builds_models_in_a_row_and_reports_a_failure_with_its_output(
    builder_server: BuilderServer, tmp_path: Path
) -> None:
    """Each build checks that its model generates, in this process: the server, which forks the
    builds, runs none. The first build may be the one that starts the server."""
    llama = build_synthetic_model(tmp_path / "llama", tiny_shape("LlamaForCausalLM", "llama"), seed=1)
    builds, server = builder_server.builds, builder_server.pid
    qwen = build_synthetic_model(tmp_path / "qwen2", tiny_shape("Qwen2ForCausalLM", "qwen2"), seed=2)
    (tmp_path / "hf").mkdir()
    lines: list[str] = []

    with pytest.raises(BuilderFailed) as caught:
        run_builder(
            tmp_path / "hf", tmp_path / "out", tmp_path / "cache", precision="fp32", on_output=lines.append
        )

    assert (builder_server.builds, builder_server.pid) == (builds + 2, server)
    assert caught.value.returncode == 1  # a traceback: the folder has no config.json
    assert caught.value.output_tail.splitlines() == lines[-40:]
    assert "config.json" in caught.value.output_tail
    for model in (llama, qwen):
        assert json.loads((model / "genai_config.json").read_text())["model"]["vocab_size"] == 512
    assert llama != qwen


def test_model_synthetic_command_prints_the_folder_last(
    synthetic_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["model", "synthetic", "--shape", "phi3-mini", "--layers", "1", "--hidden", "512", "-q"]
    assert run_cli([*argv, str(synthetic_model)]) == 0  # already built: returned at once
    assert capsys.readouterr().out.splitlines()[-1] == str(synthetic_model)


@pytest.mark.unit
def test_model_synthetic_command_reports_a_bad_size_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        run_cli(["model", "synthetic", "--shape", "phi3-mini", "--hidden", "100", str(tmp_path / "m")]) == 1
    )
    assert "ortfleet model: error: --hidden must be a multiple of 512" in capsys.readouterr().err


@pytest.mark.unit
def test_builder_command_passes_extra_options() -> None:
    paths = Path("hf"), Path("out"), Path("cache")
    command = builder_command(
        *paths, precision="fp16", execution_provider="cuda", extra_options={"use_paged_attention": "true"}
    )
    assert command == [
        sys.executable, "-m", BUILDER_MODULE, "-i", "hf", "-o", "out", "-p", "fp16", "-e", "cuda",
        "-c", "cache", "--extra_options", "use_paged_attention=true",
    ]  # fmt: skip
    assert "--extra_options" not in builder_command(*paths, precision="int4")


@pytest.mark.unit
def test_synthetic_cuda_build_is_fp16_paged_and_skips_its_check_without_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    builder = FakeBuilder()
    monkeypatch.setattr(synthetic_module, "run_builder", builder)
    monkeypatch.setattr(synthetic_module, "_save_config", lambda *args, **kwargs: None)
    monkeypatch.setattr(convert_module, "cuda_available", lambda: False)
    monkeypatch.setattr(synthetic_module, "check_generates", refuse_check)
    with caplog.at_level(logging.WARNING):
        build_synthetic_model(tmp_path / "phi3-cuda", PHI3_MINI, device="cuda")
    assert builder.calls == [
        {
            "precision": "fp16",
            "execution_provider": "cuda",
            "extra_options": {"use_paged_attention": "true"},
            "on_output": builder.calls[0]["on_output"],
            "runner": (RANDOM_WEIGHTS_MODULE, "--seed", "0"),
        }
    ]
    assert "skipped the check" in caplog.text


@pytest.mark.unit
def test_default_cuda_model_is_fp16_paged_in_its_own_folder_and_skips_its_check_without_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    builder = FakeBuilder()
    monkeypatch.setattr(default_module, "run_builder", builder)
    monkeypatch.setattr(default_module, "locate_default_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(default_module, "_load_gguf", lambda gguf: (object(), object()))
    monkeypatch.setattr(default_module, "_save_checkpoint", lambda *args, **kwargs: None)
    monkeypatch.setattr(convert_module, "cuda_available", lambda: False)
    monkeypatch.setattr(default_module, "check_generates", refuse_check)
    with caplog.at_level(logging.WARNING):
        path = ensure_default_model(tmp_path, device="cuda", progress=False)
    assert path == default_model_dir(tmp_path, "cuda") == tmp_path.absolute() / DEFAULT_CUDA_MODEL_NAME
    assert path != default_model_dir(tmp_path)
    assert [(c["precision"], c["execution_provider"], c["extra_options"]) for c in builder.calls] == [
        ("fp16", "cuda", {"use_paged_attention": "true"})
    ]
    assert "skipped the check" in caplog.text


@pytest.mark.unit
def test_default_model_is_built_for_cpu_or_cuda_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cpu or cuda, not 'rocm'"):
        default_model_dir(tmp_path, "rocm")


def save_tiny_config(folder: Path, model_type: str, architecture: str, dtype: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        model_type,
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        dtype=dtype,
    )
    config.architectures = [architecture]
    config.save_pretrained(folder)


@pytest.mark.unit
def test_random_weights_are_small_finite_fp16_values_in_the_configs_own_architecture(tmp_path: Path) -> None:
    import torch

    save_tiny_config(tmp_path, "qwen2", "Qwen2ForCausalLM", "float16")
    model = random_model(str(tmp_path), seed=0)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    parameters = {name: parameter.detach() for name, parameter in model.named_parameters()}
    for name, parameter in parameters.items():
        assert parameter.dtype == torch.float16, name
        if "norm" in name:
            assert bool((parameter == 1).all()), name
        else:
            values = parameter.float()
            assert bool(torch.isfinite(values).all()), name
            assert 0.015 < float(values.std()) < 0.025, name
            assert float(values.abs().max()) < 0.2, name
    q, k = (
        parameters["model.layers.0.self_attn.q_proj.weight"],
        parameters["model.layers.1.self_attn.q_proj.weight"],
    )
    assert not torch.equal(q, k)  # each tensor starts at its own offset into the random block
    again = {name: p.detach() for name, p in random_model(str(tmp_path), seed=0).named_parameters()}
    assert all(torch.equal(parameters[name], again[name]) for name in parameters)  # the seed decides


@pytest.mark.unit
def test_random_weights_keep_gemmas_zero_norms_which_it_reads_as_one(tmp_path: Path) -> None:
    save_tiny_config(tmp_path, "gemma2", "Gemma2ForCausalLM", "float32")
    model = random_model(str(tmp_path), seed=1)
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    assert norms
    assert all(bool((p == 0).all()) for p in norms)


@pytest.mark.unit
def test_a_weight_larger_than_the_random_block_reads_it_at_a_row_stride() -> None:
    import torch

    block = torch.arange(1000, dtype=torch.float32)
    view = block_view(block, (50, 4, 10), offset=7)  # 2,000 values from a block of 1,000
    assert view.shape == (50, 4, 10)
    assert torch.equal(view[0].flatten(), block[7:47])
    assert int(view[-1, -1, -1]) <= 999
    assert len({int(row[0, 0]) for row in view}) == 50  # every row starts somewhere else
    assert torch.equal(block_view(block, (3, 5), offset=985), block[985:1000].view(3, 5))  # fits: contiguous


@pytest.mark.parametrize("shape", [PHI3_MINI, LLAMA3_8B, QWEN25_7B], ids=lambda shape: shape.name)
@pytest.mark.unit
def test_the_builder_gets_a_config_of_the_shapes_own_architecture_and_no_weights(
    shape: Shape, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = byte_pair_tokenizer(512)  # the shape's vocabulary is in the config; its tokenizer is slow
    monkeypatch.setattr(synthetic_module, "byte_pair_tokenizer", lambda vocab_size: small)
    synthetic_module._save_config(tmp_path, shape, half=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [shape.architecture]
    assert config["model_type"] == shape.model_type
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (
        shape.hidden_size,
        shape.num_layers,
        shape.num_kv_heads,
    )
    assert (config["vocab_size"], config["dtype"]) == (shape.vocab_size, "float16")
    assert config["rope_parameters"]["rope_theta"] == shape.rope_theta
    assert {path.suffix for path in tmp_path.iterdir()} <= {".json", ".jinja"}  # no weights file
