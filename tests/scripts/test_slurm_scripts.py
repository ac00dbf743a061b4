"""The Slurm/torchrun launchers: shell syntax, and what they run, with stub srun/scontrol/ray/megarl.

The stubs log each command line; `srun` strips its own options and runs the rest for real, so the
embedded `bash -c` commands execute (and a syntax error in them fails the test).
"""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RAY_SBATCH = REPO / "scripts" / "slurm" / "megarl_ray.sbatch"
TORCHRUN = REPO / "scripts" / "slurm" / "torchrun.sbatch"
SCRIPTS = [RAY_SBATCH, TORCHRUN, *sorted((REPO / "scripts").glob("*.sh"))]

SRUN = r"""#!/usr/bin/env bash
echo "srun $*" >> "$STUB_LOG"
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in -w|--nodelist) shift 2 ;; *) shift ;; esac
done
exec "$@"
"""
LOGGER = '#!/usr/bin/env bash\necho "$(basename "$0") $*" >> "$STUB_LOG"\n'


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    files = {
        "srun": SRUN,
        "scontrol": '#!/usr/bin/env bash\nprintf "gpu-a\\ngpu-b\\ngpu-c\\n"\n',
        "hostname": '#!/usr/bin/env bash\necho "10.0.0.7 fe80::1"\n',
        "ray": LOGGER,
        "megarl": LOGGER,
        "fakepython": LOGGER + "if [[ $1 == -c ]]; then echo 3; fi\n",  # "3 nodes alive"
    }
    for name, text in files.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_LOG": str(log),
        "MEGARL_PYTHON": str(bin_dir / "fakepython"),
        "MEGARL_HEAD_WAIT": "0",
    }
    return env, log


def _embedded_commands(lines):
    """The `bash -c` strings srun was asked to run."""
    out = []
    for line in lines:
        words = shlex.split(line.split(" ", 1)[1]) if line.startswith("srun ") else []
        if "bash" in words and "-c" in words:
            out.append(words[words.index("-c") + 1])
    return out


def test_ray_sbatch_starts_head_then_workers_then_the_driver(stubs, tmp_path):
    env, log = stubs
    env.update(SLURM_JOB_NODELIST="gpu-[a-c]", SLURM_GPUS_ON_NODE="4", SLURM_CPUS_ON_NODE="32")
    subprocess.run(
        ["bash", str(RAY_SBATCH), "configs/llama3-70b_ppo.yaml", "actor.optim.lr=1e-6", "trainer.experiment=a b"],
        env=env,
        check=True,
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
    )
    lines = log.read_text().splitlines()
    ray_lines = [ln for ln in lines if ln.startswith("ray start")]
    head = [ln for ln in ray_lines if "--head" in ln]
    assert head == [
        "ray start --head --node-ip-address=10.0.0.7 --port=6379 --num-gpus=4 --num-cpus=32"
        " --include-dashboard=false --block"
    ]
    workers = [ln for ln in ray_lines if "--head" not in ln]
    assert workers == ["ray start --address=10.0.0.7:6379 --num-gpus=4 --num-cpus=32 --block"] * 2
    assert any("-w gpu-b" in ln for ln in lines) and any("-w gpu-c" in ln for ln in lines)
    driver = [ln for ln in lines if ln.startswith("megarl ")]
    assert driver == [
        "megarl train --config configs/llama3-70b_ppo.yaml resources.nodes=3 resources.gpus_per_node=4"
        " resources.ray_address=10.0.0.7:6379 actor.optim.lr=1e-6 trainer.experiment=a b"
    ]
    assert sum(ln.startswith("ray stop") for ln in lines) == 3  # cleanup on every node
    for command in _embedded_commands(lines):
        subprocess.run(["bash", "-n", "-c", command], check=True)


