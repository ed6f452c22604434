"""Triton helpers that load tiles of rows from THD buffers.

Notation (docs/design.md): a block's rows sit at buffer rows ``row0 + offs`` (``row`` = buffer row) and
global tokens ``glob + offs``; rows whose global index is >= T (the ragged last block) read as zeros.
``EVEN`` (T a multiple of the sub-tile) drops the row masks. Head dims are tiles of BLOCK_D = the next
power of two >= 16 (``offs_d = arange(BLOCK_D)``); of those only the first HEAD_DIM columns exist, the
rest read as zeros (they add nothing to q.k, P.V or the gradients) and are never written.
``EVEN_D`` (HEAD_DIM == BLOCK_D) drops the column masks. Gradient tiles are stored with ``store_grad``:
with ``ACCUMULATE`` added to the fp32 rows already there (a distributed backward's stages sum into one
buffer instead of each writing a fresh one that is then gathered and added).
"""
import triton
import triton.language as tl


@triton.jit
def row_col_mask(valid, offs_d, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr):
    """[rows, BLOCK_D] mask of valid rows and the HEAD_DIM real columns."""
    # (if / else, not an early return: Triton types every return of a function alike, dead or not)
    if EVEN_D:
        keep = valid[:, None]
    else:
        keep = valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    return keep


@triton.jit
def load_rows(Ptr, row0, offs_r, stride_t, col0, offs_d, valid, EVEN: tl.constexpr, HEAD_DIM: tl.constexpr,
              EVEN_D: tl.constexpr):
    """Load [len(offs_r), BLOCK_D] at buffer rows row0 + offs_r of one head; rows past T and columns
    past HEAD_DIM read as 0."""
    # int64 scalar base + int32 tile offsets: 64-bit pointer math per element would cost registers
    ptrs = Ptr + row0 * stride_t + col0 + (offs_r[:, None] * stride_t + offs_d[None, :])
    if EVEN:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        x = tl.load(ptrs, mask=row_col_mask(valid, offs_d, HEAD_DIM, EVEN_D), other=0.0)
    return x


@triton.jit
def load_partner(A, B, Glob, Row, j, sub0, offs, stride_a, col_a, stride_b, col_b, offs_d, T, EVEN: tl.constexpr,
                 HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr):
    """Rows sub0 + offs of partner block j from two buffers (K and V, or Q and dO): (glob, valid, a, b)."""
    glob = tl.load(Glob + j) + sub0 + offs
    row0 = (tl.load(Row + j) + sub0).to(tl.int64)
    valid = glob < T
    a = load_rows(A, row0, offs, stride_a, col_a, offs_d, valid, EVEN, HEAD_DIM, EVEN_D)
    b = load_rows(B, row0, offs, stride_b, col_b, offs_d, valid, EVEN, HEAD_DIM, EVEN_D)
    return glob, valid, a, b


@triton.jit
def locate_work_rows(WorkOrder, WorkGlob, WorkRow, T, num_heads, GROUP: tl.constexpr, M_SPLIT: tl.constexpr,
                     BLOCK_M: tl.constexpr):
    """Program id -> (hq, hk, work block w, m_rel, offs_m, q_glob, q_row0, q_valid) of a q-major program."""
    pid = tl.program_id(0) // num_heads
    hq = tl.program_id(0) % num_heads
    hk = hq // GROUP
    w = tl.load(WorkOrder + pid // M_SPLIT)
    m_rel = (pid % M_SPLIT) * BLOCK_M + tl.arange(0, BLOCK_M)
    q_glob = tl.load(WorkGlob + w) + m_rel
    offs_m = tl.arange(0, BLOCK_M)
    q_row0 = (tl.load(WorkRow + w) + (pid % M_SPLIT) * BLOCK_M).to(tl.int64)
    return hq, hk, w, m_rel, offs_m, q_glob, q_row0, q_glob < T


@triton.jit
def store_grad(ptrs, grad, keep, ACCUMULATE: tl.constexpr):
    """Store an fp32 gradient tile at ``ptrs`` (where ``keep``), added to what is there with ACCUMULATE."""
    # The add is a relaxed atomic (sm_90: red.global.add.v4.f32, no value returned) rather than a load,
    # an add and a store: loading the old dK and dV tiles beside the two fp32 accumulators spilled 12
    # registers in the dK/dV kernel. Each address has one program per launch and launches are ordered,
    # so the sum is old + new every time (deterministic; fp32 atomics flush subnormals to zero).
    if ACCUMULATE:
        tl.atomic_add(ptrs, grad, mask=keep, sem="relaxed")
    else:
        tl.store(ptrs, grad, mask=keep)
