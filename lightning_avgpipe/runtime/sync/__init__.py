"""What keeps the copies of a weight one: a stage's N replicas averaged to their reference (``stage_replicas.py``), the
gradients of weights tied across stages summed (``ties.py``), clipping by the norm over every stage
(``clipping.py``) and the gradient norms of the noise scale (``gradient_probe.py``). Of the runtime it may import
``comms/`` and ``sharding/``; nothing of the step that calls it.
"""
