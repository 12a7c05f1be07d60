"""Failure handling: the job's first failure shared through the rendezvous store (``report.py``), the watchdog that
ends a stuck rank (``watchdog.py``), the process groups torn down at exit (``shutdown.py``) and a mistake said in a
few lines (``console.py``). It imports nothing of the rest of the runtime: the step, the links and the builds all
report through it, so it must work when they do not.
"""
