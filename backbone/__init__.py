"""The backbone: model loading, f(c) capture, prompts. Everything model-specific lives here."""
from backbone.model import DEFAULT_BACKBONE, EMBEDDED, Backbone, load_backbone, resolve_name
from backbone.prompts import LIST_TEMPLATES, PAPER_TEMPLATES, TASKS, Prompt, postprocess

__all__ = ["Backbone", "load_backbone", "resolve_name", "DEFAULT_BACKBONE", "EMBEDDED", "Prompt", "postprocess",
           "PAPER_TEMPLATES", "LIST_TEMPLATES", "TASKS"]
