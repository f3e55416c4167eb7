"""Floor 7, the application: the Studio service the web app calls (backbone gate, memories, plug-ins, comparisons
and shares, evaluations)."""
import ground  # noqa: F401  (sets OMP_WAIT_POLICY before torch starts its thread pool)
