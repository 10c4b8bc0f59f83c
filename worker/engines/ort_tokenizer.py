"""The model's tokenizer, through ORT-GenAI (a token's own bytes through llguidance)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime_genai as og

if TYPE_CHECKING:
    from llguidance import LLTokenizer


class OrtTokenizer:
    def __init__(self, source: og.Model | og.Config, vocab: int | None, model_dir: Path) -> None:
        self._tokenizer = og.Tokenizer(source)
        self._vocab_size = vocab
        self._model_dir = model_dir
        self._byte_tokenizer: LLTokenizer | None = None

    def token_bytes(self, token: int) -> bytes:
        """The token's own bytes (a byte-level token can hold part of a character), read from the model
        folder's tokenizer.json by llguidance the first time it is asked."""
        if self._byte_tokenizer is None:
            from llguidance import LLTokenizer

            self._byte_tokenizer = LLTokenizer(str(self._model_dir / "tokenizer.json"))
        return self._byte_tokenizer.decode_bytes([token])

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text)]

    def apply_chat_template(self, messages_json: str) -> str:
        return str(self._tokenizer.apply_chat_template(messages_json, add_generation_prompt=True))

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(np.asarray(token_ids, dtype=np.int32)))

    def stream_decoder(self) -> og.TokenizerStream:
        return self._tokenizer.create_stream()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(int(t) for t in self._tokenizer.eos_token_ids)
