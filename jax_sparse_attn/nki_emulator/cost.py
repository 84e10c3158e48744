"""The emulator's cost model: every constant, every per-instruction formula, and the bounds.

A MODEL, not a measurement. Each instruction the emulator executes is charged to one engine
(TensorE, VectorE, ScalarE, GpSimd, or the DMA queues) for the time the NKI documentation's
"Estimated instruction cost" formula gives; the modelled time of a program is the busiest engine's
total (perfect overlap between engines, no dependency stalls), and programs of an SPMD launch run
on separate physical cores in parallel.

Sources (Neuron SDK docs, repository aws-neuron/aws-neuron-sdk):

* [isa]: the NKI ISA API reference pages, section "Estimated instruction cost", in
  ``general/nki/api/nki/isa/__init__.py`` at tag v2.25.0 (the NKI 0.3 pages at v2.29.1 no longer
  carry that section; the instructions' semantics did not change for the ones used here).
* [arch1] ``nki/guides/architecture/trainium_inferentia2_arch.rst``, [arch2] ``trainium2_arch.rst``,
  [arch3] ``trainium3_arch.rst`` (v2.29.1): engine clocks, device HBM bandwidth, cores per device,
  TensorE TFLOPS.
* [dma] ``nki/deep-dives/nki-dma-bandwidth-guide.rst`` and ``nki/get-started/about/nki-dma-overview.rst``
  (v2.29.1): 16 DMA engines per NeuronCore, per-engine and aggregate DMA bandwidth, payload size.
* [dge] ``nki/deep-dives/nki-dge.rst`` (v2.29.1): software DGE uses GpSimd cycles; a hardware-DGE
  DMA takes about 600 ns; two DGE instances per NeuronCore-v3.
* [lnc] ``about-neuron/arch/neuron-features/logical-neuroncore-config.rst``: LNC=2 on trn2 by
  default (two physical cores, one logical core).
* NKI 0.4 to 0.7 (``release-notes/components/nki.rst`` at v2.32.0; readthedocs v2.33.0): no new
  cost formulas; what they change in the model (``nl.copy`` on VectorE from 0.6, a bf16 matmul
  dst on NeuronCore-v4, the gather-transpose ``dma_transpose``) is noted at its entry below.

To cost a new instruction: add one line to :data:`COSTS` (engine, cycles as a function of the
:class:`Op` summary) and call ``ctx.cost.compute(instr, engine, dst, inputs)`` in the emulated
instruction (DMA instructions call ``ctx.cost.dma``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")

# --------------------------------------------------------------------------------------------
# Constants (one place; each with its source or marked as an assumption)

# [isa] "MIN_II is the minimum instruction initiation interval for small input tiles. MIN_II is
# roughly 64 engine cycles." (activation, tensor_scalar, tensor_copy, memset, ... pages)
MIN_II = 64
# [isa] affine_select / iota pages: "GPSIMD_START is the instruction startup overhead on GpSimdE,
# roughly 150 engine cycles."
GPSIMD_START = 150
# [isa] nc_matmul page: cost max(min(64, N_stationary), N_moving) cycles, 4x for fp32 inputs.
MATMUL_MIN_STATIONARY = 64
MATMUL_FP32_FACTOR = 4
# nc_matmul page (v2.25.0 and v2.32.0), is_stationary_onezero / is_moving_onezero: "setting this
# field explicitly could lead to 2x better performance" for an fp32 operand of ones and zeros.
# Taken as halving the fp32 factor per such operand (inferred: the page gives no formula).
MATMUL_ONEZERO_SPEEDUP = 2
# nki-library's own estimate of nc_match_replace8 (core/topk/rotational_topk.py: a max8 +
# match_replace8 round costs 2 * (N + 144)): N + 144 VectorE cycles. Not a documented figure.
MATCH_REPLACE8_OVERHEAD = 144
# [dma] "Each NeuronCore has 16 DMA engines" (v2, v3 and v4).
DMA_ENGINES = 16
# Assumption: engine time per contiguous DMA chunk (one "DMA buffer", [arch1]: "There is some
# performance overhead at both DMA buffer and transfer levels"). [dma] gives no per-chunk figure,
# only that >= 4 KiB per partition saturates the engines, 2 KiB approaches peak and < 256 B is
# severely overhead-bound; 20 ns per chunk per engine gives ~90% / ~82% / ~36% of peak there.
DMA_CHUNK_NS = 20.0
# [dge] "Each hardware-DGE DMA instruction takes approximately 600 ns to execute"; "Each TRN2
# NeuronCore has two DGE instances". Charged to the DMA queues for a DMA with a runtime
# (scalar_offset) address on NeuronCore-v3+ (assumption: the compiler picks hwdge for those).
HWDGE_NS = 600.0
HWDGE_INSTANCES = 2
# Assumption: software-DGE descriptor generation (indirect DMA, [dge]: "Consumes GpSimd Engine
# cycles") costs GPSIMD_START plus one GpSimd cycle per descriptor (gathered row); the docs give
# no figure.
SWDGE_CYCLES_PER_DESCRIPTOR = 1
# [arch2] "DMA transpose on Trainium2 can achieve up to 90% DMA throughput utilization given
# hardware-friendly tensor access patterns"; used as the transpose's bandwidth factor
# (optimistic: the perf guide calls DMA transposes' bandwidth "much lower" in general).
DMA_TRANSPOSE_EFFICIENCY = 0.9
# Assumption: registers ops (register_load/move/store) run on engine sequencers and cost nothing
# on the engines modelled here.


@dataclass(frozen=True)
class Hardware:
    """Per-target constants; bandwidths in GB/s (1e9 B/s), clocks in GHz, per PHYSICAL core."""

    tensor_ghz: float
    vector_ghz: float
    scalar_ghz: float
    gpsimd_ghz: float
    hbm_gbps_per_core: float
    dma_gbps_per_core: float
    pe_bf16_tflops_per_core: float
    lnc: int  # physical cores per logical core by default

    def clock_ghz(self, engine: str) -> float:
        return {
            "tensor": self.tensor_ghz,
            "vector": self.vector_ghz,
            "scalar": self.scalar_ghz,
            "gpsimd": self.gpsimd_ghz,
        }[engine]


HARDWARE: dict[str, Hardware] = {
    # [arch1]: Tensor 2.8 GHz, Vector 1.12, Scalar 1.4, GpSimd 1.4; a device has 2 NeuronCore-v2
    # and 820 GB/s of HBM (410 GB/s per core); TensorE "maximum throughput of 92 TFLOPS" (BF16).
    # [dma]: TRN1 272 GB/s aggregate DMA per NeuronCore. LNC=1 ([lnc]: LNC is trn2/trn3 only).
    "trn1": Hardware(2.8, 1.12, 1.4, 1.4, 820 / 2, 272, 92.0, lnc=1),
    # [arch2]: Tensor 2.4 GHz, Vector 0.96, Scalar 1.2, GpSimd 1.2; 3 TB/s HBM per device of 8
    # physical NeuronCore-v3 ([lnc]) = 375 GB/s per core; 79 BF16 dense TFLOPS per core.
    # [dma]: TRN2 368 GB/s aggregate DMA per NeuronCore. [lnc]: LNC=2 by default.
    "trn2": Hardware(2.4, 0.96, 1.2, 1.2, 3000 / 8, 368, 79.0, lnc=2),
    # [arch3]: Tensor 2.4, Vector 1.2, Scalar 1.2, GpSimd 1.2 GHz; 4.7 TB/s HBM per device of 8
    # NeuronCore-v4 = 587.5 GB/s per core; 79 BF16 TFLOPS. [dma]: TRN3 528 GB/s per NeuronCore.
    # LNC=2 assumed as on trn2 (assumption; [lnc] says LNC applies to Trn2 and Trn3).
    "trn3": Hardware(2.4, 1.2, 1.2, 1.2, 4700 / 8, 528, 79.0, lnc=2),
}


# --------------------------------------------------------------------------------------------
# Per-instruction formulas


@dataclass
class Op:
    """What a cost formula sees of one instruction.

    ``n``: elements per partition of the main input (``data``/``src``; of ``dst`` when the
    instruction has no tile input); ``p``: its partitions; ``in_dtypes``/``out_dtype``;
    ``in_psum``: whether each input tile is in PSUM; ``ops``: the ALU operator names;
    ``n_stationary``/``n_moving``: matmul free sizes; ``value``: memset's value.
    """

    n: int
    p: int
    in_dtypes: tuple = ()
    out_dtype: Any = None
    in_psum: tuple = ()
    ops: tuple = ()
    n_stationary: int = 0
    n_moving: int = 0
    value: Any = None
    n_dst: int = 0  # elements per partition of dst
    fp32_onezero: int = 0  # nc_matmul: fp32 operands flagged as ones and zeros only

    @property
    def all_bf16(self) -> bool:
        return all(d == "bfloat16" for d in self.in_dtypes) and self.out_dtype == "bfloat16"


def _matmul(o: Op) -> float:
    cycles = max(min(MATMUL_MIN_STATIONARY, o.n_stationary), o.n_moving)
    if "float32" not in o.in_dtypes:
        return cycles
    return cycles * MATMUL_FP32_FACTOR / MATMUL_ONEZERO_SPEEDUP**o.fp32_onezero


def _tensor_tensor(o: Op) -> float:
    one_psum = len(o.in_psum) == 2 and o.in_psum[0] != o.in_psum[1]
    fast_bf16 = o.all_bf16 and not any(o.in_psum) and set(o.ops) <= {"add", "multiply", "subtract"}
    return max(MIN_II, o.n if (one_psum or fast_bf16) else 2 * o.n)


def _scalar_tensor_tensor(o: Op) -> float:
    fast = (
        all(d == "bfloat16" for d in o.in_dtypes) and o.ops == ("subtract", "multiply")
        and o.n % 2 == 0
    )  # fmt: skip
    return o.n if fast else 2 * o.n


def _tensor_reduce(o: Op) -> float:
    fast = o.all_bf16 and o.ops and o.ops[0] in ("add", "maximum", "max")
    return o.n / 2 if fast else o.n


def _memset(o: Op) -> float:
    half = o.value == 0 and o.out_dtype in ("bfloat16", "float16")
    return max(MIN_II, o.n / 2 if half else o.n)


def _activation(o: Op) -> float:
    return max(MIN_II, o.n)


def _min_ii_n(o: Op) -> float:
    return max(MIN_II, o.n)


@dataclass(frozen=True)
class Cost:
    """An instruction's default engine and its cycles on that engine (``engine=`` may override)."""

    engine: str
    cycles: Callable[[Op], float]
    engines: tuple = ()  # engines the instruction may run on when ``engine=`` is given


