"""Per-device memory and time of gathered_attn_idx with the cache split over its rows, against the
same call with the cache replicated, on N virtual host CPU devices.

    python benchmarks/sharded_cache.py --devices 4 --json benchmarks/records/cpu-2core-jax0.10.2-sharded-cache.json

Both layouts are jitted on the same mesh with q, idx and the sink replicated (decode: too few
tokens to split), timed after warm-up as the median of interleaved rounds. Per-device memory is
XLA's own accounting of the compiled program (``memory_analysis()``: arguments, temporaries,
outputs on one device). The devices are virtual and share the host's cores: the times compare
the two layouts on the same hardware, they are not a multi-device speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--shape", default="4,16,576,2048,1048576", help="T,H,D,K,R")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_sparse_attn as jsa
    from jax_sparse_attn.bench.common import environment

    T, H, D, K, R = (int(v) for v in args.shape.split(","))
    mesh = jax.make_mesh((args.devices,), ("rows",))
    replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("rows"))

    def make_cache(sharding):
        # Made on the devices in its final layout (no host copy of the 1 GiB cache), by one fused
        # elementwise hash of the position: jax.random would hold f32 and u32 copies of the
        # whole cache on every device while making it (over 20 GiB for 4 replicas at R = 1M).
        def fill():
            r = jax.lax.broadcasted_iota(jnp.float32, (R, D), 0)
            d = jax.lax.broadcasted_iota(jnp.float32, (R, D), 1)
            u = jnp.sin(r * 12.9898 + d * 78.233) * 43758.5453
            return (2 * (u - jnp.floor(u)) - 1).astype(jnp.bfloat16)

        return jax.jit(fill, out_shardings=sharding)()

    rng = np.random.default_rng(0)
    q = jax.device_put(rng.standard_normal((T, H, D)).astype(jnp.bfloat16), replicated)
    idx = jax.device_put(rng.integers(0, R, (T, K)).astype(np.int32), replicated)
    sink = jax.device_put(np.zeros(H, np.float32), replicated)
    attn = jax.jit(jsa.gathered_attn_idx)

    layouts = {}
    for name, sharding in (("replicated", replicated), ("rows", by_rows)):
        kv = make_cache(sharding)
        compiled = attn.lower(q, kv, idx, sink).compile()
        mem = compiled.memory_analysis()
        text = compiled.as_text()
        layouts[name] = {
            "kv": kv,
            "per_device_cache_bytes": kv.addressable_shards[0].data.nbytes,
            "per_device_argument_bytes": int(mem.argument_size_in_bytes),
            "per_device_temp_bytes": int(mem.temp_size_in_bytes),
            "per_device_output_bytes": int(mem.output_size_in_bytes),
            "collectives": sorted({c for c in ("all-gather", "all-reduce", "all-to-all",
                                               "collective-permute") if c in text}),
            "seconds": [],
        }
        jax.block_until_ready(attn(q, kv, idx, sink))  # warm-up
    outs = {}
    for _ in range(args.rounds):
        for name, entry in layouts.items():
            start = time.perf_counter()
            outs[name] = jax.block_until_ready(attn(q, entry["kv"], idx, sink))
            entry["seconds"].append(time.perf_counter() - start)
    diff = float(np.max(np.abs(np.asarray(outs["rows"], np.float32)
                               - np.asarray(outs["replicated"], np.float32))))
    result = {"shape": {"T": T, "H": H, "D": D, "K": K, "R": R, "dtype": "bfloat16"},
              "devices": args.devices, "environment": environment(),
              "max_abs_diff_rows_vs_replicated": diff, "layouts": {}}
    for name, entry in layouts.items():
        entry.pop("kv")
        entry["median_seconds"] = statistics.median(entry["seconds"])
        result["layouts"][name] = entry
    rep, rows = result["layouts"]["replicated"], result["layouts"]["rows"]
    result["cache_bytes_ratio_replicated_over_rows"] = (rep["per_device_cache_bytes"]
                                                        / rows["per_device_cache_bytes"])
    result["time_ratio_rows_over_replicated"] = rows["median_seconds"] / rep["median_seconds"]
    print(f"T,H,D,K,R = {T},{H},{D},{K},{R} bf16 on {args.devices} virtual CPU devices")
    for name, e in result["layouts"].items():
        print(f"  {name:10s} cache/device {e['per_device_cache_bytes'] / 2**30:.3f} GiB, "
              f"args {e['per_device_argument_bytes'] / 2**30:.3f} GiB, "
              f"temp {e['per_device_temp_bytes'] / 2**20:.1f} MiB, "
              f"median {e['median_seconds'] * 1e3:.1f} ms, collectives {e['collectives']}")
    print(f"  rows/replicated time: {result['time_ratio_rows_over_replicated']:.2f}; "
          f"max |rows - replicated| = {diff:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        from jax_sparse_attn.bench.records import index_if_indexed

        index_if_indexed(args.json, "python benchmarks/sharded_cache.py", argv)
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
