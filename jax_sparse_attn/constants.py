"""Named facts shared by the reference, the Neuron packing, the NKI kernels and the tests.

One home for each number: change it here and every user of it follows.
"""

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

# Finite biases below this are raised to it, so that a real slot's logit always stays above an empty
# slot's EMPTY_LOGIT (a bias of -1e30 or finfo.min used as a mask would otherwise tie with the empty
# slots and let them into the softmax). At this magnitude a logit's own value is lost in fp32 anyway.
BIAS_FLOOR = -1e29

# Index sent to the kernel for an empty slot (with bias EMPTY_LOGIT): any in-range row works.
EMPTY_SLOT_INDEX = 0

# Largest cache the int32 kernel indices can address.
MAX_ROWS = 2**31 - 1

# --- NKI kernel geometry (used by the kernels, the Neuron packing and the tests) -----------------

# Slots and head-dim columns travel in tiles of PARTITIONS rows: the kernel requires D and K to be
# multiples of this (the packing pads both).
KERNEL_TILE = PARTITIONS
# Largest free size of one nc_matmul moving operand / one fp32 PSUM tile: the score matmul covers at
# most this many slots per instruction, the value accumulator at most this many head-dim columns.
MATMUL_MAX_N = PSUM_BANK_FP32
# At most this many query heads per kernel call: they sit on the partitions of the score tile.
MAX_HEADS_PER_CALL = PARTITIONS
# dma_transpose writes 2-byte elements at 32-byte aligned destination offsets: the transposed q
# tile pads its head axis to a multiple of this many bf16 elements.
DMA_TRANSPOSE_ALIGN_ELEMS = 16
# SBUF bytes per partition on the smallest target (trn1; trn2 has 224 KiB). The packing refuses
# shapes whose per-token working set would not fit.
SBUF_BYTES_PER_PARTITION = 192 * 1024
SBUF_BYTES_PER_PARTITION_TRN2 = 224 * 1024
