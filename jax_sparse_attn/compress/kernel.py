"""The NKI kernel of the compressor's pooling (``compress_pool``): the masked softmax over each
window of rows, per channel, in f32, with channels on the partitions and a tile's windows along
the free axis, in a per-row form (prefill) or a per-window form (decode) picked by the ISA cost
formulas; both add in the contract's order and divide as it does.

docs/compress-kernel.md has the packing, the layout, the steps and the modelled cost; the op's
contract is docs/compress.md. The function is plain Python: ``nki.jit`` is applied where it is
called on Neuron, the project's emulator runs it as it is. Importing this module never needs the
Neuron SDK.
"""

from __future__ import annotations

import dataclasses

from ..constants import FLT_MAX, KERNEL_TILE
from ..nki_emulator.cost import MIN_II

try:  # The Neuron SDK only exists on a Trainium host (Neuron pip repository).
    import nki
    import nki.isa as nisa
    import nki.language as nl
except ImportError:
    nki = nl = nisa = None

# Elements per partition of one tile's s (f32) and kv: 4096 f32 = 16 KiB per partition each, so
# each DMA moves >= 4 KiB per partition ("saturates the engines", nki-dma-bandwidth-guide.rst,
# as the cost model reads it) and the two live tiles take 32 KiB of the 192 KiB (trn1/trn2)
# per-partition SBUF (nki_emulator.targets). An assumption balancing per-instruction overhead
# (MIN_II = 64 cycles, ISA pages) against padding of short inputs.
TILE_ELEMENTS = 4096


@dataclasses.dataclass(frozen=True)
class CompressPlan:
    """Compile-time sizes of one launch: ``n`` rows per window, ``group`` (G) windows per tile,
    ``tiles`` of them over all programs (``windows_padded = tiles * G``)."""

    rows: int
    group: int
    tiles: int

    @property
    def windows_padded(self) -> int:
        return self.tiles * self.group


