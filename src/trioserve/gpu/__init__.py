"""The model runner: torch and transformers. Imported only inside worker
processes (and by tools that build models), never by the front-end.

Inductor caches what it compiles (the compiled model of ``--compile``, the
CPU decode attention kernel) under trioserve's cache, unless
``TORCHINDUCTOR_CACHE_DIR`` says otherwise. This is set here, before any
module of this package imports transformers: importing transformers imports
``torch._inductor``, which then fixes its default (``/tmp/torchinductor_$USER``)
in that same variable.
"""

import os

from trioserve.config import cache_dir

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
