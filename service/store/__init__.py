"""Where the service keeps jobs: the repository (``repository.JobStore``), its rows and its
database (``rows``, ``database``; Alembic's migrations are ``service/migrations``)."""
