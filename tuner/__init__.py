"""The strategy tuner: profiling on the job's workers, the cost model and the choice policy.

So far (issue 5, partial): ``tuner.cost`` (the pure cost model and ``choose``),
``tuner.measure`` (hardware fits), ``tuner.memory`` (measured tensor memory) and
``tuner.profile`` (``profile_job``), which ``kfac: auto`` uses in the train loop. The tuner
actor with its profile cache, trial verification and ``kaisa-ray tune`` are still to come.
"""
