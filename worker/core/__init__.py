"""The engine core: a worker's engine in a process of its own (`python -m worker.core`), the worker as its
frontend. The process (`server.py`, `__main__.py`), the crossing between them (`facts.py`, `commands.py`,
`step_wire.py`, `updates.py`, `channel.py`) and the frontend's client (`client.py`)."""
