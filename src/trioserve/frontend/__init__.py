"""The front-end: the engine actors that start, supervise, route to and hear from engine cores (``engines/``), the
text a request goes in and comes out as (``text/``), and each request's state and stream (``requests/``)."""
