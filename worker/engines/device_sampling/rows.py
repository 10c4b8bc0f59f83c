"""The rows of a run's logits that the host reads (a grammar's, a row the sampler graph leaves to
RowSampler, a prompt chunk's for its log-probabilities), taken where the model left them: one small
onnxruntime graph, Gather on axis 0 and a Cast to float32, on the sampler graph's provider, so only those
rows leave the card."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from worker.engines.device_sampling.graph import ELEMENTS, OPSET, TensorProto


class RowGather:
    """Rows of logits [tokens, vocab] (float16 or float32, an OrtValue on the session's device) to the host
    as float32; a session for each element type, made at its first use."""

    def __init__(self, providers: Sequence[Any], options: ort.SessionOptions | None = None) -> None:
        self._providers = list(providers)
        self._options = options
        self._sessions: dict[int, ort.InferenceSession] = {}

    def take(self, logits: ort.OrtValue, index: np.ndarray) -> np.ndarray:
        """The rows written straight into a host array (copied once, from the card on a card)."""
        session = self._session(ELEMENTS[logits.data_type()])
        rows = np.empty((len(index), logits.shape()[1]), np.float32)
        binding = session.io_binding()
        binding.bind_ortvalue_input("logits", logits)
        binding.bind_cpu_input("index", np.asarray(index, np.int64))
        binding.bind_ortvalue_output("rows", ort.OrtValue.ortvalue_from_numpy(rows))
        session.run_with_iobinding(binding)
        return rows

    def _session(self, element: int) -> ort.InferenceSession:
        session = self._sessions.get(element)
        if session is None:
            model = _gather_model(element).SerializeToString()
            session = ort.InferenceSession(model, self._options, providers=self._providers)
            self._sessions[element] = session
        return session


def _gather_model(element: int) -> Any:
    import onnx
    from onnx import helper

    if element == TensorProto.FLOAT:
        nodes = [helper.make_node("Gather", ["logits", "index"], ["rows"], axis=0)]
    else:
        nodes = [helper.make_node("Gather", ["logits", "index"], ["picked"], axis=0)]
        nodes.append(helper.make_node("Cast", ["picked"], ["rows"], to=TensorProto.FLOAT))
    graph = helper.make_graph(
        nodes,
        "host_rows",
        [
            helper.make_tensor_value_info("logits", element, ["tokens", "vocab"]),
            helper.make_tensor_value_info("index", TensorProto.INT64, ["rows"]),
        ],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["rows", "vocab"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
