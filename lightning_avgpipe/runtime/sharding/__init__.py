"""A stage's tensors and optimizer state split over ranks: tensor parallelism (``tensor_parallel.py``,
``head_parallel.py``, ``sequence_parallel.py``; 2D and 2.5D on a grid: ``grid.py``, ``grid_stage.py``), optimizer
state sharded over the pipeline groups (``zero.py``) and the sharded elastic reference (``sharded_reference.py``). Of
the runtime it may import ``comms/p2p.py``, ``build/materialize.py`` and ``deferred.py`` (a sharded layer's deferred
weight gradients).
"""
