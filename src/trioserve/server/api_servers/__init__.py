"""Several API-server processes on one port (``serve --api-server-count M``): their supervisor in the serving
process (``supervisor.py``) and the entry point of each (``__main__.py``)."""
