"""The one adapter for Dask's private graph spec (`dask._task_spec`): Task, TaskRef, DataNode."""
from __future__ import annotations

from dask._task_spec import DataNode, Task, TaskRef  # dask >= 2024.12; private, used only here


__all__ = ["Task", "TaskRef", "DataNode"]