COSTS: dict[str, Cost] = {
    # [isa] nc_matmul: max(min(64, N_stationary), N_moving) TensorE cycles (x4 for fp32). The
    # formula has no dst term: a bfloat16 PSUM dst (NeuronCore-v4; up to 8192 elements from NKI
    # 0.5, release notes) costs the same (inferred).
    "nisa.nc_matmul": Cost("tensor", _matmul),
    # [isa] nc_transpose: max(P, min(64, F)) on TensorE; max(MIN_II, N) on VectorE.
    "nisa.nc_transpose": Cost("tensor", lambda o: max(o.p, min(64, o.n)), ("tensor", "vector")),
    # [isa] activation: max(MIN_II, N) ScalarE cycles; with a reduction (reduce_cmd reduce or
    # reset_reduce) as activation_reduce: max(MIN_II, N) + MIN_II.
    "nisa.activation": Cost("scalar", _activation),
    "nisa.activation+reduce": Cost("scalar", lambda o: max(MIN_II, o.n) + MIN_II),
    # [isa] tensor_scalar: max(MIN_II, N) "Vector or Scalar Engine cycles"; VectorE by default
    # (assumption for engine=unknown).
    "nisa.tensor_scalar": Cost("vector", _min_ii_n, ("vector", "scalar", "gpsimd")),
    # [isa] tensor_tensor (VectorE): max(MIN_II, N) when one input is in PSUM, or all-bf16 SBUF
    # add/multiply/subtract; max(MIN_II, 2N) otherwise.
    "nisa.tensor_tensor": Cost("vector", _tensor_tensor, ("vector", "gpsimd")),
    # [isa] tensor_scalar_reduce: max(MIN_II, N) + MIN_II Vector Engine cycles.
    "nisa.tensor_scalar_reduce": Cost("vector", lambda o: max(MIN_II, o.n) + MIN_II),
    # [isa] scalar_tensor_tensor: N for bf16 subtract-then-multiply with even N, else 2N (VectorE).
    "nisa.scalar_tensor_tensor": Cost("vector", _scalar_tensor_tensor),
    # [isa] tensor_copy: max(MIN_II, N) cycles of the chosen engine; VectorE assumed by default.
    "nisa.tensor_copy": Cost("vector", _min_ii_n, ("vector", "scalar", "gpsimd")),
    # [isa] tensor_tensor_scan: max(MIN_II, 2N) Vector Engine cycles.
    "nisa.tensor_tensor_scan": Cost("vector", lambda o: max(MIN_II, 2 * o.n)),
    # [isa] tensor_reduce: N/2 for bf16 in/out add or max, else N (VectorE).
    "nisa.tensor_reduce": Cost("vector", _tensor_reduce),
    # [isa] reciprocal: max(MIN_II, 8N) VectorE cycles.
    "nisa.reciprocal": Cost("vector", lambda o: max(MIN_II, 8 * o.n)),
    # [isa] memset: max(MIN_II, N/2) for zero into bf16/fp16, else max(MIN_II, N) (VectorE).
    "nisa.memset": Cost("vector", _memset, ("vector", "gpsimd")),
    # [isa] iota: 150 + N GpSimd cycles.
    "nisa.iota": Cost("gpsimd", lambda o: GPSIMD_START + o.n),
    # Selection instructions. [isa] max8 and nc_find_index8 (v2.25.0): "N engine cycles" (VectorE:
    # the pages place them on the Vector engine with match_replace8, inferred for max8).
    "nisa.max8": Cost("vector", lambda o: o.n),
    "nisa.nc_find_index8": Cost("vector", lambda o: o.n),
    # nc_match_replace8: the v2.25.0 page's "min(MIN_II, N)" cannot be meant (it would cost at most
    # 64 cycles for 16,384 elements); nki-library's own estimate (core/topk/rotational_topk.py,
    # ceil(k/8) * 2 * (N + 144) for a max8 + match_replace8 round) gives N + 144: used here, as
    # that library's estimate, not a documented figure.
    "nisa.nc_match_replace8": Cost("vector", lambda o: o.n + MATCH_REPLACE8_OVERHEAD),
    # nc_n_gather: no documented figure. Assumption: GPSIMD_START plus one GpSimd cycle per
    # gathered element per partition (the page: "n = ceil(elems_per_partition / 512)" groups of
    # instructions).
    "nisa.nc_n_gather": Cost("gpsimd", lambda o: GPSIMD_START + o.n),
    # select_reduce: no documented figure. Assumption: max(MIN_II, N) VectorE cycles, as the
    # other one-pass elementwise VectorE instructions (tensor_copy, tensor_scalar).
    "nisa.select_reduce": Cost("vector", _min_ii_n),
    # [isa] topk (v2.32.0, the page's own "Estimated instruction cost"): 4*n + K GpSimd cycles per
    # partition (n: elements of the snake, passed as ``value``; K: dst columns); the partitions
    # run in parallel.
    "nisa.topk": Cost("gpsimd", lambda o: 4 * o.value + o.n_dst),
    # nl functions, costed as the instruction they lower to (assumption where noted):
    # nl.full / nl.zeros are a memset.
    "nl.full": Cost("vector", _memset),
    # NKI 0.3 release notes (known issues): "nl.copy uses the Scalar Engine"; as tensor_copy. From
    # NKI 0.6 it "uses the Vector engine (tensor_copy)" (0.6 release notes): CostRecord.compute
    # charges the Vector engine then.
    "nl.copy": Cost("scalar", _min_ii_n, ("scalar", "vector")),
    # Assumption: a partition broadcast costs like a VectorE copy of the result.
    "nl.broadcast_to": Cost("vector", _min_ii_n),
    # Assumption: binary nl ops with two tiles are tensor_tensor, with a scalar tensor_scalar;
    # unary ones are a ScalarE activation; reductions are tensor_reduce.
    "nl.binary": Cost("vector", _tensor_tensor),
    "nl.binary_scalar": Cost("vector", _min_ii_n),
    "nl.unary": Cost("scalar", _activation),
    "nl.reduce": Cost("vector", _tensor_reduce),
}

