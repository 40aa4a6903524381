# SPDX-License-Identifier: Apache-2.0
"""state_dict() and load_state_dict(): tierstate's (one checkpoint per shard, as bytes made
with no file) and the torch.optim optimizer's that the rule stands in for, both ways."""
from __future__ import annotations

import math
from typing import Any

import torch

from . import _bnb
from ._common import _DTYPES, _FORMAT, _format_suffix, _key_name, _number, _on
from ._ranks import as_param, local


class _StateDicts:
    """The optimizer's state_dict side (a mixin of _OffloadedBase)."""

    def state_dict(self) -> dict[str, Any]:
        """The param groups (as torch.optim keeps them) and one tierstate checkpoint per dtype."""
        self._refuse_if("state_dict")
        self._build()
        sd = super().state_dict()
        shards = {}
        for key, shard in self._shards.items():
            with _on(key[1]):
                data = shard.save_bytes()  # the checkpoint's bytes, through no file
            # Named by dtype and members, not device: it loads on another GPU, or the CPU.
            shards[self._saved_name(key)] = {"checkpoint": data, "params": list(self._members[key])}
        sd["tierstate"] = {"format": _FORMAT, "shards": shards}
        if self._partition is not None:  # (a rank's share: loaded by the same rank of the same partition)
            sd["tierstate"]["partition"] = self._partition_record()
        return sd

    def _partition_record(self) -> dict[str, Any]:
        return {"rank": self._rank, "world": len(self._pieces), "pieces": [list(x) for x in self._pieces[self._rank]]}

    def _saved_name(self, key: tuple) -> str:
        # (8-bit state and a master other than fp32 are named too: a state_dict of 8-bit state
        # is refused by an optimizer of fp32 state, by name, before any checkpoint is read; bf16
        # state keeps the plain name, as before them, and its checkpoint's own check refuses it)
        return f"{_DTYPES[key[0]]}/{self._members[key][0]}{_format_suffix(key, compact_only=True)}"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes a state_dict() of this class, one of the torch optimizer it stands in for, or
        one of bitsandbytes' (AdamW8bit, Adam8bit, Lion8bit, SGD8bit; 32-bit and paged forms
        too), whose 8-bit moments are decoded and then stored in this optimizer's state_dtype."""
        self._refuse_if("load_state_dict", replaced=True)
        if _bnb.is_bitsandbytes(state_dict):
            state_dict = _bnb.to_torch(self, state_dict)
        if "tierstate" not in state_dict:
            self._load_torch_state_dict(state_dict)
            return
        ts = state_dict["tierstate"]
        if ts.get("format") != _FORMAT:
            raise ValueError(f"{type(self).__name__}: a state_dict of format {ts.get('format')!r}; "
                             f"this is {_FORMAT}")
        self._build()
        saved = ts.get("partition")
        mine = self._partition_record() if self._partition is not None else None
        if saved != mine:
            said = ("one process's state" if saved is None else
                    f"rank {saved['rank']} of {saved['world']}'s share of the state (partition=)")
            wants = ("one process's" if mine is None else f"rank {mine['rank']} of {mine['world']}'s share, "
                     "of the same params")
            raise ValueError(f"{type(self).__name__}: the state_dict holds {said}; this optimizer takes {wants} "
                             "(each rank loads the state_dict it saved; loading at another world size is not "
                             "built yet)")
        ours = {self._saved_name(key): key for key in self._shards}
        if set(ts["shards"]) != set(ours):
            raise ValueError(f"{type(self).__name__}: the state_dict has state for parameters of "
                             f"{sorted(ts['shards'])}; this optimizer's are {sorted(ours)}")
        for key, info in ts["shards"].items():
            if list(info["params"]) != self._members[ours[key]]:
                raise ValueError(f"{type(self).__name__}: the state_dict's {key} parameters are "
                                 f"{list(info['params'])}; this optimizer's are {self._members[ours[key]]}")
        sizes = [len(g["params"]) for g in state_dict["param_groups"]]
        if sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"{type(self).__name__}: the state_dict's param groups have {sizes} params; "
                             f"this optimizer's have {[len(g['params']) for g in self.param_groups]}")
        # Each shard's load checks everything before it changes anything; with several, the
        # ones loaded before a failing one are put back from a copy made first.
        backups = {}
        if len(self._shards) > 1:
            for key, shard in self._shards.items():
                with _on(key[1]):
                    backups[key] = shard.save_bytes()
        done = []
        for name, info in ts["shards"].items():
            key = ours[name]
            try:
                with _on(key[1]):
                    self._shards[key].load_bytes(info["checkpoint"])
            except Exception as e:
                for k in done:
                    with _on(k[1]):
                        self._shards[k].load_bytes(backups[k])
                raise type(e)(f"{type(self).__name__}.load_state_dict: the checkpoint of the "
                              f"{_key_name(key)} parameters: {e}") from e
            done.append(key)
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._note_versions()
        self._pushed.clear()
        self._push_hyperparameters(force=True)

    def torch_state_dict(self) -> dict[str, Any]:
        """The state as the torch optimizer this one stands in for keeps it (torch.optim.Adam,
        AdamW, SGD, Adafactor; lion-pytorch's Lion), loadable by one over the same params. The slots are in
        each param's dtype, as torch keeps them; a master is not kept."""
        self._refuse_if("torch_state_dict")
        if self._partition is not None:
            raise ValueError(f"{type(self).__name__}: torch_state_dict with partition=: each rank holds a slice of "
                             "the state (its state_dict() has it); gathering it is not built yet")
        self._build()  # (get_state flushes a delayed update itself)
        groups = []
        index = 0
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g.update(self._torch_group_extras())
            g["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(g)
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, p in enumerate(self._params()):
            key, _ = self._where[i]
            steps = self._shards[key].tensor_step_count(f"p{i}")
            if steps == 0:
                continue  # as torch: a param never stepped has no state
            s = {"step": torch.tensor(float(steps), dtype=torch.float32)} if self._torch_keeps_step else {}
            for slot in self._torch_slots:
                with _on(key[1]):
                    value = self._shards[key].get_state(f"p{i}", slot)
                s[slot] = as_param(value, p)
            if self._torch_tensor_keys(p):
                with _on(key[1]):
                    s.update(self._to_torch_tensor_state(p, self._shards[key].get_tensor_state(f"p{i}")))
            if s:  # (torch.optim.SGD without momentum keeps nothing)
                state[i] = s
        return {"state": state, "param_groups": groups}

    def _torch_group(self, g: dict[str, Any]) -> dict[str, Any]:
        """A torch param group as this optimizer keeps it: its numbers, a flag it lacks as
        torch's default (False: an older torch's, or lion-pytorch's without maximize)."""
        out = {k: False for k in self._torch_flags}
        keep = self._torch_group_keys + self._torch_flags + ("params", "initial_lr", "param_names")
        out.update((k, v) for k, v in g.items() if k in keep)
        return out

    def _as_state(self, v: torch.Tensor, what: str) -> torch.Tensor:
        """A state tensor as float32 on the CPU, as the shards take it: converted while the load
        is planned, so that one that cannot be (a complex or meta tensor) refuses it whole."""
        if not (v.is_floating_point() and v.device.type in ("cpu", "cuda")):
            raise ValueError(f"{type(self).__name__}: the state_dict's {what} is a {v.dtype} tensor on {v.device}; "
                             "the state is real numbers on the CPU or a GPU")
        return v.detach().to("cpu", torch.float32).reshape(-1)

    def _load_torch_state_dict(self, sd: dict[str, Any]) -> None:
        """Everything is checked, and what goes where is planned, before anything changes."""
        name = type(self).__name__
        if self._partition is not None:
            raise ValueError(f"{name}: a torch optimizer's state_dict into one with partition=: each rank holds a "
                             "slice of the state; splitting it is not built yet (load this class's state_dict())")
        if not isinstance(sd, dict) or "param_groups" not in sd or "state" not in sd:
            raise ValueError(f"{name}: not a state_dict (no 'state' and 'param_groups')")
        saved_groups = sd["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{name}: the state_dict has {len(saved_groups)} param groups; this optimizer has "
                             f"{len(self.param_groups)}")
        self._build()
        ids: list[Any] = []  # the saved id of each of this optimizer's params, in order
        for gi, (g, mine) in enumerate(zip(saved_groups, self.param_groups)):
            missing = [k for k in self._torch_group_keys if k not in g]
            if missing:
                raise ValueError(f"{name}: the state_dict's param group {gi} has no {missing}: not a state_dict "
                                 f"of the optimizer {name} stands in for")
            self._check_torch_group(g)
            if len(g.get("params", [])) != len(mine["params"]):
                raise ValueError(f"{name}: the state_dict's param group {gi} has {len(g.get('params', []))} params; "
                                 f"this optimizer's has {len(mine['params'])}")
            self._check_group({**self._torch_group(g), "params": []})  # its numbers, in torch's words
            ids.extend(g["params"])
        params = self._params()
        state = sd["state"]
        position = {sid: i for i, sid in enumerate(ids)}
        # per param: (step, slots, per-tensor state)
        plan: list[tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = [(0, {}, {}) for _ in params]
        slots = self._torch_slots
        base_allowed = set(slots) | ({"step"} if self._torch_keeps_step else set())
        for key, s in state.items():
            i = position.get(key, position.get(int(key) if isinstance(key, str) and key.isdigit() else key))
            if i is None:
                raise ValueError(f"{name}: the state_dict has state for param {key!r}, which no param group lists")
            if not isinstance(s, dict):
                raise ValueError(f"{name}: the state_dict's state[{key!r}] is not a dict")
            tensor_keys = self._torch_tensor_keys(params[i])
            allowed = base_allowed | set(tensor_keys)
            extra = sorted(set(s) - allowed)
            if extra:
                raise ValueError(f"{name}: the state_dict's state[{key!r}] has {extra}, which {name}'s state "
                                 f"does not (it keeps {sorted(allowed)}): a state_dict of another optimizer")
            values = {}
            for slot in slots:
                v = s.get(slot)
                if v is None:
                    continue
                v = local(v) if torch.is_tensor(v) else v  # (FSDP2's: this rank's shard)
                if not torch.is_tensor(v) or v.numel() != local(params[i]).numel():
                    got = f"{v.numel()} elements" if torch.is_tensor(v) else type(v).__name__
                    raise ValueError(f"{name}: the state_dict's state[{key!r}][{slot!r}] is {got}; its param has "
                                     f"{local(params[i]).numel()} elements")
                values[slot] = self._as_state(v, f"state[{key!r}][{slot!r}]")
            tensor_values = {}
            for k, n in tensor_keys.items():
                v = s.get(k)
                if v is None:
                    continue
                if not torch.is_tensor(v) or v.numel() != n:
                    got = f"{v.numel()} elements" if torch.is_tensor(v) else type(v).__name__
                    raise ValueError(f"{name}: the state_dict's state[{key!r}][{k!r}] is {got}; for its param of "
                                     f"shape {tuple(params[i].shape)} it has {n}")
                tensor_values[k] = self._as_state(v, f"state[{key!r}][{k!r}]")
            if self._torch_keeps_step:
                if "step" not in s:
                    raise ValueError(f"{name}: the state_dict's state[{key!r}] has no 'step'")
                n = _number(s["step"], f"state[{key!r}]['step']")
                if not math.isfinite(n) or n < 0 or n > 2 ** 53 or n != int(n):
                    raise ValueError(f"{name}: the state_dict's state[{key!r}]['step'] is {n}; a step count is an "
                                     "integer in [0, 2^53]")
                if n > 0 and (len(values) != len(slots) or len(tensor_values) != len(tensor_keys)):
                    raise ValueError(f"{name}: the state_dict's state[{key!r}] has step {int(n)} but not all of "
                                     f"{list(slots) + list(tensor_keys)}")
                plan[i] = (int(n), values, tensor_values)
            else:  # (SGD's, Lion's): a param with its slots has stepped
                if values and len(values) != len(slots):
                    raise ValueError(f"{name}: the state_dict's state[{key!r}] has some of {list(slots)}, not all")
                plan[i] = (1 if slots and values else 0, values, {})
        super().load_state_dict({"state": {}, "param_groups": [self._torch_group(g) for g in saved_groups]})
        # The param indices now match (torch's load checked the group sizes).
        for i, p in enumerate(params):
            key, _ = self._where[i]
            shard = self._shards[key]
            with _on(key[1]):
                if "master" in shard.slot_names():
                    off = getattr(p, "_tierstate_offload", None)  # (offload_parameters: its values are the store's)
                    shard.set_state(f"p{i}", "master", off.read(off.source(p)[2]).reshape(-1) if off is not None
                                    else local(p).detach().reshape(-1))
                if "compensation" in shard.slot_names():  # (torch keeps none: the param is exact)
                    shard.set_state(f"p{i}", "compensation", torch.zeros(local(p).numel()))
                for slot in slots:
                    value = plan[i][1].get(slot)
                    shard.set_state(f"p{i}", slot, torch.zeros(local(p).numel()) if value is None else value.reshape(-1))
                if self._torch_tensor_keys(p):
                    shard.set_tensor_state(f"p{i}", self._from_torch_tensor_state(p, plan[i][2]))
        # Each param's own count; the optimizer's, the most any param took (a param without
        # state took none; for SGD and Lion, whose torch state keeps no count, 1 or 0).
        most = max((n for n, _, _ in plan), default=0)
        for key, shard in self._shards.items():
            with _on(key[1]):
                shard.set_step_count(most)
        for i in range(len(params)):
            key, _ = self._where[i]
            with _on(key[1]):
                self._shards[key].set_tensor_step_count(f"p{i}", plan[i][0])
        self._note_versions()
        self._pushed.clear()
        self._push_hyperparameters(force=True)
