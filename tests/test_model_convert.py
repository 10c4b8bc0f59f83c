"""`ortfleet model convert`: a team's own Hugging Face checkpoint folder or GGUF file, converted offline into
the model cache under a name that says what it is, converted again only when the source changes, refused in
one line when the builder cannot convert it, and served by a worker."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from common.model_folder import read_marker
from ortfleet.commands.model import register
from ortfleet.modelbuild import convert as convert_module
from ortfleet.modelbuild import own_model as own_model_module
from ortfleet.modelbuild.build_server import BuilderServer
from ortfleet.modelbuild.cache import list_models
from ortfleet.modelbuild.convert import BuilderFailed, ModelCheckFailed, check_generates
from ortfleet.modelbuild.own_model import convert_own_model, has_chat_template
from ortfleet.modelbuild.own_source import builder_architectures
from ortfleet.modelbuild.synthetic import byte_pair_tokenizer
from tests.conftest import Fleet
from tests.test_model_build import generate

EVENT_FAILED = 8
VOCAB_SIZE = 384
HEADS, KV_HEADS, LAYERS = 4, 2, 2


def write_checkpoint(folder: Path) -> Path:
    """A small random-weight Llama checkpoint as training writes one: config.json, safetensors, tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_pair_tokenizer(VOCAB_SIZE)
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(7)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a q or k projection's rows (its rotary halves interleaved), which transformers
    undoes when it reads a llama GGUF."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(checkpoint: Path, path: Path) -> Path:
    """``checkpoint`` as llama.cpp writes a llama GGUF: its settings and tokenizer as metadata, its
    weights in F32 under llama.cpp's tensor names."""
    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    settings = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab = tokenizer["model"]["vocab"] | {
        added["content"]: added["id"] for added in tokenizer["added_tokens"]
    }
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {added["content"] for added in tokenizer["added_tokens"]}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("own llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(config["hidden_size"] // HEADS)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([" ".join(merge) for merge in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(vocab[settings["bos_token"]])
    writer.add_eos_token_id(vocab[settings["eos_token"]])
    writer.add_pad_token_id(vocab[settings["pad_token"]])
    writer.add_unk_token_id(vocab[settings["unk_token"]])
    writer.add_chat_template((checkpoint / "chat_template.jinja").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for name, weights in sorted(load_file(checkpoint / "model.safetensors").items()):
        if name.endswith("q_proj.weight"):
            weights = llama_cpp_permute(weights, HEADS)
        elif name.endswith("k_proj.weight"):
            weights = llama_cpp_permute(weights, KV_HEADS)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, np.ascontiguousarray(weights, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf_header(path: Path, architecture: str, **numbers: int) -> Path:
    """A GGUF of ``architecture`` with no tensors: all that is read before its weights are."""
    writer = gguf.GGUFWriter(path, architecture)
    for key, value in numbers.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fake_checkpoint(folder: Path, architecture: str = "LlamaForCausalLM") -> Path:
    """The files a checkpoint folder is checked for, with no real contents."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "tokenizer.json").write_text("{}")
    return folder


class FakeBuilder:
    """Stands in for run_builder: records its arguments and writes a minimal model folder."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, hf_dir: Path, out_dir: Path, cache_dir: Path, **kwargs: Any) -> None:
        self.calls.append({"hf_dir": hf_dir, **kwargs})
        out_dir.mkdir(parents=True)
        (out_dir / "genai_config.json").write_text("{}")


def refuse_check(model_dir: Path, *, chat: bool) -> None:
    raise AssertionError("the generation check ran without CUDA")


@pytest.fixture
def fake_builder(monkeypatch: pytest.MonkeyPatch) -> FakeBuilder:
    builder = FakeBuilder()
    monkeypatch.setattr(own_model_module, "run_builder", builder)
    monkeypatch.setattr(own_model_module, "check_generates", lambda model_dir, chat: None)
    return builder


def run_cli(argv: list[str], cache_root: Path) -> int:
    parser = argparse.ArgumentParser(prog="ortfleet")
    register(parser.add_subparsers(dest="command", required=True), lambda: cache_root)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


def greedy_tokens(model_dir: Path, prompt: str, max_tokens: int = 8) -> list[int]:
    tokens, flags, _ = generate(model_dir, prompt, max_tokens=max_tokens)
    assert not flags & EVENT_FAILED
    return tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("sources") / "Own-Llama")


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="module")
def converted(checkpoint: Path, model_cache: Path, builder_server: BuilderServer) -> Path:
    return convert_own_model(checkpoint, model_cache, progress=False)


def test_a_checkpoint_folder_becomes_an_int4_cpu_model_named_after_it(
    converted: Path, model_cache: Path
) -> None:
    marker = read_marker(converted)

    assert converted == model_cache / "own-llama-int4-cpu"
    assert marker is not None
    assert marker["recipe"] == "own-model/1/int4/cpu"
    assert len(greedy_tokens(converted, "Hello world")) == 8
    assert "MatMulNBits" in (converted / "model.onnx").read_bytes().decode("latin-1")  # int4 weights


def test_a_second_convert_of_an_unchanged_checkpoint_returns_at_once(
    converted: Path, checkpoint: Path, model_cache: Path
) -> None:
    weights = (converted / "model.onnx.data").stat()
    marker = read_marker(converted)
    started = time.monotonic()

    again = convert_own_model(checkpoint, model_cache, progress=False)

    assert again == converted
    assert time.monotonic() - started < 1
    assert (converted / "model.onnx.data").stat().st_ino == weights.st_ino
    assert read_marker(converted) == marker


def test_a_gguf_converts_to_the_onnx_model_of_the_checkpoint_it_was_written_from(
    converted: Path, checkpoint: Path, model_cache: Path, tmp_path: Path, builder_server: BuilderServer
) -> None:
    source = write_gguf(checkpoint, tmp_path / "Own-Llama.F32.gguf")

    from_gguf = convert_own_model(source, model_cache, progress=False)

    assert from_gguf == model_cache / "own-llama.f32-int4-cpu"
    for name in ("model.onnx", "model.onnx.data", "genai_config.json"):
        assert (from_gguf / name).read_bytes() == (converted / name).read_bytes(), name
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert greedy_tokens(from_gguf, prompt) == greedy_tokens(converted, prompt)


def test_a_model_without_a_chat_template_is_checked_with_a_plain_prompt(
    converted: Path, tmp_path: Path
) -> None:
    plain = Path(shutil.copytree(converted, tmp_path / "plain"))
    (plain / "chat_template.jinja").unlink()

    assert has_chat_template(converted)
    assert not has_chat_template(plain)
    with pytest.raises(ModelCheckFailed, match="chat template"):
        check_generates(plain)
    check_generates(plain, chat=False)


def test_model_convert_command_prints_the_folder_last_and_model_list_shows_it(
    converted: Path, checkpoint: Path, model_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["model", "convert", str(checkpoint), "-q"], model_cache) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(converted)

    assert run_cli(["model", "list"], model_cache) == 0
    rows = {row.split()[0]: row.split() for row in capsys.readouterr().out.splitlines()[1:]}
    assert rows["own-llama-int4-cpu"][3:] == ["complete", str(converted)]


def test_a_converted_checkpoint_serves_completions_through_a_gateway(fleet: Fleet, converted: Path) -> None:
    fleet.start_worker("own-llama", model=converted)

    answer = httpx.post(
        f"{fleet.gateway_url}/v1/completions",
        json={"model": "own-llama", "prompt": "Hello world", "max_tokens": 5, "temperature": 0},
        timeout=60,
    )

    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "own-llama"
    assert answer.json()["usage"]["completion_tokens"] == 5


@pytest.mark.unit
def test_a_changed_source_is_converted_again(fake_builder: FakeBuilder, tmp_path: Path) -> None:
    source = fake_checkpoint(tmp_path / "mine")
    first = convert_own_model(source, tmp_path / "cache", progress=False)
    convert_own_model(source, tmp_path / "cache", progress=False)
    assert len(fake_builder.calls) == 1

    weights = source / "model.safetensors"
    weights.write_bytes(b"new weights")
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000_000))
    again = convert_own_model(source, tmp_path / "cache", progress=False)

    assert again == first
    assert len(fake_builder.calls) == 2


