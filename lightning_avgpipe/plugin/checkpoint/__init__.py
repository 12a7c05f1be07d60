"""Checkpoints of a split model: what a checkpoint holds and how a stage's part is cut from it (``state.py``,
``optimizer_by_name.py``), the two transports (one streamed file, ``streamed.py``; a folder every rank writes its part
of, ``sharded.py``, read by ``dcp_reader.py`` without running code), what a ``fit`` will restore (``resume.py``) and
the strategy's checkpoint hooks over them (``hooks.py``). Of ``plugin/`` it may import ``compat.py``, ``split/``
and ``process/base.py``; of the runtime, anything (``runtime/files/`` writes the bytes).
"""
