"""The step: Lightning's step hooks mapped onto the stage pipeline (``hooks.py``), the user's hooks run on the last
stage (``bridge.py``), the loss and logs sent to every stage (``results.py``), the batches of N pipelines
(``data.py``), the gradients between ``training_step`` and ``backward`` (``gradients.py``), 16-mixed's one loss
scale (``precision.py``) and the first step's memory breakdown (``memory.py``). Of ``plugin/`` it may import
``compat.py``, ``contract.py`` and ``split/placeholders.py``; nothing of the checkpoint or the tuner.
"""