_NL_UNARY = {"negative", "exp", "log", "tanh", "sqrt", "square", "relu", "reciprocal"}
_NL_REDUCE = {"max", "min", "sum"}


def _cost_key(instr: str, n_tiles: int, n_inputs: int) -> str:
    if instr in COSTS:
        return instr
    name = instr.split(".", 1)[1]
    if instr.startswith("nl."):
        if name in _NL_REDUCE:
            return "nl.reduce"
        if name in _NL_UNARY:
            return "nl.unary"
        return "nl.binary" if n_tiles >= 2 else "nl.binary_scalar"
    raise KeyError(
        f"no cost formula for {instr}: add a line to jax_sparse_attn.nki_emulator.cost.COSTS"
    )


def _name(x: Any) -> str:
    return getattr(x, "__name__", str(x))


def _dtype_name(t: Any) -> str:
    return np.dtype(t.dtype).name


# --------------------------------------------------------------------------------------------
# Recording


@dataclass
class CostRecord:
    """The modelled cost of one program (one physical core): engine totals and by instruction."""

    target: str
    engine_us: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ENGINES, 0.0))
    by_instruction: dict[str, list] = field(default_factory=dict)  # instr -> [count, us]
    dma_bytes: int = 0
    hbm_bytes: int = 0  # of dma_bytes, those read from or written to HBM (at the HBM side's dtype)

    @property
    def hw(self) -> Hardware:
        return HARDWARE[self.target]

    @property
    def modelled_us(self) -> float:
        """The busiest engine's total (perfect overlap)."""
        return max(self.engine_us.values())

    @property
    def busiest_engine(self) -> str:
        return max(ENGINES, key=lambda e: self.engine_us[e])

    def _charge(self, instr: str, engine: str, us: float) -> None:
        self.engine_us[engine] += us
        entry = self.by_instruction.setdefault(instr, [0, 0.0])
        entry[0] += 1
        entry[1] += us

    def compute(
        self, instr: str, engine: Any, dst: Any, inputs: list, *, ops: tuple = (),
        n_stationary: int = 0, n_moving: int = 0, value: Any = None, reduce: bool = False,
        fp32_onezero: int = 0,
    ) -> float:  # fmt: skip
        """Charge a compute instruction; ``inputs`` are its tile operands (main input first)."""
        main = inputs[0] if inputs else dst
        n = int(np.prod(main.shape[1:], dtype=np.int64)) if len(main.shape) > 1 else 1
        op = Op(
            n=n,
            p=int(main.shape[0]),
            in_dtypes=tuple(_dtype_name(t) for t in inputs),
            out_dtype=_dtype_name(dst) if dst is not None else None,
            in_psum=tuple(t.buffer.name == "psum" for t in inputs),
            ops=tuple(_name(o) for o in ops),
            n_stationary=n_stationary,
            n_moving=n_moving,
            value=value,
            fp32_onezero=fp32_onezero,
            n_dst=int(np.prod(dst.shape[1:], dtype=np.int64)) if dst is not None and len(dst.shape) > 1 else 1,
        )
        key = _cost_key(instr + ("+reduce" if reduce else ""), len(inputs), len(inputs))
        cost = COSTS[key]
        chosen = getattr(engine, "value", engine)
        if instr == "nl.copy" and engine is None:
            from .versions import has

            chosen = "vector" if has("nl.copy on VectorE") else "scalar"
        if chosen in (None, "unknown") or not cost.engines:
            chosen = cost.engine
            if (
                instr == "nisa.tensor_tensor" and not any(op.in_psum)
                and all(d in ("int32", "uint32") for d in op.in_dtypes + (op.out_dtype,))
            ):  # fmt: skip
                # tensor_tensor page (0.3): all-int32/uint32 operands default to the GpSimd
                # Engine unless one is in PSUM (same cycle formula assumed there).
                chosen = "gpsimd"
        if chosen not in ("tensor", "vector", "scalar", "gpsimd"):
            chosen = cost.engine
        cycles = float(cost.cycles(op))
        us = cycles / (self.hw.clock_ghz(chosen) * 1e3)
        self._charge(instr, chosen, us)
        return us

    def dma(
        self, instr: str, src: Any, dst: Any, values: np.ndarray, ok: np.ndarray | None,
        dge: Any, *, transpose: bool = False, indirect_rows: int = 0, dynamic: bool = False,
        nc_version: int = 3,
    ) -> float:  # fmt: skip
        """Charge a DMA: bytes over the per-core DMA bandwidth plus per-chunk engine overhead."""
        elements = values.size
        if ok is not None:
            moved = np.broadcast_to(
                ok.reshape(ok.shape + (1,) * (values.ndim - ok.ndim)), values.shape
            )
            elements = int(moved.sum())
        itemsize = max(np.dtype(src.dtype).itemsize, np.dtype(dst.dtype).itemsize)
        nbytes = elements * itemsize
        chunks = max(_chunks(src, values.shape), _chunks(dst, values.shape))
        if ok is not None and ok.ndim == 1:
            chunks = max(1, int(round(chunks * float(ok.mean())))) if ok.any() else 0
        bw = self.hw.dma_gbps_per_core * (DMA_TRANSPOSE_EFFICIENCY if transpose else 1.0)
        ns = nbytes / bw + chunks * DMA_CHUNK_NS / DMA_ENGINES
        if dynamic and not indirect_rows and nc_version >= 3:
            ns += HWDGE_NS / HWDGE_INSTANCES
        self.dma_bytes += nbytes
        for side in (src, dst):
            if not _on_chip(side):
                self.hbm_bytes += elements * np.dtype(side.dtype).itemsize
        self._charge(instr, "dma", ns / 1e3)
        if indirect_rows or (dynamic and nc_version < 3):
            descriptors = indirect_rows or chunks
            cycles = GPSIMD_START + SWDGE_CYCLES_PER_DESCRIPTOR * descriptors
            self._charge(instr + " (swdge)", "gpsimd", cycles / (self.hw.gpsimd_ghz * 1e3))
        return ns / 1e3

    def summary(self) -> dict:
        return {
            "modelled_us": self.modelled_us,
            "busiest_engine": self.busiest_engine,
            "per_engine_us": dict(self.engine_us),
            "dma_bytes": self.dma_bytes,
            "hbm_bytes": self.hbm_bytes,
        }


