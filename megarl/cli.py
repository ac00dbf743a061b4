"""The `megarl` command: `train`, `convert`, `check-parity`, `config`, `plan`, `simulate` (and, as it lands, `eval`).

Owns: argument parsing and turning the library's validation errors into one clear line and a
non-zero exit code (no traceback for bad input). The work itself lives in the library.
"""

from __future__ import annotations

import argparse
import os
import sys

from megarl.models.layout import ParallelLayout
from megarl.utils.errors import RankError
from megarl.utils.interrupts import GracefulStop, SigintRearmed, exit_code
from megarl.utils.lifetime import NodeLostError

_USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, KeyError)


def _add_layout(parser: argparse.ArgumentParser, default_help: str) -> None:
    parser.add_argument("--tp", type=int, default=1, help=f"tensor-parallel size {default_help}")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages per PP rank")
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size (MoE models; experts split over ep data-parallel ranks)"
    )


def _layout(args) -> ParallelLayout:
    return ParallelLayout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep)


def _convert_parser(sub) -> None:
    convert = sub.add_parser("convert", help="convert checkpoints between HuggingFace and megatron-core")
    direction = convert.add_subparsers(dest="direction", required=True)
    to_mcore = direction.add_parser("hf-to-mcore", help="HF safetensors → megatron-core distributed checkpoint")
    to_mcore.add_argument("--hf-path", required=True)
    to_mcore.add_argument("--mcore-path", required=True)
    to_mcore.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="storage dtype (default: the HF config's dtype)",
    )
    _add_layout(to_mcore, "of the written checkpoint's source layout")
    to_hf = direction.add_parser("mcore-to-hf", help="megatron-core distributed checkpoint → HF safetensors")
    to_hf.add_argument("--mcore-path", required=True)
    to_hf.add_argument("--hf-path", required=True)
    _add_layout(to_hf, "used to read the checkpoint (any layout loads it; 1 = single process)")
    for p in (to_mcore, to_hf):
        p.add_argument("--overwrite", action="store_true", help="replace a non-empty target directory")


def _parity_parser(sub) -> None:
    parity = sub.add_parser("check-parity", help="compare megatron-core and transformers logits")
    parity.add_argument("--hf-path", required=True)
    parity.add_argument("--atol", type=float, default=1e-4)
    parity.add_argument("--seq-len", type=int, default=32)
    parity.add_argument("--batch", type=int, default=2)
    _add_layout(parity, "")


def _config_parser(sub) -> None:
    config = sub.add_parser(
        "config", help="print the resolved run config (defaults <- YAML <- overrides) and validate it"
    )
    config.add_argument("config", help="YAML file of overrides (configs/*.yaml)")
    config.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6 rollout.samples_per_prompt=8"
    )
    config.add_argument("--validate-only", action="store_true", help="print only the derived sizes, not the YAML")
    config.add_argument("--explain", action="store_true", help="put each field's docstring above it")
    config.add_argument(
        "--no-check-paths",
        action="store_true",
        help="skip checks that read local files (HF config.json, data): paths that exist only on the cluster",
    )


def _plan_parser(sub) -> None:
    plan = sub.add_parser(
        "plan", help="predict memory per role/GPU and time per phase of a layout; --search ranks layouts"
    )
    plan.add_argument("--config", help="YAML file of overrides (configs/*.yaml); default: the built-in defaults")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.layout.tp=4 rollout.tp=2")
    plan.add_argument(
        "--hf-config", help="model: HF directory / config.json, or a preset name (default: model.hf_path)"
    )
    plan.add_argument("--gpu", default="H100", help="hardware table entry: H100, H200, A100, B200")
    for name, unit in (
        ("hbm-gb", "GB"),
        ("tflops", "TFLOP/s bf16"),
        ("hbm-tbps", "TB/s"),
        ("nvlink-gbps", "GB/s"),
        ("network-gbps", "GB/s per GPU"),
    ):
        plan.add_argument(f"--{name}", type=float, help=f"override the table's value ({unit})")
    plan.add_argument("--mfu", type=float, default=0.35, help="Megatron MFU (benchmarks/train_step.py measures it)")
    plan.add_argument("--search", action="store_true", help="rank every valid layout for the GPU count")
    plan.add_argument("--gpus", type=int, help="--search: total GPUs (default resources.nodes * gpus_per_node)")
    plan.add_argument("--top", type=int, default=10, help="--search: rows shown")
    plan.add_argument("--json", action="store_true", help="JSON instead of the table")


def _train_parser(sub) -> None:
    train = sub.add_parser("train", help="run PPO / GRPO training (config validated before any worker starts)")
    train.add_argument("--config", required=True, help="YAML file of overrides (configs/*.yaml)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=20 actor.optim.lr=1e-6")


