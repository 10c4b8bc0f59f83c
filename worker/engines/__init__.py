"""The engines an engine core runs, and what loading one takes: ortfleet's batcher (`batcher/`), og.Engine
(`ort_engine.py` with `ort_solo.py` and `row_sizing.py`), the fake engine, the engine thread they share,
the model folder's config, the device, and the sampler graph for the card (`device_sampling/`). Nothing
here writes to Redis or knows of jobs: that is the worker's, the frontend's, around it."""