def plan_compress(windows: int, rows: int, programs: int) -> CompressPlan:
    """The tile size for ``windows`` windows of ``rows`` rows over ``programs`` programs: the
    largest ``G`` with ``G * rows <= TILE_ELEMENTS`` (at least 1), no larger than a program's
    share, and the tiles a multiple of ``programs`` (the packing pads the windows). One window
    (a decode step of one sequence) is one tile, whose channel tiles the programs share."""
    if windows <= 1:
        return CompressPlan(rows, 1, 1)
    per_program = max(1, -(-windows // programs))
    group = max(1, min(TILE_ELEMENTS // rows, per_program))
    tiles_each = -(-per_program // group)
    return CompressPlan(rows, group, tiles_each * programs)


def _channel_tiles(channels: int):
    """``(c0, pc)`` of the channel tiles of at most 128 partitions."""
    return [(c0, min(KERNEL_TILE, channels - c0)) for c0 in range(0, channels, KERNEL_TILE)]


def per_window(group: int, rows: int) -> bool:
    """Whether a tile runs in the per-window form (docs/compress-kernel.md, "Layout and steps"):
    the one with fewer modelled cycles on its busier engine, by the ISA pages' formulas (f32 SBUF
    inputs: tensor_tensor ``max(MIN_II, 2N)``, tensor_tensor_scan and scalar_tensor_tensor ``2N``,
    activation ``max(MIN_II, N)``; VectorE 0.96 GHz, GpSimd and ScalarE 1.2 GHz on trn2,
    ``nki_emulator/cost.py``). Few windows of many rows (a decode step) favour it."""
    g, n, ii = group, rows, MIN_II
    per_row_vector = g * n + 2 * (n - 1) * max(ii, 2 * g)
    per_row_gpsimd = 2 * n * max(ii, 2 * g) + max(ii, 2 * g * n)
    per_window_vector = g * n + g * (2 * max(ii, 2 * n) + 2 * n) + 2 * max(ii, 2 * g)
    per_window_scalar = g * max(ii, n)
    by_rows = max(per_row_vector / 0.96, per_row_gpsimd / 1.2)
    by_windows = max(per_window_vector / 0.96, per_window_scalar / 1.2)
    return by_windows < by_rows


def compress_pool_kernel(kv_w, s_w, rows):
    """The masked softmax pooling of every window.

    Operands (prepared by :mod:`jax_sparse_attn.compress.neuron`; ``n`` rows per window: ``r``,
    or ``2 r`` with overlap; ``G`` windows per tile; ``Co`` output channels)::

        kv_w  [Co, tiles, G*n]  any float  the windows' kv rows, channel-major: element
                                           [c, t, g*n + i] is row i of window t*G + g on
                                           channel c (0 where the row is masked)
        s_w   [Co, tiles, G*n]  f32        their scores min(score + ape, FLT_MAX), -inf masked

    ``rows`` (n) is a compile-time int. Launch as ``kernel[P]`` with the tiles a multiple of
    ``P``; program ``p`` pools its share of the tiles in a hardware loop. Returns
    ``out [Co, tiles, G]`` f32 in shared HBM: the pooled value of window t*G + g on channel c."""
    channels, tiles, width = kv_w.shape
    assert tuple(s_w.shape) == (channels, tiles, width), f"s_w {s_w.shape} vs kv_w {kv_w.shape}"
    assert width % rows == 0, f"{width} elements per tile is not whole windows of {rows} rows"
    group = width // rows
    programs, program = nl.num_programs(), nl.program_id(0)
    assert tiles == 1 or tiles % programs == 0, (
        f"{tiles} tiles must be 1 or a multiple of the {programs} programs")
    channel_tiles = _channel_tiles(channels)
    if tiles == 1:
        # One tile: the programs share its channel tiles (each program is specialised to its
        # id, so this is a compile-time choice; docs/compress-kernel.md, "Launch").
        channel_tiles, tile_of_program = channel_tiles[program::programs], 0
    else:
        tile_of_program = program
    per_program = max(1, tiles // programs)
    out = nl.ndarray((channels, tiles, group), dtype=nl.float32, buffer=nl.shared_hbm)
    # Allocated outside the loop: a fori_loop body's tensors die with its iteration
    # (nki.language.fori_loop page); one set per channel tile (a static loop inside).
    bufs = []
    for _, pc in channel_tiles:
        bufs.append((
            nl.ndarray((pc, group, rows), dtype=kv_w.dtype, buffer=nl.sbuf),
            nl.ndarray((pc, group, rows), dtype=nl.float32, buffer=nl.sbuf),
            nl.ndarray((pc, group), dtype=nl.float32, buffer=nl.sbuf),  # m
            nl.ndarray((pc, group), dtype=nl.float32, buffer=nl.sbuf),  # z
            nl.ndarray((pc, group), dtype=nl.float32, buffer=nl.sbuf),  # the pooled values
        ))  # fmt: skip

    windows_form = per_window(group, rows)
    if windows_form:
        # The scans' second operand: (partial + e) * 1 keeps every partial sum as it is.
        ones = nl.ndarray((KERNEL_TILE, rows), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0)
        scan = nl.ndarray((KERNEL_TILE, group, rows), dtype=nl.float32, buffer=nl.sbuf)

    def one_tile(tile):
        for (c0, pc), (kv_sb, s_sb, m, z, acc) in zip(channel_tiles, bufs):
            # A runtime tile address, scalar_offset on axis 1 (G*n elements per tile,
            # nki/deep-dives/nki-aps.rst).
            for dst, src in ((s_sb, s_w), (kv_sb, kv_w)):
                nisa.dma_copy(dst=dst, src=_at_tile(
                    src, tile, [[tiles * width, pc], [rows, group], [1, rows]], c0 * tiles * width,
                    width))  # fmt: skip
            # The window max (order-free), and -inf (every row masked) -> -FLT_MAX.
            nisa.tensor_reduce(dst=m, op=nl.max, data=s_sb, axis=2)
            if windows_form:
                _pool_per_window(kv_sb, s_sb, m, z, acc, ones[0:pc, :], scan[0:pc], group, rows)
            else:
                _pool_per_row(kv_sb, s_sb, m, z, acc, rows)
            nisa.dma_copy(dst=_at_tile(out, tile, [[tiles * group, pc], [1, group]],
                                       c0 * tiles * group, group), src=acc)  # fmt: skip

    if per_program == 1:
        # One tile (a decode step): its addresses are compile-time constants, no loop register.
        one_tile(tile_of_program)
    else:
        nl.fori_loop(program * per_program, (program + 1) * per_program, one_tile)
    return out


def _at_tile(tensor, tile, pattern, offset: int, per_tile: int):
    """``tensor``'s access pattern at tile ``tile``: a runtime address (the loop's register:
    ``scalar_offset`` on axis 1 moves by ``per_tile`` elements, nki/deep-dives/nki-aps.rst), or
    for a Python int a constant offset."""
    if isinstance(tile, int):
        return tensor.ap(pattern=pattern, offset=offset + tile * per_tile)
    return tensor.ap(pattern=pattern, offset=offset, scalar_offset=tile, indirect_dim=1)


def _pool_per_row(kv_sb, s_sb, m, z, acc, rows: int):
    """The per-row form (docs/compress-kernel.md, "Layout and steps"), after the max ``m``:
    ``acc [pc, G]``."""
    nisa.tensor_scalar(dst=m, data=m, op0=nl.maximum, operand0=-FLT_MAX)
    # s - m, row by row (m is per window), then exp over the tile.
    for i in range(rows):
        nisa.tensor_tensor(dst=s_sb[:, :, i], data1=s_sb[:, :, i], data2=m,
                           op=nl.subtract, engine=nisa.engine.gpsimd)  # fmt: skip
    nisa.activation(dst=s_sb, op=nl.exp, data=s_sb)
    # z left to right in window order; z = 1 where it is 0 (every row masked:
    # z >= 1 otherwise, the max row's e is 1).
    _sum_rows(z, s_sb, rows)
    nisa.scalar_tensor_tensor(dst=z, data=z, op0=nl.equal, operand0=0.0, op1=nl.add,
                              operand1=z)  # fmt: skip
    # t = (e / z) * kv; a masked row's kv is 0 (packing), its e is 0.
    for i in range(rows):
        nisa.tensor_tensor(dst=s_sb[:, :, i], data1=s_sb[:, :, i], data2=z,
                           op=nl.divide, engine=nisa.engine.gpsimd)  # fmt: skip
    nisa.tensor_tensor(dst=s_sb, data1=s_sb, data2=kv_sb, op=nl.multiply,
                       engine=nisa.engine.gpsimd)  # fmt: skip
    # The pooled value, left to right in window order.
    _sum_rows(acc, s_sb, rows)


def _pool_per_window(kv_sb, s_sb, m, z, acc, ones, scan, group: int, rows: int):
    """The per-window form (docs/compress-kernel.md, "Layout and steps"), after the max ``m``: per
    window one ScalarE ``exp(s - m)`` (m as the bias column), a scan for z, one ``(e / z) * kv``
    and a scan for the pooled value; ``acc [pc, G]``."""
    # -max(m, -FLT_MAX): the bias column of each window's exp (s + (-m) = s - m exactly).
    nisa.tensor_scalar(dst=m, data=m, op0=nl.maximum, operand0=-FLT_MAX, op1=nl.multiply,
                       operand1=-1.0)  # fmt: skip
    for g in range(group):
        nisa.activation(dst=s_sb[:, g, :], op=nl.exp, data=s_sb[:, g, :], bias=m[:, g : g + 1])
        # z: r[i] = (e[i] + r[i-1]) * 1, r[-1] = 0: left to right (tensor_tensor_scan page).
        nisa.tensor_tensor_scan(dst=scan[:, g, :], data0=s_sb[:, g, :], data1=ones, initial=0.0,
                                op0=nl.add, op1=nl.multiply)  # fmt: skip
    nisa.scalar_tensor_tensor(dst=z, data=scan[:, :, rows - 1], op0=nl.equal, operand0=0.0,
                              op1=nl.add, operand1=scan[:, :, rows - 1])  # fmt: skip
    for g in range(group):
        # t = (e / z) * kv (scalar_tensor_tensor page: operand0 a [P, 1] column).
        nisa.scalar_tensor_tensor(dst=s_sb[:, g, :], data=s_sb[:, g, :], op0=nl.divide,
                                  operand0=z[:, g : g + 1], op1=nl.multiply,
                                  operand1=kv_sb[:, g, :])  # fmt: skip
        nisa.tensor_tensor_scan(dst=scan[:, g, :], data0=s_sb[:, g, :], data1=ones, initial=0.0,
                                op0=nl.add, op1=nl.multiply)  # fmt: skip
    nisa.tensor_copy(dst=acc, src=scan[:, :, rows - 1])


def _sum_rows(dst, tile, rows: int):
    """``dst = ((tile[:, :, 0] + tile[:, :, 1]) + tile[:, :, 2]) + ...`` (``[pc, G]``), one
    VectorE add per row, in row order."""
    if rows == 1:
        nisa.tensor_copy(dst=dst, src=tile[:, :, 0])
        return
    nisa.tensor_tensor(dst=dst, data1=tile[:, :, 0], data2=tile[:, :, 1], op=nl.add)
    for i in range(2, rows):
        nisa.tensor_tensor(dst=dst, data1=dst, data2=tile[:, :, i], op=nl.add)
