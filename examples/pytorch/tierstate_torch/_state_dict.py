# SPDX-License-Identifier: Apache-2.0
"""state_dict() and load_state_dict(): tierstate's (one checkpoint per shard, as bytes made
with no file) and the torch.optim optimizer's that the rule stands in for, both ways."""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from . import _bnb
from ._common import _DTYPES, _FORMAT, _format_suffix, _key_name, _number, _on
from ._ranks import as_param, is_sharded, local, local_of_whole


class _StateView(dict):
    """torch.optim's per-param `state`, which tierstate keeps in its shards instead: empty, but
    true once the optimizer has stepped. torch.distributed.checkpoint takes an optimizer whose
    `state` is empty for a fresh one and steps it once, with zero gradients and lr 0, to make
    its state: that step would decay a trained optimizer's moments and count one more step."""

    def __init__(self, owner: Any) -> None:
        super().__init__()
        self._owner = weakref.ref(owner)

    def __bool__(self) -> bool:
        owner = self._owner()
        return owner is not None and owner._has_stepped()

    def __missing__(self, key: Any) -> dict:  # (as torch.optim's defaultdict(dict))
        self[key] = {}
        return self[key]

    def __deepcopy__(self, memo: dict) -> "_StateView":
        return self  # (it holds nothing: a copy of the optimizer reads the same shards' count)


