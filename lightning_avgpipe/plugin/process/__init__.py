"""The process plumbing every Lightning parallel strategy repeats: one process per device, its ranks and process
groups and its failures (``base.py``, the strategy's base class), and what the launcher adds to Lightning's
(``launcher.py``). Of ``plugin/`` it may import ``compat.py`` and ``split/hints.py``; of the runtime only
``runtime/failures/``.
"""
