"""blockattn: masked attention over packed variable-length sequences, split across GPUs by a per-batch plan."""

from blockattn.masks import MaskSpec

__all__ = ["MaskSpec"]
__version__ = "0.1.0"