def _on_chip(x: Any) -> bool:
    """Whether a DMA side lives in SBUF/PSUM (access patterns are on HBM tensors only)."""
    from ._core import AccessPattern

    return not isinstance(x, AccessPattern) and x.buffer.on_chip


def _chunks(x: Any, shape: tuple) -> int:
    """Contiguous runs a DMA side consists of: per partition on chip, per address run in HBM."""
    from ._core import AccessPattern

    if isinstance(x, AccessPattern):
        if x.vector_offset is not None:
            # Each gathered row is its own run (rows are not assumed adjacent).
            inner = x.pattern[1:]
            runs_per_row = 1
            for stride, count in reversed(inner):
                if stride == 1:
                    continue
                runs_per_row *= count
            return x.pattern[0][1] * runs_per_row
        flat, _ = x.resolve("cost", skip_oob=True)
        flat = np.asarray(flat).reshape(-1)
        return 1 + int(np.count_nonzero(np.diff(flat) != 1)) if flat.size else 0
    if x.buffer.on_chip:
        # One run per partition at least (the free bytes of a partition are contiguous when the
        # view is; a strided view is counted as contiguous: an approximation).
        return int(shape[0]) if shape else 1
    data = x._data
    if data.size == 0:
        return 0
    # The runs are the elements outside the largest contiguous (row-major) suffix of the view.
    suffix = 1
    expected = data.itemsize
    dims = list(zip(data.shape, data.strides))
    k = len(dims)
    while k > 0 and (dims[k - 1][0] == 1 or dims[k - 1][1] == expected):
        expected *= dims[k - 1][0]
        suffix *= dims[k - 1][0]
        k -= 1
    return max(1, data.size // suffix)


# --------------------------------------------------------------------------------------------
# Bounds of the attention op


def attention_bounds(
    target: str, T: int, H: int, D: int, K: int, *, itemsize: int = 2,
    row_itemsize: int | None = None, scales_per_row: int = 0, value_dim: int | None = None,
) -> dict:
    """``hbm_bound_us`` and ``pe_bound_us`` of one call, per LOGICAL core of ``target``.

    HBM: the bytes that must move once: q ``T*H*D``, the gathered slot rows ``T*K*D`` and the
    output ``T*H*D`` (``itemsize`` bytes each; the rows ``row_itemsize`` when given, 1 for an FP8
    cache, plus ``scales_per_row`` f32 scales per gathered row), and the bias ``T*K`` fp32, over
    the HBM bandwidth of the logical core's physical cores. PE: the two attention matmuls,
    ``4*T*H*K*D`` flops, at the BF16 TensorE peak of those cores. With ``value_dim`` V < D the
    output is ``T*H*V`` and the value matmul ``2*T*H*K*V`` flops. A MODEL (see the module
    docstring for sources).
    """
    V = D if value_dim is None else value_dim
    hw = HARDWARE[target]
    row_itemsize = itemsize if row_itemsize is None else row_itemsize
    nbytes = T * H * (D + V) * itemsize + T * K * D * row_itemsize + T * K * 4 * (1 + scales_per_row)
    flops = 2 * T * H * K * (D + V)
    return {
        "hbm_bound_us": nbytes / (hw.hbm_gbps_per_core * hw.lnc * 1e3),
        "pe_bound_us": flops / (hw.pe_bf16_tflops_per_core * hw.lnc * 1e6),
        "bound_bytes": nbytes,
        "bound_flops": flops,
        "cores": hw.lnc,
    }