def _simulate_parser(sub) -> None:
    from megarl.utils.simulate.command import add_arguments

    simulate = sub.add_parser(
        "simulate",
        help="predict sync vs async samples/s of a cluster layout (discrete-event "
        "model; --preset 7b-64gpu or --calibrate RUN_DIR)",
    )
    add_arguments(simulate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _convert_parser(sub)
    _parity_parser(sub)
    _config_parser(sub)
    _plan_parser(sub)
    _simulate_parser(sub)
    return parser


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _run_convert(args) -> int:
    if args.direction == "mcore-to-hf" and _layout(args).min_world_size == 1:
        # a dense model is exported in this process, without megatron-core (`megarl.models.dcp_export`):
        # no rank to fork, so no server preloading megatron-core beside it on the two cores
        return _convert(args)
    return _in_rank_server(_convert, args)


def _in_rank_server(work, args) -> int:
    """`work(args)` (an exit code). The rank server starts first (`megarl.utils.rank_server`); as the `megarl`
    command the work then runs in a child of it, and this process imports no torch; called in-process
    (`main(argv)`: tools, tests reading its output) it runs here, beside the server's imports."""
    from megarl.utils import rank_server

    if rank_server.start_early() and args.as_command:
        return rank_server.run_in_server(_run, work, args)
    return work(args)


def _convert(args) -> int:
    from megarl.models import convert

    if args.direction == "hf-to-mcore":
        result = convert.hf_to_mcore(
            args.hf_path, args.mcore_path, _layout(args), dtype=args.dtype, overwrite=args.overwrite
        )
        message = f"wrote megatron checkpoint {args.mcore_path} ({result['model_type']}, {result['dtype']})"
    else:
        result = convert.mcore_to_hf(args.mcore_path, args.hf_path, _layout(args), overwrite=args.overwrite)
        message = f"wrote HF checkpoint {args.hf_path} ({result['tensors']} tensors, {result['bytes'] / 2**20:.1f} MiB)"
    if _is_rank0():
        print(message)
    return 0


def _run_parity(args) -> int:
    return _in_rank_server(_parity, args)


def _parity(args) -> int:
    from megarl.models.parity import check_parity

    result = check_parity(args.hf_path, _layout(args), batch=args.batch, seq=args.seq_len, atol=args.atol)
    print(result)
    return 0 if result.ok else 1


def _run_config(args) -> int:
    from megarl.config import describe, dump_yaml, load_config, validate

    cfg = load_config(args.config, args.overrides)
    if not args.validate_only:
        print(dump_yaml(cfg, comments=args.explain), end="")
    derived = validate(cfg, check_paths=not args.no_check_paths)
    print(f"# ok: {describe(derived)}")
    if args.validate_only and cfg.resources.accelerator == "gpu":
        _print_memory_plan(cfg)
    return 0


def _print_memory_plan(cfg) -> None:
    """Predicted peak memory per role (H100 table); a warning, never an error, when it does not fit."""
    from megarl.plan import gpu_spec, plan_run, resolve_dims
    from megarl.plan.report import memory_summary

    try:
        dims = resolve_dims(cfg.model.hf_path)
    except ValueError as err:
        print(f"# plan: skipped ({err})")
        return
    print("\n".join(memory_summary(plan_run(cfg, dims, gpu_spec("H100")))))


def _plan_config(args):
    from megarl.config import load_config

    cfg = load_config(args.config or (), args.overrides)
    if args.hf_config:
        cfg.model.hf_path = args.hf_config
    if not cfg.model.hf_path:
        raise ValueError("megarl plan needs a model: --config RUN.yaml (model.hf_path) or --hf-config")
    if args.gpus:
        res = cfg.resources
        if res.pools:
            raise ValueError(
                "--gpus resizes the one default pool; this config sets resources.pools: edit those instead"
            )
        if args.gpus > res.gpus_per_node and args.gpus % res.gpus_per_node:
            raise ValueError(f"--gpus={args.gpus} is not a multiple of resources.gpus_per_node={res.gpus_per_node}")
        res.nodes, res.gpus_per_node = max(1, args.gpus // res.gpus_per_node), min(args.gpus, res.gpus_per_node)
    return cfg


def _run_plan(args) -> int:
    import json

    from megarl.plan import Assumptions, gpu_spec, plan_run, report, resolve_dims
    from megarl.plan.search import search

    cfg = _plan_config(args)
    gpu = gpu_spec(
        args.gpu,
        hbm_gb=args.hbm_gb,
        tflops=args.tflops,
        hbm_tbps=args.hbm_tbps,
        nvlink_gbps=args.nvlink_gbps,
        network_gbps=args.network_gbps,
    )
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu={args.mfu} must be in (0, 1]")
    dims, assumptions = resolve_dims(cfg.model.hf_path), Assumptions(mfu=args.mfu)
    if args.search:
        found = search(cfg, dims, gpu, assumptions)
        if not found:
            raise ValueError("no valid layout for these GPUs and batch sizes (see `megarl config --validate-only`)")
        print(
            json.dumps(report.search_json(found, args.top), indent=1)
            if args.json
            else report.format_search(found, args.top)
        )
        return 0
    plan = plan_run(cfg, dims, gpu, assumptions)
    print(json.dumps(report.plan_json(plan), indent=1) if args.json else report.format_plan(plan))
    return 0


def _run_simulate(args) -> int:
    from megarl.utils.simulate.command import run

    return run(args)


def _run_train(args) -> int:
    from megarl.controller import fork_server

    # the workers' imports start first, from the files' raw values: the typed config below imports torch (~3 s
    # on a core the server can use meanwhile); the checks after it leave that core idle too (no worker or Ray
    # starts before them)
    forks = fork_server.start_early(args.config, args.overrides)
    try:
        from megarl.config import describe, load_config, validate
        from megarl.trainer import train

        cfg = load_config(args.config, args.overrides)
        forks = fork_server.confirm(forks, cfg)  # the loaded config's server: this one, or a new one, or none
        derived = validate(cfg)  # before ray.init: a bad config fails in seconds, naming the field
        print(f"[megarl] {cfg.trainer.experiment}: {describe(derived)}", flush=True)
        train(cfg, derived, forks)
    finally:
        if forks is not None:
            forks.stop()
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    """Like `parse_args`, but dotted overrides may also follow options (`config f.yaml --validate-only a.b=1`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv=None, *, as_command: bool = False) -> int:
    """Run a megarl command in this process; `as_command` (the `megarl` command itself, `run`): `convert` and
    `check-parity` do their work in a child of the rank server (`_in_rank_server`)."""
    args = parse_args(argv)
    args.as_command = as_command
    handlers = {
        "train": _run_train,
        "convert": _run_convert,
        "check-parity": _run_parity,
        "config": _run_config,
        "plan": _run_plan,
        "simulate": _run_simulate,
    }
    # Ctrl-C works even where SIGINT was inherited ignored (`cmd &` in a script); `train` stops
    # gracefully on the first SIGINT/SIGTERM and at once on a second one
    with GracefulStop() if args.command == "train" else SigintRearmed():
        return _run(handlers[args.command], args)


def _run(handler, args) -> int:
    try:
        return handler(args)
    except KeyboardInterrupt as err:
        return exit_code(err)  # 130 for SIGINT, 143 for SIGTERM
    except _USER_ERRORS as err:
        print(f"megarl {args.command}: error: {err}", file=sys.stderr)
        return 2
    except NodeLostError as err:  # a Ray node died mid-run: which one, and what a rerun does
        print(f"megarl {args.command}: error: {err}", file=sys.stderr)
        return 1
    except RankError as err:  # the rank's traceback only when asked for: the message names the problem
        detail = err.remote_traceback if os.environ.get("MEGARL_DEBUG") else f"{err.exc_type}: {err.remote_message}"
        print(f"megarl {args.command}: error on rank {err.rank}: {detail}", file=sys.stderr)
        return 1


def run() -> None:
    """The `megarl` command (console script, `python -m megarl.cli`): `main`, then leave.

    After `train`, `convert` and `check-parity` the process stops Ray (`shutdown_ray`, where imported) and
    leaves with `os._exit` once every atexit handler has run (logging, multiprocessing, ...) and
    stdout/stderr are flushed: Python's own teardown after them took 1.45 s of the quickstart's exit (native
    teardown of Ray and torch; py-spy) and 0.6–0.8 s of a conversion's (clearing torch's, megatron-core's
    and transformers' modules; strace: no system call in between). Every file these commands write is
    closed by then (checkpoints and exports are synchronous and synced; the metrics writers close at the end
    of `fit`). Other commands, and `main` called in-process, exit as usual.
    """
    code = main(as_command=True)
    if sys.argv[1:2] in (["train"], ["convert"], ["check-parity"]):
        import atexit

        if "ray" in sys.modules:  # before the atexit handlers: Ray's own one waits 1.5 s longer
            from megarl.controller.placement import shutdown_ray

            shutdown_ray()
        atexit._run_exitfuncs()  # what normal interpreter exit runs, in the same (reverse) order
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
