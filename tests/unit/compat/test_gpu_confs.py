"""How the drop-ins (TorchDistributor, MirroredStrategyRunner) read the GPU confs they share."""

from __future__ import annotations

import pytest

from sparkdl._internal.compat.gpus import TASK_GPU_CONF, GpuConfigError, tasks_of, whole_gpus


def test_processes_that_do_not_fill_whole_tasks_are_refused_naming_the_two_nearest_counts() -> None:
    assert tasks_of("MirroredStrategyRunner", "num_slots", 8, 2) == 4
    with pytest.raises(GpuConfigError, match=r"MirroredStrategyRunner\(num_slots=5\) with spark\.task\.resource\.gpu"
                                             r"\.amount=2: num_slots must be a multiple .* use num_slots=4 or 6"):
        tasks_of("MirroredStrategyRunner", "num_slots", 5, 2)
    with pytest.raises(GpuConfigError, match=r"use num_processes=4$"):
        tasks_of("TorchDistributor", "num_processes", 3, 4)


def test_without_a_session_the_gpu_conf_is_unset_and_the_error_says_why_and_how() -> None:
    with pytest.raises(GpuConfigError, match=r"^Runner gives GPUs, but 'spark\.task\.resource\.gpu\.amount' is unset "
                                             r"\(there is no active SparkSession\); set .*or pass use_gpu=False"):
        whole_gpus(None, TASK_GPU_CONF, "Runner gives GPUs")
    assert issubclass(GpuConfigError, RuntimeError) and issubclass(GpuConfigError, ValueError)
