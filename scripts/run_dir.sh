# Sourced by the quickstart scripts, which start a fresh run each time (trainer.resume=auto would continue the
# previous one) by removing RUN_DIR: `check_run_dir RUN_DIR KEEP...`, called before anything else is done, refuses
# (exit status 2, nothing removed) a RUN_DIR that holds any KEEP (the prepared model, the data) or that exists
# without being a megarl run directory (no config.yaml, which `megarl train` writes first). Without it
# `bash scripts/quickstart.sh runs` deleted the model it had just prepared, and would any directory named by mistake.
check_run_dir() {
  local run=$1 keep
  shift
  for keep in "$@"; do
    case "$(realpath -m "$keep")/" in
      "$(realpath -m "$run")"/*)
        echo "[quickstart] error: run directory $run holds $keep, which the run needs; pick another run directory" >&2
        exit 2 ;;
    esac
  done
  if [ -e "$run" ] && [ ! -f "$run/config.yaml" ]; then
    echo "[quickstart] error: $run exists and is not a megarl run directory (no config.yaml); pick another run" \
      "directory, or remove it yourself" >&2
    exit 2
  fi
}
