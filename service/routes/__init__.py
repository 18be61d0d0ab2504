"""The HTTP API's routes, one router per group (jobs, plans, health, the dashboard's pages), with
the request and response models they answer with (``schemas``) and the error answers they share
(``responses``)."""
