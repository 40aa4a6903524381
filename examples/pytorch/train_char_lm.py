# SPDX-License-Identifier: Apache-2.0
"""A character-level transformer trained on tierstate's README with tierstate_torch.AdamW.

    python examples/pytorch/train_char_lm.py                      # state in host memory
    python examples/pytorch/train_char_lm.py --tier nvme --path /mnt/nvme
    python examples/pytorch/train_char_lm.py --overlap --micro-batches 2
    python examples/pytorch/train_char_lm.py --tier nvme --offload-params --overlap  # weights on NVMe too

What changes against a torch.optim.AdamW loop is the line that makes the optimizer; the
scheduler, GradScaler, zero_grad, step and checkpoints are PyTorch's own.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tierstate_torch  # noqa: E402


class CharLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", choices=["pinned", "nvme"], default="pinned")
    ap.add_argument("--path", help="tier nvme: the directory for the scratch file (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--overlap", action="store_true", help="hand gradients over from backward's hooks")
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--offload-params", action="store_true",
                    help="the weights in the tier too (offload_parameters), fetched layer by layer")
    args = ap.parse_args()

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    context, batch = 64, 16
    torch.manual_seed(0)
    model = CharLM(len(chars), args.width, args.layers, context)

    scratch = None
    path = args.path
    if args.tier == "nvme" and path is None:
        scratch = tempfile.TemporaryDirectory(prefix="tierstate-")
        path = scratch.name
    off = tierstate_torch.offload_parameters(model, args.tier, path) if args.offload_params else None
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "pos"]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and n != "pos")]
    opt = tierstate_torch.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-3, betas=(0.9, 0.95), tier=args.tier, path=path,
        overlap_backward=args.overlap, micro_batches=args.micro_batches)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    print(f"{sum(p.numel() for p in model.parameters())} parameters; optimizer: {opt.composition()}")

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(args.micro_batches):
            i = torch.randint(0, len(data) - context - 1, (batch,))
            x = torch.stack([data[j:j + context] for j in i])
            y = torch.stack([data[j + 1:j + context + 1] for j in i])
            loss = nn.functional.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
            (loss / args.micro_batches).backward()
            total += loss.item() / args.micro_batches
        opt.step()
        sched.step()
        if step == 1 or step % 25 == 0:
            s = opt.last_step
            print(f"step {step:4d}  loss {total:.3f}  lr {sched.get_last_lr()[0]:.2e}  "
                  f"tier read {s['tier_bytes_read'] / 1e6:.1f} MB  update {s['total_seconds'] * 1e3:.1f} ms")
    took = time.perf_counter() - start
    print(f"{args.steps} steps in {took:.1f} s; state after {opt.step_count()} steps in {args.tier}")
    if off is not None:
        s = off.stats()
        print(f"weights in {args.tier}: {s['tier_bytes'] / 1e6:.1f} MB, a window of {s['buffer_count']} x "
              f"{s['buffer_bytes'] / 1e6:.2f} MB; {s['acquires']} fetches ({s['ready']} read ahead), "
              f"{s['bytes_read'] / 1e6:.0f} MB read, {s['grad_bytes_written'] / 1e6:.0f} MB of gradients written")
        opt.close()
        off.close()
        del off, opt
    if scratch:
        scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
