"""What every process of the tree is built on: a child process as a supervised task (``process.py``), the main
of every child with its parent watch (``child_main.py``), the one entry point of child processes (``entry.py``) and
one-shot programs run in a child (``oneshot.py``)."""
