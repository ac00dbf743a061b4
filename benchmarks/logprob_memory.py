"""Benchmark: peak memory and time of megarl's chunked log-prob + entropy vs naive `log_softmax`.

    python benchmarks/logprob_memory.py                        # CPU, 2048 tokens x 32768 vocab
    python benchmarks/logprob_memory.py --tokens 8192 --vocab 151936 --device cuda --dtype bfloat16

Both variants take the same logits [tokens, vocab] (as a TP=1 model emits them), compute the
log-prob of a target token and the entropy, and back-propagate a weighted sum of both:
  * naive: `log_softmax(logits.float())`, gather, `-(p * logp).sum(-1)` (what most RL codebases do);
  * ours: `megarl.engine.logprobs.vocab_parallel_logprobs` (chunks of --chunk tokens).
Peak memory is measured *above* the logits and their gradient (which both need): on CUDA with
`max_memory_allocated`, on CPU as the peak RSS (Linux VmHWM) of a fresh worker process per variant
(torch's CPU allocator is invisible to tracemalloc). Prints time (best of --repeats, alternating) and the ratios
naive / ours, plus the max |difference| of the results.
"""

import argparse
import subprocess
import sys
import time

import torch

from megarl.engine.logprobs import vocab_parallel_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_inputs(args):
    gen = torch.Generator().manual_seed(0)
    logits = torch.empty(args.tokens, args.vocab, dtype=DTYPES[args.dtype])  # no full-size temporaries
    logits.normal_(0.0, 2.0, generator=gen)
    logits = logits.to(args.device)
    target = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(args.device)
    weights = torch.randn(2, args.tokens, generator=gen).to(args.device)
    return logits.requires_grad_(True), target, weights


def naive(logits, target):
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def ours(logits, target, chunk):
    return vocab_parallel_logprobs(logits, target, chunk_tokens=chunk)


def run(variant, logits, target, weights, chunk):
    logits.grad = None
    logp, entropy = naive(logits, target) if variant == "naive" else ours(logits, target, chunk)
    ((weights[0] * logp).sum() + (weights[1] * entropy).sum()).backward()
    return logp.detach(), entropy.detach(), logits.grad


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(variant, inputs, args):
    _sync(args.device)
    start = time.perf_counter()
    out = run(variant, *inputs, args.chunk)
    _sync(args.device)
    return time.perf_counter() - start, out


def cuda_peak(variant, inputs, args) -> int:
    inputs[0].grad = torch.empty_like(inputs[0])  # both variants need the logits' gradient
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run(variant, *inputs, args.chunk)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def worker(args) -> None:
    """CPU: one variant in this fresh process; prints its peak RSS growth in bytes (Linux VmHWM).

    (getrusage's ru_maxrss is inherited from the parent across fork+exec, so it cannot be used.)
    """
    inputs = make_inputs(args)
    inputs[0].grad = torch.zeros_like(inputs[0])
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak-RSS watermark to the current RSS
    base = _status_kib("VmRSS")
    run(args.worker, *inputs, args.chunk)
    print((_status_kib("VmHWM") - base) * 1024)


def cpu_peak(variant, args) -> int:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--dtype",
        args.dtype,
        "--chunk",
        str(args.chunk),
        "--threads",
        str(args.threads),
    ]
    return int(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])


def main(args) -> None:
    inputs = make_inputs(args)
    times = {"naive": [], "ours": []}
    for _ in range(args.repeats):
        for variant in ("naive", "ours"):
            seconds, out = timed(variant, inputs, args)
            times[variant].append(seconds)
            if variant == "naive":
                reference = [t.clone() for t in out]
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(out, reference)]
    peaks = {v: cuda_peak(v, inputs, args) if args.device == "cuda" else cpu_peak(v, args) for v in times}
    best = {v: min(t) for v, t in times.items()}
    logits_mb = inputs[0].numel() * inputs[0].element_size() / 2**20
    print(
        f"device={args.device} dtype={args.dtype} tokens={args.tokens} vocab={args.vocab} chunk={args.chunk}"
        f" logits={logits_mb:.0f} MiB threads={torch.get_num_threads()}"
    )
    for v in ("naive", "ours"):
        print(f"  {v:5s}: time {best[v] * 1e3:8.1f} ms   peak extra memory {peaks[v] / 2**20:8.1f} MiB")
    print(
        f"  memory ratio naive/ours = {peaks['naive'] / max(peaks['ours'], 1):.1f}x   "
        f"time ratio naive/ours = {best['naive'] / best['ours']:.2f}x"
    )
    print(f"  max |diff|: log-prob {diffs[0]:.2e}, entropy {diffs[1]:.2e}, grad {diffs[2]:.2e}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=256, help="tokens per chunk of the fused path")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=["naive", "ours"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    torch.set_num_threads(arguments.threads)
    if arguments.worker:
        arguments.device = "cpu"
        worker(arguments)
    else:
        main(arguments)
