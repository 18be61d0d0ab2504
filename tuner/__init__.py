"""The strategy tuner: profiling on the job's workers, the cost model and the choice policy.

So far (issue 5, partial): ``tuner.cost`` (the pure cost model and ``choose``),
``tuner.measure`` (hardware fits), ``tuner.memory`` (measured tensor memory) and
``tuner.profile`` (``profile_job``). The tuner actor, trial verification and ``kfac: auto``
are still to come.
"""
