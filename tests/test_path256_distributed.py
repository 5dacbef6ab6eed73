"""The Path demo under torchrun on CPU (gloo, two processes): the sampler's split of the global batch, training
that matches one process with the same global batch, and checkpoints that resume on another number of processes.
"""

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing
from test_path256_demo import error_of, fake_data, fake_load_or_generate, run_flags  # noqa: F401 (a fixture)

import path256  # noqa: E402 (on the path test_path256_demo sets)
import path_train  # noqa: E402
from path_train import BatchSampler, Dist  # noqa: E402


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_the_global_batch_of_one_process(world):
    """Step by step (across epochs too), the ranks' batches are the one-process batch of the same global size,
    cut in rank order."""
    n, batch = 40, 4
    one = BatchSampler(n, batch * world, seed=3, dist=Dist(), device=torch.device("cpu"))
    ranks = [BatchSampler(n, batch, seed=3, dist=Dist(rank, world), device=torch.device("cpu")) for rank in range(world)]
    for step in range(2 * (n // (batch * world)) + 1):
        assert torch.equal(torch.cat([sampler(step) for sampler in ranks]), one(step))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, argv: list[str]) -> None:
    """One torchrun-like process: the environment torchrun sets, the test's fake images, the demo's main."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU, also on a machine with GPUs
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    path_train.pathfinder.load_or_generate = fake_load_or_generate
    torch.set_num_threads(1)
    status = path256.main(argv)
    if status:
        raise RuntimeError(f"rank {rank} of {world}: path256.main returned {status}")


def run_processes(world: int, argv: list[str]) -> None:
    torch.multiprocessing.start_processes(_rank_main, args=(world, _free_port(), argv), nprocs=world,
                                          start_method="spawn")


def weights(tmp_path, out: str) -> dict:
    return torch.load(tmp_path / out / "path32_sparse_ckpt.pt", weights_only=True)


@pytest.mark.slow
def test_two_processes_train_like_one_and_resume_on_either(tmp_path, fake_data):
    """Two ranks of batch 4 take the steps of one process of batch 8, flips and masked pixels included (gradients
    averaged by DDP: equal up to float rounding); a checkpoint of two ranks resumes on one process and one of one process on two ranks, and
    both end where the one-process run ends."""
    flags = ["--n-train", "16", "--steps", "4", "--augment", "--pretrain-steps", "1"]
    assert path256.main(run_flags(tmp_path, *flags, "--batch-size", "8", out="one")) == 0

    run_processes(2, run_flags(tmp_path, *flags, "--batch-size", "4", "--stop-after", "2", out="two_then_one"))
    metrics = json.loads((tmp_path / "two_then_one" / "path32_sparse.json").read_text())
    assert metrics["world"] == 2 and metrics["pieces"][-1]["ended_step"] == 2
    assert weights(tmp_path, "two_then_one")["world"] == 2
    assert path256.main(run_flags(tmp_path, *flags, "--batch-size", "8", "--resume", out="two_then_one")) == 0

    assert path256.main(run_flags(tmp_path, *flags, "--batch-size", "8", "--stop-after", "2", out="one_then_two")) == 0
    run_processes(2, run_flags(tmp_path, *flags, "--batch-size", "4", "--resume", out="one_then_two"))

    one = weights(tmp_path, "one")
    for out in ("two_then_one", "one_then_two"):
        other = weights(tmp_path, out)
        assert other["state"]["step"] == one["state"]["step"] == 5  # 1 pretraining step, then 4
        assert other["state"]["samples"] == one["state"]["samples"] == 40
        for key, value in one["model"].items():
            torch.testing.assert_close(other["model"][key], value, rtol=1e-4, atol=1e-5, msg=f"{out}: {key}")


def test_resume_keeps_the_global_batch(tmp_path, fake_data, capsys):
    """On one process, a checkpoint of batch 4 does not resume at batch 8 (the global batch would change); the
    error names both global batches."""
    assert path256.main(run_flags(tmp_path, "--stop-after", "1")) == 0
    message = error_of(capsys, run_flags(tmp_path, "--batch-size", "8", "--resume"))
    assert "global batch 4 (4 x 1 processes) vs 8 (8 x 1)" in message