@pytest.mark.unit
def test_convert_for_cuda_is_fp16_with_paged_attention_and_skips_its_check_without_cuda(
    fake_builder: FakeBuilder,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = fake_checkpoint(tmp_path / "Mine")
    monkeypatch.setattr(convert_module, "cuda_available", lambda: False)
    monkeypatch.setattr(own_model_module, "check_generates", refuse_check)

    with caplog.at_level(logging.WARNING):
        path = convert_own_model(source, tmp_path / "cache", device="cuda", progress=False)

    assert path == tmp_path / "cache" / "mine-fp16-cuda-paged"
    assert [(c["precision"], c["execution_provider"], c["extra_options"]) for c in fake_builder.calls] == [
        ("fp16", "cuda", {"use_paged_attention": "true"})
    ]
    assert "skipped the check" in caplog.text


@pytest.mark.unit
def test_convert_takes_a_precision_and_a_name(fake_builder: FakeBuilder, tmp_path: Path) -> None:
    source = fake_checkpoint(tmp_path / "mine")

    path = convert_own_model(source, tmp_path / "cache", precision="fp32", name="team-model", progress=False)

    assert path == tmp_path / "cache" / "team-model"
    assert fake_builder.calls[0]["precision"] == "fp32"
    assert fake_builder.calls[0]["hf_dir"] == source


def missing_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()


def missing_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()


def missing_config(folder: Path) -> None:
    (folder / "config.json").unlink()


def unknown_architecture(folder: Path) -> None:
    (folder / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))


