"""The ortfleet gateway: a stateless Starlette app in front of the Redis job queue."""
