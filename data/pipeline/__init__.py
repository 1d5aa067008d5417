"""The data pipeline: ``data.pipeline.build(config.data, seed=..., ...)`` -> DataPipeline.

Exported lazily: worker processes import the stage modules of this package and must not
pay for torch, which the Batch-producing modules need.
"""

from typing import Any

__all__ = ["build", "DataPipeline"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from data.pipeline import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'data.pipeline' has no attribute {name!r}")
