"""Experiment (one GPU): the tree's local split-KV (``local_states(..., local="split_kv")``, the plan the bench's
``local:split_kv`` rows use) timed in CUDA-graph mode over the bench's local shard shapes (P=2), to compare a
kernel change with the ``local:split_kv graph`` rows of an earlier ``bench multigpu`` run on the same machine
kind. Prints one line per shape and writes JSON to $OUT/local_split_kv_graph.json."""
import json
import os

import torch

from attnopt.bench.common import git_commit, time_us
from attnopt.runtime import distributed as D

rows = []
for name, (Hq, Hkv, Dh) in {"llama3-8b": (32, 8, 128), "mha16": (16, 16, 128)}.items():
    for n_total in (32768, 131072):
        n = n_total // 2
        q = torch.randn(1, Hq, 1, Dh, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, Hkv, n, Dh, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, Hkv, n, Dh, device="cuda", dtype=torch.bfloat16)
        us = time_us(lambda: D.local_states(q, k, v, fp32=False, local="split_kv"), "graph")
        rows.append({"case": f"{name}-{n_total >> 10}k", "N_local": n, "us": round(us, 2)})
        print(rows[-1], flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "local_split_kv_graph.json"), "w") as f:
    json.dump({"device": torch.cuda.get_device_name(), "commit": git_commit(), "rows": rows}, f, indent=1)
