"""Variable-size collectives for vLLM's CPU communicator, so a mixture-of-experts model runs with
data parallelism on the CPU build (DP attention ranks in lockstep through the MoE layer).

vLLM 0.32.0's CPU build picks the all-gather/reduce-scatter MoE dispatcher whenever DP > 1 (with
or without --enable-expert-parallel), and that dispatcher calls `all_gatherv` and
`reduce_scatterv`, which `CpuCommunicator` does not implement: the first forward pass fails with
NotImplementedError (upstream: vllm-project/vllm#57837, open). This module adds both on top of
torch.distributed (gloo), the transport the CPU communicator already uses for its other
collectives: gather pads each rank's rows to the largest and trims after; reduce-scatter reduces
the whole tensor and keeps this rank's rows. Correct, not fast; the tiny model does not care.

With --enable-expert-parallel each rank holds only its share of the experts, but the CPU
experts' `apply` ignores the `expert_map` it is given and hands the kernel global expert ids:
`cpu_fused_moe` then reads past its local weights and the worker dies with a segmentation fault
in csrc/cpu/cpu_fused_moe.cpp (fused_moe_impl) at the first step. This module maps the ids to
local ones first; an expert another rank holds gets weight 0 (and a valid local id), so each
rank computes its experts' share and the dispatcher's reduce-scatter adds the shares up.

It is loaded only by scripts that put this directory on PYTHONPATH (scripts/vllm/moe-live.sh),
in every process vLLM starts, and patches the class when vLLM imports it.
"""

import importlib.abc
import importlib.machinery
import sys

def _patch_communicator(module) -> None:
    import torch
    import torch.distributed as dist

    cls = module.CpuCommunicator
    if getattr(cls, "_balanceroute_gatherv", False):
        return

    def all_gatherv(self, input_, dim=0, sizes=None):
        tensors = input_ if isinstance(input_, list) else [input_]
        out = []
        for t in tensors:
            d = dim + t.dim() if dim < 0 else dim
            x = t.movedim(d, 0).contiguous()
            rows = sizes if sizes is not None else [x.shape[0]] * self.world_size
            pad = max(rows)
            buf = torch.zeros((pad,) + tuple(x.shape[1:]), dtype=x.dtype)
            buf[: x.shape[0]] = x
            parts = [torch.empty_like(buf) for _ in range(self.world_size)]
            dist.all_gather(parts, buf, group=self.device_group)
            y = torch.cat([p[:n] for p, n in zip(parts, rows)], dim=0)
            out.append(y.movedim(0, d).contiguous())
        return out if isinstance(input_, list) else out[0]

    def reduce_scatterv(self, input_, dim=-1, sizes=None):
        d = dim + input_.dim() if dim < 0 else dim
        x = input_.movedim(d, 0).contiguous()
        rows = sizes if sizes is not None else [x.shape[0] // self.world_size] * self.world_size
        dist.all_reduce(x, group=self.device_group)
        start = sum(rows[: self.rank_in_group])
        return x[start : start + rows[self.rank_in_group]].movedim(0, d).contiguous()

    cls.all_gatherv = all_gatherv
    cls.reduce_scatterv = reduce_scatterv
    cls._balanceroute_gatherv = True


def _patch_experts(module) -> None:
    cls = module.CPUUnquantizedExperts
    if getattr(cls, "_balanceroute_expert_map", False):
        return
    apply = cls.apply

    def apply_local(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                    global_num_experts, expert_map, *rest, **kw):
        if expert_map is not None:
            local = expert_map[topk_ids.long()]
            remote = local < 0
            topk_weights = topk_weights.masked_fill(remote, 0).contiguous()
            topk_ids = local.clamp(min=0).to(topk_ids.dtype).contiguous()
        return apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                     global_num_experts, expert_map, *rest, **kw)

    cls.apply = apply_local
    cls._balanceroute_expert_map = True


_TARGETS = {
    "vllm.distributed.device_communicators.cpu_communicator": _patch_communicator,
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe": _patch_experts,
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _TARGETS.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return inner.create_module(s)

            def exec_module(self, module):
                inner.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


sys.meta_path.insert(0, _Finder())
