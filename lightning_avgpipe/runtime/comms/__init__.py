"""Ranks and what crosses between them: which stage, pipeline group and shard a rank holds and its process groups
(``topology.py``), point-to-point transfers between neighbouring stages (``p2p.py``) and the collectives over one
pipeline (``collectives.py``). Of the runtime it may import ``failures/`` and ``sharding/tensor_parallel.py`` (the
link of a tensor-parallel stage).
"""
