"""The paper's algorithms, plain PyTorch without Lightning: elastic averaging (``elastic.py``), the optimizer
Lightning steps, one clone per replica and then the pull (``optim.py``), a stage's replicas run as one vmapped call
(``replicas.py``), the online search for the advance-forward count k (``advance_k.py``), the gradient noise scale
(``noise_scale.py``) and batches split into micro-batches (``microbatch.py``; these last two a layer below the rest,
``tests/helpers/layers.py``). Of the package it imports only ``checks.py``, ``shards.py`` and ``schedules/``;
``config.py``, the runtime, the tuner and the plugin import it, never the reverse.
"""
