"""elasticpp: a fault-tolerant, elastic pipeline/tensor/data-parallel training daemon."""

__version__ = "0.1.0"
