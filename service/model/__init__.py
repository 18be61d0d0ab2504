"""What every room of the service shares about a job: its states and the one function that
moves it (``lifecycle``), the snapshots the store hands out (``job_data``), and the checks a
progress record passes before it is stored (``cleaning``)."""
