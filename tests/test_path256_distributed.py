"""The Path demo under torchrun on CPU (gloo, two processes): the sampler's split of the global batch, training
that matches one process with the same global batch, and checkpoints that resume on another number of processes.
"""

import json
import os
import re
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
@pytest.mark.xdist_group("local_ports")  # never beside the other test that opens local ports (`--dist loadgroup`)
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


def _failed_piece(stderr: str) -> str:
    """What a failed piece of `path_scaling.py` left on stderr, for the failure's message: the ranks' own error
    lines (an abort's reason, an exception), which come before torchrun's traceback and would fall outside its
    tail, then the tail."""
    pattern = re.compile(r"terminate called|what\(\)|Error|Exception|Abort")
    causes = [line for line in stderr.splitlines() if pattern.search(line) and not line.lstrip().startswith("File ")]
    return "\n".join(["ranks' error lines:", *causes[:30], "stderr's end:", stderr[-2000:]])


@pytest.mark.slow
@pytest.mark.xdist_group("local_ports")  # torchrun's ports: never beside the test above
def test_scaling_driver_runs_one_many_and_switching_alike(tmp_path, capsys):
    """`path_scaling.py` on CPU (gloo, 2 processes, real 32-px images pooled to 8 px, flips on): the run on two
    processes and the run switching 1 -> 2 -> 1 processes end at the one-process weights (up to float rounding),
    with the same held-out answers; the summary and its results record render in the README table."""
    import path_scaling
    import results_table

    out = tmp_path / "runs"
    flags = ["--preset", "path32", "--pool", "4", "--mask", "butterfly", "--block-size", "16", "--layers", "1",
             "--width", "16", "--heads", "2", "--n-train", "32", "--n-eval", "16", "--eval-every", "100",
             "--device", "cpu", "--workers", "1", "--backend", "torch", "--cache-dir", str(tmp_path / "cache"),
             "--augment"]
    status = path_scaling.main(["--gpus", "2", "--steps", "6", "--batch-size", "8", "--out", str(out), "--", *flags])
    assert status == 0, _failed_piece(capsys.readouterr().err)
    result = json.loads((out / "scaling.json").read_text())
    runs = result["runs"]
    assert [runs[k]["processes"] for k in ("one", "many", "switch")] == ["1", "2", "1 -> 2 -> 1"]
    assert all(r["steps"] == 6 and r["samples_per_s"] > 0 for r in runs.values())
    assert runs["many"]["weights_vs_one"] < 1e-5 and runs["switch"]["weights_vs_one"] < 1e-5
    assert len({r["held_out_correct"] for r in runs.values()}) == 1 and result["accuracy_within_noise"]
    assert result["efficiency"] == pytest.approx(runs["many"]["samples_per_s"] / (2 * runs["one"]["samples_per_s"]))
    table = results_table.render([path_scaling.record(result, "tiny", "cmd")])
    assert "| tiny, batch 8, 6 steps | 2 |" in table


def test_scaling_driver_refuses_bad_flags(tmp_path, capsys, monkeypatch):
    import path_scaling

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the flags' own errors, also on a GPU machine

    for argv, words in ((["--gpus", "1"], "--gpus must be at least 2"),
                        (["--batch-size", "9"], "must be divisible by --gpus"),
                        (["--batch-size", "0"], "must be at least --gpus"),
                        (["--steps", "2"], "--steps must be at least 3"),
                        (["--runs", "many"], "must include one")):
        base = {"--gpus": "2", "--steps": "6", "--batch-size": "8", "--runs": "one,many,switch"}
        base.update(dict(zip(argv[::2], argv[1::2])))
        flat = [x for kv in base.items() for x in kv] + ["--out", str(tmp_path)]
        with pytest.raises(SystemExit) as stop:
            path_scaling.main(flat)
        assert stop.value.code == 2 and words in capsys.readouterr().err


def test_scaling_driver_refuses_more_gpus_than_there_are(tmp_path, capsys, monkeypatch):
    import path_scaling

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = ["--gpus", "2", "--steps", "6", "--batch-size", "8", "--out", str(tmp_path), "--", "--preset", "path32"]
    with pytest.raises(SystemExit) as stop:
        path_scaling.main(argv)
    assert stop.value.code == 2 and "--gpus (2) is more than the GPUs here (1)" in capsys.readouterr().err


@pytest.mark.parametrize("requested", ["cpu", "cpu:0"])
def test_processes_asked_for_the_cpu_stay_there_on_a_machine_with_gpus(monkeypatch, requested):
    """`--device cpu` under torchrun: gloo on the CPU even where GPUs exist (one GPU and two ranks would
    otherwise ask for a second GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert path256.on_cpu(requested) and not path256.on_cpu(None) and not path256.on_cpu("cuda")
    assert path256.pick_device(requested, Dist(1, 2, 1)) == torch.device("cpu")
    assert path256.pick_device(None, Dist(1, 2, 1)) == torch.device("cuda", 1)
