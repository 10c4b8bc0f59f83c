"""The ortfleet worker: one ORT-GenAI model on one device, pulling jobs from Redis."""
