"""Running a fleet's processes on one machine: redis-server, workers and gateways, for `ortfleet up`, the
benchmarks, the drills and the tests."""
