"""The backbone: model loading, f(c) capture, prompts. Everything model-specific lives here."""
import ground  # noqa: F401  (first: it sets OpenMP's wait policy before torch loads)
from backbone.model import DEFAULT_BACKBONE, EMBEDDED, PRECISIONS, Backbone, load_backbone, resolve_name, set_precision
from backbone.prompts import LIST_TEMPLATES, PAPER_TEMPLATES, TASKS, Prompt, postprocess

__all__ = ["Backbone", "load_backbone", "resolve_name", "DEFAULT_BACKBONE", "EMBEDDED", "PRECISIONS", "set_precision",
           "Prompt", "postprocess", "PAPER_TEMPLATES", "LIST_TEMPLATES", "TASKS"]
