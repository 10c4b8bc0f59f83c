"""The `ortfleet` command and the operator tools it drives: a local fleet, benchmarks, fault drills and
model builds. It sits above the gateway and the worker, which never import it."""
