# SPDX-License-Identifier: Apache-2.0
"""tierstate_torch on CUDA parameters against torch.optim.AdamW on the same GPU: the
transformer of test_parity.py, 50 steps, in each GPU composition (ZeRO-Offload with the
state in PinnedHost and NvmeFile; OnDevice with it in Device memory, or streamed from
PinnedHost and NvmeFile), every loss within 1e-4 relative and the final params within
1e-4 * (|p| + lr); then hooks with a GradScaler, bf16 params, and 8-bit state for CUDA params in
every composition against torch.optim.AdamW on the CPU whose moments are re-encoded after
each step, as test_parity.py's CPU test does. Exits 77 (skipped) without
a CUDA device. Attention runs on the math backend: the fused backends' backward passes may
sum in a different order from run to run.

Run: python tests/pytorch/test_parity_cuda.py
"""
from __future__ import annotations

import os
import sys
import tempfile
import unittest
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_parity as tp  # noqa: E402

import tierstate_torch  # noqa: E402  (test_parity put examples/pytorch on the path)

COMPOSITIONS = (("host", "pinned"), ("host", "nvme"), ("device", "device"), ("device", "pinned"),
                ("device", "nvme"))


class CudaParity(unittest.TestCase):
    dev = torch.device("cuda")
    assert_parity = tp.Parity.assert_parity

    def setUp(self) -> None:
        self._math = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)
        self._math.__enter__()

    def tearDown(self) -> None:
        self._math.__exit__(None, None, None)

    def data(self, n: int, seed: int = 99):
        return [(x.to(self.dev), y.to(self.dev)) for x, y in tp.batches(n, seed)]

    def model(self, dtype=torch.float32):
        return tp.make_model(dtype).to(self.dev)

    def test_compositions_50_steps(self):
        data = self.data(tp.STEPS)
        ref = self.model()
        ref_opt = torch.optim.AdamW(tp.groups(ref), lr=tp.LR, betas=(0.9, 0.95))
        ref_losses = tp.train(ref, ref_opt, data, tp.schedule(ref_opt))
        with tempfile.TemporaryDirectory(dir=tp.SCRATCH) as d:
            for compute, tier in COMPOSITIONS:
                with self.subTest(compute=compute, tier=tier):
                    model = self.model()
                    opt = tierstate_torch.AdamW(tp.groups(model), lr=tp.LR, betas=(0.9, 0.95), compute=compute,
                                                tier=tier, path=d if tier == "nvme" else None, chunk_elements=4096)
                    print(opt.composition(), flush=True)
                    losses = tp.train(model, opt, data, tp.schedule(opt))
                    self.assert_parity(ref_losses, losses, ref, model)

    def test_hooks_with_a_grad_scaler(self):
        data = self.data(12, seed=7)
        for compute, tier in (("host", "pinned"), ("device", "device")):
            with self.subTest(compute=compute, tier=tier):
                runs = []
                for ours in (False, True):
                    model = self.model()
                    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12, growth_interval=4)
                    opt = (tierstate_torch.AdamW(model.parameters(), lr=tp.LR, compute=compute, tier=tier,
                                                 overlap_backward=True, grad_scaler=scaler)
                           if ours else torch.optim.AdamW(model.parameters(), lr=tp.LR))
                    runs.append((model, *tp.train_scaled(model, opt, scaler, data)))
                self.assert_parity(runs[0][1], runs[1][1], runs[0][0], runs[1][0])
                self.assertEqual(runs[0][2], runs[1][2])

    def test_bf16_params_on_the_device(self):
        data = self.data(10, seed=23) * 3
        for compute, tier in (("host", "pinned"), ("device", "device")):
            with self.subTest(compute=compute, tier=tier):
                model = self.model(torch.bfloat16)
                opt = tierstate_torch.AdamW(model.parameters(), lr=1e-2, compute=compute, tier=tier)
                losses = tp.train(model, opt, data)
                self.assertLess(losses[-1], losses[0])
                master = opt.get_state(model.head.weight, "master")
                self.assertTrue(torch.equal(master.to(torch.bfloat16), model.head.weight.detach().cpu()))
                sd = opt.torch_state_dict()
                self.assertEqual(sd["state"][0]["exp_avg"].device, model.head.weight.device)

    def test_int8_state_for_cuda_params(self):
        sizes = [5000, 700, 257, 3]
        torch.manual_seed(3)
        init = [torch.randn(n) for n in sizes]
        grads = [[torch.randn(n) * (1 + (t % 3)) for n in sizes] for t in range(12)]
        with tempfile.TemporaryDirectory(dir=tp.SCRATCH) as d:
            for compute, tier in COMPOSITIONS:
                with self.subTest(compute=compute, tier=tier):
                    ps = [x.clone().requires_grad_() for x in init]
                    qs = [x.to(self.dev).requires_grad_() for x in init]
                    ref = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=False)
                    ours = tierstate_torch.AdamW(qs, lr=1e-2, weight_decay=0.01, state_dtype="int8", min_8bit_size=300,
                                                 compute=compute, tier=tier, path=d if tier == "nvme" else None)
                    print(ours.composition(), flush=True)
                    self.assertIn("dynamic8", " ".join(ours.composition()))
                    tp.Parity.assert_8bit_parity(self, ref, ours, ps, qs, grads, 300,
                                                 (("exp_avg", True), ("exp_avg_sq", False)))
                    ours.close()
        # bf16 CUDA params with each compact master learn, on the host and on the GPU.
        data = self.data(10, seed=23) * 3
        for compute, tier in (("host", "pinned"), ("device", "device")):
            for master in ("kahan", "stochastic"):
                with self.subTest(compute=compute, master=master):
                    model = self.model(torch.bfloat16)
                    opt = tierstate_torch.AdamW(model.parameters(), lr=1e-2, state_dtype=torch.int8, master=master,
                                                compute=compute, tier=tier)
                    losses = tp.train(model, opt, data)
                    self.assertLess(losses[-1], losses[0])
                    opt.close()

if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU parity test is skipped")
        sys.exit(77)
    result = unittest.main(verbosity=2, exit=False, defaultTest="CudaParity").result
    sys.exit(0 if result.wasSuccessful() and not result.skipped else 1)
