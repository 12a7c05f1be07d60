"""Building a stage: a model's build on the meta device recorded (``init_record.py``) and replayed for a rank's own
layers only (``materialize.py``), and pretrained weights read tensor by tensor (``pretrained.py``,
``pretrained_check.py``). Of the runtime it may import only ``runtime/failures/``.
"""
