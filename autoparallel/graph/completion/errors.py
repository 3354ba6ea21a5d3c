"""Errors of whole-graph completion."""


class AnnotationConflictError(ValueError):
    """User annotations that no layout of some op satisfies together."""


class MissingRuleError(NotImplementedError):
    """An op inside the captured graph has no spmd rule."""
