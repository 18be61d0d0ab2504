"""The strategy tuner: profiling, the cost model and choice policy (``tuner.cost``), the actor.

So far: ``tuner.cost`` (issue 5, partial), the pure cost model and ``choose``. Profiling on
the workers, the tuner actor, trial verification and ``kfac: auto`` are still to come.
"""
