"""`megarl train` starts its fork server before the driver imports torch (`fork_server.start_early`, from the
config files' raw values) and keeps it only where the loaded config asks for exactly that server
(`fork_server.confirm`); the raw read never fails a run that `load_config` would accept."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.config.schema import ResourceConfig, RolloutConfig
from megarl.controller import fork_server

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "grpo_quickstart.yaml")


@pytest.fixture
def servers():
    started = []
    yield started
    for server in started:
        server.stop()


def test_the_early_defaults_are_the_schemas():
    resources, rollout = ResourceConfig(), RolloutConfig()
    for section, defaults in fork_server.EARLY_DEFAULTS.items():
        schema = resources if section == "resources" else rollout
        assert defaults == {key: getattr(schema, key) for key in defaults}, section


def test_the_server_starts_before_torch_is_imported_and_the_loaded_config_keeps_it():
    """In a fresh interpreter, as `megarl train` runs: the CLI module and `start_early` import no torch; the
    server preloads the quickstart's stack under its worker environment; the loaded config keeps that server."""
    script = textwrap.dedent(
        f"""
        import sys
        import megarl.cli
        from megarl.controller import fork_server
        server = fork_server.start_early({QUICKSTART!r}, ["trainer.total_steps=2"])
        assert server is not None and server.proc.poll() is None
        assert "torch" not in sys.modules and "megarl.config" not in sys.modules, "imported before the server"
        from megarl.config import load_config
        cfg = load_config({QUICKSTART!r}, ["trainer.total_steps=2"])
        assert fork_server.confirm(server, cfg) is server and server.proc.poll() is None
        assert server.env["OMP_NUM_THREADS"] == "1" and "vllm" in server.modules  # engine auto: vLLM preloaded
        server.stop()
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_a_server_that_does_not_fit_the_loaded_config_is_replaced(servers):
    """The raw guess differs from the loaded config (here by hand: another thread count): the early server is
    stopped and the config's own is started; a config that wants none stops it and gets none."""
    cfg = load_config(QUICKSTART, ["rollout.engine=embedded"])
    modules, env = fork_server._settings(cfg)
    early = fork_server.ForkServer.start(modules, {**env, "OMP_NUM_THREADS": "2"})
    servers.append(early)
    server = fork_server.confirm(early, cfg)
    servers.append(server)
    assert server is not early and early.proc.poll() is not None  # stopped
    assert (server.modules, server.env) == (modules, env) and server.proc.poll() is None
    assert fork_server.confirm(server, load_config(QUICKSTART, ["resources.fork_workers=false"])) is None
    assert server.proc.poll() is not None


@pytest.mark.parametrize(
    "overrides",
    [
        ["resources.cpus_per_worker=${oc.env:MEGARL_TEST_CPUS,1}"],  # an interpolation: only the loader resolves it
        ["resources.cpus_per_worker=many"],  # the wrong type: the loader names the field
        ["resources=3"],  # not a section
        ["resources.fork_workers=false"],
        ["resources.accelerator=gpu"],
        ["resources.ray_address=auto"],
    ],
)
def test_no_early_server_where_the_raw_values_do_not_ask_for_one(overrides):
    assert fork_server.start_early(QUICKSTART, overrides) is None


def test_no_early_server_for_a_file_that_does_not_read(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("resources: [unclosed\n")
    assert fork_server.start_early([QUICKSTART, str(bad)], []) is None
    assert fork_server.start_early(str(tmp_path / "missing.yaml"), []) is None


def test_the_raw_read_follows_defaults_chains_and_overrides(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"defaults: {QUICKSTART}\nresources:\n  cpus_per_worker: 2\nrollout:\n  engine: embedded\n")
    early = fork_server._early_config(str(child), ["rollout.engine=vllm"])
    cfg = load_config(str(child), ["rollout.engine=vllm"])
    assert fork_server._settings(early) == fork_server._settings(cfg)
    assert early.resources.cpus_per_worker == 2 and early.rollout.engine == "vllm"
    assert early.resources.accelerator == "cpu"  # from the quickstart, two files up
