"""Version of lightning_avgpipe."""

__version__ = "0.1.0"
