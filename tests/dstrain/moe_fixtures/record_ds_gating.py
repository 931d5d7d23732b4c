"""Record DeepSpeed's gating decisions on fixed logits, for tests/dstrain/test_moe_gate.py.

Run with the DeepSpeed reference venv (deepspeed 0.19.8, torch 2.13.0 CPU), from the repository root:

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 /work/ds-venv/bin/python \
        tests/dstrain/moe_fixtures/record_ds_gating.py tests/dstrain/moe_fixtures/ds_gating.json.gz

For every case it draws logits from a seeded generator, calls deepspeed.moe.sharded_moe.top1gating /
top2gating / topkgating with sampling off (use_rts=False, top2_2nd_expert_sampling=False, no noise), once
with sparse_routes=True (indices / locations / gates per route) and once dense (combine_weights,
dispatch_mask), and saves the logits with both outputs. The dense outputs are stored as COO (nonzero
positions and values), every tensor as a plain list (fp32 values are exact as JSON
numbers), in gzipped JSON to keep the file small and loadable without unpickling. Nothing here is computed by dstrain.
"""

import gzip
import json
import sys

import torch
from deepspeed.moe.sharded_moe import top1gating, top2gating, topkgating


def cases():
    g = torch.Generator().manual_seed(20261130)
    for k in (1, 2, 3, 4):
        for s, e in ((16, 4), (37, 4), (64, 8)):
            if k > e:
                continue
            for skew in (0.0, 2.0):
                for cf, min_cap in ((1.0, 0), (0.5, 4), (1.25, 2)):
                    for drop in (True, False):
                        logits = torch.randn(s, e, generator=g)
                        logits[:, 0] += skew  # a popular expert: forces drops under a tight capacity
                        yield dict(k=k, s=s, e=e, cf=cf, min_cap=min_cap, drop=drop, logits=logits)


def run(case):
    logits, k, cf, mc, drop = case["logits"], case["k"], case["cf"], case["min_cap"], case["drop"]
    if k == 1:
        sparse = top1gating(logits.clone(), cf, mc, drop_tokens=drop, use_rts=False, sparse_routes=True)
        dense = top1gating(logits.clone(), cf, mc, drop_tokens=drop, use_rts=False)
    elif k == 2:
        sparse = top2gating(
            logits.clone(), cf, mc, drop_tokens=drop, top2_2nd_expert_sampling=False, sparse_routes=True
        )
        dense = top2gating(logits.clone(), cf, mc, drop_tokens=drop, top2_2nd_expert_sampling=False)
    else:
        sparse = topkgating(logits.clone(), k, cf, mc, drop_tokens=drop, sparse_routes=True)
        dense = topkgating(logits.clone(), k, cf, mc, drop_tokens=drop)
    l_aux, cap, _, idx, loc, gates, counts = sparse
    cw = dense[1].to_sparse()
    return dict(
        case,
        l_aux=l_aux.detach(),
        capacity=int(cap),
        indices=idx.long(),
        locations=loc.long(),
        gates=gates.detach(),
        exp_counts=counts.long(),
        dense_l_aux=dense[0].detach(),
        combine_idx=cw.indices(),
        combine_val=cw.values().detach(),
        combine_shape=tuple(dense[1].shape),
        dispatch_nnz=int(dense[2].sum()),
    )


if __name__ == "__main__":
    # plain lists (fp32 values are exact as Python floats): far smaller than one zip record per tensor
    out = [
        {key: v.tolist() if isinstance(v, torch.Tensor) else v for key, v in run(c).items()} for c in cases()
    ]
    with gzip.open(sys.argv[1], "wt") as f:
        json.dump({"deepspeed": "0.19.8", "torch": torch.__version__, "cases": out}, f)
    print(f"{len(out)} cases -> {sys.argv[1]}")
