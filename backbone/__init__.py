"""The backbone: model loading, f(c) capture, prompts. Everything model-specific lives here."""
import os

# Idle OpenMP threads spin-wait by default; on a small shared CPU that starves the other work (measured: small
# matmuls ~50x slower on 2 busy cores). Must be set before torch starts its thread pool; users can override it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from backbone.model import DEFAULT_BACKBONE, EMBEDDED, PRECISIONS, Backbone, load_backbone, resolve_name, set_precision
from backbone.prompts import LIST_TEMPLATES, PAPER_TEMPLATES, TASKS, Prompt, postprocess

__all__ = ["Backbone", "load_backbone", "resolve_name", "DEFAULT_BACKBONE", "EMBEDDED", "PRECISIONS", "set_precision",
           "Prompt", "postprocess", "PAPER_TEMPLATES", "LIST_TEMPLATES", "TASKS"]
