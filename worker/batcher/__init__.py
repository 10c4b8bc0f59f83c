"""ortfleet's continuous batcher: iteration-level scheduling on an onnxruntime session of the model
folder's decoder, for engines without dynamic batching (CPU, and any model without paged attention).

- `graph`: the decoder graph, run on rows of KV slots (decode) or one slot (a prefill chunk);
- `kv_slots`: the KV buffers, which rows hold which slot, and the worker's KV budget;
- `sampler`: a row's next token from its logits (penalties, min_tokens, guidance, sampling, logprobs);
- `engine`: the scheduling loop on its own thread, behind worker.engine.Engine.

Why an InferenceSession and a shared KV buffer: docs/architecture.md, "CPU batching".
"""
