"""GPU check of the chunked post-training losses against their full-logits versions.

Cases, at a Qwen2.5-0.5B-like head (d=896, V=151936) by default, bf16 hidden states:

- ``distill``: ``distill_loss_sum`` (teacher and student logits made chunk by chunk) vs
  ``distill_loss_from_logits`` on full logits, forward + backward;
- ``token_logps``: ``linear_token_logps`` vs ``token_logps_from_logits``, forward + backward
  through a DPO-like loss on per-sequence sums.

For each: peak CUDA memory above the inputs, median time of forward+backward, whether two
runs give bitwise-identical losses and gradients (deterministic algorithms on), and the
largest difference of the chunked path from the full one (loss and hidden-state gradient).
A case that runs out of memory is reported as such. Everything is printed and written as
JSON to --out; exit status 1 when a chunked case fails or is not repeatable.

    python benchmarks/objective_losses.py --out objective_losses.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from training.objectives.distill_loss import distill_loss_from_logits, distill_loss_sum  # noqa: E402
from training.objectives.token_logps import linear_token_logps, token_logps_from_logits  # noqa: E402


def _inputs(args, device):
    gen = torch.Generator(device=device).manual_seed(0)
    n, d, v = args.tokens, args.dim, args.vocab

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    hidden = randn(n, d).requires_grad_()
    weight = randn(v, d, scale=d**-0.5).requires_grad_()
    t_hidden, t_weight = randn(n, d), randn(v, d, scale=d**-0.5)
    labels = torch.randint(0, v, (n,), generator=gen, device=device)
    mask = torch.rand(n, generator=gen, device=device) > 0.2
    return hidden, weight, t_hidden, t_weight, labels, mask


def _distill(args, chunk):
    def run(hidden, weight, t_hidden, t_weight, labels, mask):
        settings = dict(kind="jsd", beta=0.5, temperature=2.0, alpha=0.1)
        if chunk:
            loss = distill_loss_sum(hidden, weight, t_hidden, t_weight, labels, mask, chunk_tokens=chunk, **settings)[0]
        else:
            loss = distill_loss_from_logits(hidden @ weight.t(), t_hidden @ t_weight.t(), labels, mask, **settings)[0]
        loss.backward()
        return loss
    return run


def _token_logps(args, chunk):
    def run(hidden, weight, _t_hidden, _t_weight, labels, mask):
        labels = labels.masked_fill(~mask, -100)
        if chunk:
            logps = linear_token_logps(hidden, weight, labels, chunk_tokens=chunk)
        else:
            logps = token_logps_from_logits(hidden @ weight.t(), labels)
        sums = logps.reshape(-1, args.seq).sum(-1)
        half = sums.shape[0] // 2
        loss = -torch.nn.functional.logsigmoid(0.1 * (sums[:half] - sums[half:])).sum()
        loss.backward()
        return loss
    return run


def measure(name, run, args, device):
    inputs = _inputs(args, device)
    hidden, weight = inputs[0], inputs[1]
    cuda = device.type == "cuda"
    results, times, peak = [], [], None
    try:
        for i in range(args.repeats + 1):
            hidden.grad = weight.grad = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            loss = run(*inputs)
            if cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
            if i:  # the first run warms up
                times.append(time.perf_counter() - start)
            results.append((loss.detach().clone(), hidden.grad.clone(), weight.grad.clone()))
    except torch.OutOfMemoryError:
        return {"case": name, "status": "out of memory"}
    except RuntimeError as exc:  # e.g. a kernel without a deterministic implementation
        return {"case": name, "status": f"error: {str(exc).splitlines()[0]}"}
    first, last = results[1], results[-1]
    return {
        "case": name,
        "status": "ok",
        "peak_gib": None if peak is None else round(peak / 2**30, 3),
        "median_ms": round(1000 * statistics.median(times), 2),
        "bitwise_repeatable": all(torch.equal(a, b) for a, b in zip(first, last)),
        "_outputs": first,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (token_logps sums per sequence)")
    parser.add_argument("--dim", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run at small sizes (no memory)")
    parser.add_argument("--out", type=Path, default=Path("objective_losses.json"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("objective_losses: no CUDA device (pass --device cpu for a smoke run)", file=sys.stderr)
        return 1
    torch.use_deterministic_algorithms(True)
    rows, failed = [], False
    for family, make in (("distill", _distill), ("token_logps", _token_logps)):
        full = measure(f"{family}/full", make(args, 0), args, device)
        rows.append(full)
        for chunk in args.chunks:
            row = measure(f"{family}/chunk{chunk}", make(args, chunk), args, device)
            if row["status"] == "ok" and full["status"] == "ok":
                (la, ha, _), (lb, hb, _) = row["_outputs"], full["_outputs"]
                row["loss_rel_diff"] = abs((la - lb).item()) / max(abs(lb.item()), 1e-30)
                row["grad_h_max_abs_diff"] = (ha.float() - hb.float()).abs().max().item()
            failed |= row["status"] != "ok" or not row["bitwise_repeatable"]
            rows.append(row)
    for row in rows:
        row.pop("_outputs", None)
        print(json.dumps(row))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "args": vars(args) | {"out": str(args.out)}}
    args.out.write_text(json.dumps(report | {"rows": rows}, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