def no_architecture(folder: Path) -> None:
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (missing_tokenizer, "no tokenizer in the folder (tokenizer.json or tokenizer.model)"),
        (missing_weights, "no weights in the folder (*.safetensors or pytorch_model*.bin)"),
        (missing_config, "neither a Hugging Face checkpoint folder (with a config.json) nor a .gguf file"),
        (unknown_architecture, "its architecture MambaForCausalLM is not one that the model builder of"),
        (no_architecture, 'its config.json names no architecture ("architectures")'),
    ],
    ids=["no-tokenizer", "no-weights", "no-config", "unknown-architecture", "no-architecture"],
)
@pytest.mark.unit
def test_a_checkpoint_the_builder_cannot_convert_is_refused_in_one_line(
    damage: Any, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = fake_checkpoint(tmp_path / "mine")
    damage(source)

    assert run_cli(["model", "convert", str(source)], tmp_path / "cache") == 1

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"ortfleet model: error: cannot convert {source}: {reason}")
    assert captured.err.count("\n") == 1
    assert not (tmp_path / "cache").exists()


@pytest.mark.unit
def test_a_missing_source_and_a_precision_the_device_lacks_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["model", "convert", str(tmp_path / "nowhere")], tmp_path) == 1
    assert (
        capsys.readouterr().err
        == f"ortfleet model: error: cannot convert {tmp_path / 'nowhere'}: not found\n"
    )

    source = fake_checkpoint(tmp_path / "mine")
    assert run_cli(["model", "convert", str(source), "--precision", "fp16"], tmp_path) == 1
    assert capsys.readouterr().err == (
        "ortfleet model: error: the model builder makes int4, int8, fp32 models for cpu, not fp16\n"
    )


@pytest.mark.unit
def test_a_refusal_the_builder_states_becomes_one_line_naming_the_architecture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refusing_builder(*args: Any, **kwargs: Any) -> None:
        tail = "Traceback (most recent call last):\n  ...\n"
        tail += "NotImplementedError: The None model is not currently supported."
        raise BuilderFailed(1, tail)

    monkeypatch.setattr(own_model_module, "run_builder", refusing_builder)
    source = fake_checkpoint(tmp_path / "mine", "Phi3ForCausalLM")

    assert run_cli(["model", "convert", str(source), "-q"], tmp_path / "cache") == 1

    assert capsys.readouterr().err == (
        f"ortfleet model: error: cannot convert {source}: the model builder refused Phi3ForCausalLM at int4 "
        "for cpu: The None model is not currently supported.\n"
    )


@pytest.mark.unit
def test_the_architectures_are_those_the_installed_builder_dispatches_on() -> None:
    supported = builder_architectures()

    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM"} <= supported
    assert "MambaForCausalLM" not in supported


@pytest.mark.parametrize(
    ("write", "reason"),
    [
        (
            lambda path: path.write_bytes(b"not a GGUF at all"),
            "transformers cannot read it as a GGUF: ",
        ),
        (
            lambda path: write_gguf_header(path, "rwkv6"),
            "transformers cannot read it as a GGUF: GGUF model with architecture rwkv6 is not supported yet.",
        ),
        (
            lambda path: write_gguf_header(path, "falcon", block_count=2, embedding_length=64),
            "its architecture FalconForCausalLM is not one that the model builder of onnxruntime-genai",
        ),
    ],
    ids=["not-a-gguf", "unreadable-architecture", "unconvertible-architecture"],
)
def test_a_gguf_the_builder_cannot_convert_is_refused_in_one_line(
    write: Any, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "theirs.gguf"
    write(source)

    assert run_cli(["model", "convert", str(source), "-q"], tmp_path / "cache") == 1

    captured = capsys.readouterr()
    assert captured.err.startswith(f"ortfleet model: error: cannot convert {source}: {reason}")
    assert captured.err.count("\n") == 1
    assert list_models(tmp_path / "cache") == []
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
