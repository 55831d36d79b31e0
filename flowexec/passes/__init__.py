"""Analysis passes: pure functions from a Program (or earlier results) to side tables."""
from .dependencies import alias_groups, dependencies, read_write_sets
from .liveness import Liveness, analyse_liveness

__all__ = ["alias_groups", "read_write_sets", "dependencies", "Liveness", "analyse_liveness"]
