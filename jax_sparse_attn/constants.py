"""Named facts shared by the reference, the Neuron packing, the NKI kernels and the tests.

One home for each number: change it here and every user of it follows. The integer rounding
that the plans share lives here too: the module imports nothing, so the kernels can import it.
"""


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up, for integers (``b > 0``)."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """The least multiple of ``b`` at or above ``a`` (``b > 0``; 0 for 0)."""
    return ceil_div(a, b) * b


# Logit given to an empty slot (invalid index, or a ``-inf`` bias entry). Finite on purpose: a whole
# row masked with ``-inf`` would compute ``exp(-inf - -inf) = NaN``. ``exp(-1e30 - m)`` is exactly 0
# in fp32 for any row that has a real slot.
EMPTY_LOGIT = -1e30

# NeuronCore geometry (NKI API reference, architecture guide).
PARTITIONS = 128  # SBUF / PSUM partition count; matmul contraction and stationary width limit.
PSUM_BANK_FP32 = 512  # fp32 elements per partition in one PSUM bank (2 KiB).
PSUM_BANKS = 8

# Kernel interface: the packed bias tensor is ``[T, BIAS_PREFIX_COLS + Kp]`` f32. Column
# ``SCALE_COL`` carries the softmax scale of the token; columns ``BIAS_PREFIX_COLS:`` carry the
# per-slot bias. Scale and bias travel in one tensor because two broadcast SBUF inputs of one
# instruction at different base partitions hit compiler error NCC_IBIR297.
BIAS_PREFIX_COLS = 16
SCALE_COL = 0
# Columns UP_COLS of the prefix carry the two f32 powers of two whose product multiplies the
# kernel's dot products back after the packing scaled q down (the dot products' overflow guard,
# docs/contract.md, ``reference.prescale_queries``).
UP_COLS = (1, 2)

# The logit saturation rule (docs/contract.md, "Overflow and NaN"): a slot's scaled dot product is
# clamped to [-LOGIT_LIMIT, LOGIT_LIMIT] before the bias is added, so a real slot's logit always lies
# in [-2 * LOGIT_LIMIT, FLT_MAX] (bias in [BIAS_FLOOR, FLT_MAX]), strictly above EMPTY_LOGIT, and is
# never +-inf or NaN for finite inputs. At this magnitude a logit's own value is lost in fp32 anyway.
LOGIT_LIMIT = 1e29

# Finite biases below this are raised to it, so that a real slot's logit always stays above an empty
# slot's EMPTY_LOGIT (a bias of -1e30 or finfo.min used as a mask would otherwise tie with the empty
# slots and let them into the softmax). A ``+inf`` bias is lowered to FLT_MAX (see ``FLT_MAX``).
BIAS_FLOOR = -LOGIT_LIMIT

# Largest finite float32: the saturation bound of the dot products, of a ``+inf`` bias and of an
# infinite scale (the API lowers both to it).
FLT_MAX = 3.4028234663852886e38


def value_shift(num_slots: int, dtype="bfloat16") -> int:
    """Power-of-two exponent ``c`` of the value product's guard against f32 overflow.

    The value product runs on probabilities scaled by ``2**-c`` and the result is scaled back by
    ``2**c`` after the division by the denominator: ``o = (sum_j bf16(e_j 2**-c) x_j / den) 2**c``.
    With ``e_j <= 1`` and ``2**c >= 2 K`` no partial sum can exceed ``FLT_MAX / 2`` whatever the
    rows hold, and scaling by a power of two changes no bit unless a scaled probability falls
    below f32's smallest normal (``e_j < 2**(c - 126)``, a slot at least ``(126 - c) ln 2`` below the
    row's best logit, whose term is then below the output's resolution). ``num_slots`` is the
    user's ``K`` (before any padding). For a dtype whose rows cannot reach the bound (f16: ``K``
    times 65504 stays far below FLT_MAX) the shift is 0: no guard is needed, and f16's narrow
    exponent range would lose small probabilities to it.
    """
    import ml_dtypes  # local: keeps this module free of imports for the kernel source

    if float(ml_dtypes.finfo(dtype).max) * max(int(num_slots), 1) <= FLT_MAX / 2:
        return 0
    return max(int(num_slots) - 1, 0).bit_length() + 1

# Index sent to the indexed kernel for an empty or padding slot: out of range of every cache (the
# kernel's indices are uint32 and a cache has at most MAX_ROWS rows), so the kernel's indirect DMA
# skips it (``oob_mode=skip``, nki.isa.dma_copy page) and the slot's row stays the zeros the kernel
# wrote there. No slot ever reads a cache row it does not select.
EMPTY_SLOT_INDEX = 2**32 - 1

# Largest cache the kernel's indices can address (int32 indices of the primitives).
MAX_ROWS = 2**31 - 1

# --- NKI kernel geometry (used by the kernels, the Neuron packing and the tests) -----------------

# Slots and head-dim columns travel in tiles of PARTITIONS rows: the kernel requires K to be a
# multiple of this (the packing pads it); D is split into blocks of at most this many columns.
KERNEL_TILE = PARTITIONS
# Largest free size of one nc_matmul moving operand / one fp32 PSUM tile: the score matmul covers at
# most this many slots per instruction, the value accumulator at most this many head-dim columns.
MATMUL_MAX_N = PSUM_BANK_FP32
# At most this many query heads per kernel call: they sit on the partitions of the score tile.
MAX_HEADS_PER_CALL = PARTITIONS
# SBUF bytes per partition: 24 MiB / 128 on NeuronCore-v2 (trn1; nki/guides/architecture/
# trainium_inferentia2_arch.rst), 28 MiB / 128 on v3 (trn2; trainium2_arch.rst); v4 (trn3) is in
# nki_emulator/targets.py. The kernels size their slot chunks for the smallest (trn1), so one plan
# is valid on every target.
SBUF_BYTES_PER_PARTITION = 192 * 1024
SBUF_BYTES_PER_PARTITION_TRN2 = 224 * 1024

# Elements per partition that nisa.max8 / nc_find_index8 / nc_match_replace8 read at most (their
# ISA pages, v2.32.0: "between 8 and 16,384"; "no more than 16,384"): the emulator's limit and the
# indexer kernel's candidate buffer.
MAX8_ELEMENTS = 16384

# Targets whose NeuronCore (v3 and later) has dma_transpose and indirect DMA (nki.isa.dma_transpose
# page: "TRN2+ only"; hardware DGE "only supported for NeuronCore-v3 or newer", nki.isa.dma_copy).
TARGETS_WITH_DGE = ("trn2", "trn3")
