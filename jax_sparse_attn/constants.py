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

# Index sent to the kernel for an empty slot (with bias EMPTY_LOGIT): any in-range row works.
EMPTY_SLOT_INDEX = 0

# Largest cache the int32 kernel indices can address.
MAX_ROWS = 2**31 - 1
