"""The pieces of ``ap.Strategy`` (``autoparallel/strategy.py``): checked fields, the sub-config sections,
cross-field validation, command-line flags. Pure Python: nothing here imports paddle."""
