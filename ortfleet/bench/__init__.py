"""`ortfleet bench`: benchmarks of the fleet against its engine, the gateway alone, and a simulated fleet."""
