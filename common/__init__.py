"""What the ortfleet gateway and workers share: settings, wire formats, Redis keys, the job record and
its state machine in Redis, the worker registry, API keys and fleet figures."""
