from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ortfleet.modelbuild.cache import install_model
from ortfleet.modelbuild.convert import (
    StageProgress,
    check_generates,
    quiet_transformers,
    require_modules,
    run_builder,
)

logger = logging.getLogger(__name__)

TINY_RECIPE = "tiny-random-llama-fp32-cpu/1"
TINY_VOCAB_SIZE = 320
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How are you today? I am fine, thank you.",
    "What is the capital of France? The capital of France is Paris.",
    "Once upon a time there was a small model that answered every question.",
    "Tokens stream from the worker to the gateway, and the gateway relays them to the client.",
    "Please write a short poem about the sea, the sky and the wind.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "The weather is nice and the sun is shining on the green hills.",
    "user assistant system: you are a helpful assistant that answers in English.",
)
_REQUIRED_MODULES = ("torch", "transformers", "tokenizers", "onnx_ir", "onnxscript")


def build_tiny_model(out_dir: Path, *, seed: int = 0, force: bool = False, progress: bool = False) -> Path:
    """Build a tiny random-weight Llama ORT-GenAI model (fp32, CPU, about 500 KB) in ``out_dir``.

    It runs real ORT-GenAI inference in seconds and is what tests serve; its text is noise. An existing
    complete build with the same seed is returned at once unless ``force``; an incomplete or corrupt
    one is rebuilt. Returns the folder's absolute path.
    """

    def build(work: Path, staged: Path) -> None:
        require_modules(*_REQUIRED_MODULES)
        _build(work, staged, seed=seed, progress=StageProgress(3, enabled=progress))

    source = f"random weights, seed {seed}"
    return install_model(out_dir, build, source=source, recipe=TINY_RECIPE, force=force)


def _build(work: Path, staged: Path, *, seed: int, progress: StageProgress) -> None:
    logger.info("building a tiny random-weight Llama model (seed %d)", seed)
    hf_dir = work / "hf"
    with progress.stage("creating a tokenizer and random Llama weights"), quiet_transformers():
        _save_checkpoint(hf_dir, seed=seed)
    with progress.stage("building the fp32 ONNX model"):
        run_builder(hf_dir, staged, work / "builder-cache", precision="fp32", on_output=progress.note)
    with progress.stage("checking that onnxruntime-genai runs it"):
        check_generates(staged)


def _save_checkpoint(hf_dir: Path, *, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tokenizer()
    tokenizer.save_pretrained(hf_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(hf_dir)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer=trainer)
    return chatml_tokenizer(bpe)


def chatml_tokenizer(bpe: Any) -> Any:
    """A transformers tokenizer around a byte-level BPE, with ChatML's special tokens and template."""
    from transformers import PreTrainedTokenizerFast

    endoftext, im_start, im_end = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe,
        bos_token=im_start,
        eos_token=im_end,
        pad_token=endoftext,
        unk_token=endoftext,
        chat_template=CHATML_TEMPLATE,
    )
