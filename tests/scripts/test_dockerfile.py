"""The Dockerfile: NGC base, the image's torch kept, versions in step with setup.sh, RUN steps valid shell."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def _instructions(kind: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.split(" ", 1)[1] for line in joined.splitlines() if line.startswith(kind + " ")]


def test_run_steps_are_valid_shell():
    runs = _instructions("RUN")
    assert len(runs) >= 5
    for command in runs:
        subprocess.run(["bash", "-n", "-c", command], check=True)


def test_ngc_base_with_pinned_versions_matching_setup():
    assert _instructions("FROM") == ["nvcr.io/nvidia/pytorch:${NGC_TAG}-py3"]
    args = dict(a.split("=", 1) for a in _instructions("ARG") if "=" in a)
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert f"MCORE_VERSION={args['MCORE_VERSION']}" in setup  # one megatron-core version everywhere
    assert re.fullmatch(r"\d\d\.\d\d", args["NGC_TAG"]) and re.fullmatch(r"\d+\.\d+\.\d+", args["VLLM_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["RAY_VERSION"])


def test_image_torch_is_never_replaced():
    assert "PIP_CONSTRAINT=/etc/pip/constraint.txt" in DOCKERFILE
    assert "use_existing_torch.py" in DOCKERFILE and "--no-build-isolation" in DOCKERFILE
    for command in _instructions("RUN"):
        assert not re.search(r"pip install[^&;]*\btorch\b(?!==)", command.replace("use_existing_torch", "")), command
