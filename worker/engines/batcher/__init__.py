"""ortfleet's continuous batcher: iteration-level scheduling on an onnxruntime session of the model
folder's decoder, for engines without dynamic batching (CPU, and any model without paged attention).

- `graph`: the decoder graph, run on rows of KV slots (decode) or one slot (a prefill chunk);
- `kv_slots`: the KV buffers and the worker's KV budget;
- `rows`: the rows, which slot each holds, and where their KV moves as rows join and leave;
- `prefix_cache`: prompts' KV left in free slots for later requests;
- `sampler`: a row's next token from its logits (penalties, min_tokens, guidance, sampling, logprobs),
  `json_keys` keeping a JSON object's keys apart;
- `engine`: the scheduling loop on its own thread, behind worker.engine.Engine (`counters`: what it ran).

Why an InferenceSession and a shared KV buffer: docs/architecture.md, "CPU batching".
"""
