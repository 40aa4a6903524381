# SPDX-License-Identifier: Apache-2.0
"""tierstate_torch against torch.optim: a small transformer trained from one seed with
torch.optim.AdamW and with tierstate_torch.AdamW (state in PinnedHost, and in NvmeFile),
every step's loss within 1e-4 relative and the final params within 1e-4 * (|p| + lr);
then the parts a user swapping optimizers relies on: param groups and an LR schedule,
post-accumulate-grad hooks with gradient accumulation, GradScaler, state_dict round trips
and conversions to and from torch.optim.AdamW's, Adam with AMSGrad, bf16 params, an optimizer
replaced by a newer one and close(), errors.

Run: python tests/pytorch/test_parity.py  (PyTorch 2.11.0 and bitsandbytes 0.50.2 on CPU; the
extension's CPU build is made on first use). With TIERSTATE_TORCH_TEST_INSTALLED=1, against the
installed package instead of this checkout's sources (tests/run-all.sh's pytorch stage installs
it from a wheel): nothing is compiled then.
"""
from __future__ import annotations

import copy
import functools
import gc
import io
import json
import math
import os
import sys
import tempfile
import unittest
from pathlib import Path

import torch
import torch.nn as nn

INSTALLED = os.environ.get("TIERSTATE_TORCH_TEST_INSTALLED") == "1"
SOURCES = Path(__file__).resolve().parents[2] / "examples" / "pytorch"
if not INSTALLED:
    sys.path.insert(0, str(SOURCES))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))  # make_golden_dynamic8: the 8-bit reference
import tierstate_torch  # noqa: E402

STEPS = 50
LR = 3e-3
VOCAB, SEQ, BATCH, WIDTH = 48, 24, 6, 32
SCRATCH = os.environ.get("TIERSTATE_TEST_DIR", tempfile.gettempdir())


class Block(nn.Module):
    """A pre-norm transformer block: causal multi-head attention, then a GELU MLP.

    The key projection has no bias (as in Whisper): a key bias adds the same q.b to every
    score of a row, which softmax cancels, so its true gradient is zero and what backward
    computes for it is rounding noise. Adam divides that noise by its own magnitude and
    moves such a bias by about lr per step in the noise's direction: two correct
    implementations that round one operation differently (torch.optim.AdamW's foreach and
    single-tensor paths included) drift apart there by O(lr), whatever the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = 4
        self.norm1 = nn.LayerNorm(WIDTH)
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k = nn.Linear(WIDTH, WIDTH, bias=False)
        self.v = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A two-block causal transformer language model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


class _TwoDtypes(nn.Module):
    """A bf16 TinyLM and an fp32 gain on its logits: a model whose optimizer has two shards."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = make_model(torch.bfloat16)
        self.gain = nn.Parameter(torch.ones(4099))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(tokens) * self.gain.mean().to(torch.bfloat16)


def make_model(dtype: torch.dtype = torch.float32) -> TinyLM:
    torch.manual_seed(1234)
    return TinyLM().to(dtype)


def batches(n: int, seed: int = 99) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences with structure to learn: each token is the previous one plus a small step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        steps = torch.randint(1, 4, (BATCH, SEQ), generator=g)
        seq = (start + steps.cumsum(1)) % VOCAB
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


def groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Weight decay on matrices, none on biases, norms and embeddings' positions."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "pos"]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and n != "pos")]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over 10 steps, then cosine decay."""
    def f(step: int) -> float:
        if step < 10:
            return (step + 1) / 10
        return 0.5 * (1 + math.cos(math.pi * (step - 10) / (STEPS - 10)))
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def train(model: nn.Module, opt: torch.optim.Optimizer, data, sched=None, scaler=None,
          micro_batches: int = 1) -> list[float]:
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = loss_of(model, xm, ym) / micro_batches
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.item()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched:
            sched.step()
        losses.append(total)
    return losses


def train_scaled(model: nn.Module, opt: torch.optim.Optimizer, scaler, data, overflow_at: int = 5):
    """GradScaler's loop, with an overflow planted at step `overflow_at` (that step is
    skipped and the scale backs off). Returns the losses (0 for the overflowed step) and the
    final scale."""
    losses = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y)
        if i == overflow_at:
            loss = loss + model.head.bias.sum() * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item() if i != overflow_at else 0.0)
    return losses, scaler.get_scale()


