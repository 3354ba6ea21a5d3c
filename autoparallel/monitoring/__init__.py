"""The pieces of ``ap.PerformanceMonitor`` (``autoparallel/monitor.py``): step accounting, the world it
gathers over, suggestions from what was measured, the report."""