class _StateDicts:
    """The optimizer's state_dict side (a mixin of _OffloadedBase)."""

    def _keep_state_view(self) -> None:
        self.state = _StateView(self)

    def _has_stepped(self) -> bool:
        shards = getattr(self, "_shards", None)
        if not shards:
            return False
        try:
            return any(shard.step_count() > 0 for shard in shards.values())
        except Exception:
            return True  # (in doubt, never taken for fresh)

    def state_dict(self) -> dict[str, Any]:
        """The param groups (as torch.optim keeps them) and one tierstate checkpoint per dtype;
        with state_dict_format="torch", the state in torch's format instead (see
        torch_state_dict; the slots in fp32 and the master kept, so that it loads exactly):
        what torch.distributed.checkpoint saves, and reshards at another world size."""
        self._refuse_if("state_dict")
        self._build()
        if self._state_dict_format == "torch":
            return {"state": self._torch_state(fp32=True, full=False, master=True), "param_groups": self._torch_groups()}
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

    def _shard_of(self, i: int) -> Any:
        """The shard that keeps param i's state (partition=, where none of it is this rank's:
        the one shard every rank has, of the same format)."""
        where = self._where[i]
        return next(iter(self._shards.values())) if where is None else self._shards[where[0]]

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
                             "(each rank loads the tierstate state_dict it saved; at another world size, "
                             "save torch_state_dict(), or make the optimizer with state_dict_format='torch')")
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
        self._keep_state_view()
        self._note_versions()
        self._pushed.clear()
        self._push_hyperparameters(force=True)

    def torch_state_dict(self, full: bool = False) -> dict[str, Any]:
        """The state as the torch optimizer this one stands in for keeps it (torch.optim.Adam,
        AdamW, SGD, Adafactor; lion-pytorch's Lion), loadable by one over the same params. The
        slots are in each param's dtype, as torch keeps them; a master is not kept. With FSDP2's
        params each slot is a DTensor placed as its param (as torch.optim keeps a fully_shard
        model's state); full=True gathers them into whole tensors on every rank. With partition=
        (ShardedAdamW) the slots are whole tensors, gathered from every rank's slices. Both
        gathers are collectives: call them on every rank."""
        self._refuse_if("torch_state_dict")
        self._build()  # (get_state flushes a delayed update itself)
        return {"state": self._torch_state(fp32=False, full=full, master=False), "param_groups": self._torch_groups()}

    def _torch_groups(self) -> list[dict[str, Any]]:
        groups = []
        index = 0
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g.update(self._torch_group_extras())
            g["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(g)
        return groups

    def _step_counts(self, agreed: bool) -> list[int]:
        """Each param's own step count (torch's state[p]["step"]); `agreed`: the most any rank
        counts, so that every rank gathers the same params (partition=: a param no slice of
        which is this rank's counts on its owners only)."""
        counts = []
        for i in range(len(self._params())):
            where = self._where[i]
            counts.append(0 if where is None else self._shards[where[0]].tensor_step_count(f"p{i}"))
        if agreed and self._ranks is not None:
            import torch.distributed as dist
            t = torch.tensor(counts, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ranks.group)
            counts = [int(x) for x in t.tolist()]
        return counts

    def _torch_state(self, fp32: bool, full: bool, master: bool) -> dict[int, dict[str, torch.Tensor]]:
        """The per-param state in torch's format: the rule's slots (in fp32, or as torch keeps
        them: each param's dtype), "step" where torch keeps one, Adafactor's per-tensor
        statistics, and with `master` the master where the shard keeps one."""
        params = self._params()
        partition = self._slices is not None
        gathered = full and any(is_sharded(p) for p in params)
        counts = self._step_counts(agreed=partition or gathered)
        whole = self._gathered_slots(counts, master) if partition else {}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, p in enumerate(params):
            if counts[i] == 0:
                continue  # as torch: a param never stepped has no state
            s = {"step": torch.tensor(float(counts[i]), dtype=torch.float32)} if self._torch_keeps_step else {}
            if partition:
                for slot, flat in whole[i].items():
                    dtype = torch.float32 if fp32 or slot == "master" else p.dtype
                    s[slot] = flat.view(p.shape).to(device=p.device, dtype=dtype)
            else:
                key, _ = self._where[i]
                shard = self._shards[key]
                names = self._torch_slots + (("master",) if master and "master" in shard.slot_names() else ())
                for slot in names:
                    with _on(key[1]):
                        value = shard.get_state(f"p{i}", slot)
                    t = as_param(value, p, torch.float32 if fp32 or slot == "master" else None)
                    s[slot] = t.full_tensor() if gathered and is_sharded(t) else t
                if self._torch_tensor_keys(p):
                    with _on(key[1]):
                        s.update(self._to_torch_tensor_state(p, shard.get_tensor_state(f"p{i}")))
            if s:  # (torch.optim.SGD without momentum keeps nothing)
                state[i] = s
        return state

    def _gathered_slots(self, counts: list[int], master: bool) -> dict[int, dict[str, torch.Tensor]]:
        """partition=: each stepped param's slots whole (flat, fp32), from every rank's slices
        (one all-gather per slot through the ranks' gloo group, padded to the largest share)."""
        import torch.distributed as dist
        params = self._params()
        key, shard = next(iter(self._shards.items()))  # (partition=: one shard)
        names = list(self._torch_slots) + (["master"] if master and "master" in shard.slot_names() else [])
        sizes = [sum(c for _, _, c in mine) for mine in self._pieces]
        whole: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(len(params)) if counts[i] > 0}
        for slot in names:
            mine = torch.zeros(max(sizes), dtype=torch.float32)
            at = 0
            with _on(key[1]):
                for t, _, c in self._pieces[self._rank]:
                    mine[at:at + c] = shard.get_state(f"p{t}", slot).reshape(-1).cpu()
                    at += c
            everyone = [torch.empty_like(mine) for _ in sizes]
            dist.all_gather(everyone, mine, group=self._ranks.group)
            for i in whole:
                whole[i][slot] = torch.empty(params[i].numel(), dtype=torch.float32)
            for r, pieces in enumerate(self._pieces):
                at = 0
                for t, b, c in pieces:
                    if t in whole:
                        whole[t][slot][b:b + c] = everyone[r][at:at + c]
                    at += c
        return whole

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
            keeps_master = "master" in self._shard_of(i).slot_names()
            allowed = base_allowed | set(tensor_keys) | ({"master"} if keeps_master else set())
            extra = sorted(set(s) - allowed)
            if extra:
                raise ValueError(f"{name}: the state_dict's state[{key!r}] has {extra}, which {name}'s state "
                                 f"does not (it keeps {sorted(allowed)}): a state_dict of another optimizer")
            values = {}
            for slot in slots + (("master",) if keeps_master else ()):
                v = s.get(slot)
                if v is None:
                    continue
                # (FSDP2's: this rank's shard, of a DTensor or a whole tensor; partition=: whole)
                v = local_of_whole(v, params[i]) if torch.is_tensor(v) else v
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
                if n > 0 and (len(set(values) & set(slots)) != len(slots) or len(tensor_values) != len(tensor_keys)):
                    raise ValueError(f"{name}: the state_dict's state[{key!r}] has step {int(n)} but not all of "
                                     f"{list(slots) + list(tensor_keys)}")
                plan[i] = (int(n), values, tensor_values)
            else:  # (SGD's, Lion's): a param with its slots has stepped
                given = set(values) & set(slots)
                if given and len(given) != len(slots):
                    raise ValueError(f"{name}: the state_dict's state[{key!r}] has some of {list(slots)}, not all")
                plan[i] = (1 if slots and given else 0, values, {})
        super().load_state_dict({"state": {}, "param_groups": [self._torch_group(g) for g in saved_groups]})
        self._keep_state_view()
        # The param indices now match (torch's load checked the group sizes).
        for i, p in enumerate(params):
            if self._where[i] is None:
                continue  # (partition=: every element another rank's)
            key, _ = self._where[i]
            shard = self._shards[key]
            mine = self._mine(i, p)  # (partition=: this rank's slice; FSDP2: its shard)

            def cut(v: torch.Tensor, i: int = i) -> torch.Tensor:
                v = v.reshape(-1)
                if self._slices is None:
                    return v
                b, c = self._slices[i]
                return v[b:b + c]

            with _on(key[1]):
                if "master" in shard.slot_names():
                    off = getattr(p, "_tierstate_offload", None)  # (offload_parameters: its values are the store's)
                    saved = plan[i][1].get("master")
                    shard.set_state(f"p{i}", "master", cut(saved) if saved is not None else
                                    off.read(off.source(p)[2]).reshape(-1) if off is not None else mine.reshape(-1))
                if "compensation" in shard.slot_names():  # (torch keeps none: the param is exact)
                    shard.set_state(f"p{i}", "compensation", torch.zeros(mine.numel()))
                for slot in slots:
                    value = plan[i][1].get(slot)
                    shard.set_state(f"p{i}", slot, torch.zeros(mine.numel()) if value is None else cut(value))
                if self._torch_tensor_keys(p):
                    shard.set_tensor_state(f"p{i}", self._from_torch_tensor_state(p, plan[i][2]))
        # Each param's own count; the optimizer's, the most any param took (a param without
        # state took none; for SGD and Lion, whose torch state keeps no count, 1 or 0).
        most = max((n for n, _, _ in plan), default=0)
        for key, shard in self._shards.items():
            with _on(key[1]):
                shard.set_step_count(most)
        for i in range(len(params)):
            if self._where[i] is None:
                continue
            key, _ = self._where[i]
            with _on(key[1]):
                self._shards[key].set_tensor_step_count(f"p{i}", plan[i][0])
        self._note_versions()
        self._pushed.clear()
        self._push_hyperparameters(force=True)
