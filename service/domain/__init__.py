"""What the service does with jobs, whatever the front door: the jobs behind one object
(``jobs``), the follower that moves them by what Ray says (``follower``, ``interpretation``),
admission and caps (``admission``, ``limits``, ``sandbox``), sweeps, restarts, logs, live
updates and the read cache."""
