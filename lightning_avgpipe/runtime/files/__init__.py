"""Checkpoint files on disk: a file ``torch.load`` reads, written one tensor at a time (``torchfile.py``), the checksums
that tell a damaged file (``checksums.py``), every wait of a save bounded (``save_waits.py``) and a full disk said as
such (``disk_full.py``). Of the runtime it may import only ``runtime/failures/``.
"""