class LionReference(torch.optim.Optimizer):
    """Lion as its paper writes it and lion-pytorch applies it (PyTorch has none): decoupled
    weight decay, the sign of beta1 * m + (1 - beta1) * g, then m's own decay with beta2."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(m.clone().mul_(beta1).add(p.grad, alpha=1 - beta1).sign_(), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class Parity(unittest.TestCase):
    def assert_parity(self, ref_losses, losses, ref_model, model, lr=LR):
        self.assertEqual(len(ref_losses), len(losses))
        for i, (a, b) in enumerate(zip(ref_losses, losses)):
            self.assertLessEqual(abs(a - b), 1e-4 * abs(a), f"step {i + 1}: loss {b} vs torch's {a}")
        for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
            bound = 1e-4 * (p.detach().abs() + lr)
            excess = ((p.detach() - q.detach()).abs() - bound).max().item()
            self.assertLessEqual(excess, 0.0, f"parameter {name} differs beyond 1e-4*(|p|+lr)")

    def assert_8bit_parity(self, ref, ours, ps, qs, grads, least, slots):
        """Steps `ref` (a torch.optim-style optimizer of fp32 state over ps) and `ours` (8-bit
        state over qs) on the same gradients, `ref`'s moments (slots: (name, signed map))
        replaced after each step by what their 8-bit blocks decode to (the Python reference,
        tests/golden/make_golden_dynamic8.py) in tensors of at least `least` elements; then the
        8-bit moments equal (but for 0.1%, a moment at a midpoint rounded the other way), the
        fp32 ones to fp32 rounding, and the params within 1e-5 * (|p| + 1e-2). ps and grads are
        on the CPU; qs may be on a CUDA device."""
        import make_golden_dynamic8 as ref8
        for g in grads:
            for p, q, x in zip(ps, qs, g):
                p.grad, q.grad = x.clone(), x.to(q.device, copy=True)
            ref.step()
            ours.step()
            for p in ps:
                if p.numel() >= least:
                    for slot, signed in slots:
                        ref.state[p][slot].copy_(ref8.store(signed, ref.state[p][slot]))
        for i, (p, q) in enumerate(zip(ps, qs)):
            for slot, _ in slots:
                a, b = ref.state[p][slot], ours.get_state(q, slot).cpu()
                if p.numel() < least:
                    close = torch.allclose(a, b, rtol=1e-5, atol=1e-6 * a.abs().max().item())
                    self.assertTrue(close, f"tensor {i} {slot} (fp32 state)")
                    continue
                same = (a == b).float().mean().item()
                self.assertGreaterEqual(same, 0.999, f"tensor {i} {slot}: {same:.4f} of the moments equal")
                self.assertTrue(torch.allclose(a, b, rtol=0.05, atol=1e-12), f"tensor {i} {slot}")
            excess = ((p - q.detach().cpu()).abs() - 1e-5 * (p.abs() + 1e-2)).max().item()
            self.assertLessEqual(excess, 0.0, f"tensor {i} of {p.numel()} differs")

    def reference(self, data, **kw):
        model = make_model()
        opt = torch.optim.AdamW(groups(model), lr=LR, betas=(0.9, 0.95))
        return model, train(model, opt, data, schedule(opt), **kw)

    def ours(self, data, tier, path=None, **kw):
        model = make_model()
        opt = tierstate_torch.AdamW(groups(model), lr=LR, betas=(0.9, 0.95), tier=tier, path=path,
                                    chunk_elements=4096, **kw)
        return model, opt

    def test_transformer_50_steps_pinned_and_nvme(self):
        data = batches(STEPS)
        ref_model, ref_losses = self.reference(data)
        self.assertLess(ref_losses[-1], 0.75 * ref_losses[0], "the model did not learn: a weak test")
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            for tier, path in (("pinned", None), ("nvme", d)):
                with self.subTest(tier=tier):
                    model, opt = self.ours(data, tier, path)
                    losses = train(model, opt, data, schedule(opt))
                    self.assert_parity(ref_losses, losses, ref_model, model)
                    self.assertEqual(opt.step_count(), STEPS)
                    # What the last step spent where: the default check looked at every gradient.
                    for key in ("check_seconds", "compute_seconds", "wait_seconds", "total_seconds"):
                        self.assertGreaterEqual(opt.last_step[key], 0.0, key)
                    self.assertGreater(opt.last_step["check_seconds"], 0.0)
                    if tier == "nvme":
                        self.assertIn("NvmeFile", opt.composition()[0])
                        self.assertGreater(opt.last_step["tier_bytes_read"], 0)

    def test_gpu_compositions_on_the_emulated_device(self):
        """CUDA params' compositions (ZeRO-Offload: OnHost + CudaOverlapped; OnDevice with the
        state in Device memory, or streamed from PinnedHost or NvmeFile), run on tierstate's
        emulated device: device memory is host memory, streams are threads, the OnDevice
        kernels run on Thrust's CPP backend."""
        data = batches(20, seed=3)
        ref_model, ref_losses = self.reference(data)
        os.environ["TIERSTATE_TORCH_EMULATED_DEVICE"] = "1"
        try:
            with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
                for compute, tier, path in (("host", "pinned", None), ("host", "nvme", d), ("device", "device", None),
                                            ("device", "pinned", None), ("device", "nvme", d)):
                    with self.subTest(compute=compute, tier=tier):
                        model, opt = self.ours(data, tier, path, compute=compute)
                        expect = "CudaOverlapped<2>, " + ("OnDevice" if compute == "device" else "OnHost")
                        self.assertIn(expect, opt.composition()[0])
                        losses = train(model, opt, data, schedule(opt))
                        self.assert_parity(ref_losses, losses, ref_model, model)
                model, opt = self.ours(data, "pinned", None, compute="device", overlap_backward=True)
                self.assert_parity(ref_losses, train(model, opt, data, schedule(opt)), ref_model, model)
        finally:
            del os.environ["TIERSTATE_TORCH_EMULATED_DEVICE"]

    def test_overlap_sees_what_torch_steps(self):
        """A param used in only some micro-batches, a frozen param, and edits the overlapped
        update cannot see (refused by name)."""
        data = batches(6, seed=29)

        def run(make_opt):
            model = make_model()
            model.pos.requires_grad_(False)  # frozen
            model.aux = nn.Parameter(torch.linspace(-1, 1, 37))
            opt = make_opt(model)
            for x, y in data:
                opt.zero_grad(set_to_none=True)
                for k, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
                    loss = loss_of(model, xm, ym) / 2
                    if k == 0:  # aux gets a gradient in the first micro-batch only
                        loss = loss + (model.aux * xm.float().mean()).pow(2).sum()
                    loss.backward()
                opt.step()
            return model

        ref = run(lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
        ours = run(lambda m: tierstate_torch.AdamW(m.parameters(), lr=LR, overlap_backward=True, micro_batches=2))
        self.assert_parity([0.0], [0.0], ref, ours)
        self.assertFalse(torch.equal(ours.aux, torch.linspace(-1, 1, 37)))

        model = make_model()
        opt = tierstate_torch.AdamW(model.parameters(), lr=LR, overlap_backward=True)
        x, y = data[0]
        loss_of(model, x, y).backward()
        with self.assertRaisesRegex(RuntimeError, "zero_grad during a streaming step"):
            opt.zero_grad()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        with self.assertRaisesRegex(RuntimeError, "changed afterwards"):
            opt.step()
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.param_groups[0]["lr"] = 0.5
        with self.assertRaisesRegex(RuntimeError, "hyper-parameters are read at the first"):
            opt.step()
        # A refused step still ended: the optimizer goes on.
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        self.assertEqual(opt.step_count(), 3)
        # GradScaler.unscale_ on gradients already handed over, scaled: refused, and the
        # scaler's attributes do not leak into the next step.
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        opt = tierstate_torch.AdamW(model.parameters(), lr=LR, overlap_backward=True, grad_scaler=scaler)
        scaler.scale(loss_of(model, x, y)).backward()
        scaler.unscale_(opt)
        with self.assertRaisesRegex(RuntimeError, "unscale_ was called"):
            scaler.step(opt)
        self.assertFalse(hasattr(opt, "grad_scale") or hasattr(opt, "found_inf"))
        scaler.update()
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        self.assertEqual(opt.step_count(), 2)
        mixed = make_model()
        mixed.head.to(torch.bfloat16)
        with self.assertRaisesRegex(ValueError, "overlap_backward with parameters of several dtypes"):
            tierstate_torch.AdamW(mixed.parameters(), overlap_backward=True)

    def test_a_replaced_overlap_optimizer_lets_go_of_its_params(self):
        """An overlap_backward optimizer kept alive (by an old scheduler, a notebook variable)
        after a newer one is made over the same params: its hooks stop at once, the newer one
        alone trains them (bit for bit a run without the old one), and the old one's step()
        says it was replaced, changing nothing."""
        data = batches(6, seed=31)

        def run(keep_old: bool, **new_kw):
            model = make_model()
            old = tierstate_torch.AdamW(model.parameters(), lr=LR, overlap_backward=True)
            old_sched = schedule(old)
            train(model, old, data[:1], old_sched)
            kept = [old, old_sched] if keep_old else []
            del old, old_sched
            gc.collect()
            new = tierstate_torch.AdamW(model.parameters(), lr=LR, **new_kw)
            losses = train(model, new, data[1:], schedule(new))
            return model, losses, new, kept

        clean, clean_losses, _, _ = run(keep_old=False, overlap_backward=True)
        # The newer one with hooks of its own, and without (its step() reads .grad).
        for overlap in (True, False):
            with self.subTest(new_overlap_backward=overlap):
                model, losses, new, (old, old_sched) = run(keep_old=True, overlap_backward=overlap)
                self.assertEqual(losses, clean_losses)
                for (name, p), q in zip(clean.named_parameters(), model.parameters()):
                    self.assertTrue(torch.equal(p, q), f"parameter {name} differs from the run without the old one")
                self.assertEqual(new.step_count(), len(data) - 1)
                before = [p.detach().clone() for p in model.parameters()]
                for call in (old.step, old.zero_grad):
                    with self.assertRaisesRegex(RuntimeError, "was replaced by a newer tierstate_torch optimizer "
                                                "over the same parameters"):
                        call()
                self.assertTrue(all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))
                self.assertTrue(all(p.grad is not None for p in model.parameters()))
                self.assertEqual(old.step_count(), 1)  # its state can still be read (to carry over)
                self.assertIn("tierstate", old.state_dict())
                old_sched.step()  # a scheduler of the old one goes on harmlessly
                old.close()
                new.zero_grad()
                loss_of(model, *data[0]).backward()
                new.step()  # the newer one goes on
                self.assertEqual(new.step_count(), len(data))

        # An optimizer in the middle of a streaming step (backward handed it gradients, step()
        # not yet called) is not replaced: refused, and nothing changes.
        model = make_model()
        old = tierstate_torch.AdamW(model.parameters(), lr=LR, overlap_backward=True)
        loss_of(model, *data[0]).backward()
        for overlap in (True, False):
            with self.assertRaisesRegex(RuntimeError, "in the middle of a streaming step"):
                tierstate_torch.AdamW(model.parameters(), lr=LR, overlap_backward=overlap)
        old.step()
        old.zero_grad()
        loss_of(model, *data[1]).backward()
        old.step()
        self.assertEqual(old.step_count(), 2)

    def test_close_removes_the_hooks_and_releases_the_state(self):
        data = batches(3, seed=37)
        model = make_model()
        opt = tierstate_torch.AdamW(model.parameters(), lr=LR, overlap_backward=True)
        train(model, opt, data[:1])
        loss_of(model, *data[1]).backward()  # the hooks opened a streaming step
        with self.assertRaisesRegex(RuntimeError, r"close\(\) during a streaming step"):
            opt.close()
        opt.step()  # the refused close() changed nothing
        self.assertEqual(opt.step_count(), 2)
        sd = opt.state_dict()
        opt.close()
        opt.close()  # idempotent
        before = [p.detach().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        loss_of(model, *data[2]).backward()  # no hook of the closed optimizer runs
        self.assertTrue(all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))
        calls = {"step": opt.step, "zero_grad": opt.zero_grad, "flush": opt.flush, "step_count": opt.step_count,
                 "composition": opt.composition, "state_dict": opt.state_dict,
                 "torch_state_dict": opt.torch_state_dict, "load_state_dict": lambda: opt.load_state_dict(sd),
                 "get_state": lambda: opt.get_state(model.head.weight, "exp_avg"),
                 "add_param_group": lambda: opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})}
        for name, call in calls.items():
            with self.subTest(call=name):
                with self.assertRaisesRegex(RuntimeError, rf"AdamW\.{name}: this optimizer was closed"):
                    call()
        self.assertTrue(all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))
        # The params are free: a new optimizer takes them and its state over.
        new = tierstate_torch.AdamW(model.parameters(), lr=LR, overlap_backward=True)
        new.load_state_dict(sd)
        self.assertEqual(new.step_count(), 2)
        train(model, new, data[2:])
        self.assertEqual(new.step_count(), 3)
        # delayed_update: close() first writes the update in flight into the params, as flush().
        models = [make_model(), make_model()]
        opts = [tierstate_torch.AdamW(m.parameters(), lr=LR, delayed_update=True) for m in models]
        for m, o in zip(models, opts):
            train(m, o, data[:2])
        lagging = [p.detach().clone() for p in models[0].parameters()]
        opts[0].flush()
        opts[1].close()
        self.assertFalse(all(torch.equal(p, q) for p, q in zip(models[0].parameters(), lagging)))
        self.assertTrue(all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters())))
        # An optimizer never stepped closes too.
        tierstate_torch.Adam(make_model().parameters()).close()

    def test_bf16_param_edited_in_place_is_the_one_stepped(self):
        model = make_model(torch.bfloat16)
        opt = tierstate_torch.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
        x, y = batches(1)[0]
        loss_of(model, x, y).backward()
        opt.step()
        with torch.no_grad():
            model.head.weight.mul_(0.5)  # as a clamp, a renorm or load_state_dict would
        edited = model.head.weight.detach().clone()
        opt.step()  # lr 0: the param is written back from the master
        self.assertTrue(torch.equal(model.head.weight, edited))
        self.assertTrue(torch.equal(opt.get_state(model.head.weight, "master"), edited.float()))
        # A write that changes nothing (an EMA swap out and back) keeps the master's precision.
        opt.param_groups[0]["lr"] = 1e-3
        opt.step()
        master = opt.get_state(model.head.weight, "master")
        self.assertFalse(torch.equal(master, model.head.weight.float()))  # finer than bf16
        with torch.no_grad():
            model.head.weight.copy_(model.head.weight.clone())
        opt.param_groups[0]["lr"] = 0.0
        opt.step()
        self.assertTrue(torch.equal(opt.get_state(model.head.weight, "master"), master))

    def test_hooks_overlap_backward_with_accumulation(self):
        data = batches(20, seed=5)
        ref_model, ref_losses = self.reference(data, micro_batches=2)
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            model, opt = self.ours(data, "nvme", d, overlap_backward=True, micro_batches=2)
            losses = train(model, opt, data, schedule(opt), micro_batches=2)
        self.assert_parity(ref_losses, losses, ref_model, model)
        self.assertEqual(opt.step_count(), 20)

    def test_grad_scaler_and_a_skipped_step(self):
        data = batches(12, seed=7)

        def run(make_opt):
            model = make_model()
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=4)
            opt = make_opt(model, scaler)
            return (model, *train_scaled(model, opt, scaler, data), opt)

        ref_model, ref_losses, ref_scale, _ = run(
            lambda m, s: torch.optim.AdamW(m.parameters(), lr=LR))
        model, losses, scale, opt = run(lambda m, s: tierstate_torch.AdamW(m.parameters(), lr=LR))
        self.assert_parity(ref_losses, losses, ref_model, model)
        self.assertEqual(scale, ref_scale)
        self.assertEqual(opt.step_count(), 11)
        model, losses, scale, opt = run(lambda m, s: tierstate_torch.AdamW(
            m.parameters(), lr=LR, overlap_backward=True, grad_scaler=s))
        self.assert_parity(ref_losses, losses, ref_model, model)
        self.assertEqual(opt.step_count(), 11)
        # fp16 params with a GradScaler on NVMe: overlap_backward's update goes to a shadowed
        # state as backward runs, and the overflowed step is undone whole: the same bits as
        # plain steps in memory, the scale's history included.
        runs = []
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            for kw in (dict(tier="pinned"), dict(tier="nvme", path=d, overlap_backward=True, chunk_elements=2048)):
                half = make_model(torch.float16)
                scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=3)
                opt = tierstate_torch.AdamW(half.parameters(), lr=1e-3, **kw,
                                            grad_scaler=scaler if "path" in kw else None)
                runs.append((*train_scaled(half, opt, scaler, data[:8], overflow_at=4), opt.composition()[0],
                             opt.step_count(), {k: v.clone() for k, v in half.state_dict().items()}))
                opt.close()
        self.assertTrue(runs[1][2].endswith("with shadow_state"))
        self.assertEqual(runs[0][0], runs[1][0])  # losses (0 for the overflowed step)
        self.assertEqual(runs[0][1], runs[1][1])  # the final scale
        self.assertEqual((runs[0][3], runs[1][3]), (7, 7))
        for k in runs[0][4]:
            self.assertTrue(torch.equal(runs[0][4][k], runs[1][4][k]), k)

    def test_state_dict_round_trip_is_exact(self):
        data = batches(30, seed=11)
        model, opt = self.ours(data, "pinned")
        sched = schedule(opt)
        train(model, opt, data[:20], sched)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
        rest_a = train(model, opt, data[20:], sched)

        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            model2 = make_model()
            model2.load_state_dict(saved["model"])
            opt2 = tierstate_torch.AdamW(groups(model2), lr=LR, betas=(0.9, 0.95), tier="nvme", path=d,
                                         chunk_elements=4096)
            sched2 = schedule(opt2)
            sched2.load_state_dict(saved["sched"])
            opt2.load_state_dict(saved["opt"])
            rest_b = train(model2, opt2, data[20:], sched2)
        self.assertEqual(rest_a, rest_b)
        for p, q in zip(model.parameters(), model2.parameters()):
            self.assertTrue(torch.equal(p, q))

    def test_trace_writes_each_steps_timeline(self):
        """optimizer.trace(path): Chrome trace-event JSON of the steps inside it, each chunk
        read, computed and written once a step, in order, on a bf16 shard and an fp32 one (two
        processes of one file); the results are those of an untraced run, bit for bit; bad
        arguments are refused before anything starts, and nothing is left behind."""
        data = batches(6, seed=23)
        runs = []
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            for traced in (False, True):
                model = _TwoDtypes()  # (two shards)
                opt = tierstate_torch.AdamW(model.parameters(), lr=LR, tier="nvme", path=d, chunk_elements=2048)
                train(model, opt, data[:3])
                path = os.path.join(d, "steps.json")
                if traced:
                    with opt.trace(path) as t:
                        losses = train(model, opt, data[3:])
                    self.assertEqual(t.dropped, 0)
                    self.assertGreater(t.events, 0)
                else:
                    losses = train(model, opt, data[3:])
                runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
                opt.close()
            self.assertEqual(sorted(os.listdir(d)), ["steps.json"])
            with open(os.path.join(d, "steps.json")) as f:
                doc = json.load(f)
        self.assertEqual(runs[0][0], runs[1][0])
        for k in runs[0][1]:
            self.assertTrue(torch.equal(runs[0][1][k], runs[1][1][k]), k)
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
        self.assertEqual(sorted(names.values()), ["tierstate bfloat16@cpu", "tierstate float32@cpu"])
        for pid in names:
            steps = sorted((e for e in spans if e["pid"] == pid and e["name"] == "step"), key=lambda e: e["ts"])
            self.assertEqual(len(steps), 3)
            for s in steps:
                inside = [e for e in spans if e["pid"] == pid and s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
                chunks = {}
                for e in inside:
                    if e["name"] in ("read", "compute", "write"):
                        self.assertNotIn(e["name"], chunks.setdefault(e["args"]["chunk"], {}))
                        chunks[e["args"]["chunk"]][e["name"]] = e
                self.assertTrue(chunks)
                for k, ph in chunks.items():
                    self.assertEqual(set(ph), {"read", "compute", "write"}, k)
                    self.assertLessEqual(ph["read"]["ts"] + ph["read"]["dur"], ph["compute"]["ts"] + 1e-3)
                    self.assertLessEqual(ph["compute"]["ts"] + ph["compute"]["dur"], ph["write"]["ts"] + 1e-3)
        model = make_model()
        opt = tierstate_torch.AdamW(model.parameters(), lr=LR)
        with self.assertRaisesRegex(ValueError, "capacity=0"):
            opt.trace("x.json", capacity=0)
        with self.assertRaisesRegex(FileNotFoundError, "does not exist"):
            opt.trace("/nonexistent/dir/x.json")
        opt.close()

    def test_progress_of_making_the_state_saving_and_loading(self):
        """progress=f: f(phase, done, total) after each chunk as the first step makes the state,
        as state_dict() saves it and load_state_dict() verifies and loads it, rising to the
        total; a bad value is refused by name."""
        heard: list[tuple[str, int, int]] = []
        data = batches(2, seed=29)
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            model = make_model(torch.bfloat16)
            opt = tierstate_torch.AdamW(model.parameters(), lr=LR, tier="nvme", path=d, chunk_elements=2048,
                                        progress=lambda *a: heard.append(a))
            train(model, opt, data[:1])
            sd = opt.state_dict()
            opt.load_state_dict(sd)
            opt.close()
        n = sum(p.numel() for p in model.parameters())
        chunks = -(-n // 2048)
        for phase in ("make_state", "save", "verify", "load"):
            calls = [(done, total) for ph, done, total in heard if ph == phase]
            self.assertGreaterEqual(len(calls), chunks, phase)
            self.assertEqual(calls[-1][0], calls[-1][1], phase)
            self.assertEqual(len({t for _, t in calls}), 1, phase)
            self.assertTrue(all(a[0] < b[0] for a, b in zip(calls, calls[1:])), phase)
        self.assertEqual([ph for ph, _, _ in heard][0], "make_state")
        with self.assertRaisesRegex(ValueError, "progress must be"):
            tierstate_torch.AdamW(make_model().parameters(), progress="yes")

    def test_metrics_hear_each_step_and_the_writes_per_day(self):
        """metrics=f: each step's numbers with the state's bytes written so far and per day at
        the run's pace; drive_wear names the drive under a path, or why it cannot tell."""
        heard: list[dict] = []
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            model = make_model()
            opt = tierstate_torch.AdamW(model.parameters(), lr=LR, tier="nvme", path=d, metrics=heard.append)
            train(model, opt, batches(3, seed=31))
            wear = tierstate_torch.drive_wear(d)
            opt.close()
        self.assertEqual([h["step"] for h in heard], [1, 2, 3])
        per_step = heard[0]["tier_bytes_written"]
        self.assertGreater(per_step, 0)
        self.assertEqual(heard[-1]["state_bytes_written_total"], 3 * per_step)
        self.assertNotIn("state_bytes_written_per_day", heard[0])
        self.assertGreater(heard[2]["state_bytes_written_per_day"], 0)
        self.assertIn("device", wear)
        self.assertTrue("unavailable" in wear or "data_written_bytes" in wear, wear)
        with self.assertRaisesRegex(ValueError, "metrics must be a callable"):
            tierstate_torch.AdamW(make_model().parameters(), metrics=3)

    def test_plan_counts_the_model_and_predicts_as_the_tool(self):
        """tierstate_torch.plan(model): the model's parameters and dtype counted, the bytes of
        each composition as the planner's arithmetic has them, the table and JSON lines, and bad
        values refused naming them."""
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).to(torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        gib = 1 << 30
        p = tierstate_torch.plan(model, gpu_memory=24 * gib, host_memory=128 * gib, probe=False, host_gb_s=40.0,
                                 pcie_gb_s=20.0)
        self.assertEqual(p.params, n)
        rows = {c["name"]: c for c in p.compositions}
        on_gpu = rows["all on the GPU (no offload)"]
        self.assertEqual(on_gpu["gpu_bytes"], n * (2 + 2 + 12))  # bf16 params and grads, fp32 master and moments
        self.assertIsNone(on_gpu["step_seconds"])
        host = rows["state in PinnedHost (ZeRO-Offload)"]
        self.assertEqual(host["gpu_bytes"], n * 4)
        self.assertAlmostEqual(host["step_seconds"], max(n * (2 * 12 + 2 * 2) / 40e9, n * 4 / 20e9))
        self.assertTrue(host["fits"])
        weights = rows["state and weights in NvmeFile (offload_parameters)"]
        self.assertEqual(weights["gpu_bytes"], n * 4 * 2 / 6)  # two of the six blocks
        self.assertFalse(weights["fits"])  # no NVMe folder given
        self.assertEqual(p.recommended["name"], "all on the GPU (no offload)")
        self.assertEqual(p.machine["pcie_source"], "given")
        self.assertIn("bandwidths: host memory 40.0 GB/s (given)", str(p))
        lines = [json.loads(line) for line in p.json().splitlines()]
        self.assertEqual([r["plan"] for r in lines], [c["name"] for c in p.compositions])
        self.assertEqual(lines[0]["param"], "bf16")
        # A count, an fp32 model's dtype, the int8 state, on an NVMe folder with its probe.
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            big = tierstate_torch.plan(70e9, state="int8", rule="lion", nvme=d, nvme_capacity=4e12,
                                       scratch_bytes=8 << 20, host_gb_s=40.0, gpu_memory=24 * gib,
                                       host_memory=128 * gib)
            self.assertEqual(os.listdir(d), [])  # the probe's scratch file had no name
        self.assertEqual(big.machine["disk_source"], "measured")
        if torch.cuda.is_available():  # PCIe measured with torch
            self.assertTrue(big.machine["pcie_source"].startswith("measured"), big.machine)
            self.assertGreater(big.machine["pcie_gb_s"], 1.0)
        else:
            self.assertEqual(big.machine["pcie_source"], "assumed: torch sees no GPU")
        self.assertGreater(big.machine["disk_gb_s"], 0)
        self.assertEqual(big.recommended["name"], "state and weights in NvmeFile (offload_parameters)")
        self.assertIsNotNone(big.recommended["step_seconds"])
        self.assertEqual(tierstate_torch.plan(make_model(), probe=False).compositions[0]["gpu_bytes"],
                         sum(q.numel() for q in make_model().parameters()) * (4 + 4 + 8))  # fp32: no master
        for kwargs, words in [(dict(state="fp8"), "state = fp8"), (dict(rule="adagrad"), "rule = adagrad"),
                              (dict(gpu_memory=-1), "gpu_memory must be a positive number"),
                              (dict(layers=0), "layers = 0")]:
            with self.assertRaisesRegex(ValueError, words):
                tierstate_torch.plan(model, probe=False, **kwargs)
        with self.assertRaisesRegex(ValueError, "a parameter count must be positive"):
            tierstate_torch.plan(0)
        with self.assertRaisesRegex(TypeError, "not str"):
            tierstate_torch.plan("7B")

    def test_bind_threads_changes_no_bit(self):
        """bind_threads=True: the workers on physical cores; the same params, bit for bit."""
        data = batches(3, seed=37)
        runs = []
        for bind in (False, True):
            model = make_model(torch.bfloat16)
            opt = tierstate_torch.AdamW(model.parameters(), lr=LR, threads=2, bind_threads=bind)
            runs.append((train(model, opt, data), [p.detach().clone() for p in model.parameters()]))
            opt.close()
        self.assertEqual(runs[0][0], runs[1][0])
        for a, b in zip(runs[0][1], runs[1][1]):
            self.assertTrue(torch.equal(a, b))

    def test_state_dict_format_torch_round_trip_is_exact(self):
        """state_dict_format="torch": torch's format, the slots in fp32 and the master kept, so
        that a bf16 model's run (fp32 or 8-bit moments) goes on bit for bit from it; torch's own
        AdamW loads it too."""
        data = batches(16, seed=17)
        for state_dtype in (torch.float32, torch.int8):
            model = make_model(torch.bfloat16)
            opt = tierstate_torch.AdamW(groups(model), lr=LR, state_dtype=state_dtype, min_8bit_size=0,
                                        state_dict_format="torch")
            train(model, opt, data[:8])
            sd = opt.state_dict()
            self.assertNotIn("tierstate", sd)
            for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):  # (the state's order)
                s = sd["state"][i]
                self.assertEqual(sorted(s), ["exp_avg", "exp_avg_sq", "master", "step"])
                self.assertEqual((s["exp_avg"].dtype, s["master"].dtype, s["master"].shape),
                                 (torch.float32, torch.float32, p.shape))
            saved = copy.deepcopy(sd)
            model2 = copy.deepcopy(model)
            rest_a = train(model, opt, data[8:])
            opt2 = tierstate_torch.AdamW(groups(model2), lr=LR, state_dtype=state_dtype, min_8bit_size=0,
                                         state_dict_format="torch")
            opt2.load_state_dict(saved)
            rest_b = train(model2, opt2, data[8:])
            self.assertEqual(rest_a, rest_b, state_dtype)
            for p, q in zip(model.parameters(), model2.parameters()):
                self.assertTrue(torch.equal(p, q), state_dtype)
        ref = make_model(torch.bfloat16)
        ref_opt = torch.optim.AdamW(groups(ref), lr=LR)
        ref_opt.load_state_dict(saved)  # (torch's: it keeps "master" as one more entry, and casts the slots)
        self.assertEqual(float(ref_opt.state[next(ref.parameters())]["step"]), 8.0)

    def test_distributed_checkpoint_does_not_step_a_trained_optimizer(self):
        """torch.distributed.checkpoint's get_optimizer_state_dict steps an optimizer whose
        `state` is empty (with zero gradients and lr 0) to make its state: tierstate's `state`
        is true once it stepped, so a trained one is read as it is; with state_dict_format=
        "torch", set_optimizer_state_dict loads what get gave into a new one, which goes on bit
        for bit."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        data = batches(12, seed=19)
        model = make_model()
        opt = tierstate_torch.AdamW(groups(model), lr=LR, state_dict_format="torch")
        self.assertFalse(opt.state)
        train(model, opt, data[:6])
        self.assertTrue(opt.state)
        before = {n: opt.get_state(p, "exp_avg").clone() for n, p in model.named_parameters()}
        osd = get_optimizer_state_dict(model, opt)
        self.assertEqual(opt.step_count(), 6)
        for n, p in model.named_parameters():
            self.assertTrue(torch.equal(opt.get_state(p, "exp_avg"), before[n]), n)
            self.assertTrue(torch.equal(osd["state"][n]["exp_avg"], before[n]), n)
        saved = copy.deepcopy(osd)
        model2 = copy.deepcopy(model)
        rest_a = train(model, opt, data[6:])
        opt2 = tierstate_torch.AdamW(groups(model2), lr=LR, state_dict_format="torch")
        set_optimizer_state_dict(model2, opt2, saved)
        self.assertEqual(opt2.step_count(), 6)
        rest_b = train(model2, opt2, data[6:])
        self.assertEqual(rest_a, rest_b)
        for p, q in zip(model.parameters(), model2.parameters()):
            self.assertTrue(torch.equal(p, q))
        with self.assertRaisesRegex(ValueError, "state_dict_format must be"):
            tierstate_torch.AdamW(groups(make_model()), state_dict_format="dcp")

    def test_converts_to_and_from_torch_adamw(self):
        data = batches(30, seed=13)
        # torch -> tierstate
        ref = make_model()
        ref_opt = torch.optim.AdamW(groups(ref), lr=LR, betas=(0.9, 0.95))
        train(ref, ref_opt, data[:20])
        model = copy.deepcopy(ref)
        opt = tierstate_torch.AdamW(groups(model), lr=LR, betas=(0.9, 0.95), chunk_elements=4096)
        opt.load_state_dict(ref_opt.state_dict())
        self.assertEqual(opt.step_count(), 20)
        ref_losses = train(ref, ref_opt, data[20:])
        losses = train(model, opt, data[20:])
        self.assert_parity(ref_losses, losses, ref, model)
        # tierstate -> torch
        back = copy.deepcopy(model)
        back_opt = torch.optim.AdamW(groups(back), lr=LR, betas=(0.9, 0.95))
        back_opt.load_state_dict(opt.torch_state_dict())
        self.assertTrue(back_opt.param_groups[0]["decoupled_weight_decay"])
        more = batches(5, seed=17)
        self.assert_parity(train(back, back_opt, more), train(model, opt, more), back, model)
        # A step count that is not one is refused, naming where, and changes nothing.
        sd = ref_opt.state_dict()
        sd["state"][0]["step"] = torch.tensor(2.5)
        before = opt.step_count(next(model.parameters()))
        with self.assertRaisesRegex(ValueError, r"state\[0\]\['step'\] is 2.5"):
            opt.load_state_dict(sd)
        self.assertEqual(opt.step_count(next(model.parameters())), before)
        # A tierstate state_dict that does not fit changes nothing, the param groups included:
        # of bf16 state, or of other params, refused by the checkpoint's own check (8-bit
        # state is refused by name before: test_int8_state_is_blockwise_8bit_adamw).
        other = tierstate_torch.AdamW(groups(copy.deepcopy(model)), lr=0.07, state_dtype=torch.bfloat16)
        with self.assertRaisesRegex(Exception, "checkpoint of the float32@cpu, bfloat16 state parameters"):
            other.load_state_dict(opt.state_dict())
        self.assertEqual(other.param_groups[0]["lr"], 0.07)
        wider = copy.deepcopy(model)
        wider.head.bias = nn.Parameter(torch.zeros(VOCAB + 1))
        other = tierstate_torch.AdamW(groups(wider), lr=0.07)
        with self.assertRaisesRegex(Exception, "checkpoint of the float32@cpu parameters"):
            other.load_state_dict(opt.state_dict())
        self.assertEqual(other.param_groups[0]["lr"], 0.07)

    def test_conditional_compute_keeps_torch_per_param_step_counts(self):
        """The second block is skipped every third step (its params' .grad stays None), as
        conditional compute and MoE experts do: torch counts steps per param, and so does
        tierstate; the counts go both ways through state_dicts."""
        data = batches(30, seed=23)

        def run(model, opt, data, offset=0):
            losses = []
            for i, (x, y) in enumerate(data):
                opt.zero_grad(set_to_none=True)
                skip = (i + offset) % 3 == 2
                h = model.embed(x) + model.pos[: x.shape[1]]
                h = model.blocks[0](h) if skip else model.blocks(h)
                logits = model.head(model.norm(h))
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
                loss.backward()
                opt.step()
                losses.append(loss.item())
            return losses

        ref = make_model()
        ref_opt = torch.optim.AdamW(groups(ref), lr=LR, betas=(0.9, 0.95))
        model = make_model()
        opt = tierstate_torch.AdamW(groups(model), lr=LR, betas=(0.9, 0.95), chunk_elements=4096)
        self.assert_parity(run(ref, ref_opt, data[:20]), run(model, opt, data[:20]), ref, model)
        skipped = model.blocks[1].q.weight
        self.assertEqual(opt.step_count(), 20)
        self.assertEqual(opt.step_count(skipped), 14)
        self.assertEqual(opt.step_count(model.head.weight), 20)
        ours = opt.torch_state_dict()["state"]
        for i, p in enumerate(p for g in ref_opt.param_groups for p in g["params"]):  # (the groups' order)
            self.assertEqual(float(ours[i]["step"]), float(ref_opt.state[p]["step"]))
        # torch -> tierstate, with counts that differ per param; the last steps alike.
        again = copy.deepcopy(ref)
        again_opt = tierstate_torch.AdamW(groups(again), lr=LR, betas=(0.9, 0.95), chunk_elements=4096)
        again_opt.load_state_dict(ref_opt.state_dict())
        self.assertEqual(again_opt.step_count(again.blocks[1].q.weight), 14)
        self.assertEqual(again_opt.step_count(), 20)
        self.assert_parity(run(ref, ref_opt, data[20:], 20), run(again, again_opt, data[20:], 20), ref, again)

    def test_sgd_lion_and_adafactor_train_as_torch_does(self):
        """torch.optim.SGD (momentum with dampening, Nesterov, none), Lion (its reference above)
        and torch.optim.Adafactor against tierstate_torch's, 50 steps with the LR schedule,
        pinned and NVMe; then
        their state_dicts both ways, and a tensor skipped every third step (its buffer starts
        at its own first gradient, as torch's does)."""
        data = batches(STEPS, seed=29)
        cases = [
            ("sgd momentum", torch.optim.SGD, tierstate_torch.SGD,
             dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)),
            ("sgd nesterov", torch.optim.SGD, tierstate_torch.SGD,
             dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3, maximize=False)),
            ("sgd", torch.optim.SGD, tierstate_torch.SGD, dict(lr=0.1)),
            ("lion", LionReference, tierstate_torch.Lion, dict(lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)),
            ("adafactor", torch.optim.Adafactor, tierstate_torch.Adafactor, dict(lr=3e-2, weight_decay=1e-2, d=1.5)),
        ]
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            for name, theirs, ours, kw in cases:
                ref = make_model()
                ref_opt = theirs(groups(ref, kw.get("weight_decay", 0.0)), **kw)
                ref_losses = train(ref, ref_opt, data, schedule(ref_opt))
                self.assertLess(ref_losses[-1], 0.9 * ref_losses[0], f"{name}: the model did not learn")
                for tier, path in (("pinned", None), ("nvme", d)):
                    with self.subTest(rule=name, tier=tier):
                        model = make_model()
                        opt = ours(groups(model, kw.get("weight_decay", 0.0)), tier=tier, path=path,
                                   chunk_elements=4096, **kw)
                        self.assert_parity(ref_losses, train(model, opt, data, schedule(opt)), ref, model,
                                           lr=kw["lr"])
                        self.assertEqual(opt.step_count(), STEPS)
                # torch -> tierstate -> torch, each continuing as the other would.
                with self.subTest(rule=name, state_dict="both ways"):
                    more = batches(16, seed=31)
                    ref = make_model()
                    ref_opt = theirs(groups(ref, kw.get("weight_decay", 0.0)), **kw)
                    train(ref, ref_opt, more[:10])
                    model = copy.deepcopy(ref)
                    opt = ours(groups(model, kw.get("weight_decay", 0.0)), chunk_elements=4096, **kw)
                    opt.load_state_dict(ref_opt.state_dict())
                    self.assert_parity(train(ref, ref_opt, more[10:13]), train(model, opt, more[10:13]), ref,
                                       model, lr=kw["lr"])
                    back = copy.deepcopy(model)
                    back_opt = theirs(groups(back, kw.get("weight_decay", 0.0)), **kw)
                    back_opt.load_state_dict(opt.torch_state_dict())
                    self.assert_parity(train(back, back_opt, more[13:]), train(model, opt, more[13:]), back,
                                       model, lr=kw["lr"])

    def test_torch_state_dicts_are_checked_whole_before_anything_changes(self):
        data = batches(4, seed=41)
        ref = make_model()
        ref_opt = torch.optim.AdamW(groups(ref), lr=LR)
        train(ref, ref_opt, data[:2])
        model = copy.deepcopy(ref)
        opt = tierstate_torch.AdamW(groups(model), lr=0.07, chunk_elements=4096)
        train(model, opt, data[:1])
        before = (opt.torch_state_dict(), opt.param_groups[0]["lr"])

        def refused(sd, pattern, other=opt):
            with self.assertRaisesRegex(ValueError, pattern):
                other.load_state_dict(sd)
            after = (opt.torch_state_dict(), opt.param_groups[0]["lr"])
            self.assertEqual(after[1], before[1])
            for i, s in before[0]["state"].items():
                for k, v in s.items():
                    self.assertTrue(torch.equal(v, after[0]["state"][i][k]), f"state[{i}][{k}] changed")

        sd = copy.deepcopy(ref_opt.state_dict())
        sd["param_groups"] = sd["param_groups"][:1]
        refused(sd, "has 1 param groups; this optimizer has 2")
        sd = copy.deepcopy(ref_opt.state_dict())
        last = max(sd["state"])
        sd["state"][last]["exp_avg"] = sd["state"][last]["exp_avg"][:-1]
        refused(sd, r"\['exp_avg'\] is .* elements; its param has")
        sd = copy.deepcopy(ref_opt.state_dict())
        sd["state"][99] = sd["state"][0]
        refused(sd, "state for param 99, which no param group lists")
        sd = copy.deepcopy(ref_opt.state_dict())
        del sd["state"][0]["exp_avg_sq"]
        refused(sd, r"has step 2 but not all of \['exp_avg', 'exp_avg_sq'\]")
        # An Adam state_dict is not Lion's, whose groups it would otherwise fit.
        lion = tierstate_torch.Lion(groups(copy.deepcopy(ref)), lr=1e-4)
        with self.assertRaisesRegex(ValueError, r"have \['eps', 'amsgrad'\]: the state_dict of another optimizer"):
            lion.load_state_dict(ref_opt.state_dict())
        # A state_dict from before torch had `maximize` (or one that drops its flags) loads.
        sd = copy.deepcopy(ref_opt.state_dict())
        for g in sd["param_groups"]:
            del g["maximize"], g["amsgrad"]
        model.load_state_dict(ref.state_dict())  # (its own first step moved it)
        opt.load_state_dict(sd)
        self.assertEqual(opt.step_count(next(model.parameters())), 2)
        self.assertFalse(opt.param_groups[0]["maximize"])
        self.assert_parity(train(ref, ref_opt, data[2:]), train(model, opt, data[2:]), ref, model)

    def test_adafactor_on_every_rank_with_conditional_compute(self):
        """torch.optim.Adafactor factors the last two dimensions (a 3-D param is a batch of
        matrices) and keeps a vector's, and a scalar's, whole; a param without a gradient every
        third step keeps its count. Against torch's, with both state_dicts both ways."""
        torch.manual_seed(3)
        shapes = [(2, 3, 5), (4, 1, 6), (7, 9), (1, 8), (8,), ()]

        def make():
            g = torch.Generator().manual_seed(11)
            return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]

        targets = [torch.randn(s, generator=torch.Generator().manual_seed(13)) for s in shapes]

        def run(params, opt, steps, offset=0):
            losses = []
            for i in range(steps):
                opt.zero_grad(set_to_none=True)
                skip = (i + offset) % 3 == 2
                loss = sum(((p - t * (1 + 0.1 * (i + offset))) ** 2).sum() * (k + 1)
                           for k, (p, t) in enumerate(zip(params, targets)) if not (skip and k == 1))
                loss.backward()
                opt.step()
                losses.append(loss.item())
            return losses

        kw = dict(lr=5e-2, weight_decay=1e-2, d=1.2)
        ref, ours = make(), make()
        ref_opt = torch.optim.Adafactor(ref, **kw)
        opt = tierstate_torch.Adafactor(ours, chunk_elements=2048, **kw)
        a, b = run(ref, ref_opt, 12), run(ours, opt, 12)
        for i, (x, y) in enumerate(zip(a, b)):
            self.assertLessEqual(abs(x - y), 1e-5 * abs(x), f"step {i + 1}: loss {y} vs torch's {x}")
        for p, q in zip(ref, ours):
            self.assertTrue(torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"a param of shape {tuple(p.shape)}")
        self.assertEqual(opt.step_count(ours[1]), 8)
        self.assertEqual(opt.step_count(ours[0]), 12)
        # Backward's hooks (the passes wait for every gradient) and a GradScaler's scale give
        # the same bits.
        hooked = make()
        hooked_opt = tierstate_torch.Adafactor(hooked, chunk_elements=2048, overlap_backward=True, **kw)
        run(hooked, hooked_opt, 12)
        scaled = make()
        scaled_opt = tierstate_torch.Adafactor(scaled, chunk_elements=2048, **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for i in range(12):
            scaled_opt.zero_grad(set_to_none=True)
            loss = sum(((p - t * (1 + 0.1 * i)) ** 2).sum() * (k + 1)
                       for k, (p, t) in enumerate(zip(scaled, targets)) if not (i % 3 == 2 and k == 1))
            scaler.scale(loss).backward()
            scaler.step(scaled_opt)
            scaler.update()
        for p, q, r in zip(ours, hooked, scaled):
            self.assertTrue(torch.equal(p, q), f"overlap_backward, a param of shape {tuple(p.shape)}")
            self.assertTrue(torch.equal(p, r), f"GradScaler, a param of shape {tuple(p.shape)}")
        mine = opt.torch_state_dict()["state"]
        for i, p in enumerate(ref):
            theirs = ref_opt.state[p]
            self.assertEqual(sorted(mine[i]), sorted(theirs), f"param {i}'s state keys")
            for k, v in theirs.items():
                self.assertEqual(mine[i][k].shape, v.shape, f"state[{i}][{k!r}]'s shape")
                self.assertTrue(torch.allclose(mine[i][k].float(), v.float(), rtol=1e-5, atol=1e-12), f"[{i}][{k!r}]")
        # torch -> tierstate -> torch, each going on as the other would.
        again = [torch.nn.Parameter(p.detach().clone()) for p in ref]
        again_opt = tierstate_torch.Adafactor(again, chunk_elements=2048, **kw)
        again_opt.load_state_dict(ref_opt.state_dict())
        self.assertEqual(again_opt.step_count(again[1]), 8)
        a, b = run(ref, ref_opt, 6, 12), run(again, again_opt, 6, 12)
        for x, y in zip(a, b):
            self.assertLessEqual(abs(x - y), 1e-5 * abs(x))
        back = [torch.nn.Parameter(p.detach().clone()) for p in again]
        back_opt = torch.optim.Adafactor(back, **kw)
        back_opt.load_state_dict(again_opt.torch_state_dict())
        a, b = run(back, back_opt, 6, 18), run(again, again_opt, 6, 18)
        for x, y in zip(a, b):
            self.assertLessEqual(abs(x - y), 1e-5 * abs(x))
        # A state_dict whose statistics do not fit the params is refused whole, by name.
        sd = copy.deepcopy(ref_opt.state_dict())
        sd["state"][0]["col_var"] = sd["state"][0]["col_var"][..., :-1]
        with self.assertRaisesRegex(ValueError, r"\['col_var'\] is 8 elements; for its param of shape \(2, 3, 5\) it has 10"):
            again_opt.load_state_dict(sd)
        sd = copy.deepcopy(ref_opt.state_dict())
        del sd["state"][4]["variance"]
        with self.assertRaisesRegex(ValueError, r"has step 18 but not all of \['variance'\]"):
            again_opt.load_state_dict(sd)

    def test_sgd_momentum_buffers_start_at_each_params_own_first_gradient(self):
        data = batches(12, seed=37)

        def run(model, opt):
            losses = []
            for i, (x, y) in enumerate(data):
                opt.zero_grad(set_to_none=True)
                h = model.embed(x) + model.pos[: x.shape[1]]
                h = model.blocks[0](h) if i < 2 or i % 3 == 1 else model.blocks(h)  # block 1 joins late
                loss = nn.functional.cross_entropy(model.head(model.norm(h)).reshape(-1, VOCAB), y.reshape(-1))
                loss.backward()
                opt.step()
                losses.append(loss.item())
            return losses

        kw = dict(lr=0.05, momentum=0.9, dampening=0.5)
        ref, model = make_model(), make_model()
        ref_opt, opt = torch.optim.SGD(ref.parameters(), **kw), tierstate_torch.SGD(model.parameters(), **kw)
        self.assert_parity(run(ref, ref_opt), run(model, opt), ref, model, lr=kw["lr"])
        self.assertEqual(opt.step_count(model.blocks[1].q.weight), 12 - 2 - 3)

    def test_adam_amsgrad_maximize(self):
        data = batches(15, seed=19)
        ref = make_model()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=LR, weight_decay=1e-2, amsgrad=True, maximize=True)
        model = make_model()
        opt = tierstate_torch.Adam(model.parameters(), lr=LR, weight_decay=1e-2, amsgrad=True, maximize=True,
                                   chunk_elements=2048, threads=2)
        self.assertIn("adam_amsgrad", opt.composition()[0])
        self.assert_parity(train(ref, ref_opt, data), train(model, opt, data), ref, model)
        sd = opt.torch_state_dict()
        self.assertIn("max_exp_avg_sq", sd["state"][0])

    def test_clipping_an_inf_or_nan_norm_as_torch_does(self):
        """max_grad_norm with on_nonfinite="report" (or "ignore") and an inf or a NaN in a
        gradient: the step goes on as torch.nn.utils.clip_grad_norm_ (error_if_nonfinite=False)
        then torch.optim.AdamW would take it: a factor of 0 for an inf norm (the inf element
        becoming NaN), NaN for a NaN one."""
        for bad in (float("inf"), float("nan")):
            for policy in ("report", "ignore"):
                with self.subTest(bad=bad, policy=policy):
                    torch.manual_seed(3)
                    init = [torch.randn(5000), torch.randn(37)]
                    ref = [x.clone().requires_grad_() for x in init]
                    ours = [x.clone().requires_grad_() for x in init]
                    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
                    opt = tierstate_torch.AdamW(ours, lr=1e-2, max_grad_norm=1.0, on_nonfinite=policy)
                    for step in range(3):
                        grads = [torch.randn_like(x) * 1e-3 for x in init]
                        if step == 1:
                            grads[0][4321] = bad
                        for p, g in zip(ref, grads):
                            p.grad = g.clone()
                        torch.nn.utils.clip_grad_norm_(ref, 1.0)
                        ref_opt.step()
                        for p, g in zip(ours, grads):
                            p.grad = g.clone()
                        opt.step()
                        self.assertFalse(opt.last_step.get("skipped"), opt.last_step)
                        for a, b in zip(ref, ours):
                            torch.testing.assert_close(b.detach(), a.detach(), equal_nan=True)
                    self.assertTrue(torch.isnan(ours[0][4321]))
                    self.assertEqual(bool(torch.isfinite(ours[1]).all()), bad == float("inf"))

    def test_a_norm_across_ranks_is_one_process_bits(self):
        """FSDP2's ranks hold row ranges of each tensor, cut anywhere: their gradient norm,
        gathered (tierstate_torch._ranks: each rank's block sums, and the elements that end a
        block an earlier rank began), is the bits one process's max_grad_norm computes, for
        2, 3 and 5 ranks over awkward shapes (a rank inside one block, ranks with no rows, a
        tensor without a gradient, bf16)."""
        from tierstate_torch import _ranks
        torch.manual_seed(5)
        for dtype in (torch.float32, torch.bfloat16):
            shapes = [(5000, 3), (3, 4113), (1,), (10000, 1), (7, 2048), (2, 2)]
            grads = [torch.randn(s).to(dtype) * 10 ** torch.randint(-3, 3, ()).item() for s in shapes]
            grads[3] = None if dtype == torch.bfloat16 else grads[3]
            params = [torch.zeros(s, dtype=dtype, requires_grad=True) for s in shapes]
            opt = tierstate_torch.AdamW(params, lr=1e-3, max_grad_norm=1e-9, master="fp32")
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
            one_process = opt.last_step["grad_norm"]
            for cuts in ({"rows": 2}, {"rows": 3}, {"rows": 5}, {"at": [100, 200]}):
                with self.subTest(dtype=dtype, cuts=cuts):
                    everyone = []
                    ranks = cuts.get("rows", 3)
                    for r in range(ranks):
                        pieces = []
                        for g, shape in zip(grads, shapes):
                            rows, per_row = shape[0], math.prod(shape[1:])
                            if "at" in cuts:  # rank 1 inside one block of the (10000, 1) tensor
                                bounds = [0, *[min(a, rows) for a in cuts["at"]], rows]
                            else:
                                per = -(-rows // ranks)
                                bounds = [min(rows, per * k) for k in range(ranks)] + [rows]
                            a, b = bounds[r], bounds[r + 1]
                            part = None if g is None else g.reshape(rows, -1)[a:b].reshape(-1)
                            pieces.append((part, a * per_row))
                        everyone.append(_ranks.norm_pieces(pieces))
                    self.assertEqual(_ranks.combine_norm(everyone), one_process)

    def test_bf16_params_with_a_master(self):
        data = batches(10, seed=23)
        model = make_model(torch.bfloat16)
        opt = tierstate_torch.AdamW(model.parameters(), lr=1e-2, state_dtype=torch.bfloat16)
        self.assertIn("bf16/bf16/fp32/bf16", opt.composition()[0])
        losses = train(model, opt, data * 3)
        self.assertLess(losses[-1], losses[0])
        w = model.head.weight
        master = opt.get_state(w, "master")
        self.assertEqual(master.dtype, torch.float32)
        self.assertTrue(torch.equal(master.to(torch.bfloat16), w.detach()))

    def test_nonfinite_gradient_skips_every_shard(self):
        """Several shards (8-bit state and the small tensors min_8bit_size leaves in fp32; fp32
        and bf16 params) with the default on_nonfinite="skip_step": an inf or a NaN in any
        gradient, whatever its dtype, and whichever shard it is in, skips the whole step (no
        param, state or step count changes); a contiguous CPU gradient is checked by the
        extension's own pass (_C.any_nonfinite), a non-contiguous one by torch."""
        ext = tierstate_torch._common._ext()
        self.assertFalse(ext.any_nonfinite([torch.ones(70000), torch.ones(5, dtype=torch.bfloat16)]))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for bad in (float("inf"), float("-inf"), float("nan")):
                x = torch.zeros(200003, dtype=dtype)
                x[199999] = bad
                self.assertTrue(ext.any_nonfinite([torch.zeros(3), x]), f"{dtype} {bad}")
        with self.assertRaisesRegex(RuntimeError, "contiguous CPU tensors only"):
            ext.any_nonfinite([torch.zeros(4, 4).t()])
        with self.assertRaisesRegex(RuntimeError, "float32, bfloat16 or float16 tensors only"):
            ext.any_nonfinite([torch.zeros(4, dtype=torch.float64)])
        torch.manual_seed(5)
        init = [torch.randn(5000), torch.randn(300), torch.randn(4100).to(torch.bfloat16), torch.randn(20, 30)]
        for where in range(len(init)):
            for bad in (float("inf"), float("nan")):
                with self.subTest(tensor=where, bad=bad):
                    qs = [x.clone().requires_grad_() for x in init]
                    opt = tierstate_torch.AdamW(qs, lr=1e-2, state_dtype="int8", min_8bit_size=1000)
                    self.assertGreaterEqual(len(opt.composition()), 3)
                    for q in qs:
                        q.grad = torch.randn_like(q)
                    opt.step()
                    before = [q.detach().clone() for q in qs]
                    state = opt.state_dict()
                    for q in qs:
                        q.grad = torch.randn_like(q)
                    if where == 3:  # a non-contiguous gradient: torch's check
                        qs[3].grad = torch.randn(30, 20).t()
                        qs[3].grad[-1, -1] = bad
                    else:
                        qs[where].grad.view(-1)[-1] = bad
                    opt.step()
                    self.assertTrue(opt.last_step.get("skipped"), opt.last_step)
                    self.assertEqual(opt.step_count(), 1)
                    for a, b in zip(qs, before):
                        self.assertTrue(torch.equal(a.detach(), b))
                    after = opt.state_dict()
                    for k, v in state["state"].items():
                        for name, t in v.items():
                            if torch.is_tensor(t):
                                self.assertTrue(torch.equal(t, after["state"][k][name]), (k, name))
                    for q in qs:  # finite again: it steps
                        q.grad = torch.randn_like(q)
                    opt.step()
                    self.assertEqual(opt.step_count(), 2)

    def test_int8_state_is_blockwise_8bit_adamw(self):
        """state_dtype=torch.int8 against torch.optim.AdamW whose moments are replaced after each
        step by what their 8-bit blocks decode to (tests/golden/make_golden_dynamic8.py: the maps
        as bitsandbytes makes them, a brute-force nearest search): tensors across block edges,
        one under min_8bit_size that keeps fp32 state."""
        sizes = [5000, 700, 257, 3]
        torch.manual_seed(3)
        init = [torch.randn(n) for n in sizes]
        grads = [[torch.randn(n) * (1 + (t % 3)) for n in sizes] for t in range(12)]
        for least in (0, 300):
            with self.subTest(min_8bit_size=least):
                ps = [x.clone().requires_grad_() for x in init]
                qs = [x.clone().requires_grad_() for x in init]
                ref = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=False)
                ours = tierstate_torch.AdamW(qs, lr=1e-2, weight_decay=0.01, state_dtype="int8", min_8bit_size=least)
                self.assert_8bit_parity(ref, ours, ps, qs, grads, least, (("exp_avg", True), ("exp_avg_sq", False)))
                names = " ".join(ours.composition())
                self.assertIn("dynamic8", names)
                self.assertEqual(len(ours.composition()), 1 if least == 0 else 2)
                # state_dict and torch_state_dict give the decoded fp32 moments; a round trip is exact.
                sd = ours.state_dict()
                self.assertTrue(torch.equal(ours.torch_state_dict()["state"][0]["exp_avg"],
                                            ours.get_state(qs[0], "exp_avg")))
                q2 = [q.detach().clone().requires_grad_() for q in qs]
                again = tierstate_torch.AdamW(q2, lr=1e-2, weight_decay=0.01, state_dtype="int8", min_8bit_size=least)
                again.load_state_dict(sd)
                for a, b in zip(qs, q2):
                    a.grad = b.grad = torch.ones_like(a)
                ours.step()
                again.step()
                for a, b in zip(qs, q2):
                    self.assertTrue(torch.equal(a, b))
                # A state_dict of 8-bit state does not load into fp32 state: refused by name.
                plain = tierstate_torch.AdamW([q.detach().clone() for q in qs], lr=1e-2, weight_decay=0.01)
                with self.assertRaisesRegex(ValueError, "int8 state"):
                    plain.load_state_dict(sd)
                # Loading torch's state_dict encodes its fp32 moments.
                again.load_state_dict(ours.torch_state_dict())
                self.assertTrue(torch.equal(again.get_state(q2[0], "exp_avg"), ours.get_state(qs[0], "exp_avg")))
                for o in (ours, again, plain):
                    o.close()

    def test_int8_state_for_adam_lion_and_sgd_momentum(self):
        """state_dtype=torch.int8 for the other rules with moments, as the AdamW test above:
        torch.optim.Adam (L2 weight decay), the Lion reference and torch.optim.SGD with momentum
        (and Nesterov), their moments replaced after each step by what their 8-bit blocks decode
        to; then bf16 params without an fp32 master for each."""
        sizes = [5000, 700, 257, 3]
        torch.manual_seed(4)
        init = [torch.randn(n) for n in sizes]
        grads = [[torch.randn(n) * (1 + (t % 3)) for n in sizes] for t in range(12)]
        cases = [
            ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, foreach=False),
             lambda qs, **kw: tierstate_torch.Adam(qs, lr=1e-2, weight_decay=0.01, **kw),
             (("exp_avg", True), ("exp_avg_sq", False))),
            ("lion", lambda ps: LionReference(ps, lr=1e-3, weight_decay=0.1),
             lambda qs, **kw: tierstate_torch.Lion(qs, lr=1e-3, weight_decay=0.1, **kw), (("exp_avg", True),)),
            ("sgd_momentum", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                        foreach=False),
             lambda qs, **kw: tierstate_torch.SGD(qs, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, **kw),
             (("momentum_buffer", True),)),
        ]
        for rule, make_ref, make_ours, slots in cases:
            with self.subTest(rule=rule):
                ps = [x.clone().requires_grad_() for x in init]
                qs = [x.clone().requires_grad_() for x in init]
                ref, ours = make_ref(ps), make_ours(qs, state_dtype=torch.int8, min_8bit_size=300)
                self.assert_8bit_parity(ref, ours, ps, qs, grads, 300, slots)
                self.assertEqual(sum("dynamic8" in c for c in ours.composition()), 1)
                # A state_dict round trip steps on exactly; torch's state_dict (fp32 moments)
                # loads encoded to the same state.
                q2, q3 = ([q.detach().clone().requires_grad_() for q in qs] for _ in range(2))
                again, third = (make_ours(q, state_dtype=torch.int8, min_8bit_size=300) for q in (q2, q3))
                again.load_state_dict(ours.state_dict())
                third.load_state_dict(ours.torch_state_dict())
                for a, b, c in zip(qs, q2, q3):
                    for slot, _ in slots:
                        self.assertTrue(torch.equal(third.get_state(c, slot), ours.get_state(a, slot)), slot)
                    a.grad = b.grad = c.grad = torch.ones_like(a)
                for o in (ours, again, third):
                    o.step()
                for a, b, c in zip(qs, q2, q3):
                    self.assertTrue(torch.equal(a, b) and torch.equal(a, c), "a state_dict round trip")
                for o in (ours, again, third):
                    o.close()
                # bf16 params: a Kahan compensation lands within 2^-6 relative (2 to 4 bf16
                # spacings) of an fp32 master; stochastic rounding (a random walk of up to a spacing a step, 12 steps)
                # within 16 spacings of the larger of the start and the end, 2 on average.
                ends = {}
                for master in ("fp32", "kahan", "stochastic"):
                    rs = [x.to(torch.bfloat16).requires_grad_() for x in init]
                    opt = make_ours(rs, state_dtype=torch.int8, master=master, min_8bit_size=0)
                    for g in grads:
                        for r, x in zip(rs, g):
                            r.grad = x.to(torch.bfloat16)
                        opt.step()
                    kept = opt._shards[next(iter(opt._shards))].slot_names()
                    self.assertEqual(("master" in kept, "compensation" in kept), (master == "fp32", master == "kahan"))
                    ends[master] = [r.detach().float() for r in rs]
                    opt.close()
                for x, a, k, r in zip(init, ends["fp32"], ends["kahan"], ends["stochastic"]):
                    self.assertLessEqual(((a - k).abs() / a.abs().clamp(min=1e-2)).max().item(), 2 ** -6, "kahan")
                    spacing = 2.0 ** (torch.maximum(a.abs(), x.abs()).clamp(min=2 ** -20).log2().floor() - 7)
                    self.assertLessEqual(((a - r).abs() / spacing).max().item(), 16, "stochastic")
                    if a.numel() >= 256:
                        self.assertLessEqual(((a - r).abs() / spacing).mean().item(), 2, "stochastic")

    def test_compact_state_on_the_emulated_device(self):
        """compute='device' with 8-bit state and the compact masters, on tierstate's emulated
        device (its OnDevice kernels on Thrust's CPP backend): each rule against its torch
        reference with re-encoded moments, as the CPU tests above, with the state in Device
        memory, PinnedHost and NvmeFile; then bf16 params with each compact master, whose params
        and state equal compute='host''s bit for bit (the device kernels are the host's math)."""
        sizes = [5000, 700, 257, 3]
        torch.manual_seed(6)
        init = [torch.randn(n) for n in sizes]
        grads = [[torch.randn(n) * (1 + (t % 3)) for n in sizes] for t in range(8)]
        cases = [
            (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=False),
             lambda qs, **kw: tierstate_torch.AdamW(qs, lr=1e-2, weight_decay=0.01, **kw),
             (("exp_avg", True), ("exp_avg_sq", False))),
            (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, foreach=False),
             lambda qs, **kw: tierstate_torch.Adam(qs, lr=1e-2, weight_decay=0.01, **kw),
             (("exp_avg", True), ("exp_avg_sq", False))),
            (lambda ps: LionReference(ps, lr=1e-3, weight_decay=0.1),
             lambda qs, **kw: tierstate_torch.Lion(qs, lr=1e-3, weight_decay=0.1, **kw), (("exp_avg", True),)),
            (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01, foreach=False),
             lambda qs, **kw: tierstate_torch.SGD(qs, lr=1e-2, momentum=0.9, weight_decay=0.01, **kw),
             (("momentum_buffer", True),)),
        ]
        os.environ["TIERSTATE_TORCH_EMULATED_DEVICE"] = "1"
        try:
            with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
                for make_ref, make_ours, slots in cases:
                    for tier in ("device", "pinned", "nvme"):
                        ps = [x.clone().requires_grad_() for x in init]
                        qs = [x.clone().requires_grad_() for x in init]
                        ours = make_ours(qs, state_dtype=torch.int8, min_8bit_size=300, compute="device", tier=tier,
                                         path=d if tier == "nvme" else None)
                        with self.subTest(rule=type(ours).__name__, tier=tier):
                            self.assertIn("OnDevice", ours.composition()[0])
                            self.assertEqual(sum("dynamic8" in c for c in ours.composition()), 1)
                            self.assert_8bit_parity(make_ref(ps), ours, ps, qs, grads, 300, slots)
                        ours.close()
                    for master in ("kahan", "stochastic"):
                        runs = []
                        for compute in ("host", "device"):
                            rs = [x.to(torch.bfloat16).requires_grad_() for x in init]
                            opt = make_ours(rs, state_dtype=torch.int8, master=master, min_8bit_size=0,
                                            compute=compute, tier="pinned")
                            for g in grads:
                                for r, x in zip(rs, g):
                                    r.grad = x.to(torch.bfloat16)
                                opt.step()
                            runs.append((rs, [opt.get_state(r, slot) for r in rs for slot, _ in slots]))
                            opt.close()
                        with self.subTest(rule=type(opt).__name__, master=master):
                            self.assertTrue(all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0])), "params")
                            self.assertTrue(all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])), "state")
        finally:
            del os.environ["TIERSTATE_TORCH_EMULATED_DEVICE"]

    def test_int8_adamw_against_bitsandbytes(self):
        """state_dtype=torch.int8 against bitsandbytes.optim.AdamW8bit on CPU tensors (its CPU
        kernels, bitsandbytes 0.50.2): the same maps, blocks of 256 and min_8bit_size 4096, fed
        the same gradients for 20 steps. Each step starts bitsandbytes from our state (its codes
        and block scales are ours, in the same format, and the params ours), so each step's
        difference is that step's own, not carried. Its CPU encoder is not the nearest map value
        (a lookup table: up to 7 codes off near zero in the unsigned map), where ours is; so
        after each step every 8-bit moment decodes within one quantization step of bitsandbytes'
        (the larger map gap beside its code, times the larger block scale) plus how much farther
        its code is from the moment than the nearest. Tensors under min_8bit_size keep fp32
        state in both, which agrees to fp32 rounding; the params within 2% of lr."""
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            self.fail(f"bitsandbytes does not import ({e}): pip install --no-deps bitsandbytes==0.50.2 packaging")
        sizes = [70001, 5000, 4096, 4095, 300, 3]
        torch.manual_seed(5)
        init = [torch.randn(n) for n in sizes]
        b1, b2 = 0.9, 0.999
        hyper = dict(lr=1e-3, betas=(b1, b2), eps=1e-8, weight_decay=0.01)
        ps = [x.clone().requires_grad_() for x in init]
        qs = [x.clone().requires_grad_() for x in init]
        ref = bnb.optim.AdamW8bit(ps, min_8bit_size=4096, **hyper)
        ours = tierstate_torch.AdamW(qs, state_dtype=torch.int8, min_8bit_size=4096, **hyper)
        tiny = torch.finfo(torch.float32).tiny

        def blocks_of(v, n):  # per element, its block's largest magnitude
            return torch.nn.functional.pad(v.abs(), (0, (-n) % 256)).view(-1, 256).amax(1).repeat_interleave(256)[:n]

        equal, nearest, shrunk = {1: [], 2: []}, {1: [], 2: []}, {1: [], 2: []}
        for t in range(20):
            grads = []
            for p, q in zip(ps, qs):
                # Gradients of changing scale per block and step; a block of zeros now and then.
                g = torch.randn(p.numel()) * (10.0 ** ((torch.arange(p.numel()) // 256 + t) % 5 - 2))
                if t % 7 == 3:
                    g[256:512] = 0
                p.grad, q.grad = g.clone(), g.clone()
                grads.append(g)
            if t > 0:  # bitsandbytes from our state: our decoded moments are map values times block scales
                for p, q in zip(ps, qs):
                    p.data.copy_(q.data)
                    if p.numel() < 4096:
                        continue
                    st = ref.state[p]
                    for k, slot in ((1, "exp_avg"), (2, "exp_avg_sq")):
                        b, qmap = ours.get_state(q, slot), st[f"qmap{k}"]
                        # A block whose largest magnitude is negative has a negative scale here
                        # (exact: -1.0 x the scale) and a positive one there, whose map has no
                        # -1.0: that one element becomes -0.99296875 x the scale.
                        scale = blocks_of(b, p.numel())
                        x = b / scale.clamp(min=tiny)
                        code = (x[:, None] - qmap[None, :]).abs().argmin(1)
                        moved = (qmap[code] * scale != b).sum().item()
                        self.assertLessEqual(moved, (b == -scale).sum().item(), "our state in bitsandbytes' format")
                        st[f"state{k}"].copy_(code.to(torch.uint8).view_as(st[f"state{k}"]))
                        st[f"absmax{k}"].copy_(scale[::256])
            # Each one's state as this step starts: ours, and bitsandbytes' decoded.
            start = [{k: ours.get_state(q, s) for k, s in ((1, "exp_avg"), (2, "exp_avg_sq"))} for q in qs]
            theirs = [{k: (ref.state[p][f"qmap{k}"][ref.state[p][f"state{k}"].long().flatten()]
                           * ref.state[p][f"absmax{k}"].repeat_interleave(256)[: p.numel()])
                       for k in (1, 2)} if t > 0 and p.numel() >= 4096 else s0 for p, s0 in zip(ps, start)]
            ref.step()
            ours.step()
            for i, (p, q, g) in enumerate(zip(ps, qs, grads)):
                st = ref.state[p]
                for k, slot in ((1, "exp_avg"), (2, "exp_avg_sq")):
                    b = ours.get_state(q, slot)
                    if p.numel() < 4096:
                        a = st[f"state{k}"]
                        self.assertEqual(a.dtype, torch.float32)
                        close = torch.allclose(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
                        self.assertTrue(close, f"step {t + 1}: tensor {i} {slot}")
                        continue
                    qmap, code = st[f"qmap{k}"], st[f"state{k}"].long().flatten()
                    absmax = st[f"absmax{k}"].repeat_interleave(256)[: p.numel()]
                    a = qmap[code] * absmax
                    # The moment both encoded (as bitsandbytes' kernel makes it, in fp32), and how
                    # much farther its code is from it than the nearest map value.
                    s0, beta = theirs[i][k], (b1, b2)[k - 1]
                    moment = s0.mul(b1).add(g, alpha=1 - b1) if k == 1 else s0.mul(b2).addcmul(g, g, value=1 - b2)
                    carried = beta * (s0 - start[i][k]).abs()  # where the two started apart
                    x = moment / absmax.clamp(min=tiny)
                    hi = torch.searchsorted(qmap, x).clamp(1, 255)
                    best = torch.minimum((x - qmap[hi - 1]).abs(), (qmap[hi] - x).abs())
                    farther = ((a / absmax.clamp(min=tiny) - x).abs() - best).clamp(min=0) * absmax
                    scale = torch.maximum(absmax, blocks_of(b, p.numel()))
                    gap = torch.maximum(qmap[(code + 1).clamp(max=255)] - qmap[code],
                                        qmap[code] - qmap[(code - 1).clamp(min=0)])
                    # (and the fp32 rounding of the products that make and decode them)
                    ulps = 8 * torch.finfo(torch.float32).eps * torch.maximum(a.abs(), b.abs())
                    excess = ((a - b).abs() - gap * scale - farther - carried - ulps).max().item()
                    self.assertLessEqual(excess, 0.0, f"step {t + 1}: tensor {i} {slot} beyond one quantization step")
                    # How often the two agree (to fp32 rounding: a block scale may differ in its
                    # last bit, the two making a moment in a different order of fp32 operations),
                    # in the blocks whose scales agree: a block whose largest magnitude is
                    # negative decodes it to 0.99296875 of itself in bitsandbytes, so its scale
                    # there shrinks by that much where that element stays the largest.
                    same = (absmax - blocks_of(b, p.numel())).abs() <= 4 * torch.finfo(torch.float32).eps * absmax
                    equal[k].append(((a - b).abs() <= ulps)[same].float().mean().item())
                    shrunk[k].append(1 - same.float().mean().item())
                    nearest[k].append((farther <= ulps).float().mean().item())
                # Moments a quantization step apart move a param by a percent or two of lr.
                self.assertTrue(torch.allclose(p, q, rtol=1e-5, atol=0.02 * hyper["lr"]), f"step {t + 1}: tensor {i}")
        # The findings, at worst over the steps and tensors.
        for k, name in ((1, "m"), (2, "v")):
            print(f"  bitsandbytes {bnb.__version__}, {name}: equal to ours in {min(equal[k]):.2%} of elements of blocks "
                  f"of the same scale, its code the nearest in {min(nearest[k]):.2%}; up to {max(shrunk[k]):.1%} of "
                  f"elements in blocks whose scale it shrank")
            self.assertGreaterEqual(min(equal[k]), 0.95)
        ours.close()

    def test_load_state_dict_of_bitsandbytes(self):
        """load_state_dict takes a checkpoint of bitsandbytes' AdamW8bit, Adam8bit, Lion8bit,
        SGD8bit and 32-bit AdamW (3 steps, saved and loaded through torch.save's bytes): each
        moment equals bitsandbytes' own dequantize_blockwise of its codes (fp32 state), or what the
        Python 8-bit reference stores that as (int8 state: our blocks are not bnb's, whose scale
        is the magnitude its map's extreme code stands for, not the block's largest value); then
        one more step of each from there on the same
        gradients agrees on the params (fp32 state: to 1e-5 of lr); a state_dict of another
        shape is refused by name."""
        import make_golden_dynamic8 as ref8
        try:
            import bitsandbytes as bnb
            import bitsandbytes.functional as bnbf
        except ImportError as e:
            self.fail(f"bitsandbytes does not import ({e}): pip install --no-deps bitsandbytes==0.50.2 packaging")
        sizes = [5000, 4095, 300]
        torch.manual_seed(11)
        init = [torch.randn(n) for n in sizes]
        grads = [[torch.randn(n) for n in sizes] for _ in range(4)]
        cases = ((bnb.optim.AdamW8bit, tierstate_torch.AdamW, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
                 (bnb.optim.Adam8bit, tierstate_torch.Adam, dict(lr=1e-3, betas=(0.9, 0.99))),
                 (bnb.optim.Lion8bit, tierstate_torch.Lion, dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)),
                 (bnb.optim.SGD8bit, tierstate_torch.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.01)),
                 (bnb.optim.AdamW, tierstate_torch.AdamW, dict(lr=1e-3, weight_decay=0.01)))
        for theirs, mine, kw in cases:
            ps = [x.clone().requires_grad_() for x in init]
            ref = theirs(ps, **kw)
            for g in grads[:3]:
                for p, x in zip(ps, g):
                    p.grad = x.clone()
                ref.step()
            buf = io.BytesIO()
            torch.save(ref.state_dict(), buf)
            slots = mine([torch.zeros(1)], **kw)._torch_slots
            want = []  # bitsandbytes' own decoding of each moment
            for p in ps:
                s = ref.state[p]
                want.append([bnbf.dequantize_blockwise(s[f"state{i + 1}"], absmax=s[f"absmax{i + 1}"],
                                                       code=s[f"qmap{i + 1}"], blocksize=256).reshape(-1)
                             if s[f"state{i + 1}"].dtype == torch.uint8 else s[f"state{i + 1}"].clone()
                             for i in range(len(slots))])
            for state_dtype in ("float32", "int8"):
                with self.subTest(bnb=theirs.__name__, state_dtype=state_dtype):
                    qs = [p.detach().clone().requires_grad_() for p in ps]
                    ours = mine(qs, state_dtype=state_dtype, **kw)
                    buf.seek(0)
                    ours.load_state_dict(torch.load(buf, weights_only=False))
                    for i, q in enumerate(qs):
                        for slot, w in zip(slots, want[i]):
                            got = ours.get_state(q, slot)
                            if state_dtype == "float32" or q.numel() < 4096:
                                self.assertTrue(torch.equal(got, w), f"tensor {i} {slot}")
                            else:
                                stored = ref8.store(slot != "exp_avg_sq", w)
                                same = (got == stored).float().mean().item()
                                self.assertGreaterEqual(same, 0.999, f"tensor {i} {slot}: {same:.4f} equal")
                    if state_dtype == "float32":  # one more step of each, from the same state
                        ps2 = [p.detach().clone().requires_grad_() for p in ps]
                        ref2 = theirs(ps2, **kw)
                        buf.seek(0)
                        ref2.load_state_dict(torch.load(buf, weights_only=False))
                        for p, q, x in zip(ps2, qs, grads[3]):
                            p.grad, q.grad = x.clone(), x.clone()
                        ref2.step()
                        ours.step()
                        for i, (p, q) in enumerate(zip(ps2, qs)):
                            excess = ((p - q).abs() - 1e-5 * kw["lr"] - 1e-6 * p.abs()).max().item()
                            self.assertLessEqual(excess, 0.0, f"tensor {i}")
                    ours.close()
        # Another optimizer's state, or numbers that mean another rule, are refused by name.
        ps = [x.clone().requires_grad_() for x in init]
        ref = bnb.optim.AdamW8bit(ps, lr=1e-3, weight_decay=0.1)
        for p, x in zip(ps, grads[0]):
            p.grad = x.clone()
        ref.step()
        sd = ref.state_dict()
        for make, pattern in ((tierstate_torch.Lion, "keeps 1 moment"),
                              (tierstate_torch.Adam, "AdamW's with weight decay"),
                              (functools.partial(tierstate_torch.AdamW, amsgrad=True), "without amsgrad"),
                              (tierstate_torch.Adafactor, "rule is 'adafactor'")):
            opt = make([p.detach().clone() for p in ps])
            with self.subTest(refused=type(opt).__name__):
                with self.assertRaisesRegex(ValueError, pattern):
                    opt.load_state_dict(sd)
                self.assertEqual(opt.step_count(), 0)
                opt.close()

    def test_compact_state_training_quality(self):
        """The transformer trained 300 steps (warmup, then cosine) with each state format, from
        one seed and one data order; every tensor's state in 8 bits (min_8bit_size=0, harsher
        than the default 4096, under which this model's small matrices would keep fp32 state).
        The final loss is on 8 held-out batches, with the trained weights in fp32. 8-bit and
        8-bit + Kahan land within 2% of torch.optim.AdamW's with fp32 params and state; the
        table is printed, bitsandbytes' AdamW8bit (the same setting) beside it."""
        steps, held_out = 300, batches(8, seed=7)
        data = batches(steps, seed=11)

        def cosine(opt):
            return torch.optim.lr_scheduler.LambdaLR(
                opt, lambda i: (i + 1) / 10 if i < 10 else 0.5 * (1 + math.cos(math.pi * (i - 10) / (steps - 10))))

        def run(dtype, make):
            model = make_model(dtype)
            opt = make(groups(model))
            train(model, opt, data, cosine(opt))
            fp32 = make_model()
            fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
            with torch.no_grad():
                loss = sum(loss_of(fp32, x, y).item() for x, y in held_out) / len(held_out)
            if hasattr(opt, "close"):
                opt.close()
            return loss

        hyper = dict(lr=LR, betas=(0.9, 0.95))
        ours = lambda **kw: lambda g: tierstate_torch.AdamW(g, min_8bit_size=0, **hyper, **kw)  # noqa: E731
        rows = [
            ("torch AdamW, fp32 params and state", torch.float32, lambda g: torch.optim.AdamW(g, **hyper)),
            ("torch AdamW, bf16 params and state", torch.bfloat16, lambda g: torch.optim.AdamW(g, **hyper)),
            ("fp32 state", torch.float32, ours()),
            ("bf16 state", torch.float32, ours(state_dtype=torch.bfloat16)),
            ("8-bit", torch.float32, ours(state_dtype=torch.int8)),
            ("8-bit, bf16 params + fp32 master", torch.bfloat16, ours(state_dtype=torch.int8)),
            ("8-bit + Kahan, bf16 params", torch.bfloat16, ours(state_dtype=torch.int8, master="kahan")),
            ("8-bit + stochastic rounding, bf16 params", torch.bfloat16,
             ours(state_dtype=torch.int8, master="stochastic")),
        ]
        try:
            import bitsandbytes as bnb
            rows.append((f"bitsandbytes {bnb.__version__} AdamW8bit", torch.float32,
                         lambda g: bnb.optim.AdamW8bit(g, min_8bit_size=0, **hyper)))
        except ImportError:
            pass  # test_int8_adamw_against_bitsandbytes says so
        losses = {name: run(dtype, make) for name, dtype, make in rows}
        base = losses[rows[0][0]]
        print(f"\n  {steps} steps, held-out loss (first batch's loss {math.log(VOCAB):.3f} at chance):")
        for name, loss in losses.items():
            print(f"  {name:<44} {loss:.4f}  {(loss / base - 1) * 100:+.2f}%")
        self.assertLess(base, 0.5 * math.log(VOCAB), "the model did not learn: a weak test")
        for name in ("8-bit", "8-bit + Kahan, bf16 params"):
            self.assertLessEqual(abs(losses[name] / base - 1), 0.02, f"{name}: {losses[name]:.4f} vs {base:.4f}")

    def test_bf16_params_without_an_fp32_master(self):
        """Steps of 1e-4 on bf16 params of 1.0 (whose spacing is 2^-7): torch.optim.AdamW on the
        bf16 params rounds every one away; an fp32 master, a Kahan compensation slot and
        stochastic rounding each carry them, and land where fp32 params do."""
        n, steps, lr = 4096, 200, 1e-4
        grad = torch.linspace(0.5, 1.5, n)
        def run(make):
            p = torch.ones(n, dtype=torch.bfloat16, requires_grad=True)
            opt = make(p)
            for _ in range(steps):
                p.grad = grad.to(torch.bfloat16)
                opt.step()
            return p.detach().float(), opt
        fp32 = torch.ones(n, requires_grad=True)
        ref = torch.optim.AdamW([fp32], lr=lr, weight_decay=0)
        for _ in range(steps):
            fp32.grad = grad.to(torch.bfloat16).float()
            ref.step()
        target = fp32.detach()
        naive, _ = run(lambda p: torch.optim.AdamW([p], lr=lr, weight_decay=0))
        self.assertTrue(torch.equal(naive, torch.ones(n)), "bf16 round-to-nearest should lose every step")
        for master in ("fp32", "kahan", "stochastic"):
            for state in (torch.float32, torch.int8):
                with self.subTest(master=master, state=state):
                    got, opt = run(lambda p: tierstate_torch.AdamW([p], lr=lr, weight_decay=0, master=master,
                                                                   state_dtype=state))
                    slots = opt._shards[next(iter(opt._shards))].slot_names()
                    self.assertEqual("dynamic8" in opt.composition()[0], state == torch.int8)
                    self.assertEqual("master" in slots, master == "fp32")
                    self.assertEqual("compensation" in slots, master == "kahan")
                    spacing = 2.0 ** -8  # bf16's below 1.0
                    if master == "stochastic":
                        # Unbiased: the mean lands. Each element is a random walk of 200 roundings
                        # of about 1e-4 within a spacing: a spread of about
                        # sqrt(200 * 1e-4 * 2^-8) = 0.009 (round-to-nearest would be off by 0.02).
                        # The mean of 4096 such walks: within 6e-4 (4.4 standard errors).
                        err = got - target
                        self.assertLess(abs(err.mean().item()), 6e-4)
                        self.assertLess(err.std().item(), 0.013)
                        self.assertLess(err.abs().max().item(), 0.06)
                        p2, _ = run(lambda p: tierstate_torch.AdamW([p], lr=lr, weight_decay=0, master=master,
                                                                    state_dtype=state))
                        self.assertTrue(torch.equal(got, p2), "stochastic rounding is seeded: the same bits again")
                    else:  # the nearest bf16 of the fp32 result, or the next one
                        self.assertLessEqual((got - target).abs().max().item(), spacing)
                        self.assertLess((got - target).abs().mean().item(), spacing / 2)
                    opt.close()

    def test_compact_state_is_refused_where_it_is_not_built(self):
        w32 = torch.zeros(8, requires_grad=True)
        w16 = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
        with self.assertRaisesRegex(ValueError, "master='kahan' is for bfloat16 params"):
            tierstate_torch.AdamW([w32], master="kahan")
        with self.assertRaisesRegex(ValueError, "master='kahan' is for bfloat16 params"):
            tierstate_torch.AdamW([{"params": [w16]}, {"params": [w32], "master": "kahan"}])
        with self.assertRaisesRegex(ValueError, "master must be one of"):
            tierstate_torch.AdamW([w16], master="fp16")
        with self.assertRaisesRegex(ValueError, "state_dtype must be torch.float32, torch.bfloat16 or torch.int8"):
            tierstate_torch.AdamW([w16], state_dtype=torch.float16)
        with self.assertRaisesRegex(ValueError, "min_8bit_size must be an int >= 0"):
            tierstate_torch.AdamW([w16], state_dtype=torch.int8, min_8bit_size=-1)
        with self.assertRaisesRegex(ValueError, "built for AdamW and Adam without amsgrad, Lion and SGD with momentum"):
            tierstate_torch.SGD([w16], lr=0.1, state_dtype=torch.int8)
        with self.assertRaisesRegex(ValueError, "built for AdamW and Adam without amsgrad, Lion and SGD with momentum"):
            tierstate_torch.AdamW([w16], amsgrad=True, master="stochastic")
        with self.assertRaisesRegex(ValueError, "built for AdamW and Adam without amsgrad, Lion and SGD with momentum"):
            tierstate_torch.Adafactor([w16], master="kahan")
        # Per group: a group of 8-bit state beside one of fp32, one shard each; with
        # max_grad_norm that is refused, saying how to keep one shard.
        big = torch.zeros(5000, requires_grad=True)
        opt = tierstate_torch.AdamW([big, w32], state_dtype="int8", max_grad_norm=1.0)
        big.grad, w32.grad = torch.ones(5000), torch.ones(8)
        with self.assertRaisesRegex(ValueError, "min_8bit_size=0 keeps"):
            opt.step()
        opt = tierstate_torch.AdamW([{"params": [big]}, {"params": [w32], "state_dtype": torch.bfloat16}],
                                    state_dtype="int8", min_8bit_size=0)
        opt.step()
        self.assertEqual(len(opt.composition()), 2)
        opt.close()

    def test_rules_by_name_with_their_tables_and_state_dicts_without_files(self):
        C = tierstate_torch.optim._ext()
        self.assertEqual(C.rule_names(), ["adam", "adamw", "adam_amsgrad", "adamw_amsgrad", "sgd", "sgd_momentum",
                                          "lion", "adafactor"])
        self.assertEqual(C.rule_table("adafactor")["hyperparameters"],
                         ["lr", "beta2_decay", "eps[0]", "eps[1]", "d", "weight_decay", "maximize"])
        self.assertEqual(C.rule_table("adafactor")["slots"], [])
        table = C.rule_table("adamw")
        self.assertEqual(table["hyperparameters"], ["lr", "betas[0]", "betas[1]", "eps", "weight_decay", "maximize"])
        self.assertEqual(table["defaults"], [1e-3, 0.9, 0.999, 1e-8, 1e-2, 0.0])
        self.assertEqual(C.rule_table("adam_amsgrad")["slots"], ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"])
        self.assertEqual(C.rule_table("sgd")["slots"], [])
        self.assertEqual(C.rule_table("sgd_momentum")["hyperparameters"],
                         ["lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"])
        with self.assertRaisesRegex(ValueError, "no rule 'adagrad'"):
            C.rule_table("adagrad")
        data = batches(6, seed=5)
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            model, opt = self.ours(data, "nvme", path=d)
            train(model, opt, data[:3])
            weights = copy.deepcopy(model.state_dict())
            before = sorted(os.listdir(d))
            sd = opt.state_dict()  # the checkpoint's bytes come through no file
            self.assertEqual(sorted(os.listdir(d)), before)
            (info,) = sd["tierstate"]["shards"].values()
            self.assertEqual(info["checkpoint"].dtype, torch.uint8)
            # A damaged checkpoint is refused by name, and the optimizer goes on as it was.
            damaged = copy.deepcopy(sd)
            (bad,) = damaged["tierstate"]["shards"].values()
            bad["checkpoint"][bad["checkpoint"].numel() // 2] ^= 0x10
            with self.assertRaisesRegex(RuntimeError, r"\(load_from\).*does not match its checksum"):
                opt.load_state_dict(damaged)
            rest_a = train(model, opt, data[3:])
            opt.close()
        model2, opt2 = self.ours(data, "pinned")
        model2.load_state_dict(weights)
        opt2.load_state_dict(sd)
        self.assertEqual(train(model2, opt2, data[3:]), rest_a)

    def test_mixed_dtypes_make_one_shard_each(self):
        model = make_model()
        model.head.to(torch.bfloat16)
        opt = tierstate_torch.AdamW(model.parameters(), lr=1e-3)
        self.assertEqual(len(opt.composition()), 2)

    def test_bad_input_is_refused_by_name(self):
        model = make_model()
        with self.assertRaisesRegex(ValueError, "tier must be one of"):
            tierstate_torch.AdamW(model.parameters(), tier="disk")
        with self.assertRaisesRegex(ValueError, "needs path="):
            tierstate_torch.AdamW(model.parameters(), tier="nvme")
        with self.assertRaisesRegex(ValueError, "not a directory"):
            tierstate_torch.AdamW(model.parameters(), tier="nvme", path="/nonexistent/dir")
        with self.assertRaisesRegex(ValueError, "compute='device' updates CUDA parameters"):
            tierstate_torch.AdamW(model.parameters(), compute="device")
        with self.assertRaisesRegex(ValueError, "tier='device' keeps the state"):
            tierstate_torch.AdamW(model.parameters(), tier="device")
        with self.assertRaisesRegex(ValueError, "invalid learning rate"):
            tierstate_torch.AdamW(model.parameters(), lr=-1.0)
        with self.assertRaisesRegex(ValueError, "amsgrad"):
            tierstate_torch.AdamW([{"params": [model.pos], "amsgrad": True}, {"params": [model.head.bias]}])
        with self.assertRaisesRegex(ValueError, "Nesterov momentum requires a momentum and zero dampening"):
            tierstate_torch.SGD(model.parameters(), lr=0.1, nesterov=True)
        with self.assertRaisesRegex(ValueError, "every param group must have momentum = 0"):
            tierstate_torch.SGD([{"params": [model.pos], "momentum": 0.9}, {"params": [model.head.bias]}], lr=0.1)
        with self.assertRaisesRegex(ValueError, "invalid beta parameter at index 1"):
            tierstate_torch.Lion(model.parameters(), betas=(0.9, 1.5))
        for kw, words in ((dict(beta2_decay=0.5), "beta2_decay should be <= 0 but is: 0.5"),
                          (dict(eps=(-1.0, 1e-3)), "epsilon1 should be >= 0"),
                          (dict(eps=(None, -1.0)), "epsilon2 should be >= 0"),
                          (dict(d=0.5), "Clipping threshold d should be >= 1"),
                          (dict(weight_decay=-1.0), "weight_decay should be >= 0")):
            with self.assertRaisesRegex(ValueError, words):
                tierstate_torch.Adafactor(model.parameters(), **kw)
        x, y = batches(1)[0]
        sgd = tierstate_torch.SGD([model.pos], lr=0.1, momentum=0.9)
        loss_of(model, x, y).backward()
        sgd.step()
        sgd.param_groups[0]["momentum"] = 0.0  # the buffer's rule cannot drop its buffer
        with self.assertRaisesRegex(Exception, "momentum"):
            sgd.step()
        sgd.close()
        model.zero_grad(set_to_none=True)
        opt = tierstate_torch.AdamW(model.parameters())
        loss_of(model, x, y).backward()
        opt.step()
        with self.assertRaisesRegex(RuntimeError, "after the state was made"):
            opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})
        model.head.weight.data = model.head.weight.data.clone()
        with self.assertRaisesRegex(RuntimeError, "no longer the memory"):
            opt.step()


class TiedLM(TinyLM):
    """TinyLM with its head's weight the embedding's (tied), its blocks optionally under
    activation checkpointing."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.head.weight = self.embed.weight
        self.checkpointed = checkpointed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.norm(x))


class OffloadedParams(unittest.TestCase):
    """offload_parameters: the weights in a tier, fetched layer by layer by hooks; trained
    with tierstate's AdamW, bit for bit as the same optimizer over the model in memory."""

    def run_case(self, make, data, offload=None, micro_batches=1, overlap=True, evaluate=False):
        torch.manual_seed(5)
        model = make()
        off = tierstate_torch.offload_parameters(model, **offload) if offload is not None else None
        opt = tierstate_torch.AdamW(groups(model), lr=LR, overlap_backward=overlap, micro_batches=micro_batches,
                                    max_grad_norm=1.0 if overlap else None)
        losses = train(model, opt, data, schedule(opt), micro_batches=micro_batches)
        if evaluate:  # a no-grad pass between steps, then more steps
            with torch.no_grad():
                losses.append(loss_of(model, *data[0]).item())
            losses += train(model, opt, data[:3], micro_batches=micro_batches)
        return losses, {k: v.clone() for k, v in model.state_dict().items()}, off, opt

    def assert_same(self, ref, got, what):
        self.assertEqual(ref[0], got[0], f"{what}: the losses differ")
        self.assertEqual(sorted(ref[1]), sorted(got[1]))
        for k in ref[1]:
            self.assertTrue(torch.equal(ref[1][k], got[1][k]), f"{what}: {k} differs")

    def test_bit_for_bit_with_and_without_offload(self):
        data = batches(12, seed=7)
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            cases = [
                ("pinned, window 1", make_model, dict(tier="pinned", window=1), 1, True),
                ("nvme, window 3", make_model, dict(tier="nvme", path=d, window=3), 1, True),
                ("nvme, window 1, tied, checkpointed", lambda: TiedLM(checkpointed=True),
                 dict(tier="nvme", path=d, window=1), 1, True),
                ("pinned, tied, accumulation", TiedLM, dict(tier="pinned", window=2), 2, True),
                ("nvme, without overlap_backward", make_model, dict(tier="nvme", path=d), 1, False),
            ]
            for what, make, offload, micro, overlap in cases:
                with self.subTest(what):
                    ref = self.run_case(make, data, None, micro, overlap, evaluate=True)
                    got = self.run_case(make, data, offload, micro, overlap, evaluate=True)
                    self.assert_same(ref, got, what)
                    stats = got[2].stats()
                    self.assertGreater(stats["acquires"], 0)
                    if overlap:  # each gradient went to the store as backward made it
                        self.assertGreater(stats["grad_bytes_written"], 0)
                    for p in got[3]._params():  # between uses: a placeholder, its values in the store
                        self.assertEqual(p.data.stride(), (0,) * p.dim())
                        self.assertIsNone(p.grad) if overlap else None
                    del got
                    gc.collect()
            self.assertEqual(os.listdir(d), [], "the stores' files outlived them")

    def test_gpu_compositions_on_the_emulated_device(self):
        data = batches(8, seed=8)
        ref = self.run_case(TiedLM, data, None)
        os.environ["TIERSTATE_TORCH_EMULATED_DEVICE"] = "1"
        try:
            with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
                for offload in (dict(tier="pinned"), dict(tier="nvme", path=d, window=1)):
                    with self.subTest(offload["tier"]):
                        got = self.run_case(TiedLM, data, offload)
                        self.assertIn("CudaOverlapped<2>", got[3].composition()[0])
                        self.assert_same(ref, got, offload["tier"])
        finally:
            del os.environ["TIERSTATE_TORCH_EMULATED_DEVICE"]

    def test_shadow_state_lets_skip_step_overlap_backward(self):
        """bf16 params with the state on NVMe: overlap_backward's steps under the default
        skip_step update each chunk as backward makes its gradients (shadow_state, chosen
        automatically) and keep the update only if no gradient held an inf or a NaN: the same
        bits as plain steps in memory, with or without offloaded params, a step whose
        last-made gradient is NaN skipped whole; shadow_state=True is refused where it cannot work."""
        data = batches(8, seed=17)

        def run(offload, **kw):
            torch.manual_seed(5)
            model = TiedLM().to(torch.bfloat16)
            off = tierstate_torch.offload_parameters(model, **offload) if offload else None
            opt = tierstate_torch.AdamW(groups(model), lr=LR, **kw)
            losses, skipped = [], []
            for i, (x, y) in enumerate(data):
                opt.zero_grad(set_to_none=True)
                loss = loss_of(model, x, y)
                if i == 3:  # the first block's q: among the last gradients backward makes
                    loss = loss + (model.blocks[0].q.weight.float() * float("nan")).sum()
                loss.backward()
                opt.step()
                losses.append(str(loss.item()))
                skipped.append(opt.last_step["skipped"])
            return losses, skipped, {k: v.clone() for k, v in model.state_dict().items()}, opt, off

        ref = run(None)
        self.assertEqual(ref[1], [False, False, False, True, False, False, False, False])
        self.assertNotIn("shadow_state", ref[3].composition()[0])
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            for what, offload in (("in memory", None), ("offloaded", dict(tier="nvme", path=d, window=2))):
                with self.subTest(what):
                    got = run(offload, tier="nvme", path=d, overlap_backward=True, chunk_elements=2048)
                    self.assertEqual([c.endswith("with shadow_state") for c in got[3].composition()], [True])
                    self.assertEqual(ref[0], got[0])
                    self.assertEqual(ref[1], got[1])
                    for k in ref[2]:
                        self.assertTrue(torch.equal(ref[2][k], got[2][k]), f"{what}: {k} differs")
                    off = run(offload, tier="nvme", path=d, overlap_backward=True, shadow_state=False)
                    self.assertNotIn("shadow_state", off[3].composition()[0])
                    self.assertEqual(ref[0], off[0])
                    del got, off
                    gc.collect()
            model = TiedLM()
            with self.assertRaisesRegex(ValueError, "shadow_state=True serves overlap_backward"):
                tierstate_torch.AdamW(model.parameters(), tier="pinned", overlap_backward=True, shadow_state=True)
            with self.assertRaisesRegex(ValueError, "shadow_state must be"):
                tierstate_torch.AdamW(model.parameters(), tier="nvme", path=d, overlap_backward=True, shadow_state=1)
            with self.assertRaisesRegex(ValueError, "shadow_state.*fp32 master"):  # fp32 params: no master
                tierstate_torch.AdamW(model.parameters(), tier="nvme", path=d, overlap_backward=True, shadow_state=True)
            auto = tierstate_torch.AdamW(model.parameters(), tier="nvme", path=d, overlap_backward=True)
            self.assertNotIn("shadow_state", auto.composition()[0])  # (automatic: where it can)
            auto.close()
            gc.collect()
            self.assertEqual(os.listdir(d), [])

    def test_a_model_made_on_the_meta_device(self):
        data = batches(6, seed=9)
        ref = self.run_case(TiedLM, data, None)
        torch.manual_seed(5)
        initial = TiedLM().state_dict()
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            path = os.path.join(d, "initial.pt")
            torch.save(initial, path)
            for source in (initial, path):
                with self.subTest(type(source).__name__):
                    with torch.device("meta"):
                        model = TiedLM()
                    off = tierstate_torch.offload_parameters(model, "nvme", d, state_dict=source)
                    self.assertIs(model.head.weight, model.embed.weight)  # still tied
                    self.assertTrue(all(not p.is_meta for p in model.parameters()))
                    opt = tierstate_torch.AdamW(groups(model), lr=LR, overlap_backward=True, max_grad_norm=1.0)
                    losses = train(model, opt, data, schedule(opt))
                    self.assertEqual(ref[0], losses)
                    for k, v in model.state_dict().items():
                        self.assertTrue(torch.equal(ref[1][k], v), k)
                    del off, opt, model
                    gc.collect()
            # init=: each layer's modules made empty and initialized in turn
            with torch.device("meta"):
                model = TinyLM()
            with self.assertRaisesRegex(ValueError, r"parameter 'pos' belongs to a TinyLM, which has no "
                                                    r"reset_parameters\(\)"):
                tierstate_torch.offload_parameters(model)
            self.assertTrue(all(p.is_meta for p in model.parameters()), "a refusal changed the model")

            def init(m):
                if isinstance(m, TinyLM):
                    nn.init.normal_(m.pos, std=0.02)
                elif hasattr(m, "reset_parameters"):
                    m.reset_parameters()

            off = tierstate_torch.offload_parameters(model, "nvme", d, init=init)
            sd = model.state_dict()
            for name, v in sd.items():
                self.assertTrue(bool(torch.isfinite(v).all()), name)
            self.assertTrue(torch.equal(sd["norm.weight"], torch.ones(WIDTH)))
            w = sd["blocks.0.q.weight"]
            self.assertLessEqual(w.abs().max().item(), 1 / math.sqrt(WIDTH))
            self.assertGreater(w.std().item(), 0.2 / math.sqrt(WIDTH))
            del off, model
            gc.collect()
            self.assertEqual(os.listdir(d), ["initial.pt"])

    def test_state_dict_round_trip_and_values(self):
        data = batches(6, seed=10)
        torch.manual_seed(5)
        model = TiedLM()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        off = tierstate_torch.offload_parameters(model, "pinned")
        sd = model.state_dict()
        self.assertEqual(sorted(sd), sorted(before))
        for k in before:
            self.assertTrue(torch.equal(before[k], sd[k]), k)
        self.assertTrue(torch.isnan(model.embed.weight).all())  # a placeholder between uses
        with self.assertRaises(RuntimeError):
            with torch.no_grad():
                model.embed.weight.add_(1)  # (refused by torch: one element broadcast)
        # Trained, saved, then loaded into another offloaded model: the same values and losses.
        opt = tierstate_torch.AdamW(groups(model), lr=LR, overlap_backward=True)
        train(model, opt, data[:3])
        saved, opt_saved = model.state_dict(), opt.state_dict()
        torch.manual_seed(77)
        other = TiedLM()
        off2 = tierstate_torch.offload_parameters(other, "pinned", window=1)
        missing = other.load_state_dict(saved)
        self.assertEqual((missing.missing_keys, missing.unexpected_keys), ([], []))
        opt2 = tierstate_torch.AdamW(groups(other), lr=LR, overlap_backward=True)
        opt2.load_state_dict(opt_saved)
        self.assertEqual(train(model, opt, data[3:]), train(other, opt2, data[3:]))
        self.assertTrue(torch.equal(off.read("blocks.1.q.weight"), off2.read("blocks.1.q.weight")))
        with self.assertRaisesRegex(KeyError, "no offloaded parameter named 'nope'"):
            off.read("nope")
        with self.assertRaisesRegex(ValueError, "has shape"):
            off.write("pos", torch.zeros(3))

    def test_safetensors_export_shard_by_shard_and_import(self):
        from safetensors import safe_open  # (CI's environment has it: tests/run-all.sh's torch_venv)
        from unittest import mock

        data = batches(6, seed=11)
        torch.manual_seed(5)
        model = TiedLM()
        off = tierstate_torch.offload_parameters(model, "pinned")
        opt = tierstate_torch.AdamW(groups(model), lr=LR, overlap_backward=True)
        train(model, opt, data[:3])
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            one, many = os.path.join(d, "one"), os.path.join(d, "many")
            os.mkdir(one)
            os.mkdir(many)
            self.assertEqual([f.name for f in off.save_safetensors(one)], ["model.safetensors"])
            limit = max(sizes.values())
            files = off.save_safetensors(many, max_shard_bytes=limit)
            self.assertGreater(len(files), 3)
            self.assertEqual(files[-1].name, "model.safetensors.index.json")
            self.assertEqual(sorted(os.listdir(many)), sorted(f.name for f in files))  # no temporary left
            index = json.loads(files[-1].read_text())
            self.assertEqual(index["metadata"]["total_size"], sum(sizes.values()))
            for f in files[:-1]:
                with safe_open(str(f), framework="pt") as h:
                    keys = list(h.keys())
                    self.assertLessEqual(sum(sizes[k] for k in keys), limit, f.name)
                    for k in keys:
                        self.assertEqual(index["weight_map"][k], f.name)
                        self.assertTrue(torch.equal(h.get_tensor(k), expected[k]), k)
            # a tied weight once, under its first name (as safetensors' save_model)
            self.assertIn("embed.weight", index["weight_map"])
            self.assertNotIn("head.weight", index["weight_map"])
            self.assertEqual(sorted(index["weight_map"]), sorted(k for k in expected if k != "head.weight"))
            # Read back into a model made on the meta device: from the file, the index, the directory.
            for source in (os.path.join(one, "model.safetensors"), str(files[-1]), many, one):
                with self.subTest(source=os.path.relpath(source, d)):
                    with torch.device("meta"):
                        other = TiedLM()
                    off2 = tierstate_torch.offload_parameters(other, "nvme", d, state_dict=source)
                    self.assertIs(other.head.weight, other.embed.weight)
                    got = other.state_dict()
                    for k, v in expected.items():
                        self.assertTrue(torch.equal(got[k], v), k)
                    del off2, other
                    gc.collect()
            # An error part way (a full disk, say) leaves what was there, and no temporary file.
            before = {n: (Path(many) / n).read_bytes() for n in os.listdir(many)}
            import safetensors.torch
            real, calls = safetensors.torch.save_file, []

            def failing(tensors, filename, metadata=None):
                calls.append(filename)
                if len(calls) == 2:
                    raise OSError(28, "No space left on device")
                real(tensors, filename, metadata=metadata)

            with torch.no_grad():
                off.write("pos", torch.zeros_like(expected["pos"]))
            with mock.patch.object(safetensors.torch, "save_file", failing):
                with self.assertRaisesRegex(OSError, "No space left"):
                    off.save_safetensors(many, max_shard_bytes=limit)
            self.assertEqual({n: (Path(many) / n).read_bytes() for n in os.listdir(many)}, before)
            # A later export replaces an earlier one whole, whatever their shard counts: no reader
            # finds the earlier weights (pos is zeros now).
            for folder, shard_bytes in ((many, 1 << 30), (one, limit), (one, 2 * limit)):
                with self.subTest(reexport=os.path.basename(folder), shard_bytes=shard_bytes):
                    files = off.save_safetensors(folder, max_shard_bytes=shard_bytes)
                    self.assertEqual(sorted(os.listdir(folder)), sorted(f.name for f in files))
                    with torch.device("meta"):
                        other = TiedLM()
                    off2 = tierstate_torch.offload_parameters(other, "pinned", state_dict=folder)
                    self.assertTrue(torch.equal(off2.read("pos"), torch.zeros_like(expected["pos"])))
                    self.assertTrue(torch.equal(off2.read("blocks.1.q.weight"), expected["blocks.1.q.weight"]))
                    del off2, other
            # Refusals, by name.
            with self.assertRaisesRegex(ValueError, "is not a directory"):
                off.save_safetensors(os.path.join(d, "nowhere"))
            with self.assertRaisesRegex(ValueError, "max_shard_bytes must be a positive int"):
                off.save_safetensors(one, max_shard_bytes=0)
            broken = os.path.join(d, "broken.json")
            Path(broken).write_text(json.dumps({"weight_map": {"embed.weight": "gone.safetensors"}}))
            not_a_map = os.path.join(d, "list.json")
            Path(not_a_map).write_text(json.dumps({"weight_map": ["model.safetensors"]}))
            bad = os.path.join(d, "bad.safetensors")
            Path(bad).write_bytes(b"not safetensors")
            empty = os.path.join(d, "empty")
            os.mkdir(empty)
            for source, message in ((broken, "names 'gone.safetensors' for 'embed.weight', and there is no such file"),
                                    (bad, "is not a readable safetensors file"),
                                    (not_a_map, "is not a safetensors index .* weight_map is not an object"),
                                    (os.path.join(d, "absent.safetensors"), "does not exist"),
                                    (os.path.join(d, "absent"), "is not a file"),
                                    (empty, "no model.safetensors.index.json and no .safetensors file")):
                with self.subTest(source=source):
                    with torch.device("meta"):
                        other = TiedLM()
                    with self.assertRaisesRegex(ValueError, message):
                        tierstate_torch.offload_parameters(other, "pinned", state_dict=source)
                    self.assertTrue(all(p.is_meta for p in other.parameters()))
            del off, opt, model
            gc.collect()

    def test_awkward_graphs_give_torchs_gradients(self):
        """Gradients through offloaded params equal the model's in memory, bit for bit, where the
        hooks' bookkeeping is tested hardest: a layer run twice before one backward with a frozen
        base (LoRA, DPO's chosen and rejected), two backward passes over one graph
        (retain_graph), a Sequential with an in-place ReLU, reentrant checkpointing, a 0-dim
        parameter; and a forward interrupted (KeyboardInterrupt) midway, after which the layers
        are fetched again."""
        class Lora(nn.Module):
            def __init__(self):
                super().__init__()
                self.base = nn.Linear(8, 8)
                self.base.requires_grad_(False)
                self.a = nn.Linear(8, 2, bias=False)
                self.b = nn.Linear(2, 8, bias=False)
                self.scale = nn.Parameter(torch.tensor(1.5))
                self.boom = False

            def forward(self, x):
                if self.boom:
                    raise KeyboardInterrupt
                return torch.tanh(self.base(x) + self.b(self.a(x))) * self.scale

        class Net(nn.Module):
            def __init__(self, reentrant=False):
                super().__init__()
                self.embed = nn.Linear(8, 8)
                self.blocks = nn.ModuleList([Lora(), Lora(), nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True),
                                                                          nn.Linear(8, 8))])
                self.reentrant = reentrant

            def forward(self, x):
                x = self.embed(x)
                for b in self.blocks:
                    x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=True) if self.reentrant else b(x)
                return x.sum()

        a, b = torch.randn(3, 8), torch.randn(3, 8)

        def twice(m):  # two forwards, one backward
            (m(a) - 2 * m(b)).backward()

        def retained(m):  # two backward passes over one graph
            loss = m(a)
            x = a.clone().requires_grad_(True)
            loss2 = m(x)
            gx, = torch.autograd.grad(loss2, x, retain_graph=True)
            loss2.backward()
            loss.backward()
            m.gx = gx

        def grads(m):
            return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

        for what, make, fn in (("twice", Net, twice), ("retain_graph", Net, retained),
                               ("reentrant checkpointing", lambda: Net(reentrant=True), twice)):
            with self.subTest(what):
                torch.manual_seed(3)
                ref = make()
                torch.manual_seed(3)
                ours = make()
                off = tierstate_torch.offload_parameters(ours, window=1)
                for _ in range(2):
                    fn(ref)
                    fn(ours)
                    g_ref, g_ours = grads(ref), grads(ours)
                    self.assertEqual(sorted(g_ref), sorted(g_ours))
                    for k in g_ref:
                        self.assertTrue(torch.equal(g_ref[k], g_ours[k]), f"{what}: {k}")
                    if what == "retain_graph":
                        self.assertTrue(torch.equal(ref.gx, ours.gx))
                    self.assertEqual([layer.holds for layer in off._layers()], [0] * len(off._layers()))
                    self.assertTrue(all(p.data.stride() == (0,) * p.dim() for p in ours.parameters()))
        # interrupted: what the interrupted forward held is let go at the next forward, and
        # the values fetched then are the store's, written meanwhile
        torch.manual_seed(3)
        ref = Net()
        torch.manual_seed(3)
        ours = Net()
        off = tierstate_torch.offload_parameters(ours, window=2)
        ours.blocks[1].boom = True
        with self.assertRaises(KeyboardInterrupt):
            ours(a)
        ours.blocks[1].boom = False
        self.assertEqual(ours(a).item(), ref(a).item())
        off.write("blocks.1.b.weight", torch.zeros(8, 2))
        ref.blocks[1].b.weight.data.zero_()
        self.assertEqual(ours(a).item(), ref(a).item())
        # a gradient penalty (create_graph) is refused by name
        with self.assertRaisesRegex(RuntimeError, "create_graph=True"):
            x = a.clone().requires_grad_(True)
            g, = torch.autograd.grad(ours(x), x, create_graph=True)
        ours(a)  # (and the next forward starts clean)
        self.assertEqual([layer.holds for layer in off._layers()], [0] * len(off._layers()))

    def test_refusals_leave_the_model_as_it_was(self):
        class Rope(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

        class WithRope(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
                self.rope = Rope()

        with torch.device("meta"):
            model = WithRope()
        sd = {"lin.weight": torch.ones(4, 4), "lin.bias": torch.zeros(4)}
        with self.assertRaisesRegex(ValueError, r"buffer 'rope.inv_freq' is on the meta device and nothing gives it"):
            tierstate_torch.offload_parameters(model, state_dict=sd)
        self.assertTrue(all(p.is_meta for p in model.parameters()) and model.rope.inv_freq.is_meta)
        with self.assertRaisesRegex(ValueError, "layers= must name nn.Module classes"):
            tierstate_torch.offload_parameters(model, layers=[3])
        self.assertTrue(all(p.is_meta for p in model.parameters()))

        def init(m):
            if isinstance(m, Rope):
                m.inv_freq.copy_(torch.arange(4.0))
        off = tierstate_torch.offload_parameters(model, state_dict=sd, init=init)
        self.assertTrue(torch.equal(model.rope.inv_freq, torch.arange(4.0)))
        self.assertTrue(torch.equal(off.read("lin.weight"), torch.ones(4, 4)))
        # refused midway, after some params went to the store: a meta model's params are meta again,
        # and a model in memory keeps its params' own memory and values
        with torch.device("meta"):
            model2 = WithRope()
        with self.assertRaisesRegex(KeyError, "state_dict has no entry for 'lin.bias'"):
            tierstate_torch.offload_parameters(model2, state_dict={"lin.weight": torch.ones(4, 4)}, init=init)
        self.assertTrue(all(p.is_meta for p in model2.parameters()) and model2.rope.inv_freq.is_meta)
        cpu = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        before = [(p.data_ptr(), p.detach().clone()) for p in cpu.parameters()]
        real = tierstate_torch._offload.OffloadedParameters._empty
        calls = []

        def failing(self, u):
            calls.append(u)
            if len(calls) == 2:
                raise OSError("a planted failure")
            real(self, u)

        tierstate_torch._offload.OffloadedParameters._empty = failing
        try:
            with self.assertRaisesRegex(OSError, "a planted failure"):
                tierstate_torch.offload_parameters(cpu)
        finally:
            tierstate_torch._offload.OffloadedParameters._empty = real
        for p, (ptr, value) in zip(cpu.parameters(), before):
            self.assertEqual(p.data_ptr(), ptr)
            self.assertTrue(torch.equal(p.detach(), value))
            self.assertIsNone(getattr(p, "_tierstate_offload", None))
        # a submodule's own state_dict reads the store too
        self.assertTrue(torch.equal(model.lin.state_dict()["weight"], torch.ones(4, 4)))

    def test_bad_input_is_refused_by_name(self):
        model = make_model()
        with self.assertRaisesRegex(ValueError, "tier must be one of"):
            tierstate_torch.offload_parameters(model, "disk")
        with self.assertRaisesRegex(ValueError, "tier='nvme' needs path="):
            tierstate_torch.offload_parameters(model, "nvme")
        with self.assertRaisesRegex(ValueError, "window must be an int in 1..64"):
            tierstate_torch.offload_parameters(model, window=0)
        with self.assertRaisesRegex(ValueError, "init= and state_dict= build a model made on the meta device"):
            tierstate_torch.offload_parameters(model, init=lambda m: None)
        self.assertTrue(all(p.data.stride() != (0,) * p.dim() or p.dim() == 0 for p in model.parameters()))
        tierstate_torch.offload_parameters(model)
        with self.assertRaisesRegex(ValueError, "is offloaded already"):
            tierstate_torch.offload_parameters(model)
        with self.assertRaisesRegex(ValueError, "delayed_update keeps its own copy"):
            tierstate_torch.AdamW(model.parameters(), delayed_update=True).step()
        compiled = torch.compile(model, backend="eager")
        with self.assertRaisesRegex(Exception, "runs eagerly"):
            compiled(batches(1)[0][0])


class TestPackage(unittest.TestCase):
    def test_the_extension_is_the_one_expected(self):
        """Installed (TIERSTATE_TORCH_TEST_INSTALLED=1): the package outside this checkout, its
        extension the one pip installed, built against this torch, and a torch of another
        version refused with a sentence that says what to do. From the checkout: the
        just-in-time build."""
        from tierstate_torch import _build, _common
        ext = _common._ext()
        package = Path(tierstate_torch.__file__).resolve().parent
        if INSTALLED:
            self.assertNotEqual(package, SOURCES / "tierstate_torch")
            self.assertEqual(ext.__name__, "tierstate_torch._C")
            self.assertEqual(Path(ext.__file__).resolve().parent, package)
            from tierstate_torch import _build_info
            self.assertEqual(_build_info.TORCH_VERSION, torch.__version__)
            saved = torch.__version__
            try:
                torch.__version__ = "9.9.0"
                with self.assertRaisesRegex(RuntimeError, r"built against torch 2\.11.* and this is torch 9\.9\.0: .*"
                                            r"Rebuild it under this torch \(pip install --no-build-isolation --no-deps --force-reinstall"):
                    _build._load_installed()
            finally:
                torch.__version__ = saved
        else:
            self.assertEqual(package, SOURCES / "tierstate_torch")
            self.assertIn(ext.__name__, ("tierstate_torch_C", "tierstate_torch_C_cuda"))

    def test_host_kernels_are_dispatched(self):
        """Installed: the package's host kernels are dispatched (the compositions built for
        plain x86-64, the kernels once per level). Each level this CPU has, forced with
        TIERSTATE_ARCH in a process of its own, runs AdamW as torch.optim.AdamW does; a level
        that is not one is refused when the extension loads, naming it. From the checkout: the
        just-in-time build's own -march (and a package's built with TIERSTATE_TORCH_DISPATCH=0)."""
        import subprocess
        level = tierstate_torch.host_kernels()
        if INSTALLED:
            from tierstate_torch import _build_info
        if not INSTALLED or not _build_info.DISPATCH:  # (a package built with TIERSTATE_TORCH_DISPATCH=0)
            self.assertTrue(level.startswith("native "), level)
            return
        levels = ["x86-64-v2", "x86-64-v3", "x86-64-v4", "x86-64-v4-bf16"]
        self.assertIn(level, levels)
        script = (
            "import torch, tierstate_torch\n"
            "torch.manual_seed(0)\n"
            "p = torch.randn(10007, requires_grad=True); q = p.detach().clone().requires_grad_(True)\n"
            "a = tierstate_torch.AdamW([p], lr=1e-2, weight_decay=0.1); b = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)\n"
            "for _ in range(5):\n"
            "    g = torch.randn(10007); p.grad = g.clone(); q.grad = g.clone(); a.step(); b.step()\n"
            "print(tierstate_torch.host_kernels(), float((p - q).abs().max()))\n")
        cwd = os.environ.get("TIERSTATE_TEST_DIR", tempfile.gettempdir())
        for forced in levels[: levels.index(level) + 1]:
            with self.subTest(level=forced):
                out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd,
                                     env={**os.environ, "TIERSTATE_ARCH": forced})
                self.assertEqual(out.returncode, 0, out.stderr[-2000:])
                name, diff = out.stdout.split()
                self.assertEqual(name, forced)
                self.assertLess(float(diff), 1e-5)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd,
                             env={**os.environ, "TIERSTATE_ARCH": "x86-64-v9"})
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("ValueError: TIERSTATE_ARCH = x86-64-v9 is invalid: the host kernels are built for x86-64-v4-bf16, "
                      "x86-64-v4, x86-64-v3, x86-64-v2", out.stderr)


if __name__ == "__main__":
    # The CPU build (with the emulated device) even where a GPU is: test_parity_cuda.py is
    # the GPU's test.
    os.environ["TIERSTATE_TORCH_CUDA"] = "0"
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    result = unittest.main(verbosity=2, exit=False).result
    # Counted by test method (a method whose subtests fail counts once).
    failed = {getattr(t, "test_case", t).id() for t, _ in result.failures + result.errors}
    skipped = {t.id() for t, _ in result.skipped}
    ran = result.testsRun - len(skipped)
    print(f"pytorch parity: {ran} tests ran, {len(failed)} failed, {len(skipped)} skipped")
    if skipped:
        print("a skipped test fails this run: every test here needs only PyTorch and bitsandbytes on a CPU")
    sys.exit(0 if result.wasSuccessful() and not skipped else 1)
