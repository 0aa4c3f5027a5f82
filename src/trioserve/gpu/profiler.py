"""A worker's ``torch.profiler`` recording, between ``start_profile`` and
``stop_profile`` (``StartProfile`` and ``StopProfile`` from the front-end,
``ProfileShard`` to each worker).

It records the operators the model runs (``aten::mm``, ``aten::linear``,
our own kernels' custom ops), on the CPU and, on CUDA, the device's kernels
too, from the worker thread that runs the steps (the calls and the steps
share it). ``stop_profile`` writes torch's Chrome trace, which Perfetto
loads. A recording costs each step the profiler's overhead; nothing is
recorded outside one.
"""

from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile


class TorchProfiling:
    """``start_profile`` and ``stop_profile`` for a runner with a ``device``."""

    device: torch.device
    _torch_profile: profile | None = None

    def start_profile(self) -> None:
        """Record from now on (``RuntimeError`` if a recording runs)."""
        if self._torch_profile is not None:
            raise RuntimeError("a profile is already being recorded")
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        recording = profile(activities=activities, record_shapes=True)
        recording.start()
        self._torch_profile = recording

    def stop_profile(self, path: str) -> None:
        """Stop, and write the Chrome trace to ``path`` (whole, or not at all; ``""``: drop it)."""
        recording, self._torch_profile = self._torch_profile, None
        if recording is None:
            raise RuntimeError("no profile is being recorded")
        recording.stop()
        if not path:
            return
        partial = f"{path}.partial"
        recording.export_chrome_trace(partial)
        os.replace(partial, path)
