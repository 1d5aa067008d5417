"""Read torch.distributed.checkpoint (DCP) directories without executing their contents.

DCP writes its ``.metadata`` file with :mod:`pickle`, and its stock reader loads it with
``pickle.load``, which runs whatever callable the file names. The manifest's sha256 entries
only prove that a checkpoint is *intact*, not that it came from a trusted writer: anyone who
can write into a run dir can recompute them. :class:`SafeFileSystemReader` therefore reads
``.metadata`` with an unpickler that resolves only the classes DCP itself writes there (its
metadata dataclasses, torch dtypes/layouts/sizes, a path), in the spirit of
``torch.load(weights_only=True)``. Anything else is a :class:`CheckpointError` naming the file,
raised before any object from it is built.

Non-tensor values in the state dict (optimizer hyperparameters and the like) are stored by
DCP as ``torch.save`` blobs that its default planner loads with ``weights_only=False``; the
reader parses every such blob with ``weights_only=True`` first and refuses it on failure, so
the planner only ever sees a blob that the restricted loader accepted. Tensors are already
read by DCP with ``weights_only=True``.

The allowlist was taken from the globals found in real checkpoints of a model and an AdamW
optimizer saved under no parallelism, DDP and FSDP2 (CPU, gloo); see
``tests/training/test_checkpoint_code_execution.py``.
"""

from __future__ import annotations

import inspect
import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from core.exceptions import CheckpointError

METADATA_FILE = ".metadata"

_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)
_ALLOWED: dict[str, frozenset[str]] = {
    # DCP's metadata dataclasses and enums, whatever this torch version defines.
    dcp_metadata.__name__: frozenset(
        name
        for name, obj in vars(dcp_metadata).items()
        if inspect.isclass(obj) and obj.__module__ == dcp_metadata.__name__
    ),
    dcp_filesystem.__name__: frozenset({"_StorageInfo"}),
    "torch": frozenset(
        {"Size"} | {name for name, obj in vars(torch).items() if isinstance(obj, _TORCH_VALUE_TYPES)}
    ),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals in ``_ALLOWED``; the file it reads is named in the error."""

    def __init__(self, handle: io.BufferedReader, path: Path) -> None:
        super().__init__(handle)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(
            f"DCP metadata refers to {module}.{name}, which is not a checkpoint metadata type; "
            "refusing to load it (nothing from the file was executed)",
            path=str(self._path),
            hint="this file was not written by torch.distributed.checkpoint; do not resume from it unless you trust its origin",
        )


def load_metadata(path: Path) -> Metadata:
    """Unpickle a DCP ``.metadata`` file through the allowlist."""
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle, path).load()
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot read DCP metadata: {exc}", path=str(path)) from exc
    except Exception as exc:  # malformed pickle: any of several unpickling errors
        raise CheckpointError(f"DCP metadata is not readable: {type(exc).__name__}: {exc}", path=str(path)) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"DCP metadata holds a {type(metadata).__name__}, not a torch.distributed.checkpoint Metadata",
            path=str(path),
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A local DCP reader whose metadata and byte values are loaded without code execution."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = load_metadata(Path(self.path) / name)
        if hasattr(dcp_metadata, "StorageMeta"):  # as the stock reader does
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp_metadata.StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _WeightsOnlyBytes(planner, self))


class _WeightsOnlyBytes:
    """Wraps a load planner: every byte value must load with ``weights_only=True`` first."""

    def __init__(self, planner: Any, reader: SafeFileSystemReader) -> None:
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as exc:
            relative = self._reader.storage_data[read_item.storage_index].relative_path
            raise CheckpointError(
                f"non-tensor value {read_item.dest_index.fqn!r} is not weights-only loadable "
                f"({type(exc).__name__}); refusing to load it",
                path=str(Path(self._reader.path) / relative),
                hint="this file was not written by Lockstep; do not resume from it unless you trust its origin",
            ) from exc
        value.seek(0)
        self._planner.load_bytes(read_item, value)
