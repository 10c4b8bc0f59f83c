"""The engine core's side of a worker split into one engine-core process per device and frontend
processes: the wire format of a step's output and of the frontends' commands, and the channel they cross.
Not yet wired into the worker."""