def test_ray_sbatch_in_a_container_runs_the_join_check_and_the_driver_in_the_head_nodes_container(stubs, tmp_path):
    """With MEGARL_CONTAINER, ray and megarl exist only in the image: the join check and the driver must run
    through srun on the head node, in the same named container as its raylet (Ray's sockets are in its /tmp)."""
    env, log = stubs
    env.update(SLURM_JOB_NODELIST="gpu-[a-c]", SLURM_JOB_ID="42", MEGARL_CONTAINER="registry/megarl:1")
    subprocess.run(["bash", str(RAY_SBATCH), "cfg.yaml"], env=env, check=True, cwd=tmp_path, timeout=60)
    lines = log.read_text().splitlines()
    container = "--container-image=registry/megarl:1 --container-name=megarl-42"
    srun_lines = [ln for ln in lines if ln.startswith("srun ")]
    assert srun_lines and all(container in ln for ln in srun_lines)
    check = [ln for ln in srun_lines if "import ray" in ln]
    driver = [ln for ln in srun_lines if "megarl-driver" in ln]
    assert check and all("-w gpu-a" in ln for ln in check)
    assert len(driver) == 1 and "-w gpu-a" in driver[0]
    assert any(ln.startswith("megarl train --config cfg.yaml resources.nodes=3") for ln in lines)


def test_ray_sbatch_fails_when_nodes_do_not_join(stubs, tmp_path):
    env, log = stubs
    env.update(SLURM_JOB_NODELIST="gpu-[a-c]", MEGARL_JOIN_TIMEOUT="0")
    Path(env["MEGARL_PYTHON"]).write_text(LOGGER + "echo 1\n")  # only the head joined
    result = subprocess.run(
        ["bash", str(RAY_SBATCH), "cfg.yaml"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "only 1 of 3 Ray nodes joined" in result.stderr
    assert not any(ln.startswith("megarl ") for ln in log.read_text().splitlines())


def test_torchrun_launcher_locally_and_under_slurm(stubs, tmp_path):
    env, log = stubs
    env["MEGARL_GPUS_PER_NODE"] = "2"
    args = ["tools/convert_checkpoint.py", "hf-to-mcore", "--hf-path", "/models/a b", "--tp", "2"]
    subprocess.run(["bash", str(TORCHRUN), *args], env=env, check=True, cwd=tmp_path, capture_output=True, timeout=60)
    local = log.read_text().splitlines()[-1]
    assert local.startswith(
        "fakepython -m torch.distributed.run --nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d"
        " --rdzv-endpoint=localhost:29500"
    )
    assert local.endswith("tools/convert_checkpoint.py hf-to-mcore --hf-path /models/a b --tp 2")
    env.update(SLURM_JOB_NODELIST="gpu-[a-c]", SLURM_NNODES="3", SLURM_JOB_ID="77")
    subprocess.run(["bash", str(TORCHRUN), *args], env=env, check=True, cwd=tmp_path, capture_output=True, timeout=60)
    lines = log.read_text().splitlines()
    assert lines[-2].startswith("srun --nodes=3 --ntasks-per-node=1 bash -c")
    assert "--nnodes=3 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=gpu-a:29500 --rdzv-id=77" in lines[-1]


def test_ray_local_start_and_usage(stubs, tmp_path):
    env, log = stubs
    env.update(MEGARL_PYTHON_BIN=str(Path(env["MEGARL_PYTHON"]).parent), MEGARL_RAY_CPUS="2")
    script = REPO / "scripts" / "ray_local.sh"
    subprocess.run(["bash", str(script), "start", "4"], env=env, check=True, capture_output=True, timeout=60)
    assert log.read_text().splitlines()[-1] == (
        "ray start --head --node-ip-address=127.0.0.1 --port=6379 --num-cpus=2"
        " --num-gpus=4 --include-dashboard=true --dashboard-host=127.0.0.1"
    )
    assert subprocess.run(["bash", str(script), "restart"], env=env, capture_output=True).returncode == 2
