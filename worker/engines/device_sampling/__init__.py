"""Sampling on the device: every row of a step picked at once by one ONNX graph.

- `graph`: the sampler graph (penalties, logit_bias, min_tokens, greedy, temperature, top_k, top_p,
  log-probabilities), and the rows it leaves to the host path
- `runner`: `SamplerGraph`, each row's parameters packed from its `RowSampler` and the graph run, on the
  logits where the model left them
- `rows`: the rows of a run's logits the host reads, gathered where they lie and brought back alone
"""
