"""The split at setup: a whole LightningModule cut into this rank's stages (``cut.py``, ``stages.py``), what stands in
for the layers another rank runs (``placeholders.py``), modules the model reaches by a second path
(``second_paths.py``), tensor parallelism applied to the stage (``tensor.py``), what the setup says when a model
cannot be kept to its stages (``hints.py``) and the whole model back after a run (``whole.py``). Of ``plugin/`` it
may import ``compat.py``, ``contract.py``, ``checkpoint/resume.py`` and ``steps/data.py``.
"""
