"""The strategy tuner: profiling on the job's workers, the cost model and the choice policy.

``tuner.cost`` (the pure cost model), ``tuner.choice`` (``choose`` under a budget),
``tuner.measure`` (hardware fits), ``tuner.memory`` (measured tensor memory), ``tuner.profile``
(``profile_job`` and ``measure_candidate``, collective on the job's ranks) and ``tuner.actor``
(the tuner actor with its profile cache). ``kfac: auto`` uses them in the train loop;
``tune_job`` in ``kaisa_train.job`` adds verification trials on Ray Tune.
"""
