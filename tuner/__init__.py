"""The strategy tuner (profiling, cost model, choice policy); built by a later issue."""
